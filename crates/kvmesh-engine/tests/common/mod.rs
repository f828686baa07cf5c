//! Shared helpers: an in-process engine server on loopback port 0 with a KV-event subscriber,
//! plain sim engines for P2P and P/D tests (started, asked, scraped by address), and
//! deterministic token streams.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvmesh_core::{EventBatch, KvEvent};
use kvmesh_engine::EngineConfig;
use kvmesh_engine::config::KvEventsConfig;
use kvmesh_engine::server::{RunningServer, ServerError, ServerOptions, sim_backend, start_server};
use kvmesh_events::{SubscriberConfig, SubscriberItem, subscribe};
use kvmesh_text::ByteTokenizer;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

pub struct TestServer {
    pub server: RunningServer,
    pub base: String,
    pub client: reqwest::Client,
    pub events: Option<mpsc::Receiver<SubscriberItem>>,
    cancel: CancellationToken,
}

pub fn base_config() -> EngineConfig {
    EngineConfig {
        host: "127.0.0.1".into(),
        port: 0,
        served_model_name: "sim-test".into(),
        block_size: 16,
        num_gpu_blocks: 1024,
        cpu_offload_bytes: 64 << 20,
        kv_events: Some(
            KvEventsConfig::parse(
                r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:0","topic":"kv-events"}"#,
            )
            .unwrap(),
        ),
        max_num_batched_tokens: 8192,
        max_num_seqs: 64,
        max_model_len: 65_536,
        max_waiting: 1000,
        hash_seed: Some("0".into()),
        ..EngineConfig::default()
    }
}

impl TestServer {
    /// Starts an engine with `cfg` and the gpt-oss sim profile at `time_scale`, and (when events
    /// are on) a subscriber that has joined before this returns.
    pub async fn start(cfg: EngineConfig, time_scale: f64) -> TestServer {
        Self::start_with(cfg, time_scale, ServerOptions::default()).await
    }

    pub async fn start_with(
        mut cfg: EngineConfig,
        time_scale: f64,
        options: ServerOptions,
    ) -> TestServer {
        let cancel = CancellationToken::new();
        // Loopback only: the test subscriber binds 127.0.0.1:0 and the engine connects to it
        // (vLLM's rule: an endpoint without `*` is connected to).
        let events = match cfg.kv_events.as_mut() {
            Some(ev) => {
                let mut rx = subscribe(SubscriberConfig::bind("tcp://127.0.0.1:0"), cancel.clone());
                let endpoint = match tokio::time::timeout(Duration::from_secs(5), rx.recv()).await {
                    Ok(Some(SubscriberItem::Listening { endpoint })) => endpoint,
                    other => panic!("subscriber did not start: {other:?}"),
                };
                ev.endpoint = endpoint;
                Some(rx)
            }
            None => None,
        };
        let server = try_start_engine_with(cfg, PROFILE, time_scale, 32, options)
            .await
            .unwrap();
        let base = format!("http://{}", server.addr);
        let mut ts = TestServer {
            server,
            base,
            client: reqwest::Client::new(),
            events,
            cancel,
        };
        if ts.events.is_some() {
            // PUB/SUB slow joiner: probe with resets (AllBlocksCleared on an empty cache) until
            // one arrives, then drop the probes.
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            loop {
                let r = ts
                    .client
                    .post(format!("{}/reset_prefix_cache", ts.base))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 200);
                let rx = ts.events.as_mut().unwrap();
                if let Ok(Some(SubscriberItem::Batch { .. })) =
                    tokio::time::timeout(Duration::from_millis(100), rx.recv()).await
                {
                    break;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "kv-event subscriber never joined"
                );
            }
            ts.drain_events(Duration::from_millis(150)).await;
        }
        ts
    }

    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let r = self
            .client
            .post(format!("{}{}", self.base, path))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    /// Non-streaming completion of token ids; returns the response body.
    pub async fn complete_ids(&self, prompt: &[u32], max_tokens: usize) -> Value {
        let (status, body) = self
            .post("/v1/completions", json!({"model": "sim-test", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}))
            .await;
        assert_eq!(status, 200, "{body}");
        body
    }

    pub async fn metrics(&self) -> String {
        self.client
            .get(format!("{}/metrics", self.base))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// The value of the first metric line starting with `name` (labels included in `name` if given).
    pub async fn metric(&self, name: &str) -> f64 {
        let text = self.metrics().await;
        for line in text.lines() {
            if line.starts_with(name) && line[name.len()..].starts_with(['{', ' ']) {
                return line.rsplit(' ').next().unwrap().parse().unwrap();
            }
        }
        panic!("metric {name} not found in\n{text}")
    }

    /// Collects KV events until `quiet` passes without any.
    pub async fn drain_events(&mut self, quiet: Duration) -> Vec<(u64, KvEvent)> {
        let rx = self.events.as_mut().expect("events enabled");
        let mut out = Vec::new();
        // Quiet means no KV events: the engine's load reports (heartbeats) do not count.
        let mut until = tokio::time::Instant::now() + quiet;
        while let Ok(Some(item)) = tokio::time::timeout_at(until, rx.recv()).await {
            match item {
                SubscriberItem::Batch {
                    seq,
                    batch: EventBatch { events, .. },
                    ..
                } => {
                    out.extend(events.into_iter().map(|e| (seq, e)));
                    until = tokio::time::Instant::now() + quiet;
                }
                SubscriberItem::Gap { expected, got, .. } => panic!("event gap {expected}..{got}"),
                _ => {}
            }
        }
        out
    }

    pub async fn stop(self) {
        self.cancel.cancel();
        self.server.shutdown().await;
    }
}

/// Deterministic token ids in 0..256 (byte tokenizer range) from a seed.
pub fn tokens(seed: u32, n: usize) -> Vec<u32> {
    salted_tokens(seed, 12345, n)
}

/// [`tokens`] with another salt: a second, unrelated family of streams (the benchmark's).
pub fn salted_tokens(seed: u32, salt: u32, n: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(salt);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x % 256
        })
        .collect()
}

pub fn cached_tokens(body: &Value) -> u64 {
    body["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens present")
}

/// The sim profile every engine test runs unless it compares models.
pub const PROFILE: &str = "gpt-oss-120b-h200";

/// Engine config with a P2P producer on a free port, loopback peers allowed and no KV events.
pub fn p2p_config() -> EngineConfig {
    let mut cfg = base_config();
    cfg.kv_events = None;
    cfg.num_gpu_blocks = 4096;
    cfg.p2p.port = Some(0);
    cfg.p2p.allowed_peers = vec!["127.0.0.1".into()];
    cfg
}

/// Starts a sim engine (no event subscriber) with `kv_bytes` of KV per token; the error is
/// returned so tests can check that bad settings fail the start.
pub async fn try_start_engine(
    cfg: EngineConfig,
    profile: &str,
    time_scale: f64,
    kv_bytes: usize,
) -> Result<RunningServer, ServerError> {
    try_start_engine_with(cfg, profile, time_scale, kv_bytes, ServerOptions::default()).await
}

async fn try_start_engine_with(
    cfg: EngineConfig,
    profile: &str,
    time_scale: f64,
    kv_bytes: usize,
    options: ServerOptions,
) -> Result<RunningServer, ServerError> {
    let backend = sim_backend(&cfg, profile, time_scale, kv_bytes)?;
    start_server(cfg, backend, Arc::new(ByteTokenizer), options).await
}

/// [`try_start_engine`] that must succeed.
pub async fn start_engine(
    cfg: EngineConfig,
    profile: &str,
    time_scale: f64,
    kv_bytes: usize,
) -> RunningServer {
    try_start_engine(cfg, profile, time_scale, kv_bytes)
        .await
        .unwrap()
}

/// `kv_transfer_params` naming the engine whose P2P port is `port` as the prefix source.
pub fn source(port: u16) -> Value {
    json!({"remote_kv_source": {"kv_request_id": "kv-1", "remote_host": "127.0.0.1", "remote_port": port}})
}

/// Greedy non-streaming completion on `addr`, with `kvp` as `kv_transfer_params`; returns the
/// body. Peer trouble (P2P or P/D) must never reach the client, so anything but 200 fails.
pub async fn complete(
    addr: SocketAddr,
    prompt: &[u32],
    max_tokens: usize,
    kvp: Option<Value>,
) -> Value {
    let body =
        json!({"model": "sim-test", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0});
    send_completion(addr, body, kvp).await
}

/// [`complete`] generating exactly `max_tokens` (EOS ignored), as P/D turns need.
pub async fn complete_ignore_eos(
    addr: SocketAddr,
    prompt: &[u32],
    max_tokens: usize,
    kvp: Option<Value>,
) -> Value {
    let body = json!({"model": "sim-test", "prompt": prompt, "max_tokens": max_tokens,
                      "temperature": 0, "ignore_eos": true});
    send_completion(addr, body, kvp).await
}

pub async fn send_completion(addr: SocketAddr, mut body: Value, kvp: Option<Value>) -> Value {
    if let Some(p) = kvp {
        body["kv_transfer_params"] = p;
    }
    let r = reqwest::Client::new()
        .post(format!("http://{addr}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status(),
        200,
        "P2P and P/D trouble must never reach the client"
    );
    r.json().await.unwrap()
}

/// Sum of every sample of metric `name` on `addr` whose line contains each comma-separated part
/// of `labels` (`""`: all samples, e.g. every reason of a counter).
pub async fn scrape_metric(addr: SocketAddr, name: &str, labels: &str) -> f64 {
    let text = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| labels.split(',').all(|part| l.contains(part)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `kv_transfer_params` of a P/D prefill leg (what the router sends to a prefiller).
pub fn prefill_leg() -> Value {
    serde_json::to_value(kvmesh_core::KvTransferParams::prefill_leg()).unwrap()
}

/// A prefill leg carrying the decoder's history params (as the router merges them).
pub fn merge(hist: &Value) -> Value {
    let mut leg = prefill_leg();
    for (k, v) in hist.as_object().unwrap() {
        if k != "do_remote_decode" && k != "do_remote_prefill" {
            leg[k] = v.clone();
        }
    }
    leg
}
