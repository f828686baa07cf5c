//! Prefetch ahead of arrival (`prefetch:` in the router config), end to end with three sim
//! engines on loopback: a session's turn ends on its owner, the router has a second engine pull
//! the history during the gap (counted on both sides, shown in `/debug/decisions` and in the
//! index), and when the owner is gone the next turn is served from that copy — a local CPU-tier
//! hit, with no pull on its critical path and no recompute. Short histories are not prefetched.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::engines::{SimEngine, engine_metric, start_engine, stop};
use common::{doc, eventually_async, get_json, scrape_metric, start_router, wait_for_prefix};
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
  - {type: p2p-source-producer, name: p2p, parameters: {minCachedTokenDelta: 256}}
schedulingProfiles:
  - name: prefix-p2p
    plugins: [{pluginRef: prefix, weight: 3}, {pluginRef: queue, weight: 1}, {pluginRef: max}, {pluginRef: p2p}]
  - name: by-load
    plugins: [{pluginRef: queue, weight: 1}, {pluginRef: max}]
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
        let metric = |outcome: &'static str| {
            let base = base.clone();
            async move {
                scrape_metric(
                    &base,
                    "kvmesh_router_prefetches_total",
                    &format!("outcome=\"{outcome}\""),
                )
                .await
            }
        };

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
