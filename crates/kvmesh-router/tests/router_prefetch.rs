//! Prefetch ahead of arrival (`prefetch:` in the router config), end to end with three sim
//! engines on loopback: a session's turn ends on its owner, the router has a second engine pull
//! the history during the gap (counted on both sides, shown in `/debug/decisions` and in the
//! index), and when the owner is gone the next turn is served from that copy — a local CPU-tier
//! hit, with no pull on its critical path and no recompute. Short histories are not prefetched.
//! When the next turn goes back to its owner and the owner's GPU tier lost the history during
//! the gap, the owner restores it from its own CPU tier ahead of the turn; a gap in which
//! nothing was evicted costs no request.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::engines::{
    SimEngine, engine_metric, sim_config, start_engine, start_engine_with, stop,
};
use common::{
    doc, eventually_async, get_json, post_json, scrape_metric, start_router, wait_for_prefix,
};
use serde_json::{Value, json};

const LIMIT: Duration = Duration::from_secs(90);

/// Prefix-aware load profile (so the next turn goes where the history is) plus prefetch.
const CONFIG: &str = r#"
seed: 7
block_size: 16
plugins:
  - {type: prefix-cache-scorer, name: prefix}
  - {type: queue-scorer, name: queue}
  - {type: max-score-picker, name: max}
  - {type: p2p-source-producer, name: p2p, parameters: {min_cached_token_delta: 256}}
scheduling_profiles:
  - name: prefix-p2p
    plugins: [{plugin_ref: prefix, weight: 3}, {plugin_ref: queue, weight: 1}, {plugin_ref: max}, {plugin_ref: p2p}]
  - name: by-load
    plugins: [{plugin_ref: queue, weight: 1}, {plugin_ref: max}]
default_profile: prefix-p2p
prefetch:
  session_id: header:x-session-id
  min_tokens: 1024
  kv_bytes_per_token: 1000
  delay_ms: 300
  # The prediction: where would the next turn go by load alone?
  profile: by-load
"#;

fn yaml(engines: &[&SimEngine]) -> String {
    format!("{CONFIG}{}", common::engines::engines_yaml(engines))
}

async fn turn(router: &str, session: &str, prompt: &str) -> (String, Value) {
    let resp = common::client()
        .post(format!("{router}/v1/completions"))
        .header("x-session-id", session)
        .json(&json!({"prompt": prompt, "max_tokens": 4, "temperature": 0}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let ep = resp.headers()["x-kvmesh-endpoint"]
        .to_str()
        .unwrap()
        .to_owned();
    (ep, resp.json().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_session_history_is_prefetched_to_a_second_engine_and_used_there() {
    tokio::time::timeout(LIMIT, async {
        let mut engines = vec![
            start_engine("e0", 20.0, 4096).await,
            start_engine("e1", 20.0, 4096).await,
            start_engine("e2", 20.0, 4096).await,
        ];
        let r = start_router(&yaml(&engines.iter().collect::<Vec<_>>()), None).await;
        let base = format!("http://{}", r.addr);
        let metric = |outcome: &'static str| prefetches(base.clone(), outcome);

        // Turn 1 of a session with a 4K history, computed on its owner; right after it, a long
        // request with the same prefix keeps the owner busy through the session's gap, so the
        // prediction (by load) sends the next turn elsewhere: that engine prefetches.
        let history = doc(11, 4096);
        let (owner, _) = turn(&base, "s-1", &history).await;
        let busy = tokio::spawn(
            common::client()
                .post(format!("{base}/v1/completions"))
                .json(&json!({"prompt": format!("{history} busy"), "max_tokens": 3000, "ignore_eos": true}))
                .send(),
        );
        eventually_async(20, "the prefetch landed", || async {
            metric("landed").await >= 1.0
        })
        .await;
        assert_eq!(metric("issued").await, 1.0);
        let decisions = get_json(&format!("{base}/debug/decisions")).await;
        let prefetch = decisions
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["path"] == "/kvmesh/prefetch")
            .unwrap_or_else(|| panic!("no prefetch decision: {decisions}"))
            .clone();
        let target = prefetch["endpoint"].as_str().unwrap().to_owned();
        assert_ne!(
            target, owner,
            "the second holder is another engine: {prefetch}"
        );
        assert_eq!(prefetch["outcome"], "prefetch");
        // The target pulled the history from the owner's CPU tier, and says so.
        let target_url = engines
            .iter()
            .find(|e| e.name == target)
            .unwrap()
            .url
            .clone();
        let owner_url = engines
            .iter()
            .find(|e| e.name == owner)
            .unwrap()
            .url
            .clone();
        let blocks = engine_metric(&target_url, "kvmesh_engine_prefetch_blocks_total").await;
        assert!(blocks >= 255.0, "4096 tokens = 256 blocks, {blocks} landed");
        assert_eq!(
            scrape_metric(
                &target_url,
                "kvmesh_engine_prefetches_total",
                "outcome=\"pulled\""
            )
            .await,
            1.0
        );
        assert!(
            scrape_metric(&owner_url, "kvmesh_p2p_blocks_total", "direction=\"out\"").await
                >= 255.0
        );
        // The router's index shows the second holder.
        wait_for_prefix(&r, &history, &target, "cpu_tokens", 4080).await;

        // The owner goes away during the gap; the next turn (history + a new message) is placed
        // on the second holder and reads the history from its own CPU tier.
        let pulled_before =
            scrape_metric(&target_url, "kvmesh_p2p_blocks_total", "direction=\"in\"").await;
        let hits_before = engine_metric(&target_url, "vllm:prefix_cache_hits_total").await;
        let owner_idx = engines.iter().position(|e| e.name == owner).unwrap();
        engines.remove(owner_idx).server.shutdown().await;
        let next = format!("{history} and then the tool said {}", doc(12, 200));
        let (placed, body) = turn(&base, "s-1", &next).await;
        assert_eq!(
            placed, target,
            "the next turn goes where the history is: {body}"
        );
        let hits = engine_metric(&target_url, "vllm:prefix_cache_hits_total").await - hits_before;
        assert!(
            hits >= 4080.0,
            "history served from the prefetched copy ({hits} hit tokens)"
        );
        assert_eq!(
            scrape_metric(&target_url, "kvmesh_p2p_blocks_total", "direction=\"in\"").await,
            pulled_before,
            "no pull on the next turn's critical path"
        );
        eventually_async(5, "the prefetch counted as used", || async {
            metric("used").await == 1.0
        })
        .await;
        assert_eq!(metric("wasted").await, 0.0);

        busy.abort();
        // A short history is not worth a pull.
        turn(&base, "s-2", &doc(13, 300)).await;
        eventually_async(5, "short history skipped", || async {
            metric("skipped_short").await >= 1.0
        })
        .await;
        stop(r, engines).await;
    })
    .await
    .expect("test timed out");
}

/// One engine (every next turn goes back to its owner), a small GPU tier, restore-ahead on, and
/// the `prefetch:` timing settings given.
fn restore_config(timing: &str) -> String {
    format!(
        r#"
seed: 7
block_size: 16
plugins:
  - {{type: prefix-cache-scorer, name: prefix}}
  - {{type: max-score-picker, name: max}}
scheduling_profiles:
  - name: prefix
    plugins: [{{plugin_ref: prefix, weight: 1}}, {{plugin_ref: max}}]
prefetch:
  session_id: header:x-session-id
  min_tokens: 1024
  kv_bytes_per_token: 1000
  restore: true
  restore_recheck_ms: 50
{timing}"#
    )
}

/// Restore whenever the eviction is seen (`gap_timing: false`: no gap estimate needed).
const RESTORE_ON_EVICTION: &str = "  delay_ms: 200\n  gap_timing: false\n";

/// Restores timed by the session's gaps (the default).
const RESTORE_GAP_TIMED: &str = "  delay_ms: 100\n  lead_ms: 300\n  gap_tolerance: 0.5\n";

/// The router's `kvmesh_router_prefetches_total{outcome}`.
async fn prefetches(base: String, outcome: &'static str) -> f64 {
    scrape_metric(
        &base,
        "kvmesh_router_prefetches_total",
        &format!("outcome=\"{outcome}\""),
    )
    .await
}

/// Sends small unrelated prompts until the router's index shows one of them on `endpoint`: its
/// KV-event subscription is live. (A SUB socket that connects after the engine published loses
/// those events — ZMQ's slow joiner — and the restore test reads the index right after turn 1.)
async fn wait_until_indexing(r: &kvmesh_router::RouterHandle, base: &str, endpoint: &str) {
    for attempt in 0..40u32 {
        let probe = doc(900 + attempt, 64);
        let resp = post_json(
            &format!("{base}/v1/completions"),
            &json!({"prompt": probe, "max_tokens": 1}),
        )
        .await;
        assert_eq!(resp.status(), 200);
        for _ in 0..10 {
            let v = common::debug_prefix(r, &probe).await;
            if v["endpoints"][endpoint]["any_tokens"].as_u64().unwrap_or(0) > 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    panic!("the router never indexed {endpoint}'s KV events");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_history_evicted_from_the_owners_gpu_is_restored_ahead_of_the_next_turn() {
    tokio::time::timeout(LIMIT, async {
        // 320 GPU blocks of 16 tokens; a restore keeps 512 / 16 = 32 of them allocatable.
        let mut config = sim_config(320);
        config.max_num_batched_tokens = 512;
        let engines = vec![start_engine_with("e0", config, 20.0).await];
        let yaml = format!(
            "{}{}",
            restore_config(RESTORE_ON_EVICTION),
            common::engines::engines_yaml(&engines.iter().collect::<Vec<_>>())
        );
        let r = start_router(&yaml, None).await;
        let base = format!("http://{}", r.addr);
        let url = engines[0].url.clone();
        let metric = |outcome: &'static str| prefetches(base.clone(), outcome);

        wait_until_indexing(&r, &base, "e0").await;
        // Turn 1 ends on e0 with its 2K history in both tiers; the router watches the gap.
        let history = doc(21, 2048);
        let (owner, _) = turn(&base, "s-1", &history).await;
        assert_eq!(owner, "e0");
        wait_for_prefix(&r, &history, "e0", "gpu_tokens", 2032).await;
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(metric("restore_issued").await, 0.0, "still in the GPU tier");
        // Another client's 4.8K prompt pushes most of it out of the GPU tier (not the CPU tier).
        let filler = post_json(
            &format!("{base}/v1/completions"),
            &json!({"prompt": doc(22, 4800), "max_tokens": 1}),
        )
        .await;
        assert_eq!(filler.status(), 200);
        eventually_async(20, "the owner restored the history", || async {
            metric("restored").await >= 1.0
        })
        .await;
        assert_eq!(metric("restore_issued").await, 1.0);
        assert_eq!(metric("issued").await, 0.0, "no pull: one engine");
        let restored = engine_metric(&url, "kvmesh_engine_prefetch_restored_blocks_total").await;
        assert!(
            restored >= 64.0,
            "most of the 128 blocks came back: {restored}"
        );
        assert_eq!(
            scrape_metric(
                &url,
                "kvmesh_engine_prefetches_total",
                "outcome=\"restored\""
            )
            .await,
            1.0
        );
        assert!(
            engine_metric(
                &url,
                "kvmesh_engine_prefetch_restore_modelled_seconds_total"
            )
            .await
                > 0.0
        );
        let decisions = get_json(&format!("{base}/debug/decisions?last=50")).await;
        let restore = decisions
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["outcome"] == "prefetch_restore")
            .unwrap_or_else(|| panic!("no restore decision: {decisions}"));
        assert_eq!(restore["endpoint"], "e0", "{restore}");
        assert_eq!(restore["path"], "/kvmesh/prefetch", "{restore}");
        // The index sees the history back in the GPU tier.
        wait_for_prefix(&r, &history, "e0", "gpu_tokens", 2032).await;

        // The next turn finds the history in the GPU tier: no restore on its critical path.
        let restores_before = engine_metric(&url, "kvmesh_engine_cpu_restored_blocks_total").await;
        let hits_before = engine_metric(&url, "vllm:prefix_cache_hits_total").await;
        let next = format!("{history} and then the tool said {}", doc(23, 200));
        let (placed, _) = turn(&base, "s-1", &next).await;
        assert_eq!(placed, "e0");
        let hits = engine_metric(&url, "vllm:prefix_cache_hits_total").await - hits_before;
        assert!(
            hits >= 2032.0,
            "history served from the GPU tier ({hits} hit tokens)"
        );
        assert_eq!(
            engine_metric(&url, "kvmesh_engine_cpu_restored_blocks_total").await,
            restores_before,
            "no CPU-tier restore on the next turn's path"
        );
        eventually_async(5, "the restore counted as used", || async {
            metric("restore_used").await == 1.0
        })
        .await;

        // A gap in which nothing was evicted: index reads only, no request to the engine.
        let short = doc(24, 2048);
        turn(&base, "s-2", &short).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        turn(&base, "s-2", &format!("{short} ok")).await;
        eventually_async(5, "the owner kept it", || async {
            metric("skipped_owner").await >= 1.0
        })
        .await;
        assert_eq!(metric("restore_issued").await, 1.0);
        assert_eq!(
            scrape_metric(&url, "kvmesh_engine_prefetches_total", "").await,
            1.0,
            "the engine was asked once"
        );
        stop(r, engines).await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn only_a_session_with_a_regular_pace_is_restored_ahead() {
    tokio::time::timeout(LIMIT, async {
        let mut config = sim_config(320);
        config.max_num_batched_tokens = 512;
        let engines = vec![start_engine_with("e0", config, 20.0).await];
        let yaml = format!(
            "{}{}",
            restore_config(RESTORE_GAP_TIMED),
            common::engines::engines_yaml(&engines.iter().collect::<Vec<_>>())
        );
        let r = start_router(&yaml, None).await;
        let base = format!("http://{}", r.addr);
        let url = engines[0].url.clone();
        let metric = |outcome: &'static str| prefetches(base.clone(), outcome);
        let evict = |seed: u32| {
            let base = base.clone();
            async move {
                let filler = post_json(
                    &format!("{base}/v1/completions"),
                    &json!({"prompt": doc(seed, 4800), "max_tokens": 1}),
                )
                .await;
                assert_eq!(filler.status(), 200);
            }
        };

        wait_until_indexing(&r, &base, "e0").await;
        // Every gap below is 1 s from one answer to the next turn: a regular pace.
        let gap = Duration::from_millis(1000);
        // Turn 1: no gap seen yet. Its history leaves the GPU tier in the gap, and nothing is
        // restored: when the turn comes back is unknown.
        let mut prompt = doc(31, 2048);
        turn(&base, "s-1", &prompt).await;
        let ended = tokio::time::Instant::now();
        evict(32).await;
        eventually_async(10, "the unpredictable session was skipped", || async {
            metric("restore_skipped_unpredictable").await >= 1.0
        })
        .await;
        assert_eq!(metric("restore_issued").await, 0.0);
        assert_eq!(metric("timed_by_gap").await, 0.0);
        tokio::time::sleep_until(ended + gap).await;
        // Turns 2 and 3; after turn 3 the router has seen two gaps that agree.
        for (i, seed) in [33, 34].into_iter().enumerate() {
            prompt = format!("{prompt} and the tool said {}", doc(seed, 100));
            turn(&base, "s-1", &prompt).await;
            let ended = tokio::time::Instant::now();
            eventually_async(5, "two gaps make an estimate", || async {
                metric("timed_by_gap").await == i as f64
            })
            .await;
            if i == 0 {
                tokio::time::sleep_until(ended + gap).await;
            }
        }
        // After the third turn the router knows the pace: the history evicted now comes back
        // ahead of the fourth turn.
        evict(35).await;
        eventually_async(20, "the owner restored the history", || async {
            metric("restored").await >= 1.0
        })
        .await;
        assert_eq!(metric("restore_issued").await, 1.0);
        assert!(engine_metric(&url, "kvmesh_engine_prefetch_restored_blocks_total").await >= 64.0);
        let decisions = get_json(&format!("{base}/debug/decisions?last=50")).await;
        let restore = decisions
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["outcome"] == "prefetch_restore")
            .unwrap_or_else(|| panic!("no restore decision: {decisions}"));
        let why = restore["p2p"]["why"].as_str().unwrap_or_default();
        assert!(why.contains("the session's gaps"), "{restore}");
        prompt = format!("{prompt} and then {}", doc(36, 100));
        turn(&base, "s-1", &prompt).await;
        eventually_async(5, "the restore counted as used", || async {
            metric("restore_used").await == 1.0
        })
        .await;
        stop(r, engines).await;
    })
    .await
    .expect("test timed out");
}
