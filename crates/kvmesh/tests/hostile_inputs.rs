//! Hostile bytes on every listening port of real `kvmesh` processes (issue 15's evidence): a
//! `sim` engine with a P2P producer, a KV-event PUB socket and a replay ROUTER socket, behind a
//! `kvmesh router` that also binds a SUB socket. Per port kind a list of malformed inputs is sent
//! over loopback — HTTP (router and engine), P2P, ZMTP (PUB, replay ROUTER, bound SUB) — and after
//! each port both processes must be alive, answer `/health` and a normal request, keep that port
//! serving, and stay under a stated RSS bound. The count of inputs per port is printed.
//!
//! The raw-bytes helpers are small copies of the crate-level suites'
//! (`kvmesh-events/tests/hostile.rs`, `kvmesh-transfer/tests/length_bombs.rs`): test files of
//! other crates are not a dependency of this one.
//!
//! Also lying P2P sources (issue 37, finding 6): a source whose advertised blocks its producer
//! does not serve (misses) or whose producer stalls, named by a real router for requests on a
//! real engine (`a_lying_p2p_source_stops_being_named_and_a_stall_costs_the_predicted_time`,
//! on `hostile_common`'s helpers).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod hostile_common;

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use kvmesh_core::Fingerprint;
use kvmesh_core::events::{EventBatch, KvEvent};
use kvmesh_events::{Publisher, PublisherConfig, SubscriberConfig, SubscriberItem, subscribe};
use kvmesh_transfer::connection::Connection;
use kvmesh_transfer::message::{Hello, Message, PROTOCOL_VERSION, RefuseReason};
use serde_json::json;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::Child;
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;

const BIN: &str = env!("CARGO_BIN_EXE_kvmesh");

/// How much either process's resident memory may grow over its warmed-up baseline while one
/// port's inputs are sent (the largest legitimate buffer is a 64 MiB request body).
const RSS_BOUND_KIB: u64 = 256 * 1024;

/// How long one hostile exchange may take before we stop waiting for the server's answer.
const EXCHANGE: Duration = Duration::from_secs(5);

// ---------------------------------------------------------------------------------------------
// Processes

/// One child process with its stderr captured to a file (shown if it dies).
struct Proc {
    name: &'static str,
    child: Child,
    pid: u32,
    stderr: std::path::PathBuf,
    baseline_kib: u64,
}

impl Proc {
    fn rss_kib(&self) -> u64 {
        self.status_kib("VmRSS:")
    }

    /// The process's peak RSS so far (`VmHWM`).
    fn peak_rss_kib(&self) -> u64 {
        self.status_kib("VmHWM:")
    }

    fn status_kib(&self, field: &str) -> u64 {
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", self.pid)).unwrap_or_default();
        status
            .lines()
            .find(|l| l.starts_with(field))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }

    /// Panics with the tail of its stderr if it exited.
    fn assert_running(&mut self, after: &str) {
        if let Ok(Some(status)) = self.child.try_wait() {
            let log = std::fs::read_to_string(&self.stderr).unwrap_or_default();
            let tail: String = log
                .lines()
                .rev()
                .take(30)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("\n");
            panic!(
                "{} exited ({status}) after {after}; stderr tail:\n{tail}",
                self.name
            );
        }
    }
}

/// Starts `kvmesh ARGS`, waits until every prefix in `wanted` has been seen at the start of a
/// stdout line and returns those lines' remainders (stdout keeps being drained afterwards).
async fn spawn(
    name: &'static str,
    args: &[String],
    wanted: &[&str],
    dir: &Path,
) -> (Proc, Vec<String>) {
    let stderr = dir.join(format!("{name}.stderr"));
    let mut child = tokio::process::Command::new(BIN)
        .args(args)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&stderr).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = child.id().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut found: Vec<Option<String>> = vec![None; wanted.len()];
    let waited = timeout(Duration::from_secs(30), async {
        while found.iter().any(Option::is_none) {
            let Some(line) = lines.next_line().await.unwrap() else {
                break;
            };
            for (i, prefix) in wanted.iter().enumerate() {
                if let Some(rest) = line.strip_prefix(prefix) {
                    found[i] = Some(rest.trim().to_owned());
                }
            }
        }
    })
    .await;
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let mut proc = Proc {
        name,
        child,
        pid,
        stderr,
        baseline_kib: 0,
    };
    if waited.is_err() || found.iter().any(Option::is_none) {
        proc.assert_running("starting");
        panic!("{name} did not print {wanted:?}");
    }
    (proc, found.into_iter().map(Option::unwrap).collect())
}

/// A loopback port that was free a moment ago (for the router's bound SUB socket, whose config
/// needs a concrete port).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn host_port(endpoint: &str) -> String {
    endpoint.trim_start_matches("tcp://").to_owned()
}

/// The engine, the router, and every address they listen on.
struct Fleet {
    engine: Proc,
    router: Proc,
    engine_http: String,
    router_http: String,
    engine_http_addr: String,
    router_http_addr: String,
    p2p: SocketAddr,
    pub_ep: String,
    replay_ep: String,
    sub_ep: String,
    client: reqwest::Client,
    _dir: tempfile::TempDir,
}

async fn start_fleet() -> Fleet {
    let dir = tempfile::tempdir().unwrap();
    let events = json!({
        "enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv-events",
        "endpoint": "tcp://127.0.0.1:0", "bind": true, "replay_endpoint": "tcp://127.0.0.1:0",
    });
    let engine_args: Vec<String> = [
        "engine",
        "--port",
        "0",
        "--backend",
        "sim",
        "--served-model-name",
        "sim",
        "--block-size",
        "16",
        "--num-gpu-blocks",
        "4096",
        "--cpu-offload-bytes",
        "64MiB",
        "--time-scale",
        "100",
        "--p2p-port",
        "0",
        "--kv-events-config",
        &events.to_string(),
    ]
    .map(str::to_owned)
    .to_vec();
    let (engine, found) = spawn(
        "engine",
        &engine_args,
        &[
            "kvmesh engine listening on ",
            "kvmesh engine p2p listening on ",
            "kvmesh engine kv events bound on ",
            "kvmesh engine kv events replay bound on ",
        ],
        dir.path(),
    )
    .await;
    let engine_http = found[0].clone();
    let p2p: SocketAddr = found[1].parse().unwrap();
    let pub_ep = found[2].clone();
    let replay_ep = found[3].clone();

    // e0 follows the engine's events (connect + replay); e1 names the same engine and makes the
    // router bind a SUB socket, the third ZMQ socket kind that listens.
    let sub_ep = format!("tcp://127.0.0.1:{}", free_port());
    let config = format!(
        "block_size: 16\ntokenizer: byte\nendpoints:\n  \
         - {{name: e0, url: \"{engine_http}\", p2p: \"{p2p}\", kv_events: {{endpoint: \"{pub_ep}\", \
         topic: kv-events, replay_endpoint: \"{replay_ep}\"}}}}\n  \
         - {{name: e1, url: \"{engine_http}\", kv_events: {{endpoint: \"{sub_ep}\", bind: true, \
         topic: kv-events}}}}\n"
    );
    let config_path = dir.path().join("router.yaml");
    std::fs::write(&config_path, config).unwrap();
    let router_args: Vec<String> = vec![
        "router".into(),
        "--port".into(),
        "0".into(),
        "--config".into(),
        config_path.display().to_string(),
    ];
    let (router, found) = spawn("router", &router_args, &["listening on "], dir.path()).await;
    let router_http = found[0].clone();
    let addr = |url: &str| url.trim_start_matches("http://").to_owned();
    Fleet {
        engine,
        router,
        engine_http_addr: addr(&engine_http),
        router_http_addr: addr(&router_http),
        engine_http,
        router_http,
        p2p,
        pub_ep,
        replay_ep,
        sub_ep,
        client: reqwest::Client::builder()
            .timeout(Duration::from_secs(20))
            .build()
            .unwrap(),
        _dir: dir,
    }
}

impl Fleet {
    /// A normal completion and chat completion through the router, and a completion straight
    /// to the engine; each must be 200.
    async fn normal_requests(&self) {
        let completion = json!({"model": "sim", "prompt": "The quick brown fox jumps over the lazy dog, again and again.", "max_tokens": 4, "temperature": 0});
        let chat = json!({"model": "sim", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4});
        for (base, path, body) in [
            (&self.router_http, "/v1/completions", &completion),
            (&self.router_http, "/v1/chat/completions", &chat),
            (&self.engine_http, "/v1/completions", &completion),
        ] {
            let r = self
                .client
                .post(format!("{base}{path}"))
                .json(body)
                .send()
                .await
                .unwrap_or_else(|e| panic!("{base}{path}: {e}"));
            let status = r.status();
            let text = r.text().await.unwrap_or_default();
            assert_eq!(status, 200, "{base}{path}: {text}");
        }
    }

    /// Both processes running, healthy, serving, and within the RSS bound; prints the tally.
    async fn assert_healthy(&mut self, port: &str, tried: usize) {
        self.engine.assert_running(port);
        self.router.assert_running(port);
        for base in [&self.engine_http, &self.router_http] {
            let r = self
                .client
                .get(format!("{base}/health"))
                .send()
                .await
                .unwrap_or_else(|e| panic!("{base}/health after {port}: {e}"));
            assert_eq!(r.status(), 200, "{base}/health after {port}");
        }
        self.normal_requests().await;
        let mut over = Vec::new();
        for p in [&self.engine, &self.router] {
            let rss = p.rss_kib();
            let grown = rss.saturating_sub(p.baseline_kib);
            eprintln!(
                "hostile {port}: {} RSS {} MiB (baseline {} MiB, +{} MiB)",
                p.name,
                rss / 1024,
                p.baseline_kib / 1024,
                grown / 1024
            );
            if grown >= RSS_BOUND_KIB {
                over.push(format!("{} RSS grew by {grown} KiB", p.name));
            }
        }
        assert!(
            over.is_empty(),
            "after {port}: {over:?} (bound {RSS_BOUND_KIB} KiB)"
        );
        eprintln!("hostile {port}: {tried} inputs tried, both processes alive and serving");
    }
}

// ---------------------------------------------------------------------------------------------
// Raw exchanges

/// What a server did with one hostile input.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Answer {
    /// An HTTP status line.
    Status(u16),
    /// Closed (or reset) without an HTTP status.
    Closed,
    /// Still open, silent, when we stopped waiting.
    Silent,
}

/// Connects, writes `bytes` (a write error is fine: the server may hang up first), half-closes
/// if `close_write`, and reads until an HTTP status line, EOF, or `EXCHANGE` elapses.
async fn exchange(addr: &str, bytes: &[u8], close_write: bool) -> Answer {
    exchange_within(addr, bytes, close_write, EXCHANGE).await
}

/// [`exchange`] with its own time limit (for inputs the server takes long to refuse).
async fn exchange_within(addr: &str, bytes: &[u8], close_write: bool, limit: Duration) -> Answer {
    let Ok(mut s) = TcpStream::connect(addr).await else {
        return Answer::Closed;
    };
    let (mut rd, mut wr) = s.split();
    let write = async {
        let _ = wr.write_all(bytes).await;
        if close_write {
            let _ = wr.shutdown().await;
        }
        // Keep the write half alive while the read side waits.
        std::future::pending::<()>().await;
    };
    let read = async {
        let mut got = Vec::new();
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match rd.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
            if let Some(code) = status_code(&got) {
                return Answer::Status(code);
            }
            if got.len() > 1 << 20 {
                break;
            }
        }
        status_code(&got).map_or(Answer::Closed, Answer::Status)
    };
    let both = async {
        tokio::select! {
            a = read => a,
            () = write => unreachable!(),
        }
    };
    timeout(limit, both).await.unwrap_or(Answer::Silent)
}

fn status_code(got: &[u8]) -> Option<u16> {
    let line_end = got.windows(2).position(|w| w == b"\r\n")?;
    let line = std::str::from_utf8(&got[..line_end]).ok()?;
    let mut parts = line.split(' ');
    parts.next().filter(|v| v.starts_with("HTTP/"))?;
    parts.next()?.parse().ok()
}

/// Sends `bytes` and waits until the peer closes (true) or `EXCHANGE` passes (false).
async fn send_and_expect_close(addr: &str, bytes: &[u8]) -> bool {
    let Ok(mut s) = TcpStream::connect(addr).await else {
        return true;
    };
    let _ = s.write_all(bytes).await;
    let mut buf = vec![0u8; 4096];
    timeout(EXCHANGE, async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .is_ok()
}

// ---------------------------------------------------------------------------------------------
// HTTP inputs

fn post(path: &str, body: &[u8]) -> Vec<u8> {
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(body);
    req
}

fn nested(depth: usize, open: &str, close: &str, inner: &str) -> String {
    format!("{}{inner}{}", open.repeat(depth), close.repeat(depth))
}

/// Malformed HTTP requests: (what, bytes, half-close after writing). One line per input, so
/// the table is left unformatted.
#[rustfmt::skip]
fn http_inputs() -> Vec<(String, Vec<u8>, bool)> {
    let mut v: Vec<(String, Vec<u8>, bool)> = Vec::new();
    let mut add = |what: &str, bytes: Vec<u8>, close: bool| v.push((what.to_owned(), bytes, close));
    const C: &str = "/v1/completions";
    const CHAT: &str = "/v1/chat/completions";

    // Framing.
    add("1 MiB header value", format!("GET /health HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n", "a".repeat(1 << 20)).into_bytes(), false);
    add("20k headers", format!("GET /health HTTP/1.1\r\nHost: x\r\n{}\r\n", "X-H: v\r\n".repeat(20_000)).into_bytes(), false);
    add("1 MiB request line", format!("GET /{} HTTP/1.1\r\nHost: x\r\n\r\n", "p".repeat(1 << 20)).into_bytes(), false);
    add("Content-Length 2^62, no body", format!("POST {C} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{{", 1u64 << 62).into_bytes(), true);
    add("Content-Length 10^30", format!("POST {C} HTTP/1.1\r\nHost: x\r\nContent-Length: 1{}\r\n\r\n", "0".repeat(30)).into_bytes(), true);
    add("Content-Length not a number", format!("POST {C} HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n").into_bytes(), true);
    add("conflicting Content-Lengths", format!("POST {C} HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\n{{}}").into_bytes(), true);
    add("negative Content-Length", format!("POST {C} HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n").into_bytes(), true);
    add("chunk size 2^64+", format!("POST {C} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nfffffffffffffffffff\r\nab").into_bytes(), true);
    add("chunked, never terminated", format!("POST {C} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n2\r\n{{\"\r\n").into_bytes(), true);
    add("truncated body", [format!("POST {C} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n").into_bytes(), br#"{"model": "sim", "prompt": "abc"#.to_vec()].concat(), true);
    add("truncated headers", format!("POST {C} HTTP/1.1\r\nHost: x\r\nContent-Len").into_bytes(), true);
    add("binary garbage", (0..4096u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect(), true);
    add("TLS ClientHello", vec![0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03], true);
    add("non-UTF-8 path", b"GET /v1/\xff\xfe HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(), false);
    add("non-UTF-8 header value", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: \xff\xfe\xfd\r\n\r\n".to_vec(), false);
    add("non-UTF-8 query", b"GET /v1/models?x=%ff%fe&\xff HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(), false);
    add("unknown method", format!("BREW {C} HTTP/1.1\r\nHost: x\r\n\r\n").into_bytes(), false);
    add("HTTP/0.9-style line", b"GET /\r\n\r\n".to_vec(), true);
    add("ZMTP greeting", greeting_and_ready("SUB"), true);

    // Bodies.
    add("bad JSON", post(C, br#"{"model": "sim", "prompt": "#), false);
    add("JSON not an object", post(C, b"[1, 2, 3]"), false);
    add("empty body", post(C, b""), false);
    add("non-UTF-8 body", post(C, b"{\"model\": \"sim\", \"prompt\": \"\xff\xfe\xfd\"}"), false);
    add("lone surrogate escape", post(C, br#"{"model": "sim", "prompt": "\ud800"}"#), false);
    add("NUL bytes in prompt", post(C, br#"{"model": "sim", "prompt": "a\u0000b", "max_tokens": 1}"#), false);
    add("wrong types", post(C, br#"{"model": 5, "prompt": {"a": 1}, "max_tokens": "x", "temperature": "hot"}"#), false);
    add("max_tokens 1e30", post(C, br#"{"model": "sim", "prompt": "x", "max_tokens": 1e30}"#), false);
    add("max_tokens negative", post(C, br#"{"model": "sim", "prompt": "x", "max_tokens": -5}"#), false);
    add("n = 10^9", post(C, br#"{"model": "sim", "prompt": "x", "max_tokens": 1, "n": 1000000000}"#), false);
    add("logprobs 10^9", post(C, br#"{"model": "sim", "prompt": "x", "max_tokens": 1, "logprobs": 1000000000}"#), false);
    add("token id 2^32", post(C, br#"{"model": "sim", "prompt": [4294967296], "max_tokens": 1}"#), false);
    add("token id -1", post(C, br#"{"model": "sim", "prompt": [-1], "max_tokens": 1}"#), false);
    add("token id out of vocab", post(C, br#"{"model": "sim", "prompt": [4000000000], "max_tokens": 1}"#), false);
    add("empty prompt array", post(C, br#"{"model": "sim", "prompt": [], "max_tokens": 1}"#), false);
    add("ragged prompt batch", post(C, br#"{"model": "sim", "prompt": [[1, 2], "x", [[3]]], "max_tokens": 1}"#), false);
    add("10k nested arrays", post(C, format!(r#"{{"model": "sim", "prompt": {}}}"#, nested(10_000, "[", "]", "1")).as_bytes()), false);
    add("10k nested objects in an unknown field", post(C, format!(r#"{{"model": "sim", "prompt": "x", "zz": {}}}"#, nested(10_000, r#"{"a":"#, "}", "1")).as_bytes()), false);
    add("10k nested arrays in chat content", post(CHAT, format!(r#"{{"model": "sim", "messages": [{{"role": "user", "content": {}}}]}}"#, nested(10_000, "[", "]", "1")).as_bytes()), false);
    add("messages not an array", post(CHAT, br#"{"model": "sim", "messages": "hi"}"#), false);
    add("message role a number", post(CHAT, br#"{"model": "sim", "messages": [{"role": 1, "content": "x"}]}"#), false);
    add("content parts garbage", post(CHAT, br#"{"model": "sim", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": 7}, 5]}]}"#), false);
    add("chat: 50k empty messages", post(CHAT, format!(r#"{{"model": "sim", "max_tokens": 1, "messages": [{}]}}"#, vec![r#"{"role": "user", "content": ""}"#; 50_000].join(",")).as_bytes()), false);
    add("stop: 100k strings", post(C, format!(r#"{{"model": "sim", "prompt": "x", "max_tokens": 2, "stop": [{}]}}"#, vec![r#""ab""#; 100_000].join(",")).as_bytes()), false);
    add("kv_transfer_params garbage", post(C, br#"{"model": "sim", "prompt": "x", "max_tokens": 1, "kv_transfer_params": {"remote_kv_source": {"remote_host": "127.0.0.1", "remote_port": 99999999, "kv_request_id": [1]}, "do_remote_prefill": "yes"}}"#), false);
    add("stream: true, model missing", post(C, br#"{"prompt": "x", "stream": true, "max_tokens": 1}"#), false);
    add("oversized prompt: 8 MiB of text", post(C, format!(r#"{{"model": "sim", "prompt": "{}", "max_tokens": 1}}"#, "z".repeat(8 << 20)).as_bytes()), false);
    add("oversized prompt: 1M token ids", post(C, format!(r#"{{"model": "sim", "prompt": [{}], "max_tokens": 1}}"#, vec!["7"; 1 << 20].join(",")).as_bytes()), false);
    add("body over 64 MiB", post(C, &vec![b' '; (64 << 20) + 1024]), false);
    add("tokenize: 10k nested", post("/tokenize", format!(r#"{{"model": "sim", "prompt": {}}}"#, nested(10_000, "[", "]", "1")).as_bytes()), false);
    add("detokenize: huge ids", post("/detokenize", br#"{"model": "sim", "tokens": [4294967295, 99999999999]}"#), false);
    v
}

async fn hostile_http(fleet: &mut Fleet, which: &str) {
    let addr = if which == "router" {
        fleet.router_http_addr.clone()
    } else {
        fleet.engine_http_addr.clone()
    };
    let inputs = http_inputs();
    let started = Instant::now();
    let mut server_errors = Vec::new();
    for (what, bytes, close) in &inputs {
        let answer = exchange(&addr, bytes, *close).await;
        let rss = (fleet.engine.rss_kib() / 1024, fleet.router.rss_kib() / 1024);
        eprintln!(
            "  http {which}: {what:<42} -> {answer:?} (RSS MiB engine {}, router {})",
            rss.0, rss.1
        );
        if let Answer::Status(code) = answer
            && code >= 500
        {
            server_errors.push(format!("{what}: {code}"));
        }
    }
    eprintln!(
        "  http {which}: {} inputs in {:?}",
        inputs.len(),
        started.elapsed()
    );
    fleet
        .assert_healthy(&format!("HTTP ({which})"), inputs.len())
        .await;
    // Malformed input is the client's fault: a 5xx would mean the server broke on it.
    assert!(
        server_errors.is_empty(),
        "5xx for malformed input on {which}: {server_errors:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// P2P inputs

fn frame(tag: u8, body: &[u8]) -> Vec<u8> {
    let mut f = ((body.len() + 1) as u32).to_be_bytes().to_vec();
    f.push(tag);
    f.extend_from_slice(body);
    f
}

/// A Hello whose fingerprint the producer accepts: start from a guess and take, from each
/// `Refused{Fingerprint{field, ours}}`, the producer's value for that field (at most 8 rounds).
async fn handshake(addr: SocketAddr) -> Connection {
    let mut fp = Fingerprint {
        model_id: "sim".into(),
        kv_dtype: "sim".into(),
        block_size: 16,
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 1,
        hash_algo: kvmesh_core::HashAlgo::Sha256Cbor,
        none_hash: String::new(),
    };
    for _ in 0..60 {
        let stream = TcpStream::connect(addr).await.unwrap();
        let mut conn = Connection::new(stream, 4096);
        let hello = Message::Hello(Hello {
            version: PROTOCOL_VERSION,
            fingerprint: fp.clone(),
            nonce: [7; 16],
        });
        conn.write_message(&hello).await.unwrap();
        match timeout(EXCHANGE, conn.read_message()).await {
            Ok(Ok(Some(Message::HelloOk(_)))) => {
                conn.set_max_frame(64 << 20);
                return conn;
            }
            Ok(Ok(Some(Message::Refused(r)))) => match r.reason {
                RefuseReason::Fingerprint { field, ours, .. } => match field.as_str() {
                    "model_id" => fp.model_id = ours,
                    "kv_dtype" => fp.kv_dtype = ours,
                    "block_size" => fp.block_size = ours.parse().unwrap(),
                    "num_layers" => fp.num_layers = ours.parse().unwrap(),
                    "num_kv_heads" => fp.num_kv_heads = ours.parse().unwrap(),
                    "head_dim" => fp.head_dim = ours.parse().unwrap(),
                    "hash_algo" => fp.hash_algo = ours.parse().unwrap(),
                    "none_hash" => fp.none_hash = ours,
                    other => panic!("unknown fingerprint field {other}"),
                },
                // The per-IP cap (64) holds until the producer has reaped connections a test
                // just dropped: a transient refusal, by design; try again shortly.
                RefuseReason::TooManyConnections => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                other => panic!("refused: {other:?}"),
            },
            other => panic!("handshake: {other:?}"),
        }
    }
    panic!("no handshake accepted after 60 tries")
}

async fn hostile_p2p(fleet: &mut Fleet) {
    let addr = fleet.p2p;
    let a = addr.to_string();
    let mut tried = 0;
    let two_to_62 = (1u64 << 62).to_be_bytes();
    let mut just_over_preauth = 4097u32.to_be_bytes().to_vec();
    just_over_preauth.extend_from_slice(&[1; 64]);
    // Msgpack claiming huge containers inside a small frame.
    let mut huge_str = vec![0x81, 0xa5];
    huge_str.extend_from_slice(b"nonce");
    huge_str.extend_from_slice(&[0xdb, 0xff, 0xff, 0xff, 0xff]);
    let mut huge_array = vec![0x81, 0xa5];
    huge_array.extend_from_slice(b"nonce");
    huge_array.extend_from_slice(&[0xdd, 0xff, 0xff, 0xff, 0xff, 1, 2, 3]);
    let mut huge_map = vec![0xdf, 0xff, 0xff, 0xff, 0xff];
    huge_map.extend_from_slice(&[0xa1, b'a', 1]);
    let deep: Vec<u8> = std::iter::repeat_n(0x91u8, 4000).collect();
    let inputs: Vec<(&str, Vec<u8>)> = vec![
        ("zero-length frame", vec![0, 0, 0, 0]),
        ("2^62 length header", two_to_62.to_vec()),
        ("u32::MAX length", vec![0xff, 0xff, 0xff, 0xff, 1]),
        ("oversized pre-auth frame (4097)", just_over_preauth),
        ("forged header: unknown tag", frame(99, b"junk")),
        (
            "forged header: block frame before hello",
            frame(9, &[0; 20]),
        ),
        ("Lookup before Hello", frame(6, &[0x80])),
        ("Hello with garbage msgpack", frame(1, &[0xc1; 100])),
        ("Hello: msgpack str32 of 4 GiB", frame(1, &huge_str)),
        ("Hello: msgpack array32 of 4G items", frame(1, &huge_array)),
        ("Hello: msgpack map32 of 4G entries", frame(1, &huge_map)),
        ("Hello: 4000-deep nested arrays", frame(1, &deep)),
        (
            "HTTP request",
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
        ),
        ("ZMTP greeting", greeting_and_ready("DEALER")),
    ];
    // A truncated header and a truncated Hello: the producer rightly waits (5 s handshake bound)
    // for the rest; held open while the other inputs run.
    let mut truncated = Vec::new();
    for partial in [vec![0u8, 0], frame(1, &[0x83; 40])[..20].to_vec()] {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let _ = s.write_all(&partial).await;
        truncated.push(s);
        tried += 1;
    }
    for (what, bytes) in &inputs {
        let closed = send_and_expect_close(&a, bytes).await;
        eprintln!("  p2p: {what:<40} -> closed: {closed}");
        tried += 1;
    }
    // Wrong protocol version: refused, not crashed.
    {
        let mut conn = Connection::new(TcpStream::connect(addr).await.unwrap(), 4096);
        let hello = Message::Hello(Hello {
            version: 999,
            fingerprint: Fingerprint {
                model_id: "x".into(),
                kv_dtype: "x".into(),
                block_size: 1,
                num_layers: 1,
                num_kv_heads: 1,
                head_dim: 1,
                hash_algo: kvmesh_core::HashAlgo::Sha256Cbor,
                none_hash: String::new(),
            },
            nonce: [0; 16],
        });
        conn.write_message(&hello).await.unwrap();
        let got = timeout(EXCHANGE, conn.read_message()).await;
        eprintln!("  p2p: {:<40} -> {got:?}", "Hello of protocol v999");
        tried += 1;
    }
    // After a valid hello (HelloOk): garbage, length bombs, a lookup of 70k hashes.
    let after_hello: Vec<(&str, Vec<u8>)> = vec![
        (
            "garbage after a valid hello",
            (0..2048u32).map(|i| (i * 37) as u8).collect(),
        ),
        ("2^62 length after hello", two_to_62.to_vec()),
        (
            "u32::MAX length after hello",
            vec![0xff, 0xff, 0xff, 0xff, 9],
        ),
        ("second Hello after hello", {
            let mut b = frame(1, &[0x80]);
            b.extend(frame(1, &[0x80]));
            b
        }),
        ("Lookup of 70,000 hashes", {
            let msg = Message::Lookup(kvmesh_transfer::message::Lookup {
                kv_request_id: "x".repeat(1000),
                hashes: (0..70_000u64).map(kvmesh_core::BlockHash).collect(),
            });
            msg.encode(64 << 20).unwrap().to_vec()
        }),
        ("Fetch of hashes never looked up", {
            let msg = Message::Fetch(kvmesh_transfer::message::Fetch {
                hashes: (0..60_000u64).map(kvmesh_core::BlockHash).collect(),
                pending_wait_ms: u32::MAX,
                background: false,
                segments: Vec::new(),
            });
            msg.encode(64 << 20).unwrap().to_vec()
        }),
    ];
    for (what, bytes) in &after_hello {
        let mut conn = handshake(addr).await;
        let _ = conn.write_raw(bytes).await;
        let mut answers = 0;
        let closed = timeout(EXCHANGE, async {
            while let Ok(Some(_)) = conn.read_message().await {
                answers += 1;
            }
        })
        .await
        .is_ok();
        eprintln!("  p2p: {what:<40} -> {answers} frames back, closed: {closed}");
        tried += 1;
    }
    // More connections than one address may hold, all idle mid-handshake.
    let mut held = Vec::new();
    for _ in 0..80 {
        if let Ok(mut s) = TcpStream::connect(addr).await {
            let _ = s.write_all(&[0, 0]).await;
            held.push(s);
        }
    }
    tried += 1;
    eprintln!(
        "  p2p: {:<40} -> {} opened",
        "80 idle half-headers from one IP",
        held.len()
    );
    drop(held);
    drop(truncated);
    // Still serving peers.
    let _ = handshake(addr).await;
    fleet.assert_healthy("P2P producer", tried).await;
}

// ---------------------------------------------------------------------------------------------
// ZMTP inputs

/// A ZMTP 3.0 greeting (NULL) followed by a READY naming `socket_type`.
fn greeting_and_ready(socket_type: &str) -> Vec<u8> {
    let mut g = greeting(b"NULL");
    let mut body = b"\x05READY".to_vec();
    body.push(11);
    body.extend(b"Socket-Type");
    body.extend((socket_type.len() as u32).to_be_bytes());
    body.extend(socket_type.as_bytes());
    g.extend([0x04, body.len() as u8]);
    g.extend(body);
    g
}

fn greeting(mechanism: &[u8]) -> Vec<u8> {
    let mut g = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 3, 0];
    let mut m = mechanism.to_vec();
    m.resize(20, 0);
    g.extend(m);
    g.push(0);
    g.extend([0u8; 31]);
    g
}

/// Malformed ZMTP for a socket whose peers are `peer_type`.
fn zmtp_inputs(peer_type: &str, wrong_type: &str) -> Vec<(String, Vec<u8>)> {
    let ready = greeting_and_ready(peer_type);
    let mut v: Vec<(String, Vec<u8>)> = Vec::new();
    let mut bomb = ready.clone();
    bomb.push(0x02);
    bomb.extend((1u64 << 62).to_be_bytes());
    bomb.extend([0xAB; 8]);
    v.push(("length bomb: frame of 2^62".into(), bomb));
    let mut more_bomb = ready.clone();
    more_bomb.push(0x03);
    more_bomb.extend(u64::MAX.to_be_bytes());
    v.push(("length bomb: 'more' frame of 2^64-1".into(), more_bomb));
    let mut just_over = ready.clone();
    just_over.push(0x02);
    just_over.extend(((64u64 << 20) + 1).to_be_bytes());
    v.push(("frame of 64 MiB + 1, declared".into(), just_over));
    let mut cmd_bomb = greeting(b"NULL");
    cmd_bomb.push(0x06);
    cmd_bomb.extend((1u64 << 62).to_be_bytes());
    v.push(("command (READY) of 2^62".into(), cmd_bomb));
    let mut prop_bomb = greeting(b"NULL");
    let mut body = b"\x05READY".to_vec();
    body.push(11);
    body.extend(b"Socket-Type");
    body.extend(u32::MAX.to_be_bytes());
    body.extend(b"SUB");
    prop_bomb.extend([0x04, body.len() as u8]);
    prop_bomb.extend(body);
    v.push(("READY property claiming 4 GiB".into(), prop_bomb));
    let mut endless = ready.clone();
    endless.extend(std::iter::repeat_n([0x01u8, 0x00], 1 << 19).flatten());
    v.push((
        "endless multipart: 512k empty 'more' frames".into(),
        endless,
    ));
    let mut big_more = ready.clone();
    for _ in 0..200 {
        big_more.push(0x03);
        big_more.extend((64u64 << 10).to_be_bytes());
        big_more.extend(std::iter::repeat_n(0x55u8, 64 << 10));
    }
    v.push(("endless multipart: 200 x 64 KiB parts".into(), big_more));
    let mut bad_sig = ready.clone();
    bad_sig[0] = 0x00;
    v.push(("bad greeting signature".into(), bad_sig));
    let mut v1 = ready.clone();
    v1[10] = 1;
    v.push(("ZMTP 1.0 version byte".into(), v1));
    v.push(("CURVE mechanism".into(), greeting(b"CURVE")));
    v.push(("PLAIN mechanism".into(), greeting(b"PLAIN")));
    v.push((
        format!("wrong peer type ({wrong_type})"),
        greeting_and_ready(wrong_type),
    ));
    v.push((
        "HTTP bytes".into(),
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
    ));
    v.push((
        "binary garbage".into(),
        (0..4096u32)
            .map(|i| (i.wrapping_mul(40_503) >> 7) as u8)
            .collect(),
    ));
    v
}

async fn hostile_zmtp(
    addr: &str,
    peer_type: &str,
    wrong_type: &str,
    extra: Vec<(String, Vec<u8>)>,
) -> usize {
    let mut inputs = zmtp_inputs(peer_type, wrong_type);
    inputs.extend(extra);
    // Truncated greetings: the socket rightly waits (5 s) for the rest, so they are held open
    // while the other inputs run — a slow-loris on top — and dropped at the end.
    let ready = greeting_and_ready(peer_type);
    let mut truncated = Vec::new();
    for cut in [1usize, 10, 11, 40, 63] {
        if let Ok(mut s) = TcpStream::connect(addr).await {
            let _ = s.write_all(&ready[..cut]).await;
            truncated.push(s);
        }
    }
    for (what, bytes) in &inputs {
        let closed = send_and_expect_close(addr, bytes).await;
        eprintln!("  zmtp {peer_type} peer: {what:<44} -> closed: {closed}");
    }
    // More connections than a socket accepts, each stuck mid-greeting, then released.
    let mut held = Vec::new();
    for _ in 0..80 {
        if let Ok(mut s) = TcpStream::connect(addr).await {
            let _ = s.write_all(&[0xff, 0, 0]).await;
            held.push(s);
        }
    }
    drop(held);
    drop(truncated);
    inputs.len() + 5 + 1
}

fn cleared() -> EventBatch {
    EventBatch {
        ts: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64(),
        events: vec![KvEvent::AllBlocksCleared],
        data_parallel_rank: Some(0),
    }
}

/// Sum of the `name` samples in the router's `/metrics`.
async fn metric(fleet: &Fleet, name: &str) -> f64 {
    let text = fleet
        .client
        .get(format!("{}/metrics", fleet.router_http))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn hostile_pub(fleet: &mut Fleet) {
    let addr = host_port(&fleet.pub_ep);
    let mut subs = greeting_and_ready("SUB");
    for i in 0..200u32 {
        let topic = format!("\x01t{i}");
        subs.extend([0x00, topic.len() as u8]);
        subs.extend(topic.as_bytes());
    }
    let mut big_sub = greeting_and_ready("SUB");
    big_sub.push(0x02);
    big_sub.extend((64u64 << 10).to_be_bytes());
    big_sub.push(0x01);
    big_sub.extend(std::iter::repeat_n(b'k', (64 << 10) - 1));
    let extra = vec![
        ("200 subscriptions".to_owned(), subs),
        ("64 KiB subscription".to_owned(), big_sub),
    ];
    let tried = hostile_zmtp(&addr, "SUB", "PUB", extra).await;
    // The PUB socket still delivers: a fresh subscriber sees the batches a request causes.
    let cancel = CancellationToken::new();
    let mut rx = subscribe(SubscriberConfig::connect(&fleet.pub_ep), cancel.clone());
    let got = timeout(Duration::from_secs(15), async {
        loop {
            fleet.normal_requests().await;
            let batch = timeout(Duration::from_millis(300), async {
                loop {
                    match rx.recv().await {
                        Some(SubscriberItem::Batch { .. }) => return true,
                        Some(_) => continue,
                        None => return false,
                    }
                }
            })
            .await;
            if batch == Ok(true) {
                return;
            }
        }
    })
    .await;
    cancel.cancel();
    assert!(
        got.is_ok(),
        "the PUB socket delivers no batch after the hostile inputs"
    );
    fleet.assert_healthy("ZMQ PUB (engine)", tried).await;
}

async fn hostile_replay(fleet: &mut Fleet) {
    let addr = host_port(&fleet.replay_ep);
    // A request of 10 parts, and one 1 KiB part.
    let mut parts = greeting_and_ready("DEALER");
    for _ in 0..9 {
        parts.extend([0x01, 0x00]);
    }
    parts.extend([0x00, 0x08]);
    parts.extend(0u64.to_be_bytes());
    let mut big = greeting_and_ready("DEALER");
    big.extend([0x01, 0x00, 0x02]);
    big.extend(1024u64.to_be_bytes());
    big.extend([0x11; 1024]);
    let mut flood = greeting_and_ready("DEALER");
    for _ in 0..10_000 {
        flood.extend([0x01, 0x00, 0x00, 0x08]);
        flood.extend(0u64.to_be_bytes());
    }
    let extra = vec![
        ("request of 10 parts".to_owned(), parts),
        ("request part of 1 KiB".to_owned(), big),
        ("10,000 replay requests, never read".to_owned(), flood),
    ];
    let tried = hostile_zmtp(&addr, "DEALER", "PUB", extra).await;
    let t0 = Instant::now();
    let mut failures = Vec::new();
    let replayed = loop {
        match timeout(
            Duration::from_secs(10),
            kvmesh_events::request_replay(&fleet.replay_ep, 0),
        )
        .await
        {
            Ok(Ok(r)) => break r,
            other => failures.push(format!("{:?}: {other:?}", t0.elapsed())),
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "replay never answered after the hostile inputs: {failures:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    eprintln!(
        "  replay answered after {:?} ({} failed attempts first: {failures:?})",
        t0.elapsed(),
        failures.len()
    );
    assert!(
        !replayed.is_empty(),
        "the replay ring has the batches of earlier requests"
    );
    fleet
        .assert_healthy("ZMQ ROUTER (engine replay)", tried)
        .await;
}

/// Whether a publisher connecting to the router's bound SUB endpoint gets a batch through
/// (the router's `kvmesh_indexer_batches` grows). On failure prints the router's indexer metrics.
async fn sub_hears_a_publisher(fleet: &Fleet) -> bool {
    let before = metric(fleet, "kvmesh_indexer_batches_total").await;
    let mut publisher = Publisher::start(PublisherConfig::new(&fleet.sub_ep, "kv-events"))
        .await
        .unwrap();
    let heard = timeout(Duration::from_secs(15), async {
        loop {
            publisher.publish(&cleared()).await.unwrap();
            tokio::time::sleep(Duration::from_millis(100)).await;
            if metric(fleet, "kvmesh_indexer_batches_total").await > before {
                return;
            }
        }
    })
    .await
    .is_ok();
    if !heard {
        let text = fleet
            .client
            .get(format!("{}/metrics", fleet.router_http))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        for l in text.lines().filter(|l| l.starts_with("kvmesh_indexer")) {
            eprintln!("  router metric: {l}");
        }
    }
    heard
}

async fn hostile_sub(fleet: &mut Fleet) {
    let addr = host_port(&fleet.sub_ep);
    let tried = hostile_zmtp(&addr, "PUB", "SUB", Vec::new()).await;
    // The bound SUB still hears a well-behaved publisher.
    assert!(
        sub_hears_a_publisher(fleet).await,
        "the router's bound SUB hears no publisher after the hostile inputs"
    );
    fleet
        .assert_healthy("ZMQ SUB (router, bind mode)", tried)
        .await;
}

// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_bytes_on_every_port_leave_engine_and_router_serving() {
    let started = Instant::now();
    let mut fleet = timeout(Duration::from_secs(60), start_fleet())
        .await
        .expect("fleet started");
    // Warm up (allocator arenas, connection pools, the index) before taking the baselines.
    for _ in 0..3 {
        fleet.normal_requests().await;
    }
    assert!(
        sub_hears_a_publisher(&fleet).await,
        "setup: the router's bound SUB hears no publisher"
    );
    fleet.engine.baseline_kib = fleet.engine.rss_kib();
    fleet.router.baseline_kib = fleet.router.rss_kib();
    eprintln!(
        "hostile: baseline RSS engine {} MiB, router {} MiB; bound +{} MiB",
        fleet.engine.baseline_kib / 1024,
        fleet.router.baseline_kib / 1024,
        RSS_BOUND_KIB / 1024
    );
    timeout(Duration::from_secs(150), async {
        hostile_http(&mut fleet, "engine").await;
        hostile_http(&mut fleet, "router").await;
        hostile_p2p(&mut fleet).await;
        hostile_pub(&mut fleet).await;
        hostile_replay(&mut fleet).await;
        hostile_sub(&mut fleet).await;
    })
    .await
    .expect("hostile inputs finished in time");
    eprintln!("hostile: done in {:?}", started.elapsed());
}

/// Writes a whole request (`Connection: close`) and reads the whole answer: (status, the JSON
/// object in the body).
async fn exchange_full(addr: &str, req: &[u8], limit: Duration) -> (Option<u16>, String) {
    let run = async {
        let mut s = TcpStream::connect(addr).await.ok()?;
        let (mut rd, mut wr) = s.split();
        let write = async {
            let _ = wr.write_all(req).await;
            std::future::pending::<()>().await;
        };
        let read = async {
            let mut got = Vec::new();
            let _ = rd.read_to_end(&mut got).await;
            got
        };
        let got = tokio::select! {
            g = read => g,
            () = write => unreachable!(),
        };
        // The JSON object of the body, whether sent with a length or chunked.
        let json = match (
            got.iter().position(|&b| b == b'{'),
            got.iter().rposition(|&b| b == b'}'),
        ) {
            (Some(a), Some(b)) if a < b => String::from_utf8_lossy(&got[a..=b]).into_owned(),
            _ => String::new(),
        };
        Some((status_code(&got), json))
    };
    timeout(limit, run)
        .await
        .ok()
        .flatten()
        .unwrap_or((None, String::new()))
}

/// Issue 15: a chat request of 1.9 million empty messages — a 52 MiB body, under both servers'
/// 64 MiB body limit — used to be parsed into a JSON tree, rendered and tokenized in full before
/// the prompt was found longer than `max_model_len`: engine RSS 16 MiB → 1.41 GiB (peak 1.9 GiB),
/// router 17 MiB → 1.41 GiB (debug build), for one request each. Both now read `messages` with
/// `kvmesh_core::chat`'s bounds (65,536 messages, 65,536 content parts per request) and answer
/// 400 naming `messages` and the bound, within the suite's RSS bound. The same for one message
/// whose `content` is a list of 2 million text parts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn millions_of_chat_messages_stay_within_the_rss_bound() {
    let mut fleet = timeout(Duration::from_secs(60), start_fleet())
        .await
        .expect("fleet started");
    fleet.normal_requests().await;
    fleet.engine.baseline_kib = fleet.engine.rss_kib();
    fleet.router.baseline_kib = fleet.router.rss_kib();
    let messages = vec![r#"{"role":"user","content":""}"#; 1_900_000].join(",");
    let many_messages = format!(r#"{{"model":"sim","max_tokens":1,"messages":[{messages}]}}"#);
    drop(messages);
    let parts = vec![r#"{"type":"text","text":""}"#; 2_000_000].join(",");
    let many_parts = format!(
        r#"{{"model":"sim","max_tokens":1,"messages":[{{"role":"user","content":[{parts}]}}]}}"#
    );
    drop(parts);
    let cases = [
        (
            "1.9M empty messages",
            many_messages,
            "at most 65536 messages",
        ),
        (
            "2M content parts",
            many_parts,
            "at most 65536 content parts",
        ),
    ];
    let mut tried = 0;
    for (what, body, bound) in cases {
        let req = post("/v1/chat/completions", body.as_bytes());
        drop(body);
        for addr in [
            fleet.engine_http_addr.clone(),
            fleet.router_http_addr.clone(),
        ] {
            let (status, answer) = exchange_full(&addr, &req, Duration::from_secs(60)).await;
            eprintln!(
                "  {addr}: {what} ({} MiB) -> {status:?} {answer} (RSS MiB engine {}, router {}; peak {} / {})",
                req.len() >> 20,
                fleet.engine.rss_kib() / 1024,
                fleet.router.rss_kib() / 1024,
                fleet.engine.peak_rss_kib() / 1024,
                fleet.router.peak_rss_kib() / 1024
            );
            assert_eq!(status, Some(400), "{addr}: {what}: {answer}");
            let v: serde_json::Value = serde_json::from_str(&answer).expect("JSON error body");
            assert_eq!(v["error"]["param"], "messages", "{addr}: {what}: {answer}");
            let msg = v["error"]["message"].as_str().unwrap_or_default();
            assert!(msg.contains(bound), "{addr}: {what}: {msg}");
            tried += 1;
        }
    }
    fleet
        .assert_healthy("millions of chat messages / parts", tried)
        .await;
}

/// vLLM refuses more logprobs than `--max-logprobs` (default 20) with a 400 naming the field;
/// the engine used to accept `logprobs: 10^9` with a 200.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_above_vllms_max_are_refused() {
    let fleet = timeout(Duration::from_secs(60), start_fleet())
        .await
        .expect("fleet started");
    let cases = [
        (
            "/v1/completions",
            json!({"model": "sim", "prompt": "x", "max_tokens": 1, "logprobs": 1_000_000_000}),
            "logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "sim", "max_tokens": 1, "logprobs": true, "top_logprobs": 21,
                   "messages": [{"role": "user", "content": "x"}]}),
            "logprobs",
        ),
    ];
    for (path, body, param) in cases {
        for addr in [&fleet.engine_http_addr, &fleet.router_http_addr] {
            let req = post(path, body.to_string().as_bytes());
            let (status, answer) = exchange_full(addr, &req, EXCHANGE).await;
            assert_eq!(status, Some(400), "{addr}{path}: {answer}");
            let v: serde_json::Value = serde_json::from_str(&answer).expect("JSON error body");
            assert_eq!(v["error"]["param"], param, "{answer}");
            let msg = v["error"]["message"].as_str().unwrap_or_default();
            assert!(msg.contains("greater than max allowed: 20"), "{msg}");
        }
    }
    // At the limit it is served.
    let req = post(
        "/v1/completions",
        json!({"model": "sim", "prompt": "x", "max_tokens": 1, "logprobs": 20})
            .to_string()
            .as_bytes(),
    );
    let (status, answer) = exchange_full(&fleet.engine_http_addr, &req, EXCHANGE).await;
    assert_eq!(status, Some(200), "{answer}");
}

/// Issue 15: a 64 MiB completions body holding one list of ~33 million token ids. The engine
/// used to read it into a `serde_json::Value` tree (32+ bytes per id, ~1 GiB); it now reads
/// `prompt` straight from the bytes (`kvmesh_core::prompt`), keeps at most `max_model_len` ids
/// and counts the rest unread, answering vLLM's context-length 400. Peak RSS (`VmHWM`) growth is
/// measured on both processes; the engine's must stay within the suite's RSS bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_64_mib_token_id_prompt_stays_within_the_rss_bound() {
    let mut fleet = timeout(Duration::from_secs(60), start_fleet())
        .await
        .expect("fleet started");
    fleet.normal_requests().await;
    fleet.engine.baseline_kib = fleet.engine.rss_kib();
    fleet.router.baseline_kib = fleet.router.rss_kib();
    let ids = 64 * 1024 * 1024 / 2 - 64;
    let mut body = String::with_capacity(2 * ids + 64);
    body.push_str(r#"{"model":"sim","max_tokens":1,"prompt":["#);
    for i in 0..ids {
        body.push_str(if i == 0 { "1" } else { ",1" });
    }
    body.push_str("]}");
    let req = post("/v1/completions", body.as_bytes());
    drop(body);
    let mut tried = 0;
    for addr in [
        fleet.engine_http_addr.clone(),
        fleet.router_http_addr.clone(),
    ] {
        let peak_before = (fleet.engine.peak_rss_kib(), fleet.router.peak_rss_kib());
        let (status, answer) = exchange_full(&addr, &req, Duration::from_secs(120)).await;
        let peak_after = (fleet.engine.peak_rss_kib(), fleet.router.peak_rss_kib());
        eprintln!(
            "  {addr}: {ids} token ids ({} MiB) -> {status:?} {answer} (peak RSS MiB engine {} -> {}, router {} -> {})",
            req.len() >> 20,
            peak_before.0 / 1024,
            peak_after.0 / 1024,
            peak_before.1 / 1024,
            peak_after.1 / 1024
        );
        assert_eq!(status, Some(400), "{addr}: {answer}");
        let v: serde_json::Value = serde_json::from_str(&answer).expect("JSON error body");
        assert_eq!(v["error"]["param"], "prompt", "{addr}: {answer}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(
            msg.contains(&format!("However, your request has {ids} input tokens")),
            "{addr}: {msg}"
        );
        let engine_peak_growth = peak_after.0.saturating_sub(fleet.engine.baseline_kib);
        assert!(
            engine_peak_growth < RSS_BOUND_KIB,
            "{addr}: engine peak RSS grew by {engine_peak_growth} KiB (bound {RSS_BOUND_KIB} KiB)"
        );
        tried += 1;
    }
    fleet
        .assert_healthy("a 64 MiB token-id prompt", tried)
        .await;
}

/// Issue 15: a ~64 MiB body of millions of top-level keys. The router kept every one in its
/// field map (a `String` and a boxed raw value each); it now refuses the 257th field
/// (`MAX_FIELDS`) with a 400 as soon as its key is read. Peak RSS growth (`VmHWM`) is measured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn millions_of_top_level_fields_stay_within_the_rss_bound() {
    let mut fleet = timeout(Duration::from_secs(60), start_fleet())
        .await
        .expect("fleet started");
    fleet.normal_requests().await;
    fleet.engine.baseline_kib = fleet.engine.rss_kib();
    fleet.router.baseline_kib = fleet.router.rss_kib();
    let keys = 5_000_000;
    let mut body = String::with_capacity(14 * keys + 64);
    body.push_str(r#"{"model":"sim","max_tokens":1,"prompt":[1]"#);
    for i in 0..keys {
        body.push_str(&format!(r#","k{i}":0"#));
    }
    body.push('}');
    let req = post("/v1/completions", body.as_bytes());
    drop(body);
    let addr = fleet.router_http_addr.clone();
    let peak_before = fleet.router.peak_rss_kib();
    let (status, answer) = exchange_full(&addr, &req, Duration::from_secs(120)).await;
    let peak_after = fleet.router.peak_rss_kib();
    eprintln!(
        "  {addr}: {keys} top-level fields ({} MiB) -> {status:?} {answer} (router peak RSS MiB {} -> {})",
        req.len() >> 20,
        peak_before / 1024,
        peak_after / 1024
    );
    assert_eq!(status, Some(400), "{answer}");
    assert!(
        answer.contains("too many fields: at most 256 top-level fields per request"),
        "{answer}"
    );
    let growth = peak_after.saturating_sub(fleet.router.baseline_kib);
    assert!(
        growth < RSS_BOUND_KIB,
        "router peak RSS grew by {growth} KiB (bound {RSS_BOUND_KIB} KiB)"
    );
    fleet
        .assert_healthy("millions of top-level fields", 1)
        .await;
}

// ---------------------------------------------------------------------------------------------
// Lying P2P sources (issue 37, finding 6).

/// A document of `tokens` byte-tokens no other document shares a block with.
fn lying_doc(i: usize, tokens: usize) -> String {
    let head = format!("document {i:04}: ");
    let mut d = head.clone();
    while d.len() < tokens {
        d.push_str(&format!("{i} lorem ipsum dolor sit amet {} ", d.len()));
    }
    d.truncate(tokens);
    d
}

/// What one request through the router did.
struct Placed {
    endpoint: String,
    source: Option<String>,
    /// Request sent → response headers (the pull, if any, ends before them).
    headers_s: f64,
}

/// Sends `prompt` through the router (streamed when `stream`), reads it to the end, and says
/// where it went and which source was named (`x-kvmesh-explain`).
async fn place(http: &reqwest::Client, base: &str, prompt: &str, stream: bool) -> Placed {
    let t = Instant::now();
    let resp = http
        .post(format!("{base}/v1/completions"))
        .header("x-kvmesh-explain", "1")
        .json(&json!({"model": "sim", "prompt": prompt, "max_tokens": 2, "stream": stream}))
        .send()
        .await
        .unwrap();
    let headers_s = t.elapsed().as_secs_f64();
    assert!(resp.status().is_success(), "{}", resp.status());
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let endpoint = header("x-kvmesh-endpoint").unwrap_or_default();
    let decision: serde_json::Value =
        serde_json::from_str(&header("x-kvmesh-decision").unwrap_or_default()).unwrap();
    let source = decision["p2p_source"].as_str().map(str::to_owned);
    resp.bytes().await.unwrap();
    Placed {
        endpoint,
        source,
        headers_s,
    }
}

/// One run: engine `a` (a consumer) and the liar behind a router whose `liar` endpoint is
/// engine `b`'s HTTP and KV events (it really computed the documents: they are in its CPU tier)
/// but whose advertised P2P address is `liar_p2p`, which does not serve them. Placement is
/// round-robin (the default `predicted-ttft-scorer` would place every request on the holder),
/// and the P2P step is the default one (`mode: predicted`), so every request placed on `a`
/// prices a pull from the liar. Documents `docs` are used, one per request, so `a` never holds
/// one before its request. Returns the requests placed on `a` (the first 19).
async fn lying_source_run(
    dir: &Path,
    a_url: &str,
    b: (&str, &str),
    liar_p2p: &str,
    docs: std::ops::Range<usize>,
) -> (hostile_common::Proc, String, Vec<Placed>) {
    const DOC_TOKENS: usize = 2048;
    let (b_url, b_pub) = b;
    let yaml = format!(
        "block_size: 16\ntokenizer: byte\nmetrics_scrape_interval: 200ms\n\
         endpoints:\n  - {{name: a, url: \"{a_url}\"}}\n  \
         - {{name: liar, url: \"{b_url}\", p2p: \"{liar_p2p}\", kv_events: {{endpoint: \"{b_pub}\", topic: kv-events}}}}\n\
         plugins:\n  - {{type: predicted-ttft-scorer, name: ttft, parameters: {{p2p: true, min_pull_tokens: 256}}}}\n  \
         - {{type: round-robin-picker, name: rr}}\n  \
         - {{type: p2p-source-producer, name: p2p, parameters: {{mode: predicted}}}}\n\
         scheduling_profiles:\n  - name: rr\n    plugins:\n      - {{plugin_ref: ttft, weight: 1}}\n      \
         - {{plugin_ref: rr}}\n      - {{plugin_ref: p2p}}\n"
    );
    let (router, base) = hostile_common::router(&yaml, dir).await;
    let http = reqwest::Client::new();
    // The liar computes every document (straight to its engine): its events tell the router it
    // holds them in its CPU tier. Wait until the router's index says so for the last one.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for i in docs.clone() {
        let body = json!({"model": "sim", "prompt": format!("{} warm", lying_doc(i, DOC_TOKENS)), "max_tokens": 1});
        let r = http
            .post(format!("{b_url}/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success());
    }
    let last = lying_doc(docs.end - 1, DOC_TOKENS);
    let indexed = async {
        loop {
            let v: serde_json::Value = http
                .post(format!("{base}/debug/prefix"))
                .json(&json!({"prompt": format!("{last} ?")}))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            if v["endpoints"]["liar"]["cpu_tokens"].as_u64() >= Some(DOC_TOKENS as u64) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(20), indexed)
        .await
        .expect("the router never indexed the liar's documents");
    let mut on_a = Vec::new();
    for (k, i) in docs.enumerate() {
        let prompt = format!("{} question {k}?", lying_doc(i, DOC_TOKENS));
        let p = place(&http, &base, &prompt, k % 2 == 0).await;
        if p.endpoint == "a" {
            on_a.push(p);
            if on_a.len() == 19 {
                break;
            }
        }
    }
    assert_eq!(on_a.len(), 19, "round-robin placed too few requests on a");
    (router, base, on_a)
}

async fn router_text(base: &str, path: &str) -> String {
    reqwest::get(format!("{base}{path}"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lying_p2p_source_stops_being_named_and_a_stall_costs_the_predicted_time() {
    let dir = tempfile::tempdir().unwrap();
    let (_a, a_url) =
        hostile_common::sim_engine(&["--p2p-allowed-peers", "127.0.0.1"], dir.path()).await;
    let (_b, b_url, b_pub, _) = hostile_common::sim_engine_with_events(json!({}), dir.path()).await;
    // A producer that holds none of the documents: the liar's P2P address in the miss run.
    let mut args = hostile_common::sim_engine_args("100");
    args.extend(["--p2p-port", "0"].map(str::to_owned));
    let (_c, found) = hostile_common::spawn(
        "engine",
        &args,
        &["kvmesh engine p2p advertised as "],
        dir.path(),
    )
    .await;
    let empty_producer = found[0].clone();

    // 1. Misses: the liar advertises 2,048 tokens per document that its producer never has.
    let (router, base, on_a) =
        lying_source_run(dir.path(), &a_url, (&b_url, &b_pub), &empty_producer, 0..40).await;
    let named = on_a
        .iter()
        .filter(|p| p.source.as_deref() == Some("liar"))
        .count();
    let metrics = router_text(&base, "/metrics").await;
    let misses = hostile_common::metric(
        &metrics,
        "kvmesh_router_p2p_source_penalties_total",
        "reason=\"miss\"",
    );
    let decisions = router_text(&base, "/debug/decisions?last=100").await;
    println!(
        "lying source (misses): named {named} of 19 requests placed on the consumer; {misses} misses counted"
    );
    assert!(
        (1..=3).contains(&named),
        "named the lying source {named} of 19 times"
    );
    assert!(misses >= 1.0, "{metrics}");
    assert!(
        hostile_common::metric(
            &metrics,
            "kvmesh_router_p2p_source_excluded",
            "source=\"liar\""
        ) == 1.0,
        "{metrics}"
    );
    assert!(
        decisions.contains("\"penalised_sources\"") && decisions.contains("\"excluded\":true"),
        "/debug/decisions shows no penalised source"
    );
    drop(router);

    // 2. Stalls: the liar's producer accepts connections and never answers.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let stall_addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            held.push(s);
        }
    });
    let (router, base, on_a) =
        lying_source_run(dir.path(), &a_url, (&b_url, &b_pub), &stall_addr, 100..140).await;
    let stalled: Vec<f64> = on_a
        .iter()
        .filter(|p| p.source.as_deref() == Some("liar"))
        .map(|p| p.headers_s)
        .collect();
    let others: Vec<f64> = on_a
        .iter()
        .filter(|p| p.source.is_none())
        .map(|p| p.headers_s)
        .collect();
    let metrics = router_text(&base, "/metrics").await;
    let stalls = hostile_common::metric(
        &metrics,
        "kvmesh_router_p2p_source_penalties_total",
        "reason=\"stall\"",
    );
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    println!(
        "stalling source: named {} of 19; those requests' headers after {:?} s (deadline from the \
         prediction), the others' median {:.3} s; {stalls} stalls counted",
        stalled.len(),
        stalled
            .iter()
            .map(|s| (s * 1000.0).round() / 1000.0)
            .collect::<Vec<_>>(),
        median(&others)
    );
    assert!(
        (1..=3).contains(&stalled.len()),
        "named the stalling source {} of 19 times",
        stalled.len()
    );
    assert!(stalls >= 1.0, "{metrics}");
    // The flat budget is 5 s (+ the pending deadline); the prediction for 2,048 tokens is about
    // 35 ms, so the engine's deadline is its floor, 200 ms. Room for a loaded 2-core machine.
    for s in &stalled {
        assert!(
            *s < 1.5,
            "a stalled pull cost {s:.2} s: the flat timeout, not the prediction"
        );
    }
    drop(router);
}
