//! Shared helpers: a fingerprint and hash-derived payloads, a verifying sink, a real producer
//! on loopback port 0 over a memory source, a consumer allowed to reach it, and a raw
//! connection that has passed the handshake (for tests that speak the protocol by hand).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvmesh_core::{BlockHash, Fingerprint, HashAlgo};
use kvmesh_transfer::connection::Connection;
use kvmesh_transfer::message::{Hello, Lookup, LookupReply, Message, PROTOCOL_VERSION};
use kvmesh_transfer::{
    AllowList, BlockSink, BlockSource, ClientConfig, MemorySource, ProducerServer, PullClient,
    PullReport, ServerConfig, SinkError, TransferMetrics,
};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub const BLOCK_BYTES: usize = 4096;

pub fn fp() -> Fingerprint {
    Fingerprint {
        model_id: "sim-test".into(),
        kv_dtype: "sim".into(),
        block_size: 16,
        num_layers: 4,
        num_kv_heads: 2,
        head_dim: 64,
        hash_algo: HashAlgo::Sha256Cbor,
        none_hash: "abcd".into(),
    }
}

/// Deterministic content derived from the hash, as the sim backend does.
pub fn payload_for(hash: BlockHash) -> Bytes {
    let seed = hash.0.to_le_bytes();
    Bytes::from(
        (0..BLOCK_BYTES)
            .map(|i| seed[i % 8] ^ (i as u8))
            .collect::<Vec<u8>>(),
    )
}

pub fn hashes(n: u64) -> Vec<BlockHash> {
    (0..n).map(|i| BlockHash(0x1000 + i)).collect()
}

/// A sink that verifies content against the hash and keeps the blocks.
#[derive(Default)]
pub struct VerifySink {
    pub got: Vec<BlockHash>,
}

impl BlockSink for VerifySink {
    fn accept(&mut self, index: usize, hash: BlockHash, payload: Bytes) -> Result<(), SinkError> {
        assert_eq!(index, self.got.len(), "blocks arrive in order");
        if payload != payload_for(hash) {
            return Err(SinkError {
                index,
                reason: "content does not match hash".into(),
            });
        }
        self.got.push(hash);
        Ok(())
    }
}

pub async fn bounded<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(20), f)
        .await
        .expect("test took too long")
}

pub struct Producer {
    pub addr: SocketAddr,
    pub source: MemorySource,
    pub metrics: TransferMetrics,
    pub cancel: CancellationToken,
    pub handle: JoinHandle<()>,
}

/// A memory source holding `populate` with their hash-derived payloads.
pub fn memory_source(populate: &[BlockHash]) -> MemorySource {
    let source = MemorySource::new(fp());
    for h in populate {
        source.insert(*h, payload_for(*h));
    }
    source
}

pub async fn start_producer(populate: &[BlockHash], config: ServerConfig) -> Producer {
    let source = memory_source(populate);
    start_with_source(source.clone(), Arc::new(source), config).await
}

pub async fn start_with_source(
    source: MemorySource,
    served: Arc<dyn BlockSource>,
    config: ServerConfig,
) -> Producer {
    let metrics = config.metrics.clone();
    let cancel = CancellationToken::new();
    let (addr, handle) = ProducerServer::bind("127.0.0.1:0", served, config, cancel.clone())
        .await
        .unwrap();
    Producer {
        addr,
        source,
        metrics,
        cancel,
        handle,
    }
}

/// An allow-list naming only `addr`.
pub fn allow_only(addr: SocketAddr) -> AllowList {
    let mut allowed = AllowList::none();
    allowed.add_socket(addr);
    allowed
}

pub fn client_for(addr: SocketAddr, tweak: impl FnOnce(&mut ClientConfig)) -> PullClient {
    let mut cfg = ClientConfig {
        allowed_peers: allow_only(addr),
        timeout: Duration::from_secs(2),
        pending_deadline: Duration::from_secs(2),
        ..ClientConfig::default()
    };
    tweak(&mut cfg);
    PullClient::new(fp(), cfg)
}

pub async fn pull(
    client: &PullClient,
    addr: SocketAddr,
    hs: &[BlockHash],
) -> (PullReport, VerifySink) {
    let mut sink = VerifySink::default();
    let report = bounded(client.pull(addr, "req-1", hs, &mut sink)).await;
    assert_eq!(
        report.blocks,
        sink.got.len(),
        "report counts exactly the blocks the sink accepted"
    );
    assert_eq!(&sink.got[..], &hs[..sink.got.len()], "a prefix, in order");
    (report, sink)
}

pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A raw connection to `addr` that has passed the handshake.
pub async fn handshake_raw(addr: SocketAddr) -> Connection {
    let stream = TcpStream::connect(addr).await.unwrap();
    let mut conn = Connection::new(stream, 1 << 20);
    conn.write_message(&Message::Hello(Hello {
        version: PROTOCOL_VERSION,
        fingerprint: fp(),
        nonce: [7; 16],
    }))
    .await
    .unwrap();
    let reply = bounded(conn.read_message()).await.unwrap();
    assert!(matches!(reply, Some(Message::HelloOk(_))), "{reply:?}");
    conn
}

/// Sends a Lookup of `hashes` on a raw connection (the producer pins the leading run).
pub async fn send_lookup(conn: &mut Connection, hashes: &[BlockHash]) {
    conn.write_message(&Message::Lookup(Lookup {
        kv_request_id: "r".into(),
        hashes: hashes.to_vec(),
    }))
    .await
    .unwrap();
}

/// [`send_lookup`], then the producer's reply, which must be a LookupReply.
pub async fn lookup_raw(conn: &mut Connection, hashes: &[BlockHash]) -> LookupReply {
    send_lookup(conn, hashes).await;
    let Some(Message::LookupReply(r)) = conn.read_message().await.unwrap() else {
        panic!("expected reply")
    };
    r
}

/// A TCP proxy in front of a producer: forwards every connection, records what the producer
/// sent (to look for clear KV on the wire) and can cut one connection (a stripe dying).
pub struct Proxy {
    pub addr: SocketAddr,
    /// Bytes the producer sent, over all connections, in arrival order per read.
    pub from_producer: Arc<parking_lot::Mutex<Vec<u8>>>,
    /// One token per accepted connection, in accept order; cancelling it drops both sockets.
    pub connections: Arc<parking_lot::Mutex<Vec<CancellationToken>>>,
}

impl Proxy {
    /// Drops the `i`-th accepted connection (0-based), both ways, at once.
    pub fn cut(&self, i: usize) {
        if let Some(t) = self.connections.lock().get(i) {
            t.cancel();
        }
    }
}

pub async fn proxy(target: SocketAddr) -> Proxy {
    proxy_stalling(target, None).await
}

/// As [`proxy`], and the `conn`-th connection (0-based, accept order) stops forwarding what the
/// producer sends after `bytes` bytes (a stripe whose stream stalls, until it is cut).
pub async fn proxy_stalling(target: SocketAddr, stall: Option<(usize, usize)>) -> Proxy {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let from_producer = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let connections = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let (seen, conns) = (Arc::clone(&from_producer), Arc::clone(&connections));
    tokio::spawn(async move {
        loop {
            let Ok((consumer, _)) = listener.accept().await else {
                return;
            };
            let Ok(producer) = TcpStream::connect(target).await else {
                return;
            };
            let cut = CancellationToken::new();
            let index = {
                let mut c = conns.lock();
                c.push(cut.clone());
                c.len() - 1
            };
            let mut budget = match stall {
                Some((i, bytes)) if i == index => bytes,
                _ => usize::MAX,
            };
            let (mut cr, mut cw) = consumer.into_split();
            let (mut pr, mut pw) = producer.into_split();
            let seen = Arc::clone(&seen);
            let up = cut.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 << 10];
                loop {
                    let n = tokio::select! {
                        r = cr.read(&mut buf) => match r { Ok(0) | Err(_) => break, Ok(n) => n },
                        () = up.cancelled() => break,
                    };
                    if pw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
                up.cancel();
            });
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 << 10];
                loop {
                    let room = buf.len().min(budget);
                    if room == 0 {
                        cut.cancelled().await;
                        break;
                    }
                    let n = tokio::select! {
                        r = pr.read(&mut buf[..room]) => match r { Ok(0) | Err(_) => break, Ok(n) => n },
                        () = cut.cancelled() => break,
                    };
                    budget -= n;
                    seen.lock().extend_from_slice(&buf[..n]);
                    if cw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
                cut.cancel();
            });
        }
    });
    Proxy {
        addr,
        from_producer,
        connections,
    }
}

/// Whether `haystack` contains `needle` anywhere.
pub fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}
