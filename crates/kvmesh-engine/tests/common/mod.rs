//! Shared helpers: an in-process engine server on loopback port 0 with a KV-event subscriber.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use kvmesh_core::{EventBatch, KvEvent};
use kvmesh_engine::EngineConfig;
use kvmesh_engine::config::KvEventsConfig;
use kvmesh_engine::server::{RunningServer, ServerOptions, sim_backend, start_server};
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
        let backend = sim_backend(&cfg, "gpt-oss-120b-h200", time_scale, 32).unwrap();
        let server = start_server(cfg, backend, Arc::new(ByteTokenizer), options)
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
        while let Ok(Some(item)) = tokio::time::timeout(quiet, rx.recv()).await {
            match item {
                SubscriberItem::Batch {
                    seq,
                    batch: EventBatch { events, .. },
                    ..
                } => {
                    out.extend(events.into_iter().map(|e| (seq, e)));
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
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(12345);
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
