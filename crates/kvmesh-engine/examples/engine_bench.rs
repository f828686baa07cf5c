//! Engine benchmark (not a test): runs the real `kvmesh engine` binary and reports
//! 1. overhead: requests/s of short prompts with a huge `--time-scale` (modelled GPU time ≈ 0),
//!    and the engine process's CPU time per request (from /proc);
//! 2. queueing: with `--max-num-seqs 1`, N concurrent 8K-token prompts at `--time-scale 1`,
//!    measured TTFT per queue position vs the profile's modelled TTFT.
//!
//! ```text
//! cargo build --release -p kvmesh
//! cargo run --release -p kvmesh-engine --example engine_bench -- target/release/kvmesh
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kvmesh_engine::compute::profiles::GPT_OSS_120B_H200;
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};

struct Engine {
    child: tokio::process::Child,
    base: String,
    pid: u32,
}

async fn start(bin: &str, args: &[&str]) -> Engine {
    let mut child = tokio::process::Command::new(bin)
        .args(["engine", "--port", "0", "--served-model-name", "bench"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start kvmesh engine");
    let pid = child.id().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let base = loop {
        let line = lines.next_line().await.unwrap().expect("engine exited");
        if let Some(rest) = line.strip_prefix("kvmesh engine listening on ") {
            break rest.trim().to_owned();
        }
    };
    Engine { child, base, pid }
}

/// utime + stime of a process, in seconds.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = f.get(11).and_then(|x| x.parse().ok()).unwrap_or(0.0)
        + f.get(12).and_then(|x| x.parse().ok()).unwrap_or(0.0);
    ticks / 100.0
}

fn prompt(seed: u32, n: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(2_654_435_761) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x % 256
        })
        .collect()
}

async fn overhead(bin: &str) {
    let mut e = start(bin, &["--time-scale", "1000000", "--max-num-seqs", "256"]).await;
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .build()
        .unwrap();
    let total = 4000usize;
    let concurrency = 64usize;
    // Warm up connections and caches.
    for i in 0..50 {
        let _ = client
            .post(format!("{}/v1/completions", e.base))
            .json(&json!({"prompt": prompt(i, 64), "max_tokens": 8}))
            .send()
            .await;
    }
    let cpu0 = cpu_seconds(e.pid);
    let t0 = Instant::now();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (client, base, next) = (client.clone(), e.base.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= total {
                    break;
                }
                let r = client
                    .post(format!("{base}/v1/completions"))
                    .json(&json!({"prompt": prompt(1000 + i as u32, 64), "max_tokens": 8, "ignore_eos": true}))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 200);
                let _ = r.bytes().await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let wall = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds(e.pid) - cpu0;
    println!(
        "## overhead: {total} requests, 64-token prompts, 8 output tokens, concurrency {concurrency}, --time-scale 1e6"
    );
    println!("requests/s: {:.0}", total as f64 / wall);
    println!(
        "engine CPU per request: {:.0} us (engine process utime+stime {:.2} s over {:.2} s wall)",
        cpu / total as f64 * 1e6,
        cpu,
        wall
    );
    let _ = e.child.kill().await;
}

async fn queueing(bin: &str) {
    let n = 8usize;
    let tokens = 8192usize;
    let mut e = start(
        bin,
        &[
            "--time-scale",
            "1",
            "--max-num-seqs",
            "1",
            "--profile",
            "gpt-oss-120b-h200",
        ],
    )
    .await;
    let client = reqwest::Client::new();
    let mut tasks = Vec::new();
    for i in 0..n {
        let (client, base) = (client.clone(), e.base.clone());
        tasks.push(tokio::spawn(async move {
            let t0 = Instant::now();
            let r = client
                .post(format!("{base}/v1/completions"))
                .json(&json!({"prompt": prompt(500 + i as u32, tokens), "max_tokens": 1, "stream": true}))
                .send()
                .await
                .unwrap();
            let mut s = r.bytes_stream();
            let mut ttft = None;
            while let Some(c) = s.next().await {
                let c = c.unwrap();
                if ttft.is_none() && String::from_utf8_lossy(&c).contains("\"text\"") {
                    ttft = Some(t0.elapsed());
                }
            }
            ttft.unwrap()
        }));
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let mut measured = Vec::new();
    for t in tasks {
        measured.push(t.await.unwrap());
    }
    let per = GPT_OSS_120B_H200.prefill_total_ms(tokens);
    println!(
        "## queueing: {n} concurrent {tokens}-token prompts, --max-num-seqs 1, gpt-oss-120b-h200, --time-scale 1"
    );
    println!("| position | measured TTFT (ms) | modelled TTFT (ms) | error |");
    println!("|---|---|---|---|");
    for (i, m) in measured.iter().enumerate() {
        let modelled = per * (i + 1) as f64;
        let ms = m.as_secs_f64() * 1000.0;
        println!(
            "| {} | {:.0} | {:.0} | {:+.1}% |",
            i + 1,
            ms,
            modelled,
            (ms - modelled) / modelled * 100.0
        );
    }
    let _ = e.child.kill().await;
}

#[tokio::main]
async fn main() {
    let bin = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "target/release/kvmesh".to_owned());
    overhead(&bin).await;
    queueing(&bin).await;
}
