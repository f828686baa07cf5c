//! P2P under contention (the shared-prefix pool experiment's failure modes, DESIGN §3/§6):
//! concurrent requests for one prefix on one consumer move its bytes once, and a pull stuck on a
//! silent peer delays neither other requests nor other pulls of that engine.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{base_config, cached_tokens, tokens};
use kvmesh_engine::EngineConfig;
use kvmesh_engine::server::{RunningServer, ServerOptions, sim_backend, start_server};
use kvmesh_text::ByteTokenizer;
use kvmesh_transfer::Direction;
use serde_json::{Value, json};
use tokio::time::timeout;

const PROFILE: &str = "gpt-oss-120b-h200";

fn p2p_config() -> EngineConfig {
    let mut cfg = base_config();
    cfg.kv_events = None;
    cfg.num_gpu_blocks = 4096;
    cfg.p2p.port = Some(0);
    cfg.p2p.allowed_peers = vec!["127.0.0.1".into()];
    cfg
}

async fn start(cfg: EngineConfig, time_scale: f64) -> RunningServer {
    start_kv(cfg, time_scale, 32).await
}

async fn start_kv(cfg: EngineConfig, time_scale: f64, kv_bytes: usize) -> RunningServer {
    let backend = sim_backend(&cfg, PROFILE, time_scale, kv_bytes).unwrap();
    start_server(
        cfg,
        backend,
        Arc::new(ByteTokenizer),
        ServerOptions::default(),
    )
    .await
    .unwrap()
}

fn source(port: u16) -> Value {
    json!({"remote_kv_source": {"kv_request_id": "kv-1", "remote_host": "127.0.0.1", "remote_port": port}})
}

async fn complete(addr: SocketAddr, prompt: &[u32], kvp: Option<Value>) -> Value {
    let mut body =
        json!({"model": "sim-test", "prompt": prompt, "max_tokens": 2, "temperature": 0});
    if let Some(p) = kvp {
        body["kv_transfer_params"] = p;
    }
    let r = reqwest::Client::new()
        .post(format!("http://{addr}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "P2P trouble must never reach the client");
    r.json().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_for_one_prefix_move_its_bytes_once() {
    timeout(Duration::from_secs(60), async {
        // 8 MiB of KV for the prefix, so the first pull is still on the wire (and then in
        // its modelled hold: B runs at real time) when the others arrive.
        let a = start_kv(p2p_config(), 1000.0, 2048).await;
        let a_p2p = a.p2p_addr.unwrap().port();
        let b = start_kv(p2p_config(), 1.0, 2048).await;
        let prefix = tokens(1, 4096); // 256 blocks
        complete(a.addr, &prefix, None).await;

        let go = Arc::new(tokio::sync::Barrier::new(4));
        let mut tasks = Vec::new();
        for i in 0..4 {
            let mut prompt = prefix.clone();
            prompt.extend(tokens(100 + i, 64));
            let addr = b.addr;
            let go = go.clone();
            tasks.push(tokio::spawn(async move {
                go.wait().await;
                complete(addr, &prompt, Some(source(a_p2p))).await
            }));
        }
        for t in tasks {
            let got = t.await.unwrap();
            assert_eq!(cached_tokens(&got), 4096, "{got}");
        }
        let p2p = &b.engine.metrics().p2p;
        assert_eq!(
            p2p.blocks(Direction::In),
            256,
            "the shared prefix crossed the wire once, not once per request"
        );
        assert_eq!(b.p2p.inflight_pulls(), 0);
        // Every request's prefix came from the peer (once), none recomputed it.
        let m = reqwest::get(format!("http://{}/metrics", b.addr))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let computed: f64 = m
            .lines()
            .filter(|l| {
                l.starts_with("vllm:prompt_tokens_by_source_total") && l.contains("local_compute")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        assert_eq!(computed, 4.0 * 64.0, "only the suffixes were computed");
        b.shutdown().await;
        a.shutdown().await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_stuck_on_a_silent_peer_delays_no_other_request() {
    timeout(Duration::from_secs(60), async {
        // A "peer" that accepts connections and never says a word.
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let silent_port = silent.local_addr().unwrap().port();
        let hold = tokio::spawn(async move {
            let mut conns = Vec::new();
            while let Ok((c, _)) = silent.accept().await {
                conns.push(c);
            }
        });
        let mut cfg = p2p_config();
        cfg.p2p.timeout = Duration::from_secs(3);
        cfg.p2p.pending_deadline = Duration::from_millis(500);
        let b = start(cfg, 1000.0).await;
        let prefix = tokens(7, 2048);

        let stuck_started = Instant::now();
        let stuck = {
            let mut prompt = prefix.clone();
            prompt.extend(tokens(8, 32));
            let addr = b.addr;
            tokio::spawn(async move { complete(addr, &prompt, Some(source(silent_port))).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        // A second request for the same prefix from the same silent peer waits for the first
        // pull, but within one budget (timeout 3 s + pending 0.5 s): waits never compound.
        let follower_started = Instant::now();
        let follower = {
            let mut prompt = prefix.clone();
            prompt.extend(tokens(11, 32));
            let addr = b.addr;
            tokio::spawn(async move { complete(addr, &prompt, Some(source(silent_port))).await })
        };
        // Same prefix (same first missing block), and an unrelated prompt: both are served
        // long before the stuck pull gives up.
        let t0 = Instant::now();
        let mut same = prefix.clone();
        same.extend(tokens(9, 32));
        complete(b.addr, &same, None).await;
        complete(b.addr, &tokens(10, 1024), None).await;
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "other requests waited {:?} behind a stuck pull",
            t0.elapsed()
        );
        let got = stuck.await.unwrap();
        assert_eq!(got["usage"]["completion_tokens"], 2);
        let got = follower.await.unwrap();
        assert_eq!(got["usage"]["completion_tokens"], 2);
        assert!(
            follower_started.elapsed() < Duration::from_millis(4_500),
            "waiting for another pull and then pulling again took {:?}",
            follower_started.elapsed()
        );
        assert!(
            stuck_started.elapsed() < Duration::from_secs(6),
            "the stuck pull itself is bounded (timeout + pending deadline)"
        );
        b.shutdown().await;
        hold.abort();
    })
    .await
    .expect("test timed out");
}
