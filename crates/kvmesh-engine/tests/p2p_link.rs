//! The sim engine's modelled link with real engines on loopback (issue 17): a holder's link is
//! shared by everything it serves, so two consumers pulling the same prefix from it at once each
//! take longer than one alone; both sides count the modelled (real-model) bytes next to the wire
//! bytes; a prefetch is background traffic that does not slow an on-demand pull.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::{
    PROFILE, cached_tokens, complete, p2p_config, scrape_metric, source, start_engine, tokens,
};
use kvmesh_engine::server::RunningServer;
use kvmesh_transfer::Direction;
use serde_json::{Value, json};
use tokio::time::timeout;

/// 32K tokens: alone ≈ 25.5 ms setup + 133 ms of bytes on the default link (≈ 159 ms); two at
/// once share the holder's link: ≈ 25.5 + 267 ms (≈ 292 ms, 1.84×).
const PREFIX: usize = 32_768;

/// Wall seconds of the one pull `engine` made (its pull-duration histogram: the pull returns only
/// once both ends' modelled transfers are done).
async fn pull_seconds(engine: &RunningServer) -> f64 {
    let n = scrape_metric(engine.addr, "kvmesh_p2p_pull_duration_seconds_count", "").await;
    assert_eq!(n, 1.0, "exactly one pull");
    scrape_metric(engine.addr, "kvmesh_p2p_pull_duration_seconds_sum", "").await
}

async fn pull_from(consumer: &RunningServer, holder_p2p: u16, prompt: &[u32]) -> Duration {
    let t0 = Instant::now();
    let got = complete(consumer.addr, prompt, 1, Some(source(holder_p2p))).await;
    assert_eq!(cached_tokens(&got), PREFIX as u64, "{got}");
    t0.elapsed()
}

/// Acceptance (issue 17): two consumers pulling the same prefix from one holder at once each
/// take longer than one alone (ideal 1.84× here; asserted > 1.5× to tolerate a loaded machine),
/// and no more than the shared link explains (< 2.5×). Time scale 1: the ~0.3 s pulls dwarf
/// scheduling jitter; the whole test runs in a few seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumers_pulling_from_one_holder_each_take_longer_than_one_alone() {
    timeout(Duration::from_secs(60), async {
        let holder = start_engine(p2p_config(), PROFILE, 1.0, 32).await;
        let holder_p2p = holder.p2p_addr.unwrap().port();
        let prefix = tokens(71, PREFIX);
        complete(holder.addr, &prefix, 1, None).await;
        let mut prompt = prefix.clone();
        prompt.extend(tokens(72, 32));

        let alone = start_engine(p2p_config(), PROFILE, 1.0, 32).await;
        let alone_wall = pull_from(&alone, holder_p2p, &prompt).await;
        let single = pull_seconds(&alone).await;

        let b = start_engine(p2p_config(), PROFILE, 1.0, 32).await;
        let c = start_engine(p2p_config(), PROFILE, 1.0, 32).await;
        let (b_wall, c_wall) = tokio::join!(
            pull_from(&b, holder_p2p, &prompt),
            pull_from(&c, holder_p2p, &prompt)
        );
        let (pb, pc) = (pull_seconds(&b).await, pull_seconds(&c).await);
        let uncontended = alone.engine.modelled_pull_time(PREFIX).unwrap().as_secs_f64();
        eprintln!(
            "pull alone {single:.3} s (modelled uncontended {uncontended:.3} s, request {alone_wall:?}); \
             two at once {pb:.3} s and {pc:.3} s (requests {b_wall:?}, {c_wall:?}): {:.2}x {:.2}x",
            pb / single,
            pc / single
        );
        assert!(single >= uncontended * 0.99, "{single} < {uncontended}");
        for p in [pb, pc] {
            assert!(p > 1.5 * single, "{p} s vs {single} s alone");
            assert!(p < 2.5 * single, "{p} s vs {single} s alone");
        }

        // Wire bytes (scaled-down payload) and modelled bytes (the real model's KV), both ways.
        let blocks = (PREFIX / 16) as u64;
        let p2p = &b.engine.metrics().p2p;
        assert_eq!(p2p.bytes(Direction::In), blocks * 16 * 32);
        assert_eq!(p2p.modelled_bytes(Direction::In), blocks * 16 * 73_728);
        assert_eq!(
            holder.engine.metrics().p2p.modelled_bytes(Direction::Out),
            3 * blocks * 16 * 73_728
        );
        let scraped = scrape_metric(b.addr, "kvmesh_p2p_modelled_bytes_total", "direction=\"in\"").await;
        assert_eq!(scraped, (blocks * 16 * 73_728) as f64);
        for link in [&holder, &alone, &b, &c].map(|s| s.engine.link().unwrap()) {
            assert_eq!(link.registered(), 0, "every transfer deregistered");
        }
        for s in [holder, alone, b, c] {
            s.shutdown().await;
        }
    })
    .await
    .expect("test timed out");
}

/// Acceptance (issue 17): a pull limited by its consumer's link is slower when that consumer is
/// also serving. The holder serves only this one pull, so the consumer's end is the narrower
/// one: alone it gets its whole link; while it serves an equally long pull to a third engine
/// the two transfers split it (ideal ≈ 1.84× the time alone at 32K tokens, as above). If the
/// node's ingress and egress did not share one link, both pulls would take the time alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_into_an_engine_that_is_also_serving_takes_longer() {
    timeout(Duration::from_secs(60), async {
        let holder = start_engine(p2p_config(), PROFILE, 1.0, 32).await;
        let holder_p2p = holder.p2p_addr.unwrap().port();
        let prefix = tokens(81, PREFIX);
        complete(holder.addr, &prefix, 1, None).await;
        let mut prompt = prefix.clone();
        prompt.extend(tokens(82, 32));

        // The same pull into an engine that serves nothing.
        let idle = start_engine(p2p_config(), PROFILE, 1.0, 32).await;
        pull_from(&idle, holder_p2p, &prompt).await;
        let single = pull_seconds(&idle).await;

        // The consumer holds another 32K-token prefix, which a third engine pulls from it while
        // it pulls the holder's.
        let consumer = start_engine(p2p_config(), PROFILE, 1.0, 32).await;
        let consumer_p2p = consumer.p2p_addr.unwrap().port();
        let served = tokens(83, PREFIX);
        complete(consumer.addr, &served, 1, None).await;
        let mut served_prompt = served.clone();
        served_prompt.extend(tokens(84, 32));
        let third = start_engine(p2p_config(), PROFILE, 1.0, 32).await;
        tokio::join!(
            pull_from(&consumer, holder_p2p, &prompt),
            pull_from(&third, consumer_p2p, &served_prompt)
        );
        let busy = pull_seconds(&consumer).await;
        let out = pull_seconds(&third).await;
        eprintln!(
            "pull into an idle engine {single:.3} s; into one also serving {busy:.3} s ({:.2}x); \
             the pull it served {out:.3} s",
            busy / single
        );
        assert!(busy > 1.5 * single, "{busy} s vs {single} s alone");
        assert!(busy < 2.5 * single, "{busy} s vs {single} s alone");
        // The consumer's link carried both directions.
        let blocks = (PREFIX / 16) as u64;
        let p2p = &consumer.engine.metrics().p2p;
        assert_eq!(p2p.modelled_bytes(Direction::In), blocks * 16 * 73_728);
        assert_eq!(p2p.modelled_bytes(Direction::Out), blocks * 16 * 73_728);
        for s in [holder, idle, consumer, third] {
            s.shutdown().await;
        }
    })
    .await
    .expect("test timed out");
}

/// Runs `POST /kvmesh/prefetch` of `history` from `holder_p2p` on `addr` to its end.
async fn prefetch(addr: std::net::SocketAddr, id: &str, history: &[u32], holder_p2p: u16) -> Value {
    let body = json!({"prefetch_id": id, "prompt_token_ids": history,
        "remote_kv_source": {"kv_request_id": id, "remote_host": "127.0.0.1", "remote_port": holder_p2p}});
    reqwest::Client::new()
        .post(format!("http://{addr}/kvmesh/prefetch"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// "A prefetch never delays other work": a prefetch pulling a 32K-token history into an engine
/// and an on-demand pull of another 32K-token prefix into the same engine from the same holder
/// at once. The prefetch is background traffic on both links (the consumer's ingress, the
/// holder's egress), so the request takes about the time it takes on an idle engine (sharing
/// would make its pull ≈ 1.84× longer), and the prefetch, which yields, ends after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefetch_does_not_slow_an_on_demand_pull_into_the_same_engine() {
    timeout(Duration::from_secs(60), async {
        let holder = start_engine(p2p_config(), PROFILE, 1.0, 32).await;
        let holder_p2p = holder.p2p_addr.unwrap().port();
        let history = tokens(91, PREFIX + 16);
        let prefix = tokens(92, PREFIX);
        complete(holder.addr, &history, 1, None).await;
        complete(holder.addr, &prefix, 1, None).await;
        let mut prompt = prefix.clone();
        prompt.extend(tokens(93, 32));

        // The request alone, on an idle engine.
        let idle = start_engine(p2p_config(), PROFILE, 1.0, 32).await;
        let alone = pull_from(&idle, holder_p2p, &prompt).await;
        let single = pull_seconds(&idle).await;

        // The same request while a prefetch pulls into the engine.
        let consumer = start_engine(p2p_config(), PROFILE, 1.0, 32).await;
        let prefetching = {
            let addr = consumer.addr;
            let history = history.clone();
            tokio::spawn(async move {
                let t0 = Instant::now();
                let report = prefetch(addr, "pf-bg", &history, holder_p2p).await;
                (report, t0.elapsed())
            })
        };
        // Past the prefetch's setup: its bytes are moving when the request's pull starts.
        tokio::time::sleep(Duration::from_millis(40)).await;
        let with_prefetch = pull_from(&consumer, holder_p2p, &prompt).await;
        let (report, prefetch_wall) = prefetching.await.unwrap();
        eprintln!(
            "request alone {alone:?} (pull {single:.3} s); with a prefetch pulling into the same \
             engine {with_prefetch:?} ({:.2}x); the prefetch took {prefetch_wall:?}",
            with_prefetch.as_secs_f64() / alone.as_secs_f64()
        );
        assert_eq!(report["outcome"], "pulled", "{report}");
        assert_eq!(report["blocks"], PREFIX / 16, "{report}");
        assert!(
            with_prefetch.as_secs_f64() < 1.3 * alone.as_secs_f64(),
            "the prefetch delayed the request: {with_prefetch:?} vs {alone:?} alone"
        );
        // The prefetch yielded: it lost (about) the request's pull time.
        assert!(
            prefetch_wall.as_secs_f64() > 1.4 * single,
            "{prefetch_wall:?} vs {single} s alone"
        );
        for link in [&holder, &idle, &consumer].map(|s| s.engine.link().unwrap()) {
            assert_eq!(link.registered(), 0, "every transfer deregistered");
        }
        for s in [holder, idle, consumer] {
            s.shutdown().await;
        }
    })
    .await
    .expect("test timed out");
}
