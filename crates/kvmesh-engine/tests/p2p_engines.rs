//! Two (or more) in-process sim engines on loopback: B pulls a prefix A holds when a request names
//! A as `remote_kv_source`, and every failure (MISS, checksum, slow peer, peer killed mid-pull,
//! fingerprint mismatch, peer not allowed) still yields the same response as plain recompute,
//! with the outcome counted by reason in `kvmesh_p2p_pulls_total`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{
    PROFILE, TestServer, base_config, cached_tokens, complete, p2p_config, scrape_metric, source,
    start_engine, tokens, try_start_engine,
};
use kvmesh_core::{BlockHash, KvEvent, Medium};
use kvmesh_engine::server::RunningServer;
use kvmesh_transfer::Direction;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::time::timeout;

/// Same text and usage as the reference, cached tokens aside.
fn assert_same_answer(got: &Value, reference: &Value) {
    assert_eq!(
        got["choices"][0]["text"], reference["choices"][0]["text"],
        "{got}"
    );
    assert_eq!(
        got["usage"]["prompt_tokens"],
        reference["usage"]["prompt_tokens"]
    );
    assert_eq!(
        got["usage"]["completion_tokens"],
        reference["usage"]["completion_tokens"]
    );
    assert_eq!(
        got["choices"][0]["finish_reason"],
        reference["choices"][0]["finish_reason"]
    );
}

/// Sends `prompt` to `b` naming `a_p2p` as source; checks the answer against a recompute on a
/// fresh engine and that exactly one pull ended with `reason`. Returns B's response.
async fn pull_fails_gracefully(
    b: &RunningServer,
    a_p2p: u16,
    prompt: &[u32],
    reason: &'static str,
) -> Value {
    let before = b.engine.metrics().p2p.pulls_by_reason(reason);
    let got = complete(b.addr, prompt, 4, Some(source(a_p2p))).await;
    let fresh = start_engine(p2p_config(), PROFILE, 1000.0, 32).await;
    let reference = complete(fresh.addr, prompt, 4, None).await;
    fresh.shutdown().await;
    assert_same_answer(&got, &reference);
    assert_eq!(
        b.engine.metrics().p2p.pulls_by_reason(reason),
        before + 1,
        "reason {reason}"
    );
    assert!(scrape_metric(b.addr, "kvmesh_p2p_pulls_total", "").await >= 1.0);
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pulled_prefix_counts_as_external_hits_and_is_republished() {
    timeout(Duration::from_secs(60), async {
        let a = start_engine(p2p_config(), PROFILE, 1000.0, 32).await;
        let a_p2p = a.p2p_addr.unwrap().port();
        let mut cfg_b = base_config(); // with a KV-event subscriber
        cfg_b.p2p.allowed_peers = vec!["127.0.0.1".into()];
        let mut b = TestServer::start(cfg_b, 1000.0).await;
        let prefix = tokens(1, 640); // 40 blocks
        complete(a.addr, &prefix, 1, None).await;
        let mut prompt = prefix.clone();
        prompt.extend(tokens(2, 100));
        let hashes = b.server.engine.block_hashes(&prompt);

        let got = complete(b.server.addr, &prompt, 4, Some(source(a_p2p))).await;
        assert_eq!(cached_tokens(&got), 640, "{got}");
        let reference = complete(a.addr, &prompt, 4, None).await;
        assert_same_answer(&got, &reference);
        assert_eq!(
            b.metric("vllm:external_prefix_cache_hits_total").await,
            640.0
        );
        assert_eq!(
            b.metric("vllm:external_prefix_cache_queries_total").await,
            740.0
        );
        let p2p = &b.server.engine.metrics().p2p;
        assert_eq!(
            p2p.pulls("partial", "miss"),
            1,
            "A holds 40 of the 46 cacheable blocks"
        );
        assert_eq!(p2p.blocks(Direction::In), 40);
        assert_eq!(p2p.bytes(Direction::In), 40 * 16 * 32);
        assert_eq!(a.engine.metrics().p2p.blocks(Direction::Out), 40);
        let text = b.metrics().await;
        assert!(text.contains("kvmesh_p2p_blocks_total{"), "{text}");
        assert!(
            text.contains("kvmesh_p2p_pull_duration_seconds_count{"),
            "{text}"
        );
        // B announced the pulled copy on its CPU tier (so a router learns it), then GPU.
        let events = b.drain_events(Duration::from_millis(300)).await;
        let cpu_stored: Vec<BlockHash> = events
            .iter()
            .filter_map(|(_, e)| match e {
                KvEvent::BlockStored(s) if s.medium == Medium::Cpu => Some(s.block_hashes.clone()),
                _ => None,
            })
            .flatten()
            .collect();
        assert_eq!(&cpu_stored[..40], &hashes[..40]);
        // A repeat on B is an ordinary local hit.
        let again = complete(b.server.addr, &prompt, 4, None).await;
        assert_eq!(cached_tokens(&again), 736);
        assert_eq!(
            b.metric("vllm:external_prefix_cache_hits_total").await,
            640.0
        );
        // The pull's pins were released when the request finished.
        assert_eq!(b.server.engine.cpu_tier().pin_count(hashes[0]), 0);
        b.stop().await;
        a.shutdown().await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn miss_checksum_fingerprint_and_not_allowed_fall_back_to_compute() {
    timeout(Duration::from_secs(90), async {
        let a = start_engine(p2p_config(), PROFILE, 1000.0, 32).await;
        let a_p2p = a.p2p_addr.unwrap().port();
        let b = start_engine(p2p_config(), PROFILE, 1000.0, 32).await;

        // MISS: A never saw this prefix.
        let cold = tokens(10, 300);
        let got = pull_fails_gracefully(&b, a_p2p, &cold, "miss").await;
        assert_eq!(cached_tokens(&got), 0);

        // A no longer holds the blocks: warmed, then its cache reset.
        let gone = tokens(11, 300);
        complete(a.addr, &gone, 1, None).await;
        assert!(a.engine.reset_prefix_cache().await);
        pull_fails_gracefully(&b, a_p2p, &gone, "miss").await;

        // Checksum: block 5 of A's copy rots at rest; the five before it still land.
        let rot = tokens(12, 320);
        complete(a.addr, &rot, 1, None).await;
        let h = a.engine.block_hashes(&rot);
        assert!(
            a.engine
                .cpu_tier()
                .corrupt_for_test(h[5], Bytes::from(vec![7u8; 16 * 32]))
        );
        let got = pull_fails_gracefully(&b, a_p2p, &rot, "checksum").await;
        assert_eq!(cached_tokens(&got), 5 * 16);

        // Peer not allowed: never contacted.
        let mut cfg = p2p_config();
        cfg.p2p.allowed_peers = vec!["10.255.0.1".into()];
        let c = start_engine(cfg, PROFILE, 1000.0, 32).await;
        let warm = tokens(13, 300);
        complete(a.addr, &warm, 1, None).await;
        let served = a.engine.metrics().p2p.fetches_served();
        let got = pull_fails_gracefully(&c, a_p2p, &warm, "not_allowed").await;
        assert_eq!(cached_tokens(&got), 0);
        assert_eq!(a.engine.metrics().p2p.fetches_served(), served);
        c.shutdown().await;

        // Fingerprint mismatch: same block size and hashes, another model (profile).
        let other = start_engine(p2p_config(), "glm-5.2-wide-ep", 1000.0, 32).await;
        complete(other.addr, &warm, 1, None).await;
        let port = other.p2p_addr.unwrap().port();
        let got = pull_fails_gracefully(&b, port, &warm, "fingerprint_mismatch").await;
        assert_eq!(cached_tokens(&got), 0);
        assert_eq!(
            other.engine.metrics().p2p.refused("fingerprint_mismatch"),
            1
        );
        other.shutdown().await;

        b.shutdown().await;
        a.shutdown().await;
    })
    .await
    .expect("test timed out");
}

/// A loopback TCP proxy to `target` that forwards consumer→producer bytes at once and
/// producer→consumer bytes at `rate` bytes/s after the first `free` bytes (a slow network or a
/// slow peer, seen from the consumer).
async fn throttling_proxy(target: SocketAddr, free: usize, rate: f64) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            // A small receive buffer on our side keeps the bytes in flight bounded, so a
            // producer killed mid-stream has really not sent the rest.
            let Ok(socket) = tokio::net::TcpSocket::new_v4() else {
                continue;
            };
            let _ = socket.set_recv_buffer_size(64 * 1024);
            let Ok(server) = socket.connect(target).await else {
                continue;
            };
            let (mut cr, mut cw) = client.into_split();
            let (mut sr, mut sw) = server.into_split();
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut cr, &mut sw).await;
            });
            tokio::spawn(async move {
                let mut sent = 0usize;
                let mut buf = vec![0u8; 16 * 1024];
                loop {
                    let n = match sr.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    if sent >= free {
                        tokio::time::sleep(Duration::from_secs_f64(n as f64 / rate)).await;
                    }
                    if cw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                    sent += n;
                }
                let _ = cw.shutdown().await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_peer_times_out_and_the_request_computes() {
    timeout(Duration::from_secs(60), async {
        let a = start_engine(p2p_config(), PROFILE, 1000.0, 1024).await;
        let mut cfg = p2p_config();
        cfg.p2p.timeout = Duration::from_millis(150);
        let b = start_engine(cfg, PROFILE, 1000.0, 1024).await;
        let prompt = tokens(20, 800);
        complete(a.addr, &prompt, 1, None).await;
        // Handshake and lookup pass; then ~1 block per second.
        let proxy = throttling_proxy(a.p2p_addr.unwrap(), 2048, 16.0 * 1024.0).await;
        let t0 = Instant::now();
        pull_fails_gracefully(&b, proxy.port(), &prompt, "timeout").await;
        assert!(t0.elapsed() < Duration::from_secs(10));
        b.shutdown().await;
        a.shutdown().await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producer_killed_mid_pull_leaves_a_correct_answer() {
    timeout(Duration::from_secs(90), async {
        // A runs on its own runtime so it can be killed: dropping the runtime drops every task
        // and closes its sockets mid-stream, as a crashed process would.
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (kill_tx, kill_rx) = std::sync::mpsc::channel::<()>();
        let a_thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap();
            let a = rt.block_on(start_engine(p2p_config(), PROFILE, 1000.0, 2048));
            tx.send((a.addr, a.p2p_addr.unwrap(), a.engine.clone()))
                .ok();
            kill_rx.recv().ok();
            rt.shutdown_background();
            std::mem::forget(a); // its compute thread dies with the process
        });
        let (a_http, a_p2p, a_engine) = rx.await.unwrap();
        let b = start_engine(p2p_config(), PROFILE, 1000.0, 2048).await;
        let prompt = tokens(30, 8192 + 17); // 512 blocks of 32 KiB = 16 MiB
        complete(a_http, &prompt, 1, None).await;
        // ~4 MiB/s: the pull would take ~4 s.
        let proxy = throttling_proxy(a_p2p, 0, 4.0 * 1024.0 * 1024.0).await;
        let b_engine = b.engine.clone();
        let killer = tokio::spawn(async move {
            while b_engine.metrics().p2p.blocks(Direction::In) < 8 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            kill_tx.send(()).ok();
        });
        let got = pull_fails_gracefully(&b, proxy.port(), &prompt, "peer_closed").await;
        killer.await.unwrap();
        let cached = cached_tokens(&got);
        eprintln!("producer killed after {cached} of 8192 prefix tokens arrived");
        assert!(
            (8 * 16..4096).contains(&cached),
            "partial pull kept: {cached}"
        );
        assert_eq!(
            scrape_metric(b.addr, "vllm:external_prefix_cache_hits_total", "").await,
            cached as f64
        );
        drop(a_engine);
        a_thread.join().unwrap();
        b.shutdown().await;
    })
    .await
    .expect("test timed out");
}

/// A burst sibling: while A is still prefilling the prefix (chunked, blocks completing step by
/// step), B's lookup sees PENDING, waits, and receives the blocks as they complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_blocks_are_received_as_the_producer_computes_them() {
    timeout(Duration::from_secs(60), async {
        let mut cfg_a = p2p_config();
        cfg_a.max_num_batched_tokens = 512;
        // gpt-oss: 8K-token prefill ≈ 250 ms modelled; ×1/0.5 → ~0.5 s in 16 chunks.
        let a = start_engine(cfg_a, PROFILE, 0.5, 32).await;
        let a_p2p = a.p2p_addr.unwrap().port();
        let b = start_engine(p2p_config(), PROFILE, 1000.0, 32).await;
        let prefix = tokens(40, 8192);
        let a_engine = a.engine.clone();
        let last = *a_engine.block_hashes(&prefix).last().unwrap();
        let warming = tokio::spawn(async move {
            complete(a.addr, &prefix, 1, None).await;
            a
        });
        // Wait until A has scheduled the prefill: its blocks are announced PENDING.
        let t0 = Instant::now();
        while !a_engine.cpu_tier().is_pending(last) {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "A never marked the prefix pending"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let mut prompt = tokens(40, 8192);
        prompt.extend(tokens(41, 50));
        assert!(
            !warming.is_finished(),
            "A must still be prefilling when B asks"
        );
        let got = complete(b.addr, &prompt, 2, Some(source(a_p2p))).await;
        let a = warming.await.unwrap();
        assert_eq!(cached_tokens(&got), 8192, "{got}");
        let p2p = &b.engine.metrics().p2p;
        assert_eq!(p2p.blocks(Direction::In), 512);
        assert_eq!(p2p.pulls_by_reason("pending_deadline"), 0);
        b.shutdown().await;
        a.shutdown().await;
    })
    .await
    .expect("test timed out");
}

/// Sim TTFT: pulling a 16K-token prefix costs the modelled pull (86 ms) plus the suffix, well
/// below recomputing it (≈ 510 ms).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sim_ttft_with_a_pull_is_the_modelled_pull_plus_the_suffix() {
    timeout(Duration::from_secs(60), async {
        let a = start_engine(p2p_config(), PROFILE, 1.0, 32).await;
        let b = start_engine(p2p_config(), PROFILE, 1.0, 32).await;
        let c = start_engine(p2p_config(), PROFILE, 1.0, 32).await;
        let prefix = tokens(50, 16384);
        complete(a.addr, &prefix, 1, None).await;
        let mut prompt = prefix.clone();
        prompt.extend(tokens(51, 64));
        let t0 = Instant::now();
        let got = complete(b.addr, &prompt, 1, Some(source(a.p2p_addr.unwrap().port()))).await;
        let pulled = t0.elapsed();
        assert_eq!(cached_tokens(&got), 16384);
        let t0 = Instant::now();
        let recomputed = complete(c.addr, &prompt, 1, None).await;
        let recompute = t0.elapsed();
        assert_same_answer(&got, &recomputed);
        let modelled = b.engine.modelled_pull_time(16384).unwrap();
        eprintln!("ttft pulled {pulled:?} (modelled pull {modelled:?}) vs recompute {recompute:?}");
        assert!(pulled >= modelled, "held for the modelled pull time");
        assert!(
            pulled.as_secs_f64() < 0.6 * recompute.as_secs_f64(),
            "pulled {pulled:?} vs recompute {recompute:?}"
        );
        for s in [a, b, c] {
            s.shutdown().await;
        }
    })
    .await
    .expect("test timed out");
}

/// A bad allow-list entry or a taken P2P port fails the start with a clear error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_p2p_settings_fail_the_start() {
    timeout(Duration::from_secs(30), async {
        let mut cfg = p2p_config();
        cfg.p2p.allowed_peers = vec!["not a host!".into()];
        let err = try_start_engine(cfg, PROFILE, 1000.0, 32)
            .await
            .err()
            .expect("bad allow-list refused");
        assert!(err.to_string().contains("--p2p-allowed-peers"), "{err}");

        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut cfg = p2p_config();
        cfg.p2p.port = Some(taken.local_addr().unwrap().port());
        let err = try_start_engine(cfg, PROFILE, 1000.0, 32)
            .await
            .err()
            .expect("taken port refused");
        assert!(err.to_string().contains("(p2p)"), "{err}");
    })
    .await
    .expect("test timed out");
}

/// On the sim backend a pull costs its modelled transfer time, however fast loopback is, and the
/// pull-duration histogram says so: a router learning pull rates from it must see the modelled
/// link, not loopback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sim_pull_durations_report_the_modelled_link() {
    timeout(Duration::from_secs(60), async {
        let a = start_engine(p2p_config(), PROFILE, 1000.0, 32).await;
        let a_p2p = a.p2p_addr.unwrap().port();
        // Real time on the consumer: the modelled pull of 640 tokens is tens of ms.
        let b = start_engine(p2p_config(), PROFILE, 1.0, 32).await;
        let prefix = tokens(31, 640);
        complete(a.addr, &prefix, 1, None).await;
        let mut prompt = prefix.clone();
        prompt.extend(tokens(32, 100));
        let got = complete(b.addr, &prompt, 1, Some(source(a_p2p))).await;
        assert_eq!(cached_tokens(&got), 640, "{got}");
        let modelled = b.engine.modelled_pull_time(640).unwrap().as_secs_f64();
        let reported = scrape_metric(b.addr, "kvmesh_p2p_pull_duration_seconds_sum", "").await;
        assert!(
            reported >= modelled * 0.99,
            "reported {reported} s < modelled {modelled} s"
        );
        b.shutdown().await;
        a.shutdown().await;
    })
    .await
    .expect("test timed out");
}
