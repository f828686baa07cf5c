//! Router benchmarks (ignored by default; run in release):
//!
//! ```text
//! cargo test --release -p kvmesh-router --test router_bench -- --ignored --nocapture --test-threads 1
//! ```
//! - added latency: short completions (11-token prompt, max_tokens 1) against a sim engine whose
//!   modelled time is divided by 10^4, directly vs through the router, at 1 and 64 concurrent clients;
//! - scheduling time of one 240K-token prompt over 96 endpoints whose index entries hold prefixes
//!   of it in both tiers (parse + tokenize + keys + lookup + pipeline, as the router reports it).
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::engines::{engines_yaml, start_engine};
use common::{FakeEngine, start_router};
use kvmesh_core::BlockHash;
use kvmesh_core::events::{BlockStored, KvEvent, Medium};
use kvmesh_index::{EndpointId, IndexConfig, PrefixIndex};
use kvmesh_router::prefix::PrefixLookup;
use serde_json::{Value, json};

fn pct(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Latencies (ms) of `per_client` sequential requests from each of `clients` concurrent clients.
async fn run_load(url: &str, clients: usize, per_client: usize) -> Vec<f64> {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .tcp_nodelay(true)
        .build()
        .unwrap();
    let tasks = (0..clients).map(|_| {
        let http = http.clone();
        let url = url.to_owned();
        tokio::spawn(async move {
            let mut out = Vec::with_capacity(per_client);
            for _ in 0..per_client {
                let t = Instant::now();
                let resp = http
                    .post(&url)
                    .json(&json!({"prompt": "hello world", "max_tokens": 1}))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(resp.status(), 200);
                resp.bytes().await.unwrap();
                out.push(t.elapsed().as_secs_f64() * 1000.0);
            }
            out
        })
    });
    let mut all = Vec::new();
    for t in futures::future::join_all(tasks).await {
        all.extend(t.unwrap());
    }
    all.sort_by(|a, b| a.partial_cmp(b).unwrap());
    all
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "benchmark; run in release with --ignored --nocapture"]
async fn bench_router_added_latency() {
    let engine = start_engine("e0", 10_000.0, 4096).await;
    let r = start_router(
        &format!("metrics_scrape_interval: 1s\n{}", engines_yaml(&[&engine])),
        None,
    )
    .await;
    let direct = format!("{}/v1/completions", engine.url);
    let routed = format!("http://{}/v1/completions", r.addr);
    run_load(&direct, 4, 50).await; // warm-up
    run_load(&routed, 4, 50).await;
    println!(
        "| clients | requests | direct p50 ms | direct p99 ms | router p50 ms | router p99 ms | added p50 ms | added p99 ms |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (clients, per) in [(1usize, 1000usize), (64, 40)] {
        let d = run_load(&direct, clients, per).await;
        let v = run_load(&routed, clients, per).await;
        let (d50, d99, v50, v99) = (pct(&d, 0.5), pct(&d, 0.99), pct(&v, 0.5), pct(&v, 0.99));
        println!(
            "| {clients} | {} | {d50:.3} | {d99:.3} | {v50:.3} | {v99:.3} | {:.3} | {:.3} |",
            d.len(),
            v50 - d50,
            v99 - d99
        );
    }
    r.shutdown().await.unwrap();
    engine.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "benchmark; run in release with --ignored --nocapture"]
async fn bench_scheduling_240k_tokens_96_endpoints() {
    const TOKENS: usize = 240_000;
    const BS: usize = 16;
    const ENDPOINTS: u32 = 96;
    let tokens: Vec<u32> = (0..TOKENS as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % 50_000)
        .collect();
    let blocks = TOKENS / BS;
    let index = Arc::new(PrefixIndex::new(IndexConfig {
        block_size: BS,
        ..IndexConfig::default()
    }));
    let t = Instant::now();
    for e in 0..ENDPOINTS {
        // Endpoint e holds the first (e+1)/96 of the prompt in GPU; even endpoints also in CPU.
        let n = blocks * (e as usize + 1) / ENDPOINTS as usize;
        for medium in [Medium::Gpu, Medium::Cpu] {
            if medium == Medium::Cpu && e % 2 == 1 {
                continue;
            }
            let hashes = (0..n)
                .map(|b| BlockHash((u64::from(e) << 32) | b as u64))
                .collect();
            let ev = KvEvent::BlockStored(BlockStored {
                block_hashes: hashes,
                parent_block_hash: None,
                token_ids: tokens[..n * BS].to_vec(),
                block_size: BS as u32,
                lora_id: None,
                medium,
                lora_name: None,
                group_idx: None,
                kv_cache_spec_kind: None,
                kv_cache_spec_sliding_window: None,
                cache_salt: None,
            });
            index.apply_event(EndpointId(e), &ev).unwrap();
        }
    }
    println!("index filled in {:.1} s", t.elapsed().as_secs_f64());
    // 96 endpoints (all pointing at one fake engine: only scheduling is measured).
    let fake = FakeEngine::start("fake").await;
    let mut yaml = String::from(
        "metrics_scrape_interval: 10s\nhealth_check: {interval: 10s}\nmax_body_bytes: 16000000\n\
         plugins:\n  - {type: prefix-cache-scorer, name: prefix}\n  - {type: queue-scorer, name: queue}\n\
         \x20 - {type: kv-cache-utilization-scorer, name: kvu}\n  - {type: prefix-cache-affinity-filter, name: sticky}\n\
         \x20 - {type: max-score-picker, name: max}\n  - {type: p2p-source-producer, name: p2p, parameters: {min_cached_token_delta: 2048}}\n\
         scheduling_profiles:\n  - name: full\n    plugins: [{plugin_ref: sticky}, {plugin_ref: prefix, weight: 3}, {plugin_ref: queue, weight: 2}, {plugin_ref: kvu, weight: 2}, {plugin_ref: max}, {plugin_ref: p2p}]\n\
         endpoints:\n",
    );
    for e in 0..ENDPOINTS {
        yaml.push_str(&format!(
            "  - {{name: e{e}, url: \"{}\", p2p: \"127.0.0.1:{}\"}}\n",
            fake.url,
            7000 + e
        ));
    }
    let prefix: Arc<dyn PrefixLookup> = index.clone();
    let r = start_router(&yaml, Some(prefix)).await;
    let body = serde_json::to_vec(&json!({"prompt": tokens, "max_tokens": 1})).unwrap();
    let http = reqwest::Client::new();
    let mut sched = Vec::new();
    let mut lookup = Vec::new();
    for i in 0..25 {
        let resp = http
            .post(format!("http://{}/v1/completions", r.addr))
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        resp.bytes().await.unwrap();
        let d: Value = http
            .get(format!("http://{}/debug/decisions?last=1", r.addr))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if i >= 5 {
            sched.push(d[0]["scheduling_us"].as_f64().unwrap() / 1000.0);
        }
        assert_eq!(d[0]["blocks"], blocks);
        // In-process: keys + lookup only.
        let t = Instant::now();
        let keys = kvmesh_core::chain::chain_keys(&tokens, BS);
        let m = index.find_matches(&keys);
        lookup.push(t.elapsed().as_secs_f64() * 1000.0);
        assert_eq!(m.len(), ENDPOINTS as usize);
    }
    sched.sort_by(|a, b| a.partial_cmp(b).unwrap());
    lookup.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let d: Value = http
        .get(format!("http://{}/debug/decisions?last=1", r.addr))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    println!("chosen {} p2p {}", d[0]["endpoint"], d[0]["p2p"]["why"]);
    println!(
        "240K tokens x 96 endpoints: router scheduling (JSON parse + keys + lookup + pipeline) p50 {:.2} ms p99(max of 20) {:.2} ms; keys+lookup alone p50 {:.2} ms",
        pct(&sched, 0.5),
        pct(&sched, 0.99),
        pct(&lookup, 0.5)
    );
    r.shutdown().await.unwrap();
    let _ = Duration::ZERO;
}
