//! P2P under contention (the shared-prefix pool experiment's failure modes;
//! `docs/architecture.md#p2p-pull`): concurrent requests for one prefix on one consumer move its
//! bytes once, and a pull stuck on a silent peer delays neither other requests nor other pulls of
//! that engine, and an overloaded engine refuses before it pulls.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{
    PROFILE, cached_tokens, complete, p2p_config, scrape_metric, source, start_engine, tokens,
};
use kvmesh_transfer::Direction;
use tokio::time::timeout;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_for_one_prefix_move_its_bytes_once() {
    timeout(Duration::from_secs(60), async {
        // 8 MiB of KV for the prefix, so the first pull is still on the wire (and then in
        // its modelled hold: B runs at real time) when the others arrive.
        let a = start_engine(p2p_config(), PROFILE, 1000.0, 2048).await;
        let a_p2p = a.p2p_addr.unwrap().port();
        let b = start_engine(p2p_config(), PROFILE, 1.0, 2048).await;
        let prefix = tokens(1, 4096); // 256 blocks
        complete(a.addr, &prefix, 2, None).await;

        let go = Arc::new(tokio::sync::Barrier::new(4));
        let mut tasks = Vec::new();
        for i in 0..4 {
            let mut prompt = prefix.clone();
            prompt.extend(tokens(100 + i, 64));
            let addr = b.addr;
            let go = go.clone();
            tasks.push(tokio::spawn(async move {
                go.wait().await;
                complete(addr, &prompt, 2, Some(source(a_p2p))).await
            }));
        }
        for t in tasks {
            let got = t.await.unwrap();
            assert_eq!(cached_tokens(&got), 4096, "{got}");
        }
        let p2p = &b.engine.metrics().p2p;
        assert_eq!(
            p2p.blocks(Direction::In),
            256,
            "the shared prefix crossed the wire once, not once per request"
        );
        assert_eq!(b.p2p.inflight_pulls(), 0);
        // Every request's prefix came from the peer (once), none recomputed it.
        let computed = scrape_metric(
            b.addr,
            "vllm:prompt_tokens_by_source_total",
            "local_compute",
        )
        .await;
        assert_eq!(computed, 4.0 * 64.0, "only the suffixes were computed");
        b.shutdown().await;
        a.shutdown().await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_stuck_on_a_silent_peer_delays_no_other_request() {
    timeout(Duration::from_secs(60), async {
        // A "peer" that accepts connections and never says a word.
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let silent_port = silent.local_addr().unwrap().port();
        let hold = tokio::spawn(async move {
            let mut conns = Vec::new();
            while let Ok((c, _)) = silent.accept().await {
                conns.push(c);
            }
        });
        let mut cfg = p2p_config();
        cfg.p2p.timeout = Duration::from_secs(3);
        cfg.p2p.pending_deadline = Duration::from_millis(500);
        let b = start_engine(cfg, PROFILE, 1000.0, 32).await;
        let prefix = tokens(7, 2048);

        let stuck_started = Instant::now();
        let stuck = {
            let mut prompt = prefix.clone();
            prompt.extend(tokens(8, 32));
            let addr = b.addr;
            tokio::spawn(async move { complete(addr, &prompt, 2, Some(source(silent_port))).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        // A second request for the same prefix from the same silent peer waits for the first
        // pull, but within one budget (timeout 3 s + pending 0.5 s): waits never compound.
        let follower_started = Instant::now();
        let follower = {
            let mut prompt = prefix.clone();
            prompt.extend(tokens(11, 32));
            let addr = b.addr;
            tokio::spawn(async move { complete(addr, &prompt, 2, Some(source(silent_port))).await })
        };
        // Same prefix (same first missing block), and an unrelated prompt: both are served
        // long before the stuck pull gives up.
        let mut same = prefix.clone();
        same.extend(tokens(9, 32));
        complete(b.addr, &same, 2, None).await;
        complete(b.addr, &tokens(10, 1024), 2, None).await;
        // Evidence, not a stopwatch: both were served while the stuck pull was still stuck.
        assert!(
            !stuck.is_finished(),
            "other requests were served only after the stuck pull gave up ({:?})",
            stuck_started.elapsed()
        );
        let got = stuck.await.unwrap();
        assert_eq!(got["usage"]["completion_tokens"], 2);
        let got = follower.await.unwrap();
        assert_eq!(got["usage"]["completion_tokens"], 2);
        // One budget is 3.5 s; compounded waits would be at least 7 s (the margin absorbs a
        // loaded machine).
        assert!(
            follower_started.elapsed() < Duration::from_millis(6_500),
            "waiting for another pull and then pulling again took {:?}",
            follower_started.elapsed()
        );
        assert!(
            stuck_started.elapsed() < Duration::from_secs(10),
            "the stuck pull itself is bounded (timeout + pending deadline)"
        );
        b.shutdown().await;
        hold.abort();
    })
    .await
    .expect("test timed out");
}

/// An engine whose waiting queue is full answers 429 at once: it does not first pull the
/// request's prefix from a peer (seconds of transfer, then pins held for nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overloaded_engine_refuses_before_pulling() {
    timeout(Duration::from_secs(60), async {
        let a = start_engine(p2p_config(), PROFILE, 1000.0, 64).await;
        let a_p2p = a.p2p_addr.unwrap().port();
        let prefix = tokens(3, 2048);
        complete(a.addr, &prefix, 1, None).await;
        let mut cfg = p2p_config();
        cfg.max_num_seqs = 1;
        cfg.max_waiting = 1;
        // Real time: the running request outlasts the checks below by a wide margin.
        let b = start_engine(cfg, PROFILE, 1.0, 64).await;
        let (b_addr, long) = (b.addr, tokens(4, 8000));
        let running = tokio::spawn(async move { complete(b_addr, &long, 40, None).await });
        let deadline = Instant::now() + Duration::from_secs(20);
        // Scheduled (its prompt is accounted) before the next one arrives...
        while scrape_metric(b.addr, "vllm:prompt_tokens_by_source_total", "").await < 8000.0 {
            assert!(Instant::now() < deadline, "the first request never started");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // ...so the next one waits behind it (max_num_seqs 1) and fills --max-waiting 1.
        let short = tokens(5, 64);
        let waiting = tokio::spawn(async move { complete(b_addr, &short, 1, None).await });
        while b.engine.waiting_at_capacity().is_none() {
            assert!(Instant::now() < deadline, "the second request never queued");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let mut body = serde_json::json!({"prompt": prefix, "max_tokens": 1});
        body["kv_transfer_params"] = source(a_p2p);
        let r = reqwest::Client::new()
            .post(format!("http://{}/v1/completions", b.addr))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 429);
        let p2p = &b.engine.metrics().p2p;
        assert_eq!(
            (p2p.connections_opened(), p2p.blocks(Direction::In)),
            (0, 0),
            "the refused request contacted its source"
        );
        running.await.unwrap();
        waiting.await.unwrap();
        b.shutdown().await;
        a.shutdown().await;
    })
    .await
    .expect("test timed out");
}
