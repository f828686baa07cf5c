//! Test helpers: a fake OpenAI engine (axum) that records what it receives, a fake prefix index,
//! a router started on loopback port 0, and the HTTP, text and metric helpers the router tests
//! share (real sim engines are in [`engines`]).
#![allow(dead_code, clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kvmesh_core::ChainKey;
use kvmesh_index::{EndpointId, EndpointMatch};
use kvmesh_router::prefix::PrefixLookup;
use kvmesh_router::{RouterConfig, RouterHandle, RouterOptions};
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// How the fake engine answers completions.
#[derive(Clone)]
pub enum Mode {
    /// JSON (or a 3-chunk SSE stream when `stream: true`) naming the engine.
    Echo,
    /// This status and body.
    Error(u16, String),
    /// Streams one chunk, then waits for `gate` before the rest.
    Gated(Arc<Notify>),
    /// Streams one chunk, then never ends (until the client goes away).
    Hang,
    /// Waits before answering headers.
    Slow(Duration),
}

pub struct Received {
    pub path: String,
    pub headers: HeaderMap,
    pub body: Value,
}

pub struct FakeState {
    pub name: String,
    pub mode: Mutex<Mode>,
    pub received: Mutex<Vec<Received>>,
    pub healthy: AtomicBool,
    /// Response streams dropped before they finished (the router hung up).
    pub cancelled: AtomicUsize,
    pub waiting: Mutex<f64>,
}

pub struct FakeEngine {
    pub url: String,
    pub state: Arc<FakeState>,
    cancel: CancellationToken,
}

impl Drop for FakeEngine {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

impl FakeEngine {
    pub async fn start(name: &str) -> FakeEngine {
        let state = Arc::new(FakeState {
            name: name.to_owned(),
            mode: Mutex::new(Mode::Echo),
            received: Mutex::new(Vec::new()),
            healthy: AtomicBool::new(true),
            cancelled: AtomicUsize::new(0),
            waiting: Mutex::new(0.0),
        });
        let app = Router::new()
            .route("/v1/completions", post(complete))
            .route("/v1/chat/completions", post(complete))
            .route("/health", get(health))
            .route("/metrics", get(metrics))
            .route("/v1/models", get(models))
            .with_state(Arc::clone(&state));
        let (url, cancel) = serve_on_loopback(app).await;
        FakeEngine { url, state, cancel }
    }

    pub fn set_mode(&self, m: Mode) {
        *self.state.mode.lock() = m;
    }

    pub fn count(&self) -> usize {
        self.state.received.lock().len()
    }

    pub fn last_body(&self) -> Value {
        self.state
            .received
            .lock()
            .last()
            .map(|r| r.body.clone())
            .unwrap_or(Value::Null)
    }
}

struct CancelOnDrop {
    state: Arc<FakeState>,
    done: bool,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if !self.done {
            self.state.cancelled.fetch_add(1, Ordering::SeqCst);
        }
    }
}

fn chunk(name: &str, i: usize) -> Bytes {
    Bytes::from(format!(
        "data: {}\n\n",
        json!({"object": "text_completion", "engine": name, "choices": [{"index": 0, "text": format!("t{i}")}]})
    ))
}

async fn complete(
    State(s): State<Arc<FakeState>>,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    s.received.lock().push(Received {
        path: uri.path().to_owned(),
        headers,
        body,
    });
    let mode = s.mode.lock().clone();
    match mode {
        Mode::Error(code, text) => (StatusCode::from_u16(code).unwrap(), text).into_response(),
        Mode::Slow(d) => {
            tokio::time::sleep(d).await;
            axum::Json(json!({"engine": s.name})).into_response()
        }
        Mode::Echo if !stream => axum::Json(
            json!({"object": "text_completion", "engine": s.name, "choices": [{"text": "ok"}]}),
        )
        .into_response(),
        Mode::Echo | Mode::Gated(_) | Mode::Hang => {
            let st = Arc::clone(&s);
            let body = async_stream::stream! {
                let mut guard = CancelOnDrop { state: Arc::clone(&st), done: false };
                yield Ok::<Bytes, std::io::Error>(chunk(&st.name, 0));
                match &mode {
                    Mode::Gated(gate) => gate.notified().await,
                    Mode::Hang => std::future::pending::<()>().await,
                    _ => {}
                }
                yield Ok(chunk(&st.name, 1));
                yield Ok(chunk(&st.name, 2));
                yield Ok(Bytes::from_static(b"data: [DONE]\n\n"));
                guard.done = true;
            };
            (
                [("content-type", "text/event-stream")],
                Body::from_stream(body),
            )
                .into_response()
        }
    }
}

async fn health(State(s): State<Arc<FakeState>>) -> StatusCode {
    if s.healthy.load(Ordering::SeqCst) {
        StatusCode::OK
    } else {
        StatusCode::INTERNAL_SERVER_ERROR
    }
}

async fn metrics(State(s): State<Arc<FakeState>>) -> String {
    format!(
        "vllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} {}\nvllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} 0.0\nvllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} 0.25\n",
        *s.waiting.lock()
    )
}

async fn models(State(s): State<Arc<FakeState>>) -> axum::Json<Value> {
    axum::Json(
        json!({"object": "list", "data": [{"id": "m", "object": "model", "owned_by": s.name}]}),
    )
}

/// A prefix lookup answering fixed matches for every request.
#[derive(Default)]
pub struct FakePrefix {
    pub matches: Mutex<Vec<EndpointMatch>>,
    /// Prompts with fewer blocks than this have nothing cached anywhere (0: no such prompts).
    pub cold_below_blocks: Mutex<usize>,
}

impl FakePrefix {
    /// Endpoint `id` holds `gpu`/`cpu` blocks of every prompt (capped at the prompt's blocks).
    pub fn set(&self, list: &[(u32, usize, usize)]) {
        let mut v: Vec<EndpointMatch> = list
            .iter()
            .map(|&(id, gpu, cpu)| EndpointMatch {
                endpoint: EndpointId(id),
                gpu_blocks: gpu,
                cpu_blocks: cpu,
                any_blocks: gpu.max(cpu),
            })
            .collect();
        v.sort_by_key(|m| m.endpoint);
        *self.matches.lock() = v;
    }
}

impl PrefixLookup for FakePrefix {
    fn find_matches(&self, keys: &[ChainKey]) -> Vec<EndpointMatch> {
        let n = keys.len();
        if n < *self.cold_below_blocks.lock() {
            return Vec::new();
        }
        self.matches
            .lock()
            .iter()
            .map(|m| EndpointMatch {
                gpu_blocks: m.gpu_blocks.min(n),
                cpu_blocks: m.cpu_blocks.min(n),
                any_blocks: m.any_blocks.min(n),
                ..*m
            })
            .filter(|m| m.any_blocks > 0)
            .collect()
    }

    fn remove_endpoint(&self, endpoint: EndpointId) {
        self.matches.lock().retain(|m| m.endpoint != endpoint);
    }
}

/// Load-aware placement (queue 3, kv-util 2, weighted random) plus P2P sources at a 2048-token
/// lead: the `load-p2p` arm, for tests that put real sim engines behind the router (append
/// `endpoints:`).
pub const LOAD_P2P_PROFILE: &str = r#"
seed: 5
plugins:
  - {type: queue-scorer, name: queue}
  - {type: kv-cache-utilization-scorer, name: kv-util}
  - {type: weighted-random-picker, name: wr}
  - {type: p2p-source-producer, name: p2p, parameters: {min_cached_token_delta: 2048}}
scheduling_profiles:
  - name: load-p2p
    plugins: [{plugin_ref: queue, weight: 3}, {plugin_ref: kv-util, weight: 2}, {plugin_ref: wr}, {plugin_ref: p2p}]
"#;

/// YAML endpoint entries for fake engines (`p2p` = 127.0.0.1:7000+i).
pub fn endpoints_yaml(engines: &[&FakeEngine]) -> String {
    let mut s = String::from("endpoints:\n");
    for (i, e) in engines.iter().enumerate() {
        s.push_str(&format!(
            "  - {{name: e{i}, url: \"{}\", p2p: \"127.0.0.1:{}\"}}\n",
            e.url,
            7000 + i
        ));
    }
    s
}

/// Serves `app` on a loopback port until the returned token is cancelled; returns its base URL.
pub async fn serve_on_loopback(app: axum::Router) -> (String, CancellationToken) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let cancel = CancellationToken::new();
    let c = cancel.clone();
    tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move { c.cancelled().await })
            .await
            .unwrap();
    });
    (url, cancel)
}

pub async fn start_router(yaml: &str, prefix: Option<Arc<dyn PrefixLookup>>) -> RouterHandle {
    let config = RouterConfig::from_yaml(yaml, std::path::Path::new("test.yaml")).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    kvmesh_router::start(
        config,
        listener,
        RouterOptions {
            prefix,
            tokenizer: None,
            config_path: None,
            ..Default::default()
        },
    )
    .await
    .unwrap()
}

/// Polls `f` every 20 ms until it is true (panics after `secs`).
pub async fn eventually(secs: u64, what: &str, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub fn client() -> reqwest::Client {
    reqwest::Client::new()
}

/// POSTs `body` as JSON to `url` (a router's or an engine's API path).
pub async fn post_json(url: &str, body: &Value) -> reqwest::Response {
    client().post(url).json(body).send().await.unwrap()
}

/// GET `url`, the body as text.
pub async fn get_text(url: &str) -> String {
    client()
        .get(url)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// GET `url`, the body as JSON.
pub async fn get_json(url: &str) -> Value {
    client()
        .get(url)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Sum of every sample of metric `name` in `{base}/metrics` whose line contains each
/// comma-separated part of `labels` (`""`: all samples).
pub async fn scrape_metric(base: &str, name: &str, labels: &str) -> f64 {
    get_text(&format!("{base}/metrics"))
        .await
        .lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| labels.split(',').all(|part| l.contains(part)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Deterministic, distinct lowercase text per seed (ByteTokenizer: one token per byte).
pub fn doc(seed: u32, len: usize) -> String {
    let mut s = String::with_capacity(len);
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    while s.len() < len {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        s.push((b'a' + (x % 26) as u8) as char);
    }
    s
}

/// Polls the async condition `f` every 20 ms until it is true (panics after `secs`): for
/// counters scraped over HTTP that settle after the responses that caused them.
pub async fn eventually_async<F, Fut>(secs: u64, what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while !f().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The router's `/debug/prefix` answer for `prompt`: what each endpoint holds of it, by tier.
pub async fn debug_prefix(r: &RouterHandle, prompt: &str) -> Value {
    post_json(
        &format!("http://{}/debug/prefix", r.addr),
        &json!({"prompt": prompt}),
    )
    .await
    .json()
    .await
    .unwrap()
}

/// Polls `/debug/prefix` until `endpoint` holds at least `tokens` of `prompt` in `tier`.
pub async fn wait_for_prefix(
    r: &RouterHandle,
    prompt: &str,
    endpoint: &str,
    tier: &str,
    tokens: u64,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let v = debug_prefix(r, prompt).await;
        let got = v["endpoints"][endpoint][tier].as_u64().unwrap_or(0);
        if got >= tokens {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "index never showed {endpoint} holding {tokens} {tier} (have {got}): {v}"
        );
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
}

pub mod engines;
