//! End-to-end P2P pulls over real loopback TCP: every outcome a consumer can see, pin accounting
//! on the producer, authentication, allow-listing, and misbehaving peers (scripted fake producers
//! speaking the real codec).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{
    BLOCK_BYTES, VerifySink, allow_only, bounded, client_for, eventually, fp, handshake_raw,
    hashes, lookup_raw, memory_source, payload_for, pull, send_lookup, start_producer,
    start_with_source,
};
use futures::future::BoxFuture;
use kvmesh_core::{BlockHash, Fingerprint};
use kvmesh_transfer::connection::Connection;
use kvmesh_transfer::message::{
    BlockFrame, BlockStatus, Done, FetchEnd, Hello, HelloOk, LookupReply, Message, PROTOCOL_VERSION,
};
use kvmesh_transfer::{
    BlockSink, BlockSource, ClientConfig, MemorySource, ProducerServer, PullClient, PullOutcome,
    PullReason, Secret, ServerConfig, SinkError,
};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

#[tokio::test]
async fn complete_pull_delivers_verified_blocks_and_reuses_the_connection() {
    let hs = hashes(24);
    let p = start_producer(&hs, ServerConfig::default()).await;
    let client = client_for(p.addr, |_| {});
    let (report, sink) = pull(&client, p.addr, &hs).await;
    assert_eq!(report.outcome, PullOutcome::Complete);
    assert_eq!((report.blocks, report.bytes), (24, 24 * BLOCK_BYTES as u64));
    assert_eq!(sink.got, hs);
    assert_eq!(client.metrics().pulls("complete", "none"), 1);
    assert_eq!(client.metrics().blocks(kvmesh_transfer::Direction::In), 24);
    eventually("producer to count sent blocks", || {
        p.metrics.blocks(kvmesh_transfer::Direction::Out) == 24
    })
    .await;
    eventually("pins released after Done", || p.source.pinned_blocks() == 0).await;

    // Second pull (a shorter prefix) rides the pooled connection.
    let (report, _) = pull(&client, p.addr, &hs[..10]).await;
    assert_eq!(report.outcome, PullOutcome::Complete);
    assert_eq!(
        (
            client.metrics().connections_opened(),
            client.metrics().connections_reused()
        ),
        (1, 1)
    );
    assert_eq!(client.idle_connections(p.addr), 1);
}

#[tokio::test]
async fn miss_in_the_middle_gives_the_leading_run_and_a_miss_at_start_fails() {
    let hs = hashes(10);
    let mut held = hs.clone();
    held.remove(6);
    let p = start_producer(&held, ServerConfig::default()).await;
    let client = client_for(p.addr, |_| {});
    let (report, _) = pull(&client, p.addr, &hs).await;
    assert_eq!(
        report.outcome,
        PullOutcome::Partial {
            reason: PullReason::Miss
        }
    );
    assert_eq!(report.blocks, 6);

    let (report, _) = pull(
        &client,
        p.addr,
        &hashes(3)
            .iter()
            .map(|h| BlockHash(h.0 + 999))
            .collect::<Vec<_>>(),
    )
    .await;
    assert_eq!(
        report.outcome,
        PullOutcome::Failed {
            reason: PullReason::Miss
        }
    );
    assert_eq!(report.blocks, 0);
    assert_eq!(client.metrics().pulls("partial", "miss"), 1);
    assert_eq!(client.metrics().pulls("failed", "miss"), 1);
    eventually("pins released", || p.source.pinned_blocks() == 0).await;
}

#[tokio::test]
async fn evicted_between_lookup_and_fetch_cannot_happen_while_pinned() {
    let hs = hashes(4);
    let p = start_producer(&hs, ServerConfig::default()).await;
    // Raw consumer: Lookup pins the leading run; eviction must be refused until Done.
    let mut conn = handshake_raw(p.addr).await;
    let r = lookup_raw(&mut conn, &hs).await;
    assert_eq!(r.statuses, vec![BlockStatus::Hit; 4]);
    assert_eq!(p.source.pinned_blocks(), 4);
    assert!(!p.source.evict(hs[0]), "pinned block survives eviction");
    conn.write_message(&Message::Fetch(kvmesh_transfer::message::Fetch {
        hashes: hs.clone(),
        pending_wait_ms: 0,
        background: false,
        segments: Vec::new(),
    }))
    .await
    .unwrap();
    let mut n = 0;
    loop {
        match conn.read_message().await.unwrap() {
            Some(Message::Block(b)) => {
                assert!(b.checksum_ok());
                n += 1;
            }
            Some(Message::Done(d)) => {
                assert_eq!((d.blocks, d.end), (4, FetchEnd::Complete));
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(n, 4);
    eventually("pins released after Done", || p.source.pinned_blocks() == 0).await;
    assert!(p.source.evict(hs[0]));
}

#[tokio::test]
async fn lease_expiry_releases_pins_of_a_consumer_that_never_fetches() {
    let hs = hashes(5);
    let cfg = ServerConfig {
        pin_lease: Duration::from_millis(200),
        ..ServerConfig::default()
    };
    let p = start_producer(&hs, cfg).await;
    let mut conn = handshake_raw(p.addr).await;
    let r = lookup_raw(&mut conn, &hs).await;
    assert_eq!(r.lease_ms, 200);
    assert_eq!(p.source.pinned_blocks(), 5);
    // Connection stays open and idle: only the lease can free the blocks.
    eventually("lease expiry", || p.source.pinned_blocks() == 0).await;
    assert!(p.source.evict(hs[0]));
    drop(conn);
}

#[tokio::test]
async fn pins_are_released_when_the_consumer_disconnects_after_lookup() {
    let hs = hashes(3);
    let p = start_producer(&hs, ServerConfig::default()).await; // 10 s lease
    let mut conn = handshake_raw(p.addr).await;
    send_lookup(&mut conn, &hs).await;
    let _ = conn.read_message().await.unwrap();
    assert_eq!(p.source.pinned_blocks(), 3);
    drop(conn);
    eventually("unpin on disconnect", || p.source.pinned_blocks() == 0).await;
}

#[tokio::test]
async fn pending_blocks_that_complete_before_the_deadline_are_streamed() {
    let hs = hashes(6);
    let p = start_producer(&hs[..3], ServerConfig::default()).await;
    for h in &hs[3..] {
        p.source.mark_pending(*h);
    }
    let src = p.source.clone();
    let later = hs[3..].to_vec();
    tokio::spawn(async move {
        for h in later {
            tokio::time::sleep(Duration::from_millis(60)).await;
            src.insert(h, payload_for(h));
        }
    });
    let client = client_for(p.addr, |c| c.pending_deadline = Duration::from_secs(3));
    let (report, _) = pull(&client, p.addr, &hs).await;
    assert_eq!(report.outcome, PullOutcome::Complete);
    assert_eq!(report.blocks, 6);
    eventually("pins released", || p.source.pinned_blocks() == 0).await;
}

#[tokio::test]
async fn pending_blocks_past_the_deadline_end_the_pull_with_what_arrived() {
    let hs = hashes(6);
    let p = start_producer(&hs[..3], ServerConfig::default()).await;
    for h in &hs[3..] {
        p.source.mark_pending(*h);
    }
    let client = client_for(p.addr, |c| c.pending_deadline = Duration::from_millis(150));
    let started = Instant::now();
    let (report, _) = pull(&client, p.addr, &hs).await;
    assert_eq!(
        report.outcome,
        PullOutcome::Partial {
            reason: PullReason::PendingDeadline
        }
    );
    assert_eq!(report.blocks, 3);
    assert!(
        started.elapsed() >= Duration::from_millis(150),
        "waited for the deadline"
    );
    assert_eq!(client.metrics().pulls("partial", "pending_deadline"), 1);
    eventually("pins released", || p.source.pinned_blocks() == 0).await;
    // The connection ended cleanly with Done, so it is pooled for the next pull.
    assert_eq!(client.idle_connections(p.addr), 1);
}

/// Serves payloads that do not match their hash (a producer with a corrupted cache).
struct CorruptingSource {
    inner: MemorySource,
    corrupt_from: usize,
    served: parking_lot::Mutex<usize>,
}

impl BlockSource for CorruptingSource {
    fn fingerprint(&self) -> Fingerprint {
        self.inner.fingerprint()
    }
    fn lookup_and_pin(&self, hashes: &[BlockHash], lease: Duration) -> Vec<BlockStatus> {
        self.inner.lookup_and_pin(hashes, lease)
    }
    fn read(&self, hash: BlockHash) -> Option<Bytes> {
        let mut n = self.served.lock();
        *n += 1;
        let p = self.inner.read(hash)?;
        if *n > self.corrupt_from {
            let mut v = p.to_vec();
            v[17] ^= 0xff;
            return Some(Bytes::from(v));
        }
        Some(p)
    }
    fn unpin(&self, hashes: &[BlockHash]) {
        self.inner.unpin(hashes);
    }
    fn wait_ready(&self, hash: BlockHash, deadline: Instant) -> BoxFuture<'static, bool> {
        self.inner.wait_ready(hash, deadline)
    }
}

#[tokio::test]
async fn a_sink_that_rejects_content_stops_the_pull() {
    let hs = hashes(8);
    let mem = memory_source(&hs);
    let served = Arc::new(CorruptingSource {
        inner: mem.clone(),
        corrupt_from: 5,
        served: Default::default(),
    });
    let p = start_with_source(mem, served, ServerConfig::default()).await;
    let client = client_for(p.addr, |_| {});
    let (report, _) = pull(&client, p.addr, &hs).await;
    assert_eq!(
        report.outcome,
        PullOutcome::Partial {
            reason: PullReason::SinkRejected
        }
    );
    assert_eq!(report.blocks, 5);
    eventually("pins released after error", || {
        p.source.pinned_blocks() == 0
    })
    .await;
}

// ---- scripted fake producers (misbehaving peers) ----

#[derive(Clone, Copy)]
enum Script {
    /// Send `n` good blocks, then one whose checksum is wrong.
    BadChecksumAfter(u32),
    /// Send `n` good blocks, then drop the socket (producer killed).
    CloseAfter(u32),
    /// Send `n` good blocks, then go silent.
    StallAfter(u32),
    /// Send a good block every 100 ms, each well within the step timeout.
    Trickle,
    /// Accept, never answer Hello.
    StallHandshake,
    /// Answer Hello, then send a frame that is out of place.
    Garbage,
}

/// A fake producer's side of a lookup: every block is a hit; then the consumer's `Fetch` (None
/// if the consumer sends something else or goes away).
async fn hits_then_fetch(conn: &mut Connection) -> Option<kvmesh_transfer::message::Fetch> {
    let Ok(Some(Message::Lookup(l))) = conn.read_message().await else {
        return None;
    };
    let statuses = vec![BlockStatus::Hit; l.hashes.len()];
    conn.write_message(&Message::LookupReply(LookupReply {
        statuses,
        lease_ms: 1000,
    }))
    .await
    .unwrap();
    match conn.read_message().await {
        Ok(Some(Message::Fetch(f))) => Some(f),
        _ => None,
    }
}

async fn fake_producer(script: Script) -> (SocketAddr, JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let handle = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let mut conn = Connection::new(stream, 1 << 20);
        let Ok(Some(Message::Hello(_))) = conn.read_message().await else {
            return;
        };
        if let Script::StallHandshake = script {
            tokio::time::sleep(Duration::from_secs(30)).await;
            return;
        }
        conn.write_message(&Message::HelloOk(HelloOk {
            version: PROTOCOL_VERSION,
            proof: None,
            promote: false,
            max_transfers: 0,
        }))
        .await
        .unwrap();
        if let Script::Garbage = script {
            // A well-formed frame that makes no sense here: Done before any request.
            let done = Done {
                blocks: 99,
                bytes: 1,
                end: FetchEnd::Complete,
            };
            let _ = conn.write_message(&Message::Done(done)).await;
            tokio::time::sleep(Duration::from_secs(5)).await;
            return;
        }
        let Some(f) = hits_then_fetch(&mut conn).await else {
            return;
        };
        if let Script::Trickle = script {
            for (i, h) in f.hashes.iter().enumerate() {
                let b = BlockFrame::new(i as u32, *h, payload_for(*h));
                if conn.write_message(&Message::Block(b)).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            return;
        }
        let n = match script {
            Script::BadChecksumAfter(n) | Script::CloseAfter(n) | Script::StallAfter(n) => n,
            _ => unreachable!(),
        };
        for (i, h) in f.hashes.iter().take(n as usize).enumerate() {
            conn.write_message(&Message::Block(BlockFrame::new(
                i as u32,
                *h,
                payload_for(*h),
            )))
            .await
            .unwrap();
        }
        match script {
            Script::BadChecksumAfter(n) => {
                let h = f.hashes[n as usize];
                let mut b = BlockFrame::new(n, h, payload_for(h));
                b.crc ^= 0xdead_beef;
                conn.write_message(&Message::Block(b)).await.unwrap();
                let _ = conn
                    .write_message(&Message::Done(Done {
                        blocks: n + 1,
                        bytes: 0,
                        end: FetchEnd::Complete,
                    }))
                    .await;
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
            Script::CloseAfter(_) => drop(conn),
            Script::StallAfter(_) => tokio::time::sleep(Duration::from_secs(30)).await,
            _ => {}
        }
    });
    (addr, handle)
}

#[tokio::test]
async fn bad_checksum_stops_the_pull_with_the_blocks_before_it() {
    let (addr, h) = fake_producer(Script::BadChecksumAfter(3)).await;
    let client = client_for(addr, |_| {});
    let (report, _) = pull(&client, addr, &hashes(8)).await;
    assert_eq!(
        report.outcome,
        PullOutcome::Partial {
            reason: PullReason::Checksum
        }
    );
    assert_eq!(report.blocks, 3);
    assert_eq!(client.metrics().pulls("partial", "checksum"), 1);
    assert_eq!(
        client.idle_connections(addr),
        0,
        "a connection that delivered garbage is not pooled"
    );
    h.abort();
}

#[tokio::test]
async fn producer_killed_mid_stream_gives_partial_with_blocks_received() {
    let (addr, h) = fake_producer(Script::CloseAfter(5)).await;
    let client = client_for(addr, |_| {});
    let (report, _) = pull(&client, addr, &hashes(12)).await;
    assert_eq!(
        report.outcome,
        PullOutcome::Partial {
            reason: PullReason::PeerClosed
        }
    );
    assert_eq!(report.blocks, 5);
    assert_eq!(report.bytes, 5 * BLOCK_BYTES as u64);
    h.await.unwrap();
}

#[tokio::test]
async fn real_producer_shut_down_mid_stream_gives_partial() {
    // A source whose 4th block never becomes ready, so we can kill the server mid-stream.
    struct SlowSource(MemorySource, Vec<BlockHash>);
    impl BlockSource for SlowSource {
        fn fingerprint(&self) -> Fingerprint {
            self.0.fingerprint()
        }
        fn lookup_and_pin(&self, hashes: &[BlockHash], lease: Duration) -> Vec<BlockStatus> {
            // The "slow" blocks are reported pending (forever), so the server waits for them.
            let mut s = self.0.lookup_and_pin(hashes, lease);
            for (st, h) in s.iter_mut().zip(hashes) {
                if self.1.contains(h) {
                    *st = BlockStatus::Pending;
                }
            }
            s
        }
        fn read(&self, hash: BlockHash) -> Option<Bytes> {
            self.0.read(hash)
        }
        fn unpin(&self, hashes: &[BlockHash]) {
            self.0.unpin(hashes)
        }
        fn wait_ready(&self, _: BlockHash, _: Instant) -> BoxFuture<'static, bool> {
            Box::pin(futures::future::pending())
        }
    }
    let hs = hashes(8);
    let mem = memory_source(&hs);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let (kill_tx, kill_rx) = tokio::sync::oneshot::channel::<()>();
    let served: Arc<dyn BlockSource> = Arc::new(SlowSource(mem, hs[3..].to_vec()));
    // The producer lives in its own runtime; shutting that runtime down kills every task
    // abruptly, like a crashed process. It is killed once the consumer holds 3 blocks.
    let producer = std::thread::spawn(move || {
        runtime.block_on(async move {
            let (addr, _h) = ProducerServer::bind(
                "127.0.0.1:0",
                served,
                ServerConfig::default(),
                CancellationToken::new(),
            )
            .await
            .unwrap();
            tx.send(addr).unwrap();
            let _ = kill_rx.await;
        });
        runtime.shutdown_timeout(Duration::from_millis(10));
    });
    struct KillAfter3 {
        inner: VerifySink,
        kill: Option<tokio::sync::oneshot::Sender<()>>,
    }
    impl BlockSink for KillAfter3 {
        fn accept(
            &mut self,
            index: usize,
            hash: BlockHash,
            payload: Bytes,
        ) -> Result<(), SinkError> {
            self.inner.accept(index, hash, payload)?;
            if index == 2
                && let Some(k) = self.kill.take()
            {
                let _ = k.send(());
            }
            Ok(())
        }
    }
    let addr = rx.await.unwrap();
    let client = client_for(addr, |c| c.pending_deadline = Duration::from_secs(10));
    let mut sink = KillAfter3 {
        inner: VerifySink::default(),
        kill: Some(kill_tx),
    };
    let report = bounded(client.pull(addr, "r", &hs, &mut sink)).await;
    assert_eq!(
        report.outcome,
        PullOutcome::Partial {
            reason: PullReason::PeerClosed
        }
    );
    assert_eq!(report.blocks, 3);
    assert_eq!(sink.inner.got, hs[..3]);
    producer.join().unwrap();
}

#[tokio::test]
async fn slow_producer_times_out_with_partial_progress() {
    let (addr, h) = fake_producer(Script::StallAfter(2)).await;
    let client = client_for(addr, |c| {
        c.timeout = Duration::from_millis(200);
        c.pending_deadline = Duration::ZERO;
    });
    let started = Instant::now();
    let (report, _) = pull(&client, addr, &hashes(6)).await;
    assert_eq!(
        report.outcome,
        PullOutcome::Partial {
            reason: PullReason::Timeout
        }
    );
    assert_eq!(report.blocks, 2);
    assert!(started.elapsed() < Duration::from_secs(2));
    h.abort();

    let (addr, h) = fake_producer(Script::StallHandshake).await;
    let client = client_for(addr, |c| c.timeout = Duration::from_millis(200));
    let (report, _) = pull(&client, addr, &hashes(6)).await;
    assert_eq!(
        report.outcome,
        PullOutcome::Failed {
            reason: PullReason::Timeout
        }
    );
    assert_eq!(client.metrics().pulls("failed", "timeout"), 1);
    h.abort();
}

#[tokio::test]
async fn unexpected_frames_from_a_producer_are_a_counted_protocol_error() {
    let (addr, h) = fake_producer(Script::Garbage).await;
    let client = client_for(addr, |_| {});
    let (report, _) = pull(&client, addr, &hashes(4)).await;
    assert_eq!(
        report.outcome,
        PullOutcome::Failed {
            reason: PullReason::Protocol
        }
    );
    assert_eq!(
        client
            .metrics()
            .protocol_errors(kvmesh_transfer::Direction::In),
        1
    );
    h.abort();
}

#[tokio::test]
async fn garbled_bytes_from_a_consumer_close_only_that_connection() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let hs = hashes(4);
    let p = start_producer(
        &hs,
        ServerConfig {
            max_frame: 1 << 20,
            ..ServerConfig::default()
        },
    )
    .await;
    for garbage in [
        &[0u8, 0, 0, 2, 0xEE, 0][..],
        &[0xff, 0xff, 0xff, 0xff, 1][..],
        &[0, 0, 0, 3, 1, 0xc1, 0xc1][..],
    ] {
        let mut s = TcpStream::connect(p.addr).await.unwrap();
        s.write_all(garbage).await.unwrap();
        let mut rest = Vec::new();
        // The server answers with an Error frame (or nothing) and closes.
        bounded(s.read_to_end(&mut rest)).await.unwrap();
    }
    eventually("three counted protocol errors", || {
        p.metrics.protocol_errors(kvmesh_transfer::Direction::Out) == 3
    })
    .await;
    // The server still serves well-behaved consumers.
    let client = client_for(p.addr, |_| {});
    let (report, _) = pull(&client, p.addr, &hs).await;
    assert_eq!(report.outcome, PullOutcome::Complete);
}

#[tokio::test]
async fn fingerprint_mismatch_is_refused_naming_the_field() {
    let hs = hashes(2);
    let p = start_producer(&hs, ServerConfig::default()).await;
    let theirs = Fingerprint {
        block_size: 32,
        head_dim: 1,
        ..fp()
    };
    let client = PullClient::new(
        theirs,
        ClientConfig {
            allowed_peers: allow_only(p.addr),
            ..ClientConfig::default()
        },
    );
    let mut sink = VerifySink::default();
    let report = bounded(client.pull(p.addr, "r", &hs, &mut sink)).await;
    assert_eq!(
        report.outcome,
        PullOutcome::Failed {
            reason: PullReason::FingerprintMismatch {
                field: "block_size".into()
            }
        }
    );
    assert_eq!(client.metrics().pulls("failed", "fingerprint_mismatch"), 1);
    eventually("producer counts the refusal", || {
        p.metrics.refused("fingerprint_mismatch") == 1
    })
    .await;
}

#[tokio::test]
async fn a_peer_outside_the_allow_list_is_never_contacted() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let client = PullClient::new(
        fp(),
        ClientConfig {
            allowed_peers: "10.1.2.3:7777,engine-a".parse().unwrap(),
            ..ClientConfig::default()
        },
    );
    let mut sink = VerifySink::default();
    let report = bounded(client.pull(addr, "r", &hashes(3), &mut sink)).await;
    assert_eq!(
        report.outcome,
        PullOutcome::Failed {
            reason: PullReason::NotAllowed
        }
    );
    // A host name that is not listed is refused without resolving it.
    let report = bounded(client.pull(
        ("evil-host.invalid", addr.port()),
        "r",
        &hashes(3),
        &mut sink,
    ))
    .await;
    assert_eq!(
        report.outcome,
        PullOutcome::Failed {
            reason: PullReason::NotAllowed
        }
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(200), listener.accept())
            .await
            .is_err(),
        "no connection may reach a non-allowed peer"
    );
    assert_eq!(client.metrics().pulls("failed", "not_allowed"), 2);
    assert_eq!(client.metrics().connections_opened(), 0);
}

#[tokio::test]
async fn producer_ip_allow_list_refuses_other_consumers() {
    let hs = hashes(2);
    let cfg = ServerConfig {
        allowed_ips: Some(vec!["10.9.9.9".parse().unwrap()]),
        ..ServerConfig::default()
    };
    let p = start_producer(&hs, cfg).await;
    let client = client_for(p.addr, |_| {});
    let (report, _) = pull(&client, p.addr, &hs).await;
    assert_eq!(
        report.outcome,
        PullOutcome::Failed {
            reason: PullReason::NotAllowed
        }
    );
    eventually("refusal counted", || p.metrics.refused("not_allowed") == 1).await;
}

#[tokio::test]
async fn shared_secret_authenticates_both_ways() {
    let hs = hashes(3);
    let p = start_producer(
        &hs,
        ServerConfig {
            secret: Some(Secret::from("hunter2")),
            ..ServerConfig::default()
        },
    )
    .await;

    let good = client_for(p.addr, |c| c.secret = Some(Secret::from("hunter2")));
    assert_eq!(
        pull(&good, p.addr, &hs).await.0.outcome,
        PullOutcome::Complete
    );

    let wrong = client_for(p.addr, |c| c.secret = Some(Secret::from("hunter3")));
    assert_eq!(
        pull(&wrong, p.addr, &hs).await.0.outcome,
        PullOutcome::Failed {
            reason: PullReason::AuthFailed
        }
    );
    eventually("producer counts the failed proof", || {
        p.metrics.refused("auth_failed") == 1
    })
    .await;

    let none = client_for(p.addr, |_| {});
    assert_eq!(
        pull(&none, p.addr, &hs).await.0.outcome,
        PullOutcome::Failed {
            reason: PullReason::AuthFailed
        }
    );

    // A consumer with a secret refuses a producer that cannot prove it.
    let open = start_producer(&hs, ServerConfig::default()).await;
    let strict = client_for(open.addr, |c| c.secret = Some(Secret::from("hunter2")));
    assert_eq!(
        pull(&strict, open.addr, &hs).await.0.outcome,
        PullOutcome::Failed {
            reason: PullReason::AuthFailed
        }
    );
}

#[tokio::test]
async fn connect_failure_is_typed() {
    // Bind then drop to get a port nobody listens on.
    let addr = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let client = client_for(addr, |_| {});
    let (report, _) = pull(&client, addr, &hashes(2)).await;
    assert_eq!(
        report.outcome,
        PullOutcome::Failed {
            reason: PullReason::Connect
        }
    );
}

#[tokio::test]
async fn stale_pooled_connection_is_replaced_transparently() {
    let hs = hashes(4);
    let p = start_producer(
        &hs,
        ServerConfig {
            idle_timeout: Duration::from_millis(100),
            ..ServerConfig::default()
        },
    )
    .await;
    let client = client_for(p.addr, |_| {});
    assert_eq!(
        pull(&client, p.addr, &hs).await.0.outcome,
        PullOutcome::Complete
    );
    // The producer closes the idle pooled connection; the next pull must still succeed.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        pull(&client, p.addr, &hs).await.0.outcome,
        PullOutcome::Complete
    );
    assert_eq!(client.metrics().connections_opened(), 2);
}

#[tokio::test]
async fn shutdown_stops_accepting_and_the_server_task_completes() {
    let hs = hashes(4);
    let p = start_producer(&hs, ServerConfig::default()).await;
    let client = client_for(p.addr, |_| {});
    assert_eq!(
        pull(&client, p.addr, &hs).await.0.outcome,
        PullOutcome::Complete
    );
    p.cancel.cancel();
    bounded(p.handle).await.unwrap();
    // The pooled connection was closed by shutdown and new connections are refused.
    let (report, _) = pull(&client, p.addr, &hs).await;
    assert!(
        matches!(
            report.outcome,
            PullOutcome::Failed {
                reason: PullReason::Connect
            }
        ),
        "{report:?}"
    );
}

#[tokio::test]
async fn hello_with_another_protocol_version_is_refused() {
    let hs = hashes(1);
    let p = start_producer(&hs, ServerConfig::default()).await;
    let stream = TcpStream::connect(p.addr).await.unwrap();
    let mut conn = Connection::new(stream, 1 << 20);
    conn.write_message(&Message::Hello(Hello {
        version: 999,
        fingerprint: fp(),
        nonce: [0; 16],
    }))
    .await
    .unwrap();
    let reply = bounded(conn.read_message()).await.unwrap();
    assert!(matches!(reply, Some(Message::Refused(_))), "{reply:?}");
    eventually("refusal counted", || p.metrics.refused("version") == 1).await;
}

#[tokio::test]
async fn block_checksum_is_verified_however_the_bytes_are_chunked() {
    use tokio::io::AsyncWriteExt;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let good = BlockFrame::new(3, BlockHash(42), payload_for(BlockHash(42)));
    let mut bad = good.clone();
    bad.crc ^= 1;
    let mut wire = Message::Block(good.clone())
        .encode(1 << 20)
        .unwrap()
        .to_vec();
    wire.extend(Message::Block(bad).encode(1 << 20).unwrap().to_vec());
    let writer = tokio::spawn(async move {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.set_nodelay(true).unwrap();
        for (i, chunk) in wire.chunks(997).enumerate() {
            s.write_all(chunk).await.unwrap();
            if i % 3 == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    });
    let (stream, _) = listener.accept().await.unwrap();
    let mut conn = Connection::new(stream, 1 << 20);
    let first = bounded(conn.read_message()).await.unwrap();
    assert_eq!(first, Some(Message::Block(good)));
    let second = bounded(conn.read_message()).await;
    assert!(
        matches!(
            second,
            Err(kvmesh_transfer::connection::ConnectionError::Checksum { index: 3 })
        ),
        "{second:?}"
    );
    writer.await.unwrap();
}

#[tokio::test]
async fn concurrent_fetches_per_peer_are_capped() {
    // Block 0 of `slow` stays pending for the whole deadline, holding its fetch slot.
    let fast = hashes(2);
    let slow = vec![BlockHash(0xdead)];
    for (cap, expect_serialized) in [(1usize, true), (2, false)] {
        let cfg = ServerConfig {
            max_transfers_per_peer: cap,
            ..ServerConfig::default()
        };
        let p = start_producer(&fast, cfg).await;
        p.source.mark_pending(slow[0]);
        let client = Arc::new(client_for(p.addr, |c| {
            c.pending_deadline = Duration::from_millis(900)
        }));
        let (c1, addr, slow1) = (Arc::clone(&client), p.addr, slow.clone());
        let holder = tokio::spawn(async move {
            let mut sink = VerifySink::default();
            c1.pull(addr, "slow", &slow1, &mut sink).await
        });
        // Let the slow fetch take its slot first.
        eventually("slow fetch started", || p.metrics.fetches_served() == 1).await;
        let started = Instant::now();
        let (report, _) = pull(&client, p.addr, &fast).await;
        let waited = started.elapsed();
        assert_eq!(report.outcome, PullOutcome::Complete);
        let slow_report = bounded(holder).await.unwrap();
        assert_eq!(
            slow_report.outcome,
            PullOutcome::Failed {
                reason: PullReason::PendingDeadline
            }
        );
        if expect_serialized {
            assert!(
                waited >= Duration::from_millis(450),
                "cap 1: second fetch waited ({waited:?})"
            );
        } else {
            assert!(
                waited < Duration::from_millis(450),
                "cap 2: second fetch ran at once ({waited:?})"
            );
        }
    }
}

#[tokio::test]
async fn overall_deadline_stops_a_trickling_producer() {
    let (addr, h) = fake_producer(Script::Trickle).await;
    let client = client_for(addr, |c| {
        c.timeout = Duration::from_secs(1);
        c.max_pull_duration = Some(Duration::from_millis(350));
    });
    let started = Instant::now();
    let (report, _) = pull(&client, addr, &hashes(20)).await;
    assert_eq!(
        report.outcome,
        PullOutcome::Partial {
            reason: PullReason::Timeout
        }
    );
    assert!((1..=5).contains(&report.blocks), "{report:?}");
    assert!(started.elapsed() < Duration::from_secs(1));
    assert_eq!(client.idle_connections(addr), 0);
    h.abort();
}

#[tokio::test]
async fn with_a_secret_the_fingerprint_is_compared_only_after_authentication() {
    let hs = hashes(2);
    let cfg = ServerConfig {
        secret: Some(Secret::from("k")),
        ..ServerConfig::default()
    };
    let p = start_producer(&hs, cfg).await;
    let other_fp = Fingerprint {
        num_layers: 99,
        ..fp()
    };
    let mk = |secret: &str| {
        PullClient::new(
            other_fp.clone(),
            ClientConfig {
                allowed_peers: allow_only(p.addr),
                secret: Some(Secret::from(secret)),
                ..ClientConfig::default()
            },
        )
    };
    let mut sink = VerifySink::default();
    let report = bounded(mk("wrong").pull(p.addr, "r", &hs, &mut sink)).await;
    assert_eq!(
        report.outcome,
        PullOutcome::Failed {
            reason: PullReason::AuthFailed
        }
    );
    let report = bounded(mk("k").pull(p.addr, "r", &hs, &mut sink)).await;
    assert_eq!(
        report.outcome,
        PullOutcome::Failed {
            reason: PullReason::FingerprintMismatch {
                field: "num_layers".into()
            }
        }
    );
}

/// A lookup without a fetch (vLLM's scheduler deciding, its worker pulling): the leading run the
/// producer holds, no block moved, no pin left behind; failures are counted as failed pulls.
#[tokio::test]
async fn lookup_counts_the_leading_run_and_moves_nothing() {
    let hs = hashes(8);
    let p = start_producer(&hs[..5], ServerConfig::default()).await;
    let client = client_for(p.addr, |_| {});
    assert_eq!(bounded(client.lookup(p.addr, "r1", &hs)).await, Ok(5));
    assert_eq!(client.metrics().blocks(kvmesh_transfer::Direction::In), 0);
    assert_eq!(
        client.metrics().pulls("complete", "none"),
        0,
        "a lookup is not a pull"
    );
    eventually("pins released once the lookup's connection closes", || {
        p.source.pinned_blocks() == 0
    })
    .await;
    // Nothing held: a miss, counted as a failed pull.
    let other: Vec<BlockHash> = hs.iter().map(|h| BlockHash(h.0 + 999)).collect();
    assert_eq!(
        bounded(client.lookup(p.addr, "r2", &other)).await,
        Err(PullReason::Miss)
    );
    assert_eq!(client.metrics().pulls("failed", "miss"), 1);
    // The pull that follows a lookup fetches what it found.
    let (report, sink) = pull(&client, p.addr, &hs[..5]).await;
    assert_eq!(report.outcome, PullOutcome::Complete);
    assert_eq!(sink.got, hs[..5]);
}

/// A modelled link for the class tests: records what each end registers and promotes, and holds
/// a background transfer (it "stalls behind demand traffic") until it is promoted.
#[derive(Debug, Default)]
struct ClassPacer {
    log: Arc<parking_lot::Mutex<Vec<String>>>,
}

struct ClassTransfer {
    log: Arc<parking_lot::Mutex<Vec<String>>>,
    promoted: Arc<tokio::sync::Notify>,
    background: bool,
}

impl kvmesh_transfer::LinkPacer for ClassPacer {
    fn begin(
        &self,
        blocks: usize,
        class: kvmesh_transfer::TrafficClass,
    ) -> Box<dyn kvmesh_transfer::PacedTransfer> {
        self.log.lock().push(format!("begin {blocks} {class:?}"));
        Box::new(ClassTransfer {
            log: Arc::clone(&self.log),
            promoted: Arc::default(),
            background: class == kvmesh_transfer::TrafficClass::Background,
        })
    }

    fn modelled_bytes_per_block(&self) -> u64 {
        0
    }
}

impl kvmesh_transfer::PacedTransfer for ClassTransfer {
    fn reached(&mut self, _blocks: usize) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if self.background {
                self.promoted.notified().await;
            }
        })
    }

    fn truncate(&mut self, _blocks: usize) {}

    fn promote(&mut self) {
        self.log.lock().push("promote".into());
        self.background = false;
        self.promoted.notify_one();
    }
}

/// A prefetch's pull is background at both ends (the producer learns it from `Fetch`), and a
/// promotion mid-pull reaches both: the consumer's ingress transfer and, through `Promote` on the
/// same connection, the producer's egress transfer, which then releases its blocks. A demand pull
/// on the same pooled connection afterwards is demand at both ends (the late `Promote` is gone).
#[tokio::test]
async fn a_background_pull_is_background_at_both_ends_until_promoted() {
    let hs = hashes(24);
    let egress = Arc::new(ClassPacer::default());
    let served = egress.log.clone();
    let config = ServerConfig {
        egress: Some(egress),
        ..ServerConfig::default()
    };
    let p = start_producer(&hs, config).await;
    let ingress = Arc::new(ClassPacer::default());
    let received = ingress.log.clone();
    let client = Arc::new(client_for(p.addr, |c| c.ingress = Some(ingress)));
    let (promote, rx) = tokio::sync::watch::channel(false);
    let task = {
        let (client, hs, addr) = (Arc::clone(&client), hs.clone(), p.addr);
        tokio::spawn(async move {
            let mut sink = VerifySink::default();
            let class = kvmesh_transfer::PullClass::Background { promote: rx };
            let report = client
                .pull_with_class(addr, "prefetch-1", &hs, &mut sink, None, class)
                .await;
            (report, sink)
        })
    };
    eventually("the producer registers a background fetch", || {
        served.lock().as_slice() == ["begin 24 Background"]
    })
    .await;
    assert_eq!(received.lock().as_slice(), ["begin 24 Background"]);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !task.is_finished(),
        "a background fetch moved while stalled"
    );
    assert_eq!(p.metrics.blocks(kvmesh_transfer::Direction::Out), 0);

    // A request now waits for these blocks.
    promote.send_replace(true);
    let (report, sink) = bounded(task).await.unwrap();
    assert_eq!(report.outcome, PullOutcome::Complete);
    assert_eq!(sink.got, hs);
    assert_eq!(served.lock().as_slice(), ["begin 24 Background", "promote"]);
    assert_eq!(
        received.lock().as_slice(),
        ["begin 24 Background", "promote"]
    );

    // A demand pull on the pooled connection: demand at both ends, nothing to promote.
    let (report, _) = pull(&client, p.addr, &hs[..8]).await;
    assert_eq!(report.outcome, PullOutcome::Complete);
    assert_eq!(client.metrics().connections_reused(), 1);
    assert_eq!(
        served.lock().last().map(String::as_str),
        Some("begin 8 Demand")
    );
    assert_eq!(
        received.lock().last().map(String::as_str),
        Some("begin 8 Demand")
    );
    // A pull promoted before it started is demand from the start.
    let (_promote, rx) = tokio::sync::watch::channel(true);
    let mut sink = VerifySink::default();
    let class = kvmesh_transfer::PullClass::Background { promote: rx };
    let report =
        bounded(client.pull_with_class(p.addr, "r", &hs[..4], &mut sink, None, class)).await;
    assert_eq!(report.outcome, PullOutcome::Complete);
    assert_eq!(
        served.lock().last().map(String::as_str),
        Some("begin 4 Demand")
    );
}

/// A producer that does not announce `Promote` support (an older one) is never sent `Promote`,
/// which it would take for a protocol violation: the consumer promotes its own end only.
#[tokio::test]
async fn a_producer_without_promote_support_is_never_sent_promote() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let hs = hashes(4);
    let (frames_tx, mut frames_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
    let producer = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let mut conn = Connection::new(stream, 1 << 20);
        let Ok(Some(Message::Hello(_))) = conn.read_message().await else {
            return;
        };
        // An older producer's HelloOk: no `promote` key.
        conn.write_message(&Message::HelloOk(HelloOk {
            version: PROTOCOL_VERSION,
            proof: None,
            promote: false,
            max_transfers: 0,
        }))
        .await
        .unwrap();
        let Some(f) = hits_then_fetch(&mut conn).await else {
            return;
        };
        frames_tx
            .send(format!("fetch background={}", f.background))
            .unwrap();
        // Hold the stream until the consumer has been promoted, then serve it.
        let _ = go_rx.await;
        for (i, h) in f.hashes.iter().enumerate() {
            let b = BlockFrame::new(i as u32, *h, payload_for(*h));
            conn.write_message(&Message::Block(b)).await.unwrap();
        }
        let done = Done {
            blocks: f.hashes.len() as u32,
            bytes: (f.hashes.len() * BLOCK_BYTES) as u64,
            end: FetchEnd::Complete,
        };
        conn.write_message(&Message::Done(done)).await.unwrap();
        // Anything the consumer sends next on this connection (it goes back to its pool).
        if let Ok(Ok(Some(m))) =
            tokio::time::timeout(Duration::from_millis(200), conn.read_message()).await
        {
            frames_tx.send(format!("then {:?}", m.tag())).unwrap();
        }
    });
    let ingress = Arc::new(ClassPacer::default());
    let received = ingress.log.clone();
    let client = client_for(addr, |c| c.ingress = Some(ingress));
    let (promote, rx) = tokio::sync::watch::channel(false);
    let mut sink = VerifySink::default();
    let class = kvmesh_transfer::PullClass::Background { promote: rx };
    let pull = client.pull_with_class(addr, "prefetch-2", &hs, &mut sink, None, class);
    let drive = async {
        assert_eq!(
            frames_rx.recv().await.as_deref(),
            Some("fetch background=true")
        );
        promote.send_replace(true);
        eventually("the consumer promotes its own end", || {
            received.lock().iter().any(|e| e == "promote")
        })
        .await;
        go_tx.send(()).unwrap();
    };
    let (report, ()) = bounded(async { tokio::join!(pull, drive) }).await;
    assert_eq!(report.outcome, PullOutcome::Complete);
    bounded(producer).await.unwrap();
    assert_eq!(
        frames_rx.recv().await,
        None,
        "the producer was sent a frame after Done"
    );
}
