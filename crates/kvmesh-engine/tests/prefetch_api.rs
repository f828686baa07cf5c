//! `POST /kvmesh/prefetch` and `DELETE /kvmesh/prefetch/{id}` on real sim engines: a prefetch
//! lands a peer's blocks in the CPU tier before any request (counted, announced, unpinned), a
//! request then finds them local with the same answer as a recompute; a peer outside the
//! allow-list is refused and counted; malformed prefetches are 400s that name the problem.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{PROFILE, base_config, cached_tokens, complete, p2p_config, start_engine, tokens};
use kvmesh_transfer::Direction;
use serde_json::{Value, json};
use tokio::time::timeout;

async fn prefetch(addr: std::net::SocketAddr, body: Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("http://{addr}/kvmesh/prefetch"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

fn body(id: &str, prompt: &[u32], port: u16) -> Value {
    json!({"prefetch_id": id, "prompt_token_ids": prompt,
           "remote_kv_source": {"kv_request_id": id, "remote_host": "127.0.0.1", "remote_port": port}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefetch_lands_a_peers_blocks_before_the_request() {
    timeout(Duration::from_secs(60), async {
        let a = start_engine(p2p_config(), PROFILE, 1000.0, 32).await;
        let a_p2p = a.p2p_addr.unwrap().port();
        let mut cfg_b = base_config();
        cfg_b.p2p.allowed_peers = vec!["127.0.0.1".into()];
        let b = start_engine(cfg_b, PROFILE, 1000.0, 32).await;
        let history = tokens(7, 640); // 40 blocks
        complete(a.addr, &history, 1, None).await;

        let (status, report) = prefetch(b.addr, body("pf-1", &history, a_p2p)).await;
        assert_eq!(status, 200, "{report}");
        assert_eq!(report["outcome"], "pulled", "{report}");
        assert_eq!(
            report["blocks"], 39,
            "the last block of a prompt is never cached: {report}"
        );
        assert_eq!(report["block_size"], 16);
        let m = b.engine.metrics();
        assert_eq!(m.p2p.blocks(Direction::In), 39);
        assert_eq!(m.prefetch.blocks.get(), 39);
        // Left to the tier's LRU: nothing stays pinned for a request that may never come.
        let hashes = b.engine.block_hashes(&history);
        assert_eq!(b.engine.cpu_tier().pin_count(hashes[0]), 0);
        // Asked again: nothing is missing.
        let (_, again) = prefetch(b.addr, body("pf-2", &history, a_p2p)).await;
        assert_eq!(again["outcome"], "nothing_missing", "{again}");

        // The next turn on B reads the history locally: no pull on its path, same answer.
        let mut next = history.clone();
        next.extend(tokens(8, 50));
        let got = complete(b.addr, &next, 4, None).await;
        assert_eq!(cached_tokens(&got), 624, "{got}");
        assert_eq!(m.p2p.blocks(Direction::In), 39, "no second pull");
        let reference = complete(a.addr, &next, 4, None).await;
        assert_eq!(got["choices"][0]["text"], reference["choices"][0]["text"]);

        // Malformed: 400s naming why.
        let (status, err) = prefetch(b.addr, body("", &history, a_p2p)).await;
        assert_eq!(status, 400, "{err}");
        assert!(
            err["error"]["message"]
                .as_str()
                .unwrap()
                .contains("prefetch_id"),
            "{err}"
        );
        let (status, err) = prefetch(b.addr, json!({"prefetch_id": "x"})).await;
        assert_eq!(status, 400, "{err}");
        // Cancelling a prefetch that is not running.
        let r = reqwest::Client::new()
            .delete(format!("http://{}/kvmesh/prefetch/none", b.addr))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 404);
        b.shutdown().await;
        a.shutdown().await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefetch_from_a_peer_not_allowed_is_refused_and_counted() {
    timeout(Duration::from_secs(60), async {
        let a = start_engine(p2p_config(), PROFILE, 1000.0, 32).await;
        let a_p2p = a.p2p_addr.unwrap().port();
        let mut cfg_b = base_config();
        cfg_b.p2p.allowed_peers = vec!["10.9.9.9".into()];
        let b = start_engine(cfg_b, PROFILE, 1000.0, 32).await;
        let history = tokens(9, 320);
        complete(a.addr, &history, 1, None).await;
        let (status, report) = prefetch(b.addr, body("pf-x", &history, a_p2p)).await;
        assert_eq!(status, 200);
        assert_eq!(report["outcome"], "failed", "{report}");
        assert_eq!(report["reason"], "not_allowed", "{report}");
        assert_eq!(b.engine.metrics().p2p.blocks(Direction::In), 0);
        let text = reqwest::get(format!("http://{}/metrics", b.addr))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(
            text.lines()
                .any(|l| l.starts_with("kvmesh_engine_prefetches_total{")
                    && l.contains("outcome=\"failed\"")
                    && l.ends_with(" 1")),
            "{text}"
        );
        b.shutdown().await;
        a.shutdown().await;
    })
    .await
    .expect("test timed out");
}
