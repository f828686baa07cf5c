//! Hot-prefix replication (`replication:`): three sim engines, a prefix-affine profile that sends
//! every request for a shared prefix to its one holder. Once the prefix is hot and the holder
//! busy, the router has the least loaded other engine copy it from the holder's CPU tier, ahead
//! of any request for it there; the index then shows two holders, and no third copy is made.
//! Each decision (issued, skipped with its reason) and the copy's end are in `/debug/decisions`.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::engines::{engine_metric, start_engine, stop};
use common::{doc, eventually_async, post_json, scrape_metric, start_router, wait_for_prefix};
use serde_json::{Value, json};

const LIMIT: Duration = Duration::from_secs(90);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hot_prefix_on_a_busy_holder_gets_a_second_holder() {
    tokio::time::timeout(LIMIT, async {
        let engines = vec![
            start_engine("e0", 1.0, 4096).await,
            start_engine("e1", 1.0, 4096).await,
            start_engine("e2", 1.0, 4096).await,
        ];
        let mut yaml = String::from(
            "seed: 1\nplugins:\n  - {type: prefix-cache-scorer, name: prefix}\n  - {type: max-score-picker, name: max}\n\
             scheduling_profiles:\n  - {name: affine, plugins: [{plugin_ref: prefix}, {plugin_ref: max}]}\n\
             replication: {min_tokens: 1024, hot_requests: 3, window_s: 30, busy_tokens: 1, cooldown_s: 0.1}\n\
             endpoints:\n",
        );
        for e in &engines {
            yaml.push_str(&format!(
                "  - {{name: {}, url: \"{}\", p2p: \"127.0.0.1:{}\", kv_events: {{endpoint: \"{}\", topic: kv-events}}}}\n",
                e.name, e.url, e.p2p_port, e.events
            ));
        }
        let r = start_router(&yaml, None).await;
        let router = format!("http://{}", r.addr);
        let prefix = doc(7, 4096);
        let seeded = post_json(
            &format!("{}/v1/completions", engines[0].url),
            &json!({"prompt": prefix, "max_tokens": 1}),
        )
        .await;
        assert_eq!(seeded.status(), 200);
        wait_for_prefix(&r, &prefix, "e0", "cpu_tokens", 4096).await;

        // A burst for the prefix: all placed on its holder, which queues them.
        let burst = |from: u32| {
            let url = format!("{router}/v1/completions");
            let prefix = prefix.clone();
            async move {
                let sends = (from..from + 6).map(|i| {
                    let (url, prompt) = (url.clone(), format!("{prefix} question {i} {}", doc(i, 300)));
                    async move {
                        let resp = post_json(&url, &json!({"prompt": prompt, "max_tokens": 32})).await;
                        assert_eq!(resp.status(), 200);
                        resp.headers()["x-kvmesh-endpoint"].to_str().unwrap().to_owned()
                    }
                });
                futures::future::join_all(sends).await
            }
        };
        let placed = burst(0).await;
        assert!(placed.iter().all(|e| e == "e0"), "affine placement: {placed:?}");
        let copies = |outcome: &'static str| {
            let router = router.clone();
            async move {
                scrape_metric(&router, "kvmesh_router_replications_total", &format!("outcome=\"{outcome}\"")).await
            }
        };
        eventually_async(30, "a copy to land", || async { copies("landed").await >= 1.0 }).await;
        assert_eq!(copies("issued").await, 1.0);
        // The least loaded other engine (e1, by index order on a tie) holds it now, pulled from
        // e0's CPU tier before any request for it was placed there.
        wait_for_prefix(&r, &prefix, "e1", "cpu_tokens", 4096).await;
        assert!(engine_metric(&engines[1].url, "kvmesh_p2p_blocks_total").await >= 256.0);
        let holders: Value = post_json(&format!("{router}/debug/prefix"), &json!({"prompt": prefix}))
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(
            holders["endpoints"]["e2"]["any_tokens"].as_u64().unwrap_or(0),
            0,
            "one copy, not the fleet: {holders}"
        );

        // Still hot, cooldown over, two holders now: no further copy (max_holders 2).
        burst(100).await;
        assert_eq!(copies("issued").await, 1.0);
        assert!(copies("skipped_holders").await >= 1.0);

        // Every decision about the hot prefix and the copy's end are in /debug/decisions.
        let decisions: Value = reqwest::get(format!("{router}/debug/decisions?last=500"))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let replication: Vec<&Value> = decisions
            .as_array()
            .unwrap()
            .iter()
            .filter(|d| d["profile"] == "replication")
            .collect();
        let with = |outcome: &str| -> Vec<&Value> {
            replication.iter().copied().filter(|d| d["outcome"] == outcome).collect()
        };
        let issued = with("replication_issued");
        assert_eq!(issued.len(), 1, "{replication:?}");
        let issued = issued[0];
        assert_eq!(issued["endpoint"], "e1", "{issued}");
        assert_eq!(issued["p2p"]["source_endpoint"], "e0", "{issued}");
        assert_eq!(issued["prompt_tokens"], 4096, "{issued}");
        assert_eq!(issued["path"], "/kvmesh/prefetch", "{issued}");
        assert!(issued["p2p"]["why"].as_str().unwrap().contains("hot"), "{issued}");
        let landed = with("replication_landed");
        assert_eq!(landed.len(), 1, "{replication:?}");
        assert_eq!(landed[0]["request_id"], issued["request_id"], "the copy's end names its decision");
        assert_eq!(landed[0]["endpoint"], "e1");
        assert!(
            landed[0]["p2p"]["why"].as_str().unwrap().contains("engine outcome pulled"),
            "{}",
            landed[0]
        );
        assert!(with("replication_failed").is_empty(), "{replication:?}");
        let skipped = with("replication_skipped");
        assert!(
            skipped.iter().any(|d| {
                let why = d["p2p"]["why"].as_str().unwrap();
                why.starts_with("skipped_holders") && why.contains("e0") && why.contains("e1")
            }),
            "a skip names its reason and the holders: {skipped:?}"
        );
        assert!(skipped.iter().all(|d| d["prompt_tokens"] == 4096), "{skipped:?}");
        stop(r, engines).await;
    })
    .await
    .unwrap();
}
