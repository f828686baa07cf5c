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

/// The engine's `/metrics` exposition.
async fn metrics_text(addr: std::net::SocketAddr) -> String {
    reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
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
        let text = metrics_text(b.addr).await;
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

/// A restore prefetch (no `remote_kv_source`) on an engine whose GPU tier lost a history that its
/// CPU tier still holds: the history's blocks go back up now, charged the modelled host-to-device
/// time, and the next turn finds them as GPU hits (no restore on its path). Asked again: nothing
/// is missing. A history larger than the GPU tier can spare is restored only down to the reserve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_prefetch_brings_the_owners_cpu_tier_history_back_to_the_gpu() {
    timeout(Duration::from_secs(60), async {
        let mut cfg = base_config();
        cfg.kv_events = None;
        // 64 GPU blocks of 16 tokens; a restore keeps 256 / 16 = 16 of them (plus one per
        // running sequence) allocatable.
        cfg.num_gpu_blocks = 64;
        cfg.max_num_batched_tokens = 256;
        let e = start_engine(cfg, PROFILE, 1000.0, 32).await;
        let m = e.engine.metrics();
        let restore =
            |id: &str, prompt: &[u32]| json!({"prefetch_id": id, "prompt_token_ids": prompt});
        let history = tokens(1, 480); // 30 blocks
        complete(e.addr, &history, 1, None).await;
        // Another session's 60-block prompt pushes it out of the GPU tier (not the CPU tier).
        complete(e.addr, &tokens(2, 960), 1, None).await;

        let restored_before = m.cpu_restored_blocks.get();
        let (status, report) = prefetch(e.addr, restore("rs-1", &history)).await;
        assert_eq!(status, 200, "{report}");
        assert_eq!(report["outcome"], "restored", "{report}");
        let blocks = report["blocks"].as_u64().unwrap();
        assert!(
            blocks >= 20,
            "most of the history had left the GPU tier: {report}"
        );
        assert_eq!(
            report["wanted_blocks"], blocks,
            "nothing held it back: {report}"
        );
        assert!(report.get("reason").is_none(), "{report}");
        // Charged as an on-demand restore is: real KV bytes over the modelled H2D bandwidth.
        let profile = kvmesh_engine::compute::profiles::profile(PROFILE).unwrap();
        let want_ms = (blocks * 16) as f64 * profile.real_kv_bytes_per_token as f64
            / kvmesh_engine::compute::sim::SIM_H2D_BYTES_PER_SEC
            * 1000.0;
        let got_ms = report["modelled_restore_ms"].as_f64().unwrap();
        assert!((got_ms - want_ms).abs() < 1e-6, "{got_ms} vs {want_ms}");
        assert_eq!(m.prefetch.restored_blocks.get(), blocks);
        assert!((m.prefetch.restore_modelled_seconds.get() * 1000.0 - want_ms).abs() < 1e-6);
        assert_eq!(m.prefetch.blocks.get(), 0, "nothing landed in the CPU tier");
        assert_eq!(m.cpu_restored_blocks.get(), restored_before + blocks);

        // Asked again: all in the GPU tier, nothing to copy (cheap).
        let (_, again) = prefetch(e.addr, restore("rs-2", &history)).await;
        assert_eq!(again["outcome"], "nothing_missing", "{again}");
        assert_eq!(again["blocks"], 0, "{again}");

        // The next turn: every history block is a hit and none is restored on its path.
        let mut next = history.clone();
        next.extend(tokens(3, 40));
        let got = complete(e.addr, &next, 4, None).await;
        assert_eq!(cached_tokens(&got), 480, "{got}");
        assert_eq!(
            m.cpu_restored_blocks.get(),
            restored_before + blocks,
            "no restore on the request's critical path"
        );

        // A history in neither tier: nothing to restore.
        let (_, none) = prefetch(e.addr, restore("rs-3", &tokens(4, 320))).await;
        assert_eq!(none["outcome"], "not_cached", "{none}");

        // Bounded: a 60-block history, pushed out of the GPU tier, comes back only down to the
        // reserve (16 blocks stay allocatable), the rest is left to the request.
        let big = tokens(5, 960);
        complete(e.addr, &big, 1, None).await;
        complete(e.addr, &tokens(6, 960), 1, None).await;
        let (_, bounded) = prefetch(e.addr, restore("rs-4", &big)).await;
        assert_eq!(bounded["outcome"], "restored", "{bounded}");
        assert_eq!(bounded["reason"], "gpu_short", "{bounded}");
        let (got, wanted) = (
            bounded["blocks"].as_u64().unwrap(),
            bounded["wanted_blocks"].as_u64().unwrap(),
        );
        assert!(got < wanted && got <= 64 - 16, "{bounded}");
        let text = metrics_text(e.addr).await;
        assert!(
            text.lines()
                .any(|l| l.starts_with("kvmesh_engine_prefetch_restored_blocks_total{")),
            "{text}"
        );
        assert!(
            text.lines()
                .any(|l| l.starts_with("kvmesh_engine_prefetches_total{")
                    && l.contains("outcome=\"restored\"")
                    && l.ends_with(" 2")),
            "{text}"
        );
        e.shutdown().await;
    })
    .await
    .expect("test timed out");
}
