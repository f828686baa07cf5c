//! Hostile peers against a real producer and consumer on loopback: frames forged, altered,
//! replayed or sent unauthenticated after a secret handshake; a producer tampering with blocks
//! behind a valid CRC; per-IP connection caps; pin quotas; pins and hand-off holds released only
//! by the session that took them; an unprotected producer beyond loopback; a peer of another
//! protocol version. Every test is bounded in time (`bounded`, `eventually`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{
    bounded, client_for, eventually, fp, handshake_raw, hashes, lookup_raw, memory_source,
    payload_for, pull, start_producer, start_with_source,
};
use futures::future::BoxFuture;
use kvmesh_core::{BlockHash, Fingerprint};
use kvmesh_transfer::connection::Connection;
use kvmesh_transfer::mac::{
    self, DirectionKey, KEY_MATERIAL, Protection, RecordKey, Role, SessionKeys, TAG_LEN,
};
use kvmesh_transfer::message::{
    Auth, BlockFrame, BlockStatus, Fetch, Hello, HelloOk, Lookup, LookupReply, Message,
    PROTOCOL_VERSION, RefuseReason, Refused,
};
use kvmesh_transfer::record;
use kvmesh_transfer::{
    BindError, BlockSource, MemorySource, ProducerServer, PullOutcome, PullReason, Secret,
    ServerConfig,
};
use parking_lot::Mutex;
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

const SECRET: &str = "correct horse battery staple";

fn with_secret() -> ServerConfig {
    ServerConfig {
        secret: Some(Secret::from(SECRET)),
        ..ServerConfig::default()
    }
}

/// A consumer that completed the secret handshake by hand; returns its connection (protected)
/// and its keys, so the test can seal records itself.
async fn authenticated_raw(addr: SocketAddr) -> (Connection, SessionKeys) {
    handshake_with(addr, Protection::Authenticate, Protection::Authenticate).await
}

/// The handshake of a consumer that asks for `asked` in its `Auth` and derives its keys for
/// `derived` (a consumer that lies about its keys, or an honest one when they agree).
async fn handshake_with(
    addr: SocketAddr,
    asked: Protection,
    derived: Protection,
) -> (Connection, SessionKeys) {
    let secret = Secret::from(SECRET);
    let stream = TcpStream::connect(addr).await.unwrap();
    let mut conn = Connection::new(stream, 4096);
    let ours = [5u8; 16];
    let hello = Message::Hello(Hello {
        version: PROTOCOL_VERSION,
        fingerprint: fp(),
        nonce: ours,
    });
    let transcript = mac::transcript_hash(&hello.encode(4096).unwrap().head[5..]);
    conn.write_message(&hello).await.unwrap();
    let Some(Message::Challenge(c)) = bounded(conn.read_message()).await.unwrap() else {
        panic!("expected a challenge")
    };
    let proof = secret.consumer_proof(&c.nonce, &ours).to_vec();
    let encrypt = asked == Protection::Encrypt;
    conn.write_message(&Message::Auth(Auth { proof, encrypt }))
        .await
        .unwrap();
    let Some(Message::HelloOk(ok)) = bounded(conn.read_message()).await.unwrap() else {
        panic!("expected HelloOk")
    };
    assert_eq!(
        ok.proof.as_deref(),
        Some(&secret.producer_proof(&c.nonce, &ours)[..])
    );
    let keys = SessionKeys::derive(
        &secret,
        derived,
        Role::Consumer,
        &ours,
        &c.nonce,
        &transcript,
    );
    conn.set_max_frame(1 << 20);
    conn.protect(&keys);
    (conn, keys)
}

/// A record key that has already protected `seq` records.
fn key_at(key: &DirectionKey, seq: u64) -> RecordKey {
    let mut k = RecordKey::new(key);
    for _ in 0..seq {
        k.seal(&mut [0u8; 1], 0);
    }
    k
}

/// The bytes of control message `msg` sealed as record number `seq` under `key`.
fn sealed(msg: &Message, key: &DirectionKey, seq: u64) -> Vec<u8> {
    let wire = msg.encode_framed(1 << 20, TAG_LEN).unwrap().to_vec();
    record::seal_control(&mut key_at(key, seq), wire)
}

/// The bytes of a block frame whose head is record `seq` under `key`.
fn sealed_block(b: &BlockFrame, key: &DirectionKey, seq: u64) -> Vec<u8> {
    let len = record::block_frame_len(b.payload.len(), true);
    let head = b.head().encode(len, 1 << 20).unwrap();
    record::seal_block(&mut key_at(key, seq), head, &b.payload)
}

/// A key nobody derived: what a forger without the secret must guess.
fn guessed_key() -> DirectionKey {
    DirectionKey::from_material(Protection::Authenticate, [0x42; KEY_MATERIAL])
}

fn lookup(hs: &[BlockHash]) -> Message {
    Message::Lookup(Lookup {
        kv_request_id: "r".into(),
        hashes: hs.to_vec(),
    })
}

/// The producer closes the connection without answering (EOF or reset, never a reply).
async fn closes_without_reply(conn: &mut Connection) {
    match bounded(conn.read_message()).await {
        Ok(None) | Err(_) => {}
        Ok(Some(m)) => panic!("the producer answered a frame it must reject: {m:?}"),
    }
}

#[tokio::test]
async fn after_a_secret_handshake_every_frame_is_authenticated_both_ways() {
    let hs = hashes(3);
    let p = start_producer(&hs, with_secret()).await;
    let (mut conn, _) = authenticated_raw(p.addr).await;
    // A sealed lookup is answered, and the answer verifies under the producer's key.
    let r = lookup_raw(&mut conn, &hs).await;
    assert_eq!(r.statuses, vec![BlockStatus::Hit; 3]);
    // The real client pulls through the same MACed conversation.
    let client = client_for(p.addr, |c| c.secret = Some(Secret::from(SECRET)));
    let (report, sink) = pull(&client, p.addr, &hs).await;
    assert_eq!(report.outcome, PullOutcome::Complete);
    assert_eq!(sink.got, hs);
    assert_eq!(p.metrics.refused("mac_failed"), 0);
}

#[tokio::test]
async fn forged_flipped_replayed_and_unsealed_frames_after_auth_are_rejected_and_counted() {
    let hs = hashes(2);
    let p = start_producer(&hs, with_secret()).await;
    type Attack = fn(&SessionKeys, &[BlockHash]) -> Vec<u8>;
    let attacks: [(&str, Attack); 5] = [
        ("bit flip in the body", |k, hs| {
            let mut w = sealed(&lookup(hs), &k.send, 0);
            w[9] ^= 0x01;
            w
        }),
        ("bit flip in the MAC", |k, hs| {
            let mut w = sealed(&lookup(hs), &k.send, 0);
            let last = w.len() - 1;
            w[last] ^= 0x80;
            w
        }),
        ("forged under a guessed key", |_, hs| {
            sealed(&lookup(hs), &guessed_key(), 0)
        }),
        (
            "reflected: sealed under the producer's own direction key",
            |k, hs| sealed(&lookup(hs), &k.recv, 0),
        ),
        (
            "unsealed, as an unauthenticated peer would send it",
            |_, hs| lookup(hs).encode(1 << 20).unwrap().to_vec(),
        ),
    ];
    for (i, (what, attack)) in attacks.iter().enumerate() {
        let (mut conn, keys) = authenticated_raw(p.addr).await;
        conn.write_raw(&attack(&keys, &hs)).await.unwrap();
        closes_without_reply(&mut conn).await;
        eventually(what, || p.metrics.refused("mac_failed") == i as u64 + 1).await;
    }
    // Replay and reorder: frame 0 twice, or frame 1 before frame 0.
    let (mut conn, keys) = authenticated_raw(p.addr).await;
    conn.write_raw(&sealed(&lookup(&hs), &keys.send, 0))
        .await
        .unwrap();
    let Some(Message::LookupReply(_)) = bounded(conn.read_message()).await.unwrap() else {
        panic!("the genuine frame is answered")
    };
    conn.write_raw(&sealed(&lookup(&hs), &keys.send, 0))
        .await
        .unwrap();
    closes_without_reply(&mut conn).await;
    let (mut conn, keys) = authenticated_raw(p.addr).await;
    conn.write_raw(&sealed(&lookup(&hs), &keys.send, 1))
        .await
        .unwrap();
    closes_without_reply(&mut conn).await;
    eventually("replay and reorder counted", || {
        p.metrics.refused("mac_failed") == 7
    })
    .await;
    // Nothing a rejected frame asked for was pinned.
    eventually("no pins left", || p.source.pinned_blocks() == 0).await;
}

/// The producer's side of a genuine secret handshake and lookup on an accepted connection (every
/// block a hit): the protected connection, its keys and the consumer's `Fetch`.
async fn genuine_until_fetch(
    listener: TcpListener,
) -> Option<(Connection, SessionKeys, kvmesh_transfer::message::Fetch)> {
    let (stream, _) = listener.accept().await.ok()?;
    let secret = Secret::from(SECRET);
    let mut conn = Connection::new(stream, 4096);
    let Ok(Some((Message::Hello(h), body))) = conn.read_message_with_body().await else {
        return None;
    };
    let ours = [9u8; 16];
    conn.write_message(&Message::Challenge(kvmesh_transfer::message::Challenge {
        nonce: ours,
    }))
    .await
    .ok()?;
    let Ok(Some(Message::Auth(_))) = conn.read_message().await else {
        return None;
    };
    let proof = Some(secret.producer_proof(&ours, &h.nonce).to_vec());
    conn.write_message(&Message::HelloOk(HelloOk {
        version: PROTOCOL_VERSION,
        proof,
        promote: false,
        max_transfers: 0,
    }))
    .await
    .ok()?;
    let keys = SessionKeys::derive(
        &secret,
        Protection::Authenticate,
        Role::Producer,
        &h.nonce,
        &ours,
        &mac::transcript_hash(&body),
    );
    conn.set_max_frame(1 << 20);
    conn.protect(&keys);
    let Ok(Some(Message::Lookup(l))) = conn.read_message().await else {
        return None;
    };
    conn.write_message(&Message::LookupReply(LookupReply {
        statuses: vec![BlockStatus::Hit; l.hashes.len()],
        lease_ms: 1000,
    }))
    .await
    .ok()?;
    let Ok(Some(Message::Fetch(f))) = conn.read_message().await else {
        return None;
    };
    Some((conn, keys, f))
}

/// A producer that authenticates properly, then sends a block whose payload was replaced by an
/// on-path attacker: CRC32 recomputed to match, tags under a key the attacker had to guess.
async fn tampering_producer() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let Some((mut conn, _, f)) = genuine_until_fetch(listener).await else {
            return;
        };
        // Block 0 genuine (records 1 and 2 from us after HelloOk), block 1 poisoned.
        let b0 = BlockFrame::new(0, f.hashes[0], payload_for(f.hashes[0]));
        conn.write_message(&Message::Block(b0)).await.unwrap();
        let mut poison = payload_for(f.hashes[1]).to_vec();
        poison[100] ^= 0xff;
        let b1 = BlockFrame::new(1, f.hashes[1], Bytes::from(poison));
        conn.write_raw(&sealed_block(&b1, &guessed_key(), 3))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(2)).await;
    });
    addr
}

#[tokio::test]
async fn a_block_with_a_valid_crc_but_a_forged_mac_is_not_delivered() {
    let addr = tampering_producer().await;
    let client = client_for(addr, |c| c.secret = Some(Secret::from(SECRET)));
    let (report, sink) = pull(&client, addr, &hashes(3)).await;
    assert_eq!(
        report.outcome,
        PullOutcome::Partial {
            reason: PullReason::MacFailed
        }
    );
    assert_eq!(sink.got.len(), 1, "only the genuine block reached the sink");
    assert_eq!(client.metrics().pulls("partial", "mac_failed"), 1);
    assert_eq!(
        client
            .metrics()
            .protocol_errors(kvmesh_transfer::Direction::In),
        1
    );
    assert_eq!(
        client.idle_connections(addr),
        0,
        "a tampered connection is not reused"
    );
}

#[tokio::test]
async fn a_second_connection_over_the_per_ip_cap_is_refused() {
    let hs = hashes(2);
    let p = start_producer(
        &hs,
        ServerConfig {
            max_connections_per_ip: 1,
            ..ServerConfig::default()
        },
    )
    .await;
    let first = handshake_raw(p.addr).await;
    // A second connection from the same address is told why and closed.
    let stream = TcpStream::connect(p.addr).await.unwrap();
    let mut second = Connection::new(stream, 4096);
    let reply = bounded(second.read_message()).await.unwrap();
    assert_eq!(
        reply,
        Some(Message::Refused(Refused {
            reason: RefuseReason::TooManyConnections
        }))
    );
    let client = client_for(p.addr, |_| {});
    let (report, _) = pull(&client, p.addr, &hs).await;
    assert_eq!(
        report.outcome,
        PullOutcome::Failed {
            reason: PullReason::Busy
        }
    );
    assert_eq!(p.metrics.refused("connection_cap"), 2);
    // The slot comes back when the first connection closes.
    drop(first);
    let start = Instant::now();
    loop {
        let (report, _) = pull(&client, p.addr, &hs).await;
        if report.outcome == PullOutcome::Complete {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "{report:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Issue 37, finding 7: with every one of the producer's connections held, a new peer used to
/// wait unanswered (its connection sat in the listen backlog) until its own handshake timeout.
#[tokio::test]
async fn a_peer_past_the_global_connection_limit_is_refused_at_once() {
    let hs = hashes(2);
    let p = start_producer(
        &hs,
        ServerConfig {
            max_connections: 2,
            ..ServerConfig::default()
        },
    )
    .await;
    let held = [handshake_raw(p.addr).await, handshake_raw(p.addr).await];
    // A third peer is told why at once, before it says anything.
    let start = Instant::now();
    let stream = TcpStream::connect(p.addr).await.unwrap();
    let mut third = Connection::new(stream, 4096);
    let reply = tokio::time::timeout(Duration::from_secs(2), third.read_message())
        .await
        .expect("a peer past the connection limit was not refused within 2 s")
        .unwrap();
    let refused_after = start.elapsed();
    println!("refused after {refused_after:?}");
    assert_eq!(
        reply,
        Some(Message::Refused(Refused {
            reason: RefuseReason::TooManyConnections
        }))
    );
    assert!(
        refused_after < Duration::from_millis(500),
        "{refused_after:?}"
    );
    // A consumer's pull fails fast as `Busy` (it would try another source), not as a timeout.
    let client = client_for(p.addr, |_| {});
    let start = Instant::now();
    let (report, _) = pull(&client, p.addr, &hs).await;
    assert_eq!(
        report.outcome,
        PullOutcome::Failed {
            reason: PullReason::Busy
        }
    );
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(p.metrics.refused("max_connections"), 2);
    assert_eq!(
        p.metrics.refused("connection_cap"),
        0,
        "not the per-address cap"
    );
    // A slot comes back when a held connection closes.
    drop(held);
    let start = Instant::now();
    loop {
        let (report, _) = pull(&client, p.addr, &hs).await;
        if report.outcome == PullOutcome::Complete {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "{report:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_peer_over_its_pin_quota_gets_misses_not_pins() {
    let hs = hashes(10);
    let p = start_producer(
        &hs,
        ServerConfig {
            max_pins_per_lookup: 4,
            max_pinned_per_peer: 6,
            ..ServerConfig::default()
        },
    )
    .await;
    let mut a = handshake_raw(p.addr).await;
    let r = lookup_raw(&mut a, &hs).await;
    let hits = |r: &LookupReply| {
        r.statuses
            .iter()
            .filter(|s| **s == BlockStatus::Hit)
            .count()
    };
    assert_eq!(
        r.statuses.len(),
        10,
        "one status per hash, as the protocol says"
    );
    assert_eq!(hits(&r), 4, "per-lookup cap");
    assert_eq!(p.source.pinned_blocks(), 4);
    // Another connection from the same address shares the address's quota.
    let mut b = handshake_raw(p.addr).await;
    assert_eq!(
        hits(&lookup_raw(&mut b, &hs).await),
        2,
        "6 per peer, 4 held"
    );
    // A huge lookup pins nothing beyond the quota either.
    let many: Vec<BlockHash> = hs.iter().copied().cycle().take(65_536).collect();
    let mut c = handshake_raw(p.addr).await;
    let r = lookup_raw(&mut c, &many).await;
    assert_eq!((r.statuses.len(), hits(&r)), (65_536, 0));
    eventually("refusals counted", || p.metrics.refused("pin_quota") == 3).await;
    // A fetch cannot pin past the cap either: the stream ends with a miss at the cap.
    a.write_message(&Message::Fetch(Fetch {
        hashes: hs.clone(),
        pending_wait_ms: 0,
        background: false,
        segments: Vec::new(),
    }))
    .await
    .unwrap();
    let mut blocks = 0;
    let done = loop {
        match bounded(a.read_message()).await.unwrap() {
            Some(Message::Block(_)) => blocks += 1,
            Some(Message::Done(d)) => break d,
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(blocks, 4);
    assert_eq!(
        done.end,
        kvmesh_transfer::message::FetchEnd::Miss { index: 4 }
    );
    // Releasing gives the quota back.
    drop((a, b, c));
    eventually("pins released", || p.source.pinned_blocks() == 0).await;
    let client = client_for(p.addr, |_| {});
    let (report, _) = pull(&client, p.addr, &hs).await;
    assert_eq!(
        (report.blocks, report.outcome),
        (
            4,
            PullOutcome::Partial {
                reason: PullReason::Miss
            }
        ),
        "a capped pull delivers the pinned prefix; the rest is computed"
    );
}

#[tokio::test]
async fn a_connection_releases_only_its_own_pins_and_never_after_its_lease() {
    let hs = hashes(1);
    let p = start_producer(
        &hs,
        ServerConfig {
            pin_lease: Duration::from_millis(1500),
            ..ServerConfig::default()
        },
    )
    .await;
    let mut a = handshake_raw(p.addr).await;
    lookup_raw(&mut a, &hs).await;
    let mut b = handshake_raw(p.addr).await;
    lookup_raw(&mut b, &hs).await;
    assert_eq!(p.source.pin_count(hs[0]), 2);
    drop(a);
    eventually("a's pin released", || p.source.pin_count(hs[0]) == 1).await;
    // b keeps its pin: a's close took one pin, not all of them.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(p.source.pin_count(hs[0]), 1);
    drop(b);
    eventually("b's pin released", || p.source.pin_count(hs[0]) == 0).await;

    // c's lease runs out while it idles, then d pins; when c finally closes it must not take
    // d's pin (the source counts pins, not owners).
    let mut c = handshake_raw(p.addr).await;
    lookup_raw(&mut c, &hs).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let mut d = handshake_raw(p.addr).await;
    lookup_raw(&mut d, &hs).await;
    tokio::time::sleep(Duration::from_millis(700)).await; // c's lease is over, d's is not
    drop(c);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(p.source.pin_count(hs[0]), 1, "d's pin survives c's close");
    drop(d);
}

/// A source that records which request each served block went to, holding one hand-off per
/// block for request `owner` (as the engine's P/D retention does).
struct HandOffSource {
    inner: MemorySource,
    owner: String,
    held: Mutex<Vec<BlockHash>>,
}

impl BlockSource for HandOffSource {
    fn fingerprint(&self) -> Fingerprint {
        self.inner.fingerprint()
    }
    fn lookup_and_pin(&self, hashes: &[BlockHash], lease: Duration) -> Vec<BlockStatus> {
        self.inner.lookup_and_pin(hashes, lease)
    }
    fn read(&self, hash: BlockHash) -> Option<Bytes> {
        self.inner.read(hash)
    }
    fn unpin(&self, hashes: &[BlockHash]) {
        self.inner.unpin(hashes);
    }
    fn wait_ready(&self, hash: BlockHash, deadline: Instant) -> BoxFuture<'static, bool> {
        self.inner.wait_ready(hash, deadline)
    }
    fn served(&self, kv_request_id: &str, hash: BlockHash) {
        if kv_request_id == self.owner {
            self.held.lock().retain(|h| *h != hash);
        }
    }
}

#[tokio::test]
async fn only_the_request_a_block_was_kept_for_releases_its_hand_off() {
    let hs = hashes(3);
    let source = memory_source(&hs);
    let served = Arc::new(HandOffSource {
        inner: source.clone(),
        owner: "prefill-req-1".into(),
        held: Mutex::new(hs.clone()),
    });
    let p = start_with_source(source, served.clone(), ServerConfig::default()).await;
    let client = client_for(p.addr, |_| {});
    let mut sink = common::VerifySink::default();
    let report = bounded(client.pull(p.addr, "someone-else", &hs, &mut sink)).await;
    assert_eq!(report.outcome, PullOutcome::Complete);
    assert_eq!(
        served.held.lock().len(),
        3,
        "another request's read releases nothing"
    );
    let mut sink = common::VerifySink::default();
    let report = bounded(client.pull(p.addr, "prefill-req-1", &hs, &mut sink)).await;
    assert_eq!(report.outcome, PullOutcome::Complete);
    assert!(
        served.held.lock().is_empty(),
        "the owner's read releases them"
    );
}

#[tokio::test]
async fn a_producer_beyond_loopback_needs_a_secret_or_an_allow_list() {
    let bind = |cfg: ServerConfig| async move {
        ProducerServer::bind(
            "0.0.0.0:0",
            Arc::new(memory_source(&[])),
            cfg,
            CancellationToken::new(),
        )
        .await
    };
    let err = bind(ServerConfig::default()).await.unwrap_err();
    assert!(matches!(err, BindError::Unprotected { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("--p2p-secret-file") && msg.contains("--p2p-allowed-consumers"),
        "{msg}"
    );
    let (_, task) = bind(with_secret()).await.unwrap();
    task.abort();
    let (_, task) = bind(ServerConfig {
        allowed_ips: Some(vec!["10.0.0.0/8".parse().unwrap()]),
        ..ServerConfig::default()
    })
    .await
    .unwrap();
    task.abort();
    // Loopback stays open for tests and the local demo.
    let (_, task) = ProducerServer::bind(
        "127.0.0.1:0",
        Arc::new(memory_source(&[])),
        ServerConfig::default(),
        CancellationToken::new(),
    )
    .await
    .unwrap();
    task.abort();
}

#[tokio::test]
async fn a_producer_of_another_protocol_version_is_named_clearly() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let mut conn = Connection::new(stream, 4096);
        let _ = conn.read_message().await;
        // What a version-3 producer answers a version-4 Hello.
        let reason = RefuseReason::Version {
            ours: 3,
            theirs: PROTOCOL_VERSION,
        };
        let _ = conn
            .write_message(&Message::Refused(Refused { reason }))
            .await;
    });
    let client = client_for(addr, |_| {});
    let (report, _) = pull(&client, addr, &hashes(1)).await;
    let reason = report.outcome.reason().cloned().unwrap();
    assert_eq!(
        reason,
        PullReason::Version {
            ours: PROTOCOL_VERSION,
            theirs: 3
        }
    );
    let said = reason.to_string();
    assert!(
        said.contains("peer speaks P2P protocol v3, we speak v4"),
        "{said}"
    );
    assert!(reason.is_misconfiguration(), "logged as a fleet problem");
    assert_eq!(client.metrics().pulls("failed", "version"), 1);
}

/// A consumer still on protocol version 3 or 2 (whose `Hello` is the same map with an older
/// `version`) is refused before anything else, told both versions, and counted.
#[tokio::test]
async fn a_consumer_of_an_older_protocol_is_refused_naming_both_versions() {
    for (secret, theirs) in [
        (None, 2),
        (Some(Secret::from(SECRET)), 2),
        (None, 3),
        (Some(Secret::from(SECRET)), 3),
    ] {
        let p = start_producer(
            &hashes(1),
            ServerConfig {
                secret,
                ..ServerConfig::default()
            },
        )
        .await;
        let stream = TcpStream::connect(p.addr).await.unwrap();
        let mut conn = Connection::new(stream, 4096);
        conn.write_message(&Message::Hello(Hello {
            version: theirs,
            fingerprint: fp(),
            nonce: [3; 16],
        }))
        .await
        .unwrap();
        let reply = bounded(conn.read_message()).await.unwrap();
        assert_eq!(
            reply,
            Some(Message::Refused(Refused {
                reason: RefuseReason::Version { ours: 4, theirs }
            }))
        );
        eventually("refusal counted", || p.metrics.refused("version") == 1).await;
    }
}

/// A producer that authenticates properly (genuine keys), sends block 0 as it should, then block
/// 1 as `attack` makes it from the genuine wire bytes of both blocks. Blocks are 300 KiB: two
/// payload records each.
async fn record_tampering_producer(attack: fn(&[u8], &[u8]) -> Vec<u8>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let Some((mut conn, keys, f)) = genuine_until_fetch(listener).await else {
            return;
        };
        // Record 0 was the LookupReply; block 0 is records 1 (head), 2 and 3, block 1 starts at 4.
        let payload = |i: u8| Bytes::from(vec![i; 300 << 10]);
        let b0 = BlockFrame::new(0, f.hashes[0], payload(0));
        let b1 = BlockFrame::new(1, f.hashes[1], payload(1));
        let genuine0 = sealed_block(&b0, &keys.send, 1);
        let genuine1 = sealed_block(&b1, &keys.send, 4);
        conn.write_raw(&genuine0).await.unwrap();
        conn.write_raw(&attack(&genuine0, &genuine1)).await.unwrap();
        tokio::time::sleep(Duration::from_secs(2)).await;
    });
    addr
}

/// Every way of bending the records of a genuine block is caught at the record it touches: the
/// consumer keeps block 0, stops with `mac_failed`, counts it and drops the connection.
#[tokio::test]
async fn altered_replayed_reordered_or_dropped_payload_records_fail_with_mac_failed() {
    const HEAD: usize = record::BLOCK_HEAD_LEN + TAG_LEN;
    const REC: usize = record::RECORD_LEN + TAG_LEN;
    type Attack = fn(&[u8], &[u8]) -> Vec<u8>;
    let attacks: [(&str, Attack); 5] = [
        ("a byte of the second payload record flipped", |_, b1| {
            let mut w = b1.to_vec();
            w[HEAD + REC + 100] ^= 0x01;
            w
        }),
        ("a byte of a record's tag flipped", |_, b1| {
            let mut w = b1.to_vec();
            w[HEAD + REC - 1] ^= 0x80;
            w
        }),
        ("the two payload records swapped", |_, b1| {
            [&b1[..HEAD], &b1[HEAD + REC..], &b1[HEAD..HEAD + REC]].concat()
        }),
        // What follows (here block 0 again) fills the record's place, and its tag fails.
        ("the first payload record dropped", |b0, b1| {
            [&b1[..HEAD], &b1[HEAD + REC..], b0].concat()
        }),
        ("block 0 replayed as block 1", |b0, _| b0.to_vec()),
    ];
    for (what, attack) in attacks {
        let addr = record_tampering_producer(attack).await;
        let client = kvmesh_transfer::PullClient::new(
            fp(),
            kvmesh_transfer::ClientConfig {
                allowed_peers: common::allow_only(addr),
                timeout: Duration::from_secs(1),
                secret: Some(Secret::from(SECRET)),
                ..kvmesh_transfer::ClientConfig::default()
            },
        );
        let mut sink = kvmesh_transfer::VecSink::default();
        let report = bounded(client.pull(addr, "r", &hashes(3), &mut sink)).await;
        assert_eq!(
            report.outcome,
            PullOutcome::Partial {
                reason: PullReason::MacFailed
            },
            "{what}"
        );
        assert_eq!(
            sink.blocks.len(),
            1,
            "{what}: only the genuine block 0 arrived"
        );
        assert_eq!(sink.blocks[0].1, Bytes::from(vec![0u8; 300 << 10]));
        assert_eq!(client.metrics().pulls("partial", "mac_failed"), 1, "{what}");
        assert_eq!(client.idle_connections(addr), 0, "{what}");
    }
}

fn encrypting(encrypt: bool) -> ServerConfig {
    ServerConfig {
        encrypt,
        ..with_secret()
    }
}

/// Encrypted end to end: the pull delivers verified blocks, and no 64-byte run of any payload
/// ever crosses the wire (while the same pull authenticated only does carry them in clear).
#[tokio::test]
async fn an_encrypted_pull_round_trips_and_no_kv_crosses_the_wire_in_clear() {
    let hs = hashes(6);
    for encrypt in [true, false] {
        let p = start_producer(&hs, encrypting(encrypt)).await;
        let px = common::proxy(p.addr).await;
        let client = client_for(px.addr, |c| {
            c.secret = Some(Secret::from(SECRET));
            c.encrypt = encrypt;
        });
        let (report, sink) = pull(&client, px.addr, &hs).await;
        assert_eq!(report.outcome, PullOutcome::Complete, "encrypt {encrypt}");
        assert_eq!(sink.got, hs);
        let wire = px.from_producer.lock().clone();
        let leaked = hs
            .iter()
            .any(|h| common::contains(&wire, &payload_for(*h)[1000..1064]));
        assert_eq!(leaked, !encrypt, "KV in clear on the wire: {leaked}");
    }
}

/// A consumer that asks for encryption but derives the wrong keys (or a forger who must guess
/// them) fails on its first record, counted as `mac_failed`; with the right keys the producer
/// answers, encrypted.
#[tokio::test]
async fn a_wrong_key_fails_on_the_first_encrypted_record() {
    let hs = hashes(2);
    let p = start_producer(&hs, encrypting(true)).await;
    let (mut conn, _) = handshake_with(p.addr, Protection::Encrypt, Protection::Authenticate).await;
    conn.write_message(&lookup(&hs)).await.unwrap();
    closes_without_reply(&mut conn).await;
    eventually("counted", || p.metrics.refused("mac_failed") == 1).await;
    let (mut conn, _) = handshake_with(p.addr, Protection::Encrypt, Protection::Encrypt).await;
    assert!(conn.encrypted());
    let r = lookup_raw(&mut conn, &hs).await;
    assert_eq!(r.statuses, vec![BlockStatus::Hit; 2]);
    // A forged record under a guessed encryption key.
    let (mut conn, _) = handshake_with(p.addr, Protection::Encrypt, Protection::Encrypt).await;
    let guessed = DirectionKey::from_material(Protection::Encrypt, [0x42; KEY_MATERIAL]);
    conn.write_raw(&sealed(&lookup(&hs), &guessed, 0))
        .await
        .unwrap();
    closes_without_reply(&mut conn).await;
    eventually("counted", || p.metrics.refused("mac_failed") == 2).await;
}

/// Ends that disagree on encrypting are refused with a reason naming the setting, on both
/// sides; a consumer that wants encryption never pulls from an open producer in clear; and a
/// producer cannot encrypt without a secret.
#[tokio::test]
async fn ends_that_disagree_on_encryption_are_refused_naming_it() {
    let hs = hashes(2);
    for (producer, consumer) in [(true, false), (false, true)] {
        let p = start_producer(&hs, encrypting(producer)).await;
        let client = client_for(p.addr, |c| {
            c.secret = Some(Secret::from(SECRET));
            c.encrypt = consumer;
        });
        let (report, _) = pull(&client, p.addr, &hs).await;
        let reason = PullReason::EncryptionMismatch {
            ours: consumer,
            theirs: producer,
        };
        assert_eq!(
            report.outcome,
            PullOutcome::Failed {
                reason: reason.clone()
            }
        );
        assert!(reason.is_misconfiguration());
        assert!(reason.to_string().contains("--p2p-encrypt"), "{reason}");
        assert_eq!(client.metrics().pulls("failed", "encryption_mismatch"), 1);
        eventually("the producer counts it", || {
            p.metrics.refused("encryption_mismatch") == 1
        })
        .await;
    }
    let open = start_producer(&hs, ServerConfig::default()).await;
    let client = client_for(open.addr, |c| c.encrypt = true);
    let (report, _) = pull(&client, open.addr, &hs).await;
    assert_eq!(
        report.outcome,
        PullOutcome::Failed {
            reason: PullReason::EncryptionMismatch {
                ours: true,
                theirs: false
            }
        }
    );
    let err = ProducerServer::bind(
        "127.0.0.1:0",
        Arc::new(memory_source(&[])),
        ServerConfig {
            encrypt: true,
            ..ServerConfig::default()
        },
        CancellationToken::new(),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, BindError::EncryptionWithoutSecret), "{err}");
}

#[tokio::test]
async fn handshake_frames_beyond_the_preauth_bound_are_refused() {
    let p = start_producer(&hashes(1), with_secret()).await;
    let stream = TcpStream::connect(p.addr).await.unwrap();
    let mut conn = Connection::new(stream, 1 << 20);
    // A Hello padded to 8 KiB: a legal frame after auth, not before.
    let mut fat = fp();
    fat.model_id = "m".repeat(8 << 10);
    conn.write_message(&Message::Hello(Hello {
        version: PROTOCOL_VERSION,
        fingerprint: fat,
        nonce: [1; 16],
    }))
    .await
    .unwrap();
    let reply = bounded(conn.read_message()).await;
    assert!(
        !matches!(reply, Ok(Some(Message::Challenge(_) | Message::HelloOk(_)))),
        "{reply:?}"
    );
    eventually("oversized pre-auth frame counted", || {
        p.metrics.refused("oversized_frame") == 1
    })
    .await;
}
