//! The producer: serves blocks from a [`BlockSource`] to consumers.
//!
//! One accept loop, one task per connection (tracked, so shutdown waits for them), a semaphore
//! capping connections and one per peer IP capping concurrent fetch streams. On cancellation the
//! accept loop stops at once; connection tasks finish the request they are serving (an in-flight
//! fetch is drained, not cut) and close when idle. Every pin a connection takes is released when
//! its fetch ends, when the next lookup replaces it, and when the connection closes for any reason.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use kvmesh_core::BlockHash;
use parking_lot::Mutex;
use tokio::net::{TcpListener, ToSocketAddrs};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;
use tokio::time::{Instant, timeout};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

use crate::auth::{self, Secret};
use crate::connection::{Connection, ConnectionError};
use crate::frame::DEFAULT_MAX_FRAME;
use crate::message::{
    BlockFrame, BlockStatus, Done, ErrorMsg, Fetch, FetchEnd, HelloOk, Lookup, LookupReply,
    Message, PROTOCOL_VERSION, RefuseReason, Refused,
};
use crate::metrics::{Direction, TransferMetrics};
use crate::source::BlockSource;

/// Producer settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Largest frame accepted or sent.
    pub max_frame: usize,
    /// Lease on the pins a lookup takes; bounds how long a vanished consumer can hold blocks.
    pub pin_lease: Duration,
    /// Upper bound on how long a fetch may wait for a pending block, whatever the consumer asks.
    pub max_pending_wait: Duration,
    /// Concurrent fetch streams per peer IP; more wait their turn.
    pub max_transfers_per_peer: usize,
    /// Concurrent connections overall; further accepts wait.
    pub max_connections: usize,
    /// A connection that sends nothing for this long is closed.
    pub idle_timeout: Duration,
    /// Hello (and auth) must complete within this.
    pub handshake_timeout: Duration,
    /// Most hashes one lookup or fetch may name.
    pub max_blocks_per_request: usize,
    /// When set, consumers must prove knowledge of it (and we prove it back).
    pub secret: Option<Secret>,
    /// When set, only these consumer IPs may connect.
    pub allowed_ips: Option<Vec<IpAddr>>,
    pub metrics: TransferMetrics,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            max_frame: DEFAULT_MAX_FRAME,
            pin_lease: Duration::from_secs(10),
            max_pending_wait: Duration::from_secs(30),
            max_transfers_per_peer: 4,
            max_connections: 256,
            idle_timeout: Duration::from_secs(120),
            handshake_timeout: Duration::from_secs(5),
            max_blocks_per_request: 1 << 16,
            secret: None,
            allowed_ips: None,
            metrics: TransferMetrics::default(),
        }
    }
}

/// State shared by every connection task.
struct Shared {
    source: Arc<dyn BlockSource>,
    config: ServerConfig,
    /// Per-peer-IP semaphores capping concurrent fetch streams.
    per_peer: Mutex<HashMap<IpAddr, Arc<Semaphore>>>,
}

impl Shared {
    fn peer_semaphore(&self, ip: IpAddr) -> Arc<Semaphore> {
        let mut map = self.per_peer.lock();
        if map.len() > 4096 {
            // Drop semaphores nobody holds so the map stays bounded.
            map.retain(|_, s| Arc::strong_count(s) > 1);
        }
        Arc::clone(
            map.entry(ip).or_insert_with(|| {
                Arc::new(Semaphore::new(self.config.max_transfers_per_peer.max(1)))
            }),
        )
    }
}

/// The P2P producer server.
#[derive(Debug)]
pub struct ProducerServer;

impl ProducerServer {
    /// Bind and start serving. The handle completes after `cancel` fires and every connection
    /// task has finished its in-flight request.
    pub async fn bind(
        addr: impl ToSocketAddrs,
        source: Arc<dyn BlockSource>,
        config: ServerConfig,
        cancel: CancellationToken,
    ) -> io::Result<(SocketAddr, JoinHandle<()>)> {
        let listener = TcpListener::bind(addr).await?;
        let local = listener.local_addr()?;
        let shared = Arc::new(Shared {
            source,
            config,
            per_peer: Mutex::default(),
        });
        let handle = tokio::spawn(accept_loop(listener, shared, cancel));
        Ok((local, handle))
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, cancel: CancellationToken) {
    let tracker = TaskTracker::new();
    let limit = Arc::new(Semaphore::new(shared.config.max_connections.max(1)));
    loop {
        let permit = tokio::select! {
            p = Arc::clone(&limit).acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
            _ = cancel.cancelled() => break,
        };
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = cancel.cancelled() => break,
        };
        let (stream, peer) = match accepted {
            Ok(x) => x,
            Err(e) => {
                // E.g. EMFILE: back off instead of spinning.
                warn!(error = %e, "p2p accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let mut conn = Connection::new(stream, shared.config.max_frame);
        if let Some(allowed) = &shared.config.allowed_ips
            && !allowed.contains(&peer.ip())
        {
            shared.config.metrics.record_refused("not_allowed");
            tracker.spawn(async move {
                let msg = Message::Refused(Refused {
                    reason: RefuseReason::NotAllowed,
                });
                let _ = timeout(Duration::from_secs(1), conn.write_message(&msg)).await;
            });
            continue;
        }
        let handler = Handler {
            conn,
            peer,
            shared: Arc::clone(&shared),
            cancel: cancel.clone(),
            pins: Vec::new(),
        };
        tracker.spawn(handler.run(permit));
    }
    tracker.close();
    tracker.wait().await;
}

/// Why a connection task stopped serving.
#[derive(Debug, thiserror::Error)]
enum HandlerError {
    #[error(transparent)]
    Connection(#[from] ConnectionError),
    #[error("protocol violation: {0}")]
    Protocol(String),
}

/// One consumer connection.
struct Handler {
    conn: Connection,
    peer: SocketAddr,
    shared: Arc<Shared>,
    cancel: CancellationToken,
    /// Every pin this connection holds (released on fetch end, next lookup, and close).
    pins: Vec<BlockHash>,
}

impl Handler {
    async fn run(mut self, _permit: OwnedSemaphorePermit) {
        let result = self.serve().await;
        self.release_pins();
        let metrics = &self.shared.config.metrics;
        match result {
            Ok(()) => {}
            Err(HandlerError::Protocol(why)) => {
                metrics.record_protocol_error(Direction::Out);
                debug!(peer = %self.peer, %why, "p2p producer: closing connection");
                let msg = Message::Error(ErrorMsg { message: why });
                let _ = timeout(Duration::from_secs(1), self.conn.write_message(&msg)).await;
            }
            Err(HandlerError::Connection(ConnectionError::Message(e))) => {
                metrics.record_protocol_error(Direction::Out);
                debug!(peer = %self.peer, error = %e, "p2p producer: garbled frame");
                let msg = Message::Error(ErrorMsg {
                    message: e.to_string(),
                });
                let _ = timeout(Duration::from_secs(1), self.conn.write_message(&msg)).await;
            }
            Err(HandlerError::Connection(e @ ConnectionError::Checksum { .. })) => {
                metrics.record_protocol_error(Direction::Out);
                debug!(peer = %self.peer, error = %e, "p2p producer: corrupt frame");
            }
            Err(HandlerError::Connection(e)) => {
                debug!(peer = %self.peer, error = %e, "p2p producer: connection ended");
            }
        }
        self.conn.shutdown().await;
    }

    fn release_pins(&mut self) {
        if !self.pins.is_empty() {
            self.shared.source.unpin(&self.pins);
            self.pins.clear();
        }
    }

    async fn serve(&mut self) -> Result<(), HandlerError> {
        let handshake_timeout = self.shared.config.handshake_timeout;
        match timeout(handshake_timeout, self.handshake()).await {
            Err(_) => return Ok(()),
            Ok(Ok(true)) => {}
            Ok(Ok(false)) => return Ok(()),
            Ok(Err(e)) => return Err(e),
        }
        loop {
            let idle = self.shared.config.idle_timeout;
            let msg = tokio::select! {
                r = timeout(idle, self.conn.read_message()) => match r {
                    Err(_) => return Ok(()),
                    Ok(r) => match r? {
                        None => return Ok(()),
                        Some(m) => m,
                    },
                },
                // Between requests shutdown wins; during a fetch (below) it does not.
                _ = self.cancel.cancelled() => return Ok(()),
            };
            match msg {
                Message::Lookup(l) => self.lookup(l).await?,
                Message::Fetch(f) => self.fetch(f).await?,
                other => {
                    return Err(HandlerError::Protocol(format!(
                        "unexpected {:?} frame",
                        other.tag()
                    )));
                }
            }
        }
    }

    /// Returns whether the consumer was accepted.
    async fn handshake(&mut self) -> Result<bool, HandlerError> {
        let hello = match self.conn.read_message().await? {
            Some(Message::Hello(h)) => h,
            None => return Ok(false),
            Some(other) => {
                return Err(HandlerError::Protocol(format!(
                    "expected Hello, got {:?}",
                    other.tag()
                )));
            }
        };
        let metrics = &self.shared.config.metrics;
        if hello.version != PROTOCOL_VERSION {
            metrics.record_refused("version");
            let reason = RefuseReason::Version {
                ours: PROTOCOL_VERSION,
                theirs: hello.version,
            };
            self.conn
                .write_message(&Message::Refused(Refused { reason }))
                .await?;
            return Ok(false);
        }
        let proof = match &self.shared.config.secret {
            None => None,
            Some(secret) => {
                let ours = auth::nonce();
                self.conn
                    .write_message(&Message::Challenge(crate::message::Challenge {
                        nonce: ours,
                    }))
                    .await?;
                let proof = match self.conn.read_message().await? {
                    Some(Message::Auth(a)) => a.proof,
                    None => return Ok(false),
                    Some(other) => {
                        return Err(HandlerError::Protocol(format!(
                            "expected Auth, got {:?}",
                            other.tag()
                        )));
                    }
                };
                if !auth::constant_time_eq(&proof, &secret.consumer_proof(&ours, &hello.nonce)) {
                    metrics.record_refused("auth_failed");
                    let reason = RefuseReason::AuthFailed;
                    self.conn
                        .write_message(&Message::Refused(Refused { reason }))
                        .await?;
                    return Ok(false);
                }
                Some(secret.producer_proof(&ours, &hello.nonce).to_vec())
            }
        };
        // Authenticate before comparing fingerprints, so an unauthenticated peer learns nothing
        // about what we serve.
        if let Err(m) = self
            .shared
            .source
            .fingerprint()
            .check_compatible(&hello.fingerprint)
        {
            metrics.record_refused("fingerprint_mismatch");
            tracing::warn!(peer = %self.peer, %m, "p2p producer: refusing a peer whose KV is incompatible");
            let reason = RefuseReason::Fingerprint {
                field: m.field.to_string(),
                ours: m.ours,
                theirs: m.theirs,
            };
            self.conn
                .write_message(&Message::Refused(Refused { reason }))
                .await?;
            return Ok(false);
        }
        self.conn
            .write_message(&Message::HelloOk(HelloOk {
                version: PROTOCOL_VERSION,
                proof,
            }))
            .await?;
        Ok(true)
    }

    fn check_len(&self, n: usize) -> Result<(), HandlerError> {
        let max = self.shared.config.max_blocks_per_request;
        if n > max {
            return Err(HandlerError::Protocol(format!(
                "{n} hashes in one request (max {max})"
            )));
        }
        Ok(())
    }

    async fn lookup(&mut self, l: Lookup) -> Result<(), HandlerError> {
        self.check_len(l.hashes.len())?;
        // A new lookup supersedes the previous one's pins.
        self.release_pins();
        let lease = self.shared.config.pin_lease;
        let statuses = self.shared.source.lookup_and_pin(&l.hashes, lease);
        if statuses.len() != l.hashes.len() {
            warn!(
                "p2p producer: BlockSource returned {} statuses for {} hashes",
                statuses.len(),
                l.hashes.len()
            );
        }
        let leading = statuses
            .iter()
            .take_while(|s| **s == BlockStatus::Hit)
            .count();
        self.pins
            .extend_from_slice(&l.hashes[..leading.min(l.hashes.len())]);
        debug!(peer = %self.peer, kv_request_id = %l.kv_request_id, blocks = l.hashes.len(), hits = leading, "p2p lookup");
        let mut statuses = statuses;
        statuses.resize(l.hashes.len(), BlockStatus::Miss);
        let lease_ms = u32::try_from(lease.as_millis()).unwrap_or(u32::MAX);
        self.conn
            .write_message(&Message::LookupReply(LookupReply { statuses, lease_ms }))
            .await?;
        Ok(())
    }

    async fn fetch(&mut self, f: Fetch) -> Result<(), HandlerError> {
        self.check_len(f.hashes.len())?;
        let sem = self.shared.peer_semaphore(self.peer.ip());
        let Ok(_permit) = sem.acquire_owned().await else {
            return Err(HandlerError::Protocol("server shutting down".into()));
        };
        let cfg = &self.shared.config;
        cfg.metrics.record_fetch_served();
        let wait = Duration::from_millis(u64::from(f.pending_wait_ms)).min(cfg.max_pending_wait);
        let deadline = Instant::now() + wait;
        // Blocks pinned by the preceding lookup, in order.
        let looked_up: Vec<BlockHash> = self.pins.clone();
        let (mut blocks, mut bytes) = (0u32, 0u64);
        let mut end = FetchEnd::Complete;
        for (i, &hash) in f.hashes.iter().enumerate() {
            let index = u32::try_from(i).unwrap_or(u32::MAX);
            if looked_up.get(i) != Some(&hash) {
                // Not pinned by the lookup (pending then, or a different list): pin it now.
                match self.pin_one(hash, deadline).await {
                    Ok(()) => {}
                    Err(e) => {
                        end = e(index);
                        break;
                    }
                }
            }
            let Some((payload, crc)) = self.shared.source.read_with_checksum(hash) else {
                end = FetchEnd::Miss { index };
                break;
            };
            let len = payload.len();
            let block = BlockFrame::with_checksum(index, hash, payload, crc);
            self.conn.write_message(&Message::Block(block)).await?;
            self.shared.config.metrics.record_block(Direction::Out, len);
            blocks += 1;
            bytes += len as u64;
        }
        self.release_pins();
        self.conn
            .write_message(&Message::Done(Done { blocks, bytes, end }))
            .await?;
        Ok(())
    }

    /// Pin one block not covered by the lookup, waiting for it if pending.
    async fn pin_one(
        &mut self,
        hash: BlockHash,
        deadline: Instant,
    ) -> Result<(), fn(u32) -> FetchEnd> {
        let source = Arc::clone(&self.shared.source);
        let lease = self.shared.config.pin_lease;
        let mut status = source
            .lookup_and_pin(&[hash], lease)
            .first()
            .copied()
            .unwrap_or(BlockStatus::Miss);
        if status == BlockStatus::Pending {
            if !source.wait_ready(hash, deadline).await {
                return Err(|index| FetchEnd::PendingDeadline { index });
            }
            status = source
                .lookup_and_pin(&[hash], lease)
                .first()
                .copied()
                .unwrap_or(BlockStatus::Miss);
        }
        match status {
            BlockStatus::Hit => {
                self.pins.push(hash);
                Ok(())
            }
            BlockStatus::Miss | BlockStatus::Pending => Err(|index| FetchEnd::Miss { index }),
        }
    }
}
