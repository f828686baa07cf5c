//! Engine-level P2P measurement (ignored by default; run in release):
//!
//! ```text
//! KVMESH_P2P_BENCH_TOKENS=40960 KVMESH_P2P_BENCH_KV_BYTES=40960 \
//!   cargo test --release -p kvmesh-engine --test p2p_bench -- --ignored --nocapture
//! ```
//!
//! Two sim engines (gpt-oss-120b-h200, real time, block 16) on loopback. A computes a prefix; B
//! answers prefix + 64-token suffix (max_tokens 1) twice: once pulling the prefix from A, once on
//! a different cold prefix of the same length (recompute). Prints TTFT of both, the modelled
//! pull/recompute times, and the measured wire time of the pull.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::{PROFILE, salted_tokens, scrape_metric, start_engine};
use kvmesh_engine::EngineConfig;
use kvmesh_engine::server::RunningServer;
use kvmesh_transfer::Direction;
use serde_json::{Value, json};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

async fn start(tokens: usize, kv_bytes: usize) -> RunningServer {
    let blocks = tokens / 16 + 64;
    let mut cfg = EngineConfig {
        port: 0,
        served_model_name: "sim-bench".into(),
        num_gpu_blocks: blocks,
        cpu_offload_bytes: (blocks * 16 * kv_bytes) as u64 + (64 << 20),
        max_model_len: tokens + 1024,
        hash_seed: Some("0".into()),
        ..EngineConfig::default()
    };
    cfg.p2p.port = Some(0);
    cfg.p2p.allowed_peers = vec!["127.0.0.1".into()];
    cfg.p2p.timeout = Duration::from_secs(30);
    start_engine(cfg, PROFILE, 1.0, kv_bytes).await
}

/// The benchmark's own token streams (salt 99), unrelated to the tests' prompts.
fn prompt(seed: u32, n: usize) -> Vec<u32> {
    salted_tokens(seed, 99, n)
}

async fn timed(s: &RunningServer, prompt: &[u32], kvp: Option<Value>) -> (Duration, Value) {
    let mut body = json!({"model": "sim-bench", "prompt": prompt, "max_tokens": 1});
    if let Some(p) = kvp {
        body["kv_transfer_params"] = p;
    }
    let client = reqwest::Client::new();
    let t0 = Instant::now();
    let r = client
        .post(format!("http://{}/v1/completions", s.addr))
        .json(&body)
        .send()
        .await
        .unwrap();
    let v: Value = r.json().await.unwrap();
    (t0.elapsed(), v)
}

/// `kvmesh_p2p_pull_duration_seconds_sum` of an engine (connect to last block landed).
async fn pull_seconds(s: &RunningServer) -> f64 {
    scrape_metric(s.addr, "kvmesh_p2p_pull_duration_seconds_sum", "").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark; run in release with --ignored --nocapture"]
async fn p2p_pull_vs_recompute_ttft() {
    let tokens = env("KVMESH_P2P_BENCH_TOKENS", 40_960);
    let kv_bytes = env("KVMESH_P2P_BENCH_KV_BYTES", 40_960);
    let runs = env("KVMESH_P2P_BENCH_RUNS", 3);
    let a = start(tokens, kv_bytes).await;
    let b = start(tokens, kv_bytes).await;
    let port = a.p2p_addr.unwrap().port();
    println!(
        "prefix {tokens} tokens x {kv_bytes} B/token = {:.1} MB; modelled pull {:?}",
        (tokens * kv_bytes) as f64 / 1e6,
        b.engine.modelled_pull_time(tokens).unwrap()
    );
    for run in 0..runs {
        let seed = 1000 + 2 * run as u32;
        let prefix = prompt(seed, tokens);
        let (warm, _) = timed(&a, &prefix, None).await;
        let mut with_suffix = prefix.clone();
        with_suffix.extend(prompt(7, 64));
        let p2p = &b.engine.metrics().p2p;
        let bytes0 = p2p.bytes(Direction::In);
        let wire0 = pull_seconds(&b).await;
        let src = json!({"remote_kv_source": {"kv_request_id": format!("bench-{run}"), "remote_host": "127.0.0.1", "remote_port": port}});
        let (pulled, body) = timed(&b, &with_suffix, Some(src)).await;
        let cached = body["usage"]["prompt_tokens_details"]["cached_tokens"].clone();
        let moved = p2p.bytes(Direction::In) - bytes0;
        let wire = pull_seconds(&b).await - wire0;
        let mut cold = prompt(seed + 1, tokens);
        cold.extend(prompt(7, 64));
        let (recompute, _) = timed(&b, &cold, None).await;
        println!(
            "run {run}: A warm {:.0} ms | B pull TTFT {:.0} ms (cached {cached}, {:.1} MB moved, pull itself {:.0} ms) | B recompute TTFT {:.0} ms | ratio {:.2}",
            warm.as_secs_f64() * 1e3,
            pulled.as_secs_f64() * 1e3,
            moved as f64 / 1e6,
            wire * 1e3,
            recompute.as_secs_f64() * 1e3,
            pulled.as_secs_f64() / recompute.as_secs_f64()
        );
        // Free both engines' caches for the next run.
        assert!(a.engine.reset_prefix_cache().await);
        assert!(b.engine.reset_prefix_cache().await);
    }
    a.shutdown().await;
    b.shutdown().await;
}
