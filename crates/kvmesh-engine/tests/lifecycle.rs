//! Engine lifecycle over real loopback HTTP: `/health` and requests once the compute loop has
//! died (a backend that panics), slow and silent clients dropped by the header/body read
//! timeout while normal requests keep working, and a shutdown that drains a running stream,
//! refuses new connections, and is bounded by the drain timeout.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvmesh_core::BlockHash;
use kvmesh_core::TokenId;
use kvmesh_engine::EngineConfig;
use kvmesh_engine::compute::{
    BackendCapabilities, BlockId, ComputeBackend, ComputeError, KvArena, KvLayout, SeqStep,
};
use kvmesh_engine::server::{HttpLimits, RunningServer, ServerOptions, sim_backend, start_server};
use kvmesh_text::ByteTokenizer;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::timeout;

fn config() -> EngineConfig {
    EngineConfig {
        host: "127.0.0.1".into(),
        port: 0,
        served_model_name: "sim-test".into(),
        block_size: 16,
        num_gpu_blocks: 256,
        cpu_offload_bytes: 8 << 20,
        kv_events: None,
        max_model_len: 4096,
        hash_seed: Some("0".into()),
        ..EngineConfig::default()
    }
}

/// The sim backend, until `armed`: then its next step panics (a backend bug, a CUDA error).
struct PanicAfterArmed {
    inner: Box<dyn ComputeBackend>,
    armed: Arc<AtomicBool>,
}

impl ComputeBackend for PanicAfterArmed {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn capabilities(&self) -> BackendCapabilities {
        self.inner.capabilities()
    }
    fn kv_layout(&self) -> KvLayout {
        self.inner.kv_layout()
    }
    fn step(
        &mut self,
        seqs: &[SeqStep<'_>],
        kv: &mut KvArena,
    ) -> Result<Vec<Option<TokenId>>, ComputeError> {
        assert!(
            !self.armed.load(Ordering::SeqCst),
            "injected backend failure"
        );
        self.inner.step(seqs, kv)
    }
    fn eos_token_ids(&self) -> Vec<TokenId> {
        self.inner.eos_token_ids()
    }
    fn modelled_pull_time(&self, tokens: usize) -> Option<Duration> {
        self.inner.modelled_pull_time(tokens)
    }
    fn modelled_link(&self) -> Option<kvmesh_engine::compute::ModelledLink> {
        self.inner.modelled_link()
    }
    fn finalize_block(&mut self, block: BlockId, hash: BlockHash, kv: &mut KvArena) {
        self.inner.finalize_block(block, hash, kv)
    }
    fn on_host_restore(&mut self, tokens: usize) -> kvmesh_engine::compute::HostRestoreCost {
        self.inner.on_host_restore(tokens)
    }
    fn run_pending_restore(&mut self) {
        self.inner.run_pending_restore()
    }
}

async fn start(time_scale: f64, http: HttpLimits) -> (RunningServer, Arc<AtomicBool>) {
    let cfg = config();
    let armed = Arc::new(AtomicBool::new(false));
    let backend = PanicAfterArmed {
        inner: sim_backend(&cfg, "gpt-oss-120b-h200", time_scale, 32).unwrap(),
        armed: Arc::clone(&armed),
    };
    let options = ServerOptions {
        http,
        ..ServerOptions::default()
    };
    let server = start_server(cfg, Box::new(backend), Arc::new(ByteTokenizer), options)
        .await
        .unwrap();
    (server, armed)
}

async fn post(client: &reqwest::Client, base: &str, body: Value) -> (u16, Value) {
    let r = client
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_compute_loop_fails_health_and_requests_with_503() {
    timeout(Duration::from_secs(30), async {
        let (server, armed) = start(100.0, HttpLimits::default()).await;
        let base = format!("http://{}", server.addr);
        let client = reqwest::Client::new();
        let health = client.get(format!("{base}/health")).send().await.unwrap();
        assert_eq!(health.status(), 200);
        let req = json!({"model": "sim-test", "prompt": "hello", "max_tokens": 4});
        assert_eq!(post(&client, &base, req.clone()).await.0, 200);

        armed.store(true, Ordering::SeqCst);
        // The request in flight when the loop dies gets a clear 503, not a hang.
        let (status, body) = post(&client, &base, req.clone()).await;
        assert_eq!(status, 503, "{body}");
        assert_eq!(body["error"]["type"], "ServiceUnavailableError", "{body}");
        let msg = body["error"]["message"].as_str().unwrap();
        assert!(msg.contains("compute loop"), "{msg}");

        for path in ["/health", "/ping"] {
            let r = client.get(format!("{base}{path}")).send().await.unwrap();
            assert_eq!(r.status(), 503, "{path}");
            let body: Value = r.json().await.unwrap();
            let msg = body["error"]["message"].as_str().unwrap();
            assert!(
                msg.contains("panicked") && msg.contains("injected backend failure"),
                "{msg}"
            );
        }
        // Later requests, streamed or not, are refused at once with the reason.
        for stream in [false, true] {
            let started = Instant::now();
            let mut r = req.clone();
            r["stream"] = json!(stream);
            let (status, body) = post(&client, &base, r).await;
            assert_eq!(status, 503, "{body}");
            assert!(
                body["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("panicked"),
                "{body}"
            );
            assert!(started.elapsed() < Duration::from_secs(2));
        }
        server.shutdown().await;
    })
    .await
    .expect("test timed out");
}

/// Reads until EOF or error; returns what arrived and how long the server kept the socket.
async fn read_until_closed(tcp: &mut TcpStream, bound: Duration) -> (Vec<u8>, Duration) {
    let started = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match timeout(bound, tcp.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (got, started.elapsed()),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => panic!("connection still open after {bound:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_silent_clients_are_dropped_while_normal_requests_work() {
    timeout(Duration::from_secs(30), async {
        let limits = HttpLimits {
            header_read_timeout: Duration::from_millis(700),
            ..HttpLimits::default()
        };
        let (server, _) = start(100.0, limits).await;
        let addr = server.addr;
        let bound = Duration::from_secs(5);

        // Connects and sends nothing.
        let mut silent = TcpStream::connect(addr).await.unwrap();
        // Sends a partial request line and stalls.
        let mut partial = TcpStream::connect(addr).await.unwrap();
        partial.write_all(b"GET /hea").await.unwrap();
        // Trickles its headers, one byte every 100 ms: the bound is on the whole header, so
        // arriving bytes do not keep it alive.
        let mut trickle = TcpStream::connect(addr).await.unwrap();
        let trickler = tokio::spawn(async move {
            let started = Instant::now();
            for b in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaa" {
                if trickle.write_all(&[*b]).await.is_err() {
                    return started.elapsed();
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            panic!("the server read a trickled header for {:?}", started.elapsed());
        });
        // Sends its headers, then stalls in the body.
        let mut slow_body = TcpStream::connect(addr).await.unwrap();
        slow_body
            .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
            .await
            .unwrap();

        // Meanwhile a normal client is served.
        let client = reqwest::Client::new();
        let (status, body) = post(
            &client,
            &format!("http://{addr}"),
            json!({"model": "sim-test", "prompt": "hello", "max_tokens": 2}),
        )
        .await;
        assert_eq!(status, 200, "{body}");

        for (what, tcp) in [("silent", &mut silent), ("partial", &mut partial)] {
            let (got, after) = read_until_closed(tcp, bound).await;
            // hyper may answer 408 before closing; either way the socket is gone.
            assert!(got.is_empty() || got.starts_with(b"HTTP/1.1 408"), "{what}: {got:?}");
            assert!(after < Duration::from_secs(3), "{what} held for {after:?}");
        }
        let trickled_for = trickler.await.unwrap();
        assert!(trickled_for < Duration::from_secs(3), "{trickled_for:?}");
        let (got, after) = read_until_closed(&mut slow_body, bound).await;
        assert!(after < Duration::from_secs(3), "slow body held for {after:?}: {got:?}");

        // And the server still answers new clients.
        let health = client.get(format!("http://{addr}/health")).send().await.unwrap();
        assert_eq!(health.status(), 200);
        server.shutdown().await;
    })
    .await
    .expect("test timed out");
}

/// Starts a streamed completion that takes about `tokens` × 4.5 ms on the sim at scale 1.
async fn start_stream(client: &reqwest::Client, base: &str, tokens: usize) -> reqwest::Response {
    let r = client
        .post(format!("{base}/v1/completions"))
        .json(
            &json!({"model": "sim-test", "prompt": "drain me", "max_tokens": tokens,
                      "ignore_eos": true, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_streams_refuses_new_connections_and_is_bounded() {
    timeout(Duration::from_secs(30), async {
        // A running stream finishes; a connection attempted meanwhile is refused.
        let (mut server, _) = start(1.0, HttpLimits::default()).await;
        let base = format!("http://{}", server.addr);
        let client = reqwest::Client::new();
        let stream = start_stream(&client, &base, 200).await;
        let reader = tokio::spawn(async move { stream.text().await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let started = Instant::now();
        server.cancel_token().cancel();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            TcpStream::connect(server.addr).await.is_err(),
            "a new connection was accepted while draining"
        );
        let text = reader.await.unwrap().unwrap();
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        assert!(text.contains("\"finish_reason\":\"length\""), "{text}");
        server.wait().await;
        assert!(started.elapsed() < Duration::from_secs(10));
        server.shutdown().await;

        // A stream longer than the drain timeout is cut at the bound.
        let limits = HttpLimits {
            drain_timeout: Duration::from_millis(300),
            ..HttpLimits::default()
        };
        let (mut server, _) = start(1.0, limits).await;
        let base = format!("http://{}", server.addr);
        let stream = start_stream(&client, &base, 3000).await;
        let reader = tokio::spawn(async move { stream.text().await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let started = Instant::now();
        server.cancel_token().cancel();
        server.wait().await;
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(250) && waited < Duration::from_secs(3),
            "{waited:?}"
        );
        let cut = reader.await.unwrap();
        assert!(
            cut.as_ref().map_or(true, |t| !t.contains("[DONE]")),
            "the stream was not cut: {cut:?}"
        );
        server.shutdown().await;
    })
    .await
    .expect("test timed out");
}
