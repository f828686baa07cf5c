//! The router's `/metrics` report the prefix index's size as it changes (`kvmesh_index_*`), for
//! the router's whole life — not just the empty index seen at start-up.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{FakeEngine, post_json, scrape_metric, start_router};
use kvmesh_core::BlockHash;
use kvmesh_core::events::{BlockStored, EventBatch, KvEvent, Medium};
use kvmesh_events::{Publisher, PublisherConfig};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn index_size_metrics_follow_the_events() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let endpoint = format!("tcp://127.0.0.1:{port}");
        let mut config = PublisherConfig::new(endpoint.clone(), "kv-events");
        config.bind = true;
        let mut publisher = Publisher::start(config).await.unwrap();
        let engine = FakeEngine::start("e0").await;
        let yaml = format!(
            "block_size: 16\nendpoints:\n  - {{name: e0, url: \"{}\", kv_events: {{endpoint: \"{endpoint}\", topic: kv-events}}}}\n",
            engine.url
        );
        let r = start_router(&yaml, None).await;
        let base = format!("http://{}", r.addr);
        let batch = EventBatch {
            ts: 0.0,
            events: vec![KvEvent::BlockStored(BlockStored::run(
                Medium::Gpu,
                None,
                16,
                vec![BlockHash(11), BlockHash(12)],
                (0..32).collect(),
            ))],
            data_parallel_rank: None,
        };
        // Publish until the subscriber has joined (ZMQ drops frames sent before it connects).
        let tokens: Vec<u32> = (0..32).collect();
        loop {
            publisher.publish(&batch).await.unwrap();
            tokio::time::sleep(Duration::from_millis(200)).await;
            let resp = post_json(&format!("{base}/debug/prefix"), &json!({"token_ids": tokens}))
                .await
                .json::<serde_json::Value>()
                .await
                .unwrap();
            if resp["endpoints"]["e0"]["gpu_tokens"] == 32 {
                break;
            }
        }
        // The stats refresh every few seconds; the index now holds 2 blocks on one endpoint.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let blocks = scrape_metric(&base, "kvmesh_index_blocks", "").await;
            let memberships = scrape_metric(&base, "kvmesh_index_memberships", "").await;
            if blocks == 2.0 && memberships >= 2.0 {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "kvmesh_index_blocks stayed {blocks} (memberships {memberships}) with 2 blocks indexed"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        r.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}
