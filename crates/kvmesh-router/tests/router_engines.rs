//! The router in front of real kvmesh engines (sim backend, in-process, loopback): KV events feed
//! the index, affinity follows the prefix holder, load + P2P spreads a burst and names the holder
//! as source, malformed requests never reach an engine, disconnects cancel upstream.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::engines::{SimEngine, engine_metric, engines_yaml, start_engine, stop};
use common::{
    LOAD_P2P_PROFILE, client, doc, eventually_async, get_json, get_text, post_json, scrape_metric,
    start_router, wait_for_prefix,
};
use futures::{FutureExt, StreamExt};
use kvmesh_router::RouterHandle;
use serde_json::{Value, json};

const LIMIT: Duration = Duration::from_secs(60);

async fn complete(
    r: &RouterHandle,
    profile: Option<&str>,
    prompt: &str,
    max_tokens: u32,
) -> (String, Value) {
    let mut req = client()
        .post(format!("http://{}/v1/completions", r.addr))
        .json(&json!({"prompt": prompt, "max_tokens": max_tokens}));
    if let Some(p) = profile {
        req = req.header("x-kvmesh-profile", p);
    }
    let resp = req.send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let ep = resp.headers()["x-kvmesh-endpoint"]
        .to_str()
        .unwrap()
        .to_owned();
    (ep, resp.json().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn affinity_sends_a_repeated_prefix_to_its_holder() {
    tokio::time::timeout(LIMIT, async {
        let engines = vec![
            start_engine("e0", 100.0, 1024).await,
            start_engine("e1", 100.0, 1024).await,
        ];
        let refs: Vec<&SimEngine> = engines.iter().collect();
        let yaml = format!(
            "seed: 1\nmetrics_scrape_interval: 50ms\n{}",
            engines_yaml(&refs)
        );
        let r = start_router(&yaml, None).await;
        for i in 0..3 {
            let prefix = doc(i, 1600);
            let (holder, _) = complete(&r, None, &prefix, 2).await;
            wait_for_prefix(&r, &prefix, &holder, "gpu_tokens", 1584).await;
            for q in 0..4 {
                let (ep, body) = complete(&r, None, &format!("{prefix} question {q}"), 2).await;
                assert_eq!(ep, holder, "request {q} on prefix {i} left the holder");
                assert!(
                    body["usage"]["prompt_tokens_details"]["cached_tokens"]
                        .as_u64()
                        .unwrap()
                        >= 1584,
                    "{body}"
                );
            }
        }
        let decisions = get_json(&format!("http://{}/debug/decisions?last=1", r.addr)).await;
        assert_eq!(decisions[0]["outcome"], "local_hit");
        // The engines' own TTFT / computed-token counters taught the cost model their prefill rate.
        common::eventually(
            5,
            "prefill rate learned from scraped engine counters",
            || !r.state.cost_model.prefill_rates().is_empty(),
        )
        .await;
        stop(r, engines).await;
    })
    .await
    .unwrap();
}

/// Seeds a 4096-token prefix on e0, then sends a burst of 12 requests sharing it. Returns the
/// router (for inspection) and the engines.
async fn burst_after_seeding() -> (RouterHandle, Vec<SimEngine>) {
    let engines = vec![
        start_engine("e0", 1.0, 2048).await,
        start_engine("e1", 1.0, 2048).await,
        start_engine("e2", 1.0, 2048).await,
    ];
    let refs: Vec<&SimEngine> = engines.iter().collect();
    let r = start_router(&format!("{LOAD_P2P_PROFILE}{}", engines_yaml(&refs)), None).await;
    let prefix = doc(42, 4096);
    // Seed directly on e0 (bypassing the router), as a previous turn would have.
    let seeded = post_json(
        &format!("{}/v1/completions", engines[0].url),
        &json!({"prompt": prefix, "max_tokens": 1}),
    )
    .await;
    assert_eq!(seeded.status(), 200);
    wait_for_prefix(&r, &prefix, "e0", "cpu_tokens", 4096).await;
    let burst = (0..12).map(|i| {
        let url = format!("http://{}/v1/completions", r.addr);
        let prompt = format!("{prefix} child {i}");
        async move {
            let resp = post_json(&url, &json!({"prompt": prompt, "max_tokens": 4})).await;
            assert_eq!(resp.status(), 200);
            resp.headers()["x-kvmesh-endpoint"]
                .to_str()
                .unwrap()
                .to_owned()
        }
    });
    let placed = futures::future::join_all(burst).await;
    for e in ["e0", "e1", "e2"] {
        assert!(
            placed.iter().any(|p| p == e),
            "burst not spread: {placed:?}"
        );
    }
    (r, engines)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn load_p2p_spreads_a_burst_and_names_the_holder_as_source() {
    tokio::time::timeout(LIMIT, async {
        let (r, engines) = burst_after_seeding().await;
        let decisions = get_json(&format!("http://{}/debug/decisions?last=12", r.addr)).await;
        let decisions = decisions.as_array().unwrap();
        assert_eq!(decisions.len(), 12);
        let (mut pulls, mut from_seed) = (0, 0);
        for d in decisions {
            if d["endpoint"] == "e0" {
                assert_eq!(d["outcome"], "local_hit", "{d}");
                assert_eq!(d["p2p"]["skipped"], "self_source", "{d}");
            } else {
                assert_eq!(d["outcome"], "pull_named", "{d}");
                // The source holds the whole prefix in its CPU tier at decision time: e0, or a peer
                // that already pulled it during the burst.
                let src = d["p2p"]["source_endpoint"].as_str().unwrap();
                let held = d["candidates"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|c| c["endpoint"] == src)
                    .unwrap()["cpu_tokens"]
                    .as_u64()
                    .unwrap();
                assert!(src != d["endpoint"] && held >= 4096, "{d}");
                from_seed += usize::from(src == "e0");
                // The target may already hold part of the prefix (a pull for an earlier request of
                // the burst landing); the delta still clears the threshold.
                assert!(d["p2p"]["delta_tokens"].as_i64().unwrap() >= 2048, "{d}");
                pulls += 1;
            }
        }
        assert!(
            pulls > 0 && from_seed > 0,
            "pulls {pulls}, from the seeded holder {from_seed}"
        );
        let metrics = get_text(&format!("http://{}/metrics", r.addr)).await;
        assert!(
            metrics.contains(&format!(
                "kvmesh_router_decisions_total{{outcome=\"pull_named\"}} {pulls}"
            )),
            "{metrics}"
        );
        stop(r, engines).await;
    })
    .await
    .unwrap();
}

/// The engines' counters prove the named pulls happened: every non-holder that served part of the
/// burst received P2P blocks and computed only the short per-request suffixes, never the
/// 4096-token prefix; the non-holders together report external (P2P) prefix-cache hits. (How one
/// engine splits the prefix between `external_kv_transfer` and `local_cache_hit` depends on which
/// of its concurrent requests landed the pulled blocks first, so it is checked over the fleet.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn load_p2p_pulls_show_up_as_external_hits() {
    tokio::time::timeout(LIMIT, async {
        let (r, engines) = burst_after_seeding().await;
        // The pulls' counters can settle after the responses they served (a request that
        // stopped waiting for a pull another request started): poll each engine's counters
        // until its pull is in evidence, bounded, instead of reading them once.
        for e in &engines[1..] {
            let placed_here = r
                .state
                .decisions
                .last(12)
                .iter()
                .filter(|d| d.decision.endpoint.as_deref() == Some(e.name.as_str()))
                .count();
            assert!(placed_here > 0, "burst_after_seeding spreads over every endpoint");
            let url = e.url.as_str();
            let what = format!(
                "{} served {placed_here} requests named to pull: P2P blocks received",
                e.name
            );
            eventually_async(10, &what, move || {
                scrape_metric(url, "kvmesh_p2p_blocks_total", "direction=\"in\"")
                    .map(|blocks_in| blocks_in >= 1.0)
            })
            .await;
            let computed =
                scrape_metric(&e.url, "vllm:prompt_tokens_by_source_total", "local_compute").await;
            assert!(
                computed <= 32.0 * placed_here as f64,
                "{} computed {computed} prompt tokens for {placed_here} requests: the prefix was recomputed, not pulled",
                e.name
            );
        }
        let pullers = &engines[1..];
        let fleet_external = move || async move {
            let mut external = 0.0;
            for e in pullers {
                external += engine_metric(&e.url, "vllm:external_prefix_cache_hits_total").await;
            }
            external
        };
        eventually_async(10, "external prefix-cache hits on any puller", || {
            fleet_external().map(|external| external > 0.0)
        })
        .await;
        // The holder pulled nothing.
        assert_eq!(engine_metric(&engines[0].url, "vllm:external_prefix_cache_hits_total").await, 0.0);
        stop(r, engines).await;
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn malformed_request_never_reaches_the_engine_and_disconnect_cancels() {
    tokio::time::timeout(LIMIT, async {
        let engines = vec![start_engine("e0", 1.0, 1024).await];
        let refs: Vec<&SimEngine> = engines.iter().collect();
        let r = start_router(&engines_yaml(&refs), None).await;
        let base = format!("http://{}", r.addr);
        let resp = client().post(format!("{base}/v1/completions")).body(r#"{"prompt": [1, "x"]}"#).send().await.unwrap();
        assert_eq!(resp.status(), 400);
        assert_eq!(engine_metric(&engines[0].url, "vllm:prompt_tokens_total").await, 0.0);
        // A long stream, abandoned after the first chunk.
        let resp = post_json(&format!("{base}/v1/completions"), &json!({"prompt": "tell me a long story", "max_tokens": 5000, "ignore_eos": true, "stream": true})).await;
        assert_eq!(resp.status(), 200);
        let mut body = resp.bytes_stream();
        body.next().await.unwrap().unwrap();
        assert_eq!(engine_metric(&engines[0].url, "vllm:num_requests_running").await, 1.0);
        drop(body);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let running = engine_metric(&engines[0].url, "vllm:num_requests_running").await;
            // What this router counts itself, and the engine's report merged in.
            let load = r.state.endpoints.list()[0].load.own_snapshot();
            let merged = r.state.endpoints.list()[0].load.snapshot();
            if running == 0.0 && load == Default::default() && (merged.requests, merged.uncached_tokens) == (0, 0) {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "running {running}, router load {load:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        stop(r, engines).await;
    })
    .await
    .unwrap();
}

/// Streams a completion through the router and reads it to the end; returns the endpoint.
async fn stream_to_end(base: &str, prompt: &str, max_tokens: u32) -> String {
    let resp = post_json(
        &format!("{base}/v1/completions"),
        &json!({"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true, "stream": true}),
    )
    .await;
    assert_eq!(resp.status(), 200);
    let ep = resp.headers()["x-kvmesh-endpoint"]
        .to_str()
        .unwrap()
        .to_owned();
    let mut body = resp.bytes_stream();
    while let Some(chunk) = body.next().await {
        chunk.unwrap();
    }
    ep
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gpu_tier_full_of_in_flight_work_is_priced_as_a_wait() {
    tokio::time::timeout(LIMIT, async {
        // 1,024 blocks of 16 tokens: each engine's GPU tier holds 16,384 tokens, and says so in
        // `vllm:cache_config_info`.
        let engines = vec![
            start_engine("e0", 1.0, 1024).await,
            start_engine("e1", 1.0, 1024).await,
        ];
        let refs: Vec<&SimEngine> = engines.iter().collect();
        let yaml = format!(
            "seed: 3\nmetrics_scrape_interval: 50ms\n{}",
            engines_yaml(&refs)
        );
        let r = start_router(&yaml, None).await;
        let base = format!("http://{}", r.addr);
        common::eventually(5, "GPU tier sizes scraped", || {
            r.state
                .endpoints
                .list()
                .iter()
                .all(|e| e.metrics().and_then(|m| m.gpu_capacity_tokens) == Some(16_384))
        })
        .await;
        // Finished streams teach the router how long a request decodes on each engine.
        for i in 0..40 {
            let known = r
                .state
                .endpoints
                .list()
                .iter()
                .filter(|e| e.load.decode_ms_per_token().is_some())
                .count();
            if known == 2 {
                break;
            }
            stream_to_end(&base, &doc(100 + i, 64), 8).await;
        }
        assert!(
            r.state
                .endpoints
                .list()
                .iter()
                .all(|e| e.load.decode_ms_per_token().is_some())
        );
        // A long stream holds 6,000 prompt + 9,000 decode tokens of one engine's 16,384.
        let long = doc(7, 6_000);
        let resp = post_json(
            &format!("{base}/v1/completions"),
            &json!({"prompt": long, "max_tokens": 9_000, "ignore_eos": true, "stream": true}),
        )
        .await;
        assert_eq!(resp.status(), 200);
        let busy = resp.headers()["x-kvmesh-endpoint"]
            .to_str()
            .unwrap()
            .to_owned();
        let mut held = resp.bytes_stream();
        held.next().await.unwrap().unwrap();
        // A follow-up sharing its first 5,000 tokens: on the busy engine it needs only its own 5
        // tokens and 2,000 decode tokens more, which no longer fit.
        let follow = format!("{}zzzzz", &long[..5_000]);
        let resp = post_json(
            &format!("{base}/v1/completions"),
            &json!({"prompt": follow, "max_tokens": 2_000, "stream": true}),
        )
        .await;
        assert_eq!(resp.status(), 200);
        drop(resp);
        let decisions = get_json(&format!("{base}/debug/decisions?last=1")).await;
        let cands = decisions[0]["candidates"].as_array().unwrap();
        let on = |name: &str| {
            cands
                .iter()
                .find(|c| c["endpoint"] == name)
                .unwrap()
                .clone()
        };
        let b = on(&busy);
        let other = on(if busy == "e0" { "e1" } else { "e0" });
        assert_eq!(b["gpu_capacity_tokens"], 16_384, "{b}");
        assert!(
            b["in_flight_context_tokens"].as_u64().unwrap() >= 14_992,
            "{b}"
        );
        assert!(
            b["in_flight_shared_tokens"].as_u64().unwrap() >= 4_992,
            "{b}"
        );
        assert!(b["predicted"]["kv_wait_ms"].as_f64().unwrap() > 0.0, "{b}");
        assert_eq!(
            other["predicted"]["kv_wait_ms"].as_f64().unwrap(),
            0.0,
            "{other}"
        );
        let metrics = get_text(&format!("{base}/metrics")).await;
        assert!(
            metrics.contains(&format!(
                "kvmesh_router_endpoint_gpu_capacity_tokens{{endpoint=\"{busy}\"}} 16384"
            )),
            "{metrics}"
        );
        assert!(
            metrics.contains("kvmesh_router_endpoint_decode_seconds_per_token{endpoint=\"e0\"}")
        );
        drop(held);
        stop(r, engines).await;
    })
    .await
    .unwrap();
}
