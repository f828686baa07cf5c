//! The producer: serves blocks from a [`BlockSource`] to consumers.
//!
//! One accept loop, one task per connection (tracked, so shutdown waits for them), a semaphore
//! capping connections (a peer past it is refused at once with `TooManyConnections`) and one per
//! peer IP capping concurrent fetch streams. On cancellation the
//! accept loop stops at once; connection tasks finish the request they are serving (an in-flight
//! fetch is drained, not cut) and close when idle. Every pin a connection takes is released when
//! its fetch ends, when the next lookup replaces it, and when the connection closes for any reason.
//!
//! Hostile peers: [`ProducerServer::bind`] refuses an address beyond loopback unless a secret or
//! an allow-list protects it; a peer address holds at most `max_connections_per_ip` connections
//! and `max_pinned_per_peer` pinned blocks (`max_pins_per_lookup` per lookup); handshake frames
//! are bounded by [`PREAUTH_MAX_FRAME`]; with a secret every later frame is MAC-verified before it
//! is decoded ([`crate::mac`]). A connection releases only pins it took itself, and only while
//! their lease runs (after it, the source's count may already belong to another connection).
//! Each refusal is counted by reason and logged once per peer ([`crate::limits`]).

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
use crate::frame::{DEFAULT_MAX_FRAME, FrameError, PREAUTH_MAX_FRAME};
use crate::layers::{LayoutError, SegmentLayout};
use crate::limits::{IpNet, PeerSlot, PeerTable, RefusalLog};
use crate::mac::{self, Protection, Role, SessionKeys};
use crate::message::{
    BlockFrame, BlockStatus, Done, ErrorMsg, Fetch, FetchEnd, HelloOk, Lookup, LookupReply,
    Message, MessageError, PROTOCOL_VERSION, RefuseReason, Refused,
};
use crate::metrics::{Direction, TransferMetrics};
use crate::pacing::{LinkPacer, TrafficClass};
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
    /// Concurrent connections overall; a peer past it is refused with `TooManyConnections`
    /// at accept (counted as `max_connections`) rather than left unanswered in the backlog.
    pub max_connections: usize,
    /// A connection that sends nothing for this long is closed.
    pub idle_timeout: Duration,
    /// Hello (and auth) must complete within this.
    pub handshake_timeout: Duration,
    /// Most hashes one lookup or fetch may name.
    pub max_blocks_per_request: usize,
    /// When set, consumers must prove knowledge of it (and we prove it back), and every frame
    /// after the handshake is authenticated ([`crate::mac`]).
    pub secret: Option<Secret>,
    /// Encrypt everything after the handshake (AES-256-GCM; needs `secret`). Consumers must ask
    /// for the same (`ClientConfig::encrypt`); one that does not is refused with
    /// `Refused{Encryption}` (counted as `encryption_mismatch`).
    pub encrypt: bool,
    /// When set, only consumers in these addresses / networks may connect.
    pub allowed_ips: Option<Vec<IpNet>>,
    /// Connections one peer address may hold at once (handshaking ones included); more are
    /// refused with `TooManyConnections`.
    pub max_connections_per_ip: usize,
    /// Blocks one lookup may pin; hits beyond it are answered `MISS`.
    pub max_pins_per_lookup: usize,
    /// Blocks one peer address may hold pinned over all its connections.
    pub max_pinned_per_peer: usize,
    pub metrics: TransferMetrics,
    /// A time-modelled engine's link ([`crate::pacing`]): each fetch is registered on it as an
    /// egress transfer and its blocks leave no sooner than the modelled link would carry them.
    /// `None` (real engines): blocks leave as fast as the socket takes them.
    pub egress: Option<Arc<dyn LinkPacer>>,
}

/// Default [`ServerConfig::max_connections_per_ip`]: room for a busy consumer's concurrent pulls
/// (its pool keeps 4 idle), a quarter of the overall 256.
/// Default concurrent fetch streams one peer IP may run ([`ServerConfig::max_transfers_per_peer`]).
pub const DEFAULT_MAX_TRANSFERS_PER_PEER: usize = 4;
pub const DEFAULT_MAX_CONNECTIONS_PER_IP: usize = 64;

/// Default [`ServerConfig::max_pins_per_lookup`]: a 128K-token prompt in 16-token blocks.
pub const DEFAULT_MAX_PINS_PER_LOOKUP: usize = 8192;

/// Default [`ServerConfig::max_pinned_per_peer`]: four such prompts at once.
pub const DEFAULT_MAX_PINNED_PER_PEER: usize = 32_768;

/// A connection does not release a pin whose lease ends within this: the source may already
/// have dropped it, and its release would take another connection's pin instead.
const RELEASE_MARGIN: Duration = Duration::from_millis(50);

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            max_frame: DEFAULT_MAX_FRAME,
            pin_lease: Duration::from_secs(10),
            max_pending_wait: Duration::from_secs(30),
            max_transfers_per_peer: DEFAULT_MAX_TRANSFERS_PER_PEER,
            max_connections: 256,
            idle_timeout: Duration::from_secs(120),
            handshake_timeout: Duration::from_secs(5),
            max_blocks_per_request: 1 << 16,
            secret: None,
            encrypt: false,
            allowed_ips: None,
            max_connections_per_ip: DEFAULT_MAX_CONNECTIONS_PER_IP,
            max_pins_per_lookup: DEFAULT_MAX_PINS_PER_LOOKUP,
            max_pinned_per_peer: DEFAULT_MAX_PINNED_PER_PEER,
            metrics: TransferMetrics::default(),
            egress: None,
        }
    }
}

impl ServerConfig {
    /// Whether consumers must authenticate or come from listed addresses.
    pub fn protected(&self) -> bool {
        self.secret.is_some() || self.allowed_ips.is_some()
    }
}

/// Why the producer did not start.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    #[error(transparent)]
    Io(#[from] io::Error),
    /// Beyond loopback, anyone who can reach the port could read (and with pins, hold) the KV.
    #[error(
        "refusing to serve KV blocks on {addr} to any host: set a shared secret \
         (`kvmesh engine --p2p-secret-file`) or an allow-list of consumer addresses \
         (`--p2p-allowed-consumers`), or bind to loopback"
    )]
    Unprotected { addr: SocketAddr },
    /// Encryption derives its keys from the shared secret.
    #[error("encrypting P2P transfers needs a shared secret (`--p2p-secret-file`)")]
    EncryptionWithoutSecret,
}

/// State shared by every connection task.
struct Shared {
    source: Arc<dyn BlockSource>,
    config: ServerConfig,
    /// Per-peer-IP semaphores capping concurrent fetch streams.
    per_peer: Mutex<HashMap<IpAddr, Arc<Semaphore>>>,
    /// Connections and pins per peer address.
    peers: Arc<PeerTable>,
    refusals: RefusalLog,
}

impl Shared {
    fn refuse(&self, peer: SocketAddr, reason: &'static str, detail: &dyn std::fmt::Display) {
        self.refusals
            .refuse(&self.config.metrics, peer, reason, detail);
    }
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
    /// task has finished its in-flight request. An address beyond loopback needs a secret or an
    /// allow-list ([`BindError::Unprotected`]).
    pub async fn bind(
        addr: impl ToSocketAddrs,
        source: Arc<dyn BlockSource>,
        config: ServerConfig,
        cancel: CancellationToken,
    ) -> Result<(SocketAddr, JoinHandle<()>), BindError> {
        if config.encrypt && config.secret.is_none() {
            return Err(BindError::EncryptionWithoutSecret);
        }
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host(addr).await?.collect();
        if !config.protected()
            && let Some(open) = addrs.iter().find(|a| !a.ip().to_canonical().is_loopback())
        {
            return Err(BindError::Unprotected { addr: *open });
        }
        let listener = TcpListener::bind(&addrs[..]).await?;
        let local = listener.local_addr()?;
        let peers = PeerTable::new(config.max_connections_per_ip, config.max_pinned_per_peer);
        let shared = Arc::new(Shared {
            source,
            config,
            per_peer: Mutex::default(),
            peers,
            refusals: RefusalLog::default(),
        });
        let handle = tokio::spawn(accept_loop(listener, shared, cancel));
        Ok((local, handle))
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, cancel: CancellationToken) {
    let tracker = TaskTracker::new();
    let limit = Arc::new(Semaphore::new(shared.config.max_connections.max(1)));
    loop {
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
        // Until the handshake succeeds, no frame may exceed the small pre-auth bound.
        let conn = Connection::new(stream, PREAUTH_MAX_FRAME);
        if let Some(allowed) = &shared.config.allowed_ips
            && !allowed.iter().any(|net| net.contains(peer.ip()))
        {
            shared.refuse(peer, "not_allowed", &"address not in the allow-list");
            tracker.spawn(refuse(conn, RefuseReason::NotAllowed));
            continue;
        }
        let Ok(permit) = Arc::clone(&limit).try_acquire_owned() else {
            let cap = shared.config.max_connections;
            shared.refuse(
                peer,
                "max_connections",
                &format_args!("the producer holds {cap} connections"),
            );
            tracker.spawn(refuse(conn, RefuseReason::TooManyConnections));
            continue;
        };
        let Some(slot) = shared.peers.admit(peer.ip()) else {
            let cap = shared.config.max_connections_per_ip;
            shared.refuse(
                peer,
                "connection_cap",
                &format_args!("already holds {cap} connections"),
            );
            tracker.spawn(refuse(conn, RefuseReason::TooManyConnections));
            continue;
        };
        let handler = Handler {
            conn,
            peer,
            shared: Arc::clone(&shared),
            cancel: cancel.clone(),
            pins: Vec::new(),
            kv_request_id: String::new(),
            accepted: false,
            slot,
        };
        tracker.spawn(handler.run(permit));
    }
    tracker.close();
    tracker.wait().await;
}

/// Tell a refused consumer why (briefly: it may not be reading), then close.
async fn refuse(mut conn: Connection, reason: RefuseReason) {
    let msg = Message::Refused(Refused { reason });
    let _ = timeout(Duration::from_secs(1), conn.write_message(&msg)).await;
}

/// Longest `kv_request_id` remembered for hand-off releases (the router's ids are ≤ 128).
const MAX_KV_REQUEST_ID: usize = 256;

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
    /// Every pin this connection holds, with its lease end (released on fetch end, next
    /// lookup, and close).
    pins: Vec<(BlockHash, Instant)>,
    /// The last lookup's request id: blocks fetched after it are served to that request.
    kv_request_id: String,
    /// The handshake succeeded.
    accepted: bool,
    /// This connection's slot under the per-IP cap (and the key of its pin quota).
    slot: PeerSlot,
}

impl Handler {
    async fn run(mut self, _permit: OwnedSemaphorePermit) {
        let result = self.serve().await;
        self.release_pins();
        if let Err(e) = result {
            self.close_with(e).await;
        }
        self.conn.shutdown().await;
    }

    /// Counts, logs and (where the peer can use it) answers why the connection is being closed.
    async fn close_with(&mut self, error: HandlerError) {
        let metrics = &self.shared.config.metrics;
        match error {
            HandlerError::Protocol(why) => {
                metrics.record_protocol_error(Direction::Out);
                debug!(peer = %self.peer, %why, "p2p producer: closing connection");
                let msg = Message::Error(ErrorMsg { message: why });
                let _ = timeout(Duration::from_secs(1), self.conn.write_message(&msg)).await;
            }
            HandlerError::Connection(ConnectionError::Mac { seq }) => {
                // Forged, altered or replayed: say nothing more to whoever sent it.
                metrics.record_protocol_error(Direction::Out);
                self.shared.refuse(
                    self.peer,
                    "mac_failed",
                    &format_args!("record {seq} failed authentication"),
                );
            }
            HandlerError::Connection(ConnectionError::Message(e)) => self.garbled(e).await,
            HandlerError::Connection(e @ ConnectionError::Checksum { .. }) => {
                metrics.record_protocol_error(Direction::Out);
                debug!(peer = %self.peer, error = %e, "p2p producer: corrupt frame");
            }
            HandlerError::Connection(e) => {
                debug!(peer = %self.peer, error = %e, "p2p producer: connection ended");
            }
        }
    }

    /// A frame that did not decode: refused (and counted by reason) when it was an oversized
    /// pre-authentication frame; the peer is told why.
    async fn garbled(&mut self, e: MessageError) {
        self.shared
            .config
            .metrics
            .record_protocol_error(Direction::Out);
        if !self.accepted
            && let MessageError::Frame(FrameError::TooLarge { len, .. }) = &e
        {
            self.shared.refuse(
                self.peer,
                "oversized_frame",
                &format_args!("a {len}-byte frame before authentication (max {PREAUTH_MAX_FRAME})"),
            );
        }
        debug!(peer = %self.peer, error = %e, "p2p producer: garbled frame");
        let msg = Message::Error(ErrorMsg {
            message: e.to_string(),
        });
        let _ = timeout(Duration::from_secs(1), self.conn.write_message(&msg)).await;
    }

    /// Releases this connection's pins: those whose lease still runs at the source, and the
    /// whole count from the peer's quota.
    fn release_pins(&mut self) {
        if self.pins.is_empty() {
            return;
        }
        let soon = Instant::now() + RELEASE_MARGIN;
        let live: Vec<BlockHash> = self
            .pins
            .iter()
            .filter(|(_, until)| *until > soon)
            .map(|(h, _)| *h)
            .collect();
        self.shared
            .peers
            .release_pins(self.slot.ip(), self.pins.len());
        if !live.is_empty() {
            self.shared.source.unpin(&live);
        }
        self.pins.clear();
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
                // The consumer promoted a background fetch that had already ended (it crossed
                // our `Done`): nothing left to promote.
                Message::Promote(_) => {}
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
        let (hello, hello_body) = match self.conn.read_message_with_body().await? {
            Some((Message::Hello(h), body)) => (h, body),
            None => return Ok(false),
            Some((other, _)) => {
                return Err(HandlerError::Protocol(format!(
                    "expected Hello, got {:?}",
                    other.tag()
                )));
            }
        };
        if hello.version != PROTOCOL_VERSION {
            let reason = RefuseReason::Version {
                ours: PROTOCOL_VERSION,
                theirs: hello.version,
            };
            let why = format!(
                "speaks P2P protocol v{}, we speak v{PROTOCOL_VERSION}",
                hello.version
            );
            return self.refuse_handshake("version", &why, reason).await;
        }
        let (proof, keys) = match &self.shared.config.secret {
            None => (None, None),
            Some(secret) => {
                let ours = auth::nonce();
                self.conn
                    .write_message(&Message::Challenge(crate::message::Challenge {
                        nonce: ours,
                    }))
                    .await?;
                let auth = match self.conn.read_message().await? {
                    Some(Message::Auth(a)) => a,
                    None => return Ok(false),
                    Some(other) => {
                        return Err(HandlerError::Protocol(format!(
                            "expected Auth, got {:?}",
                            other.tag()
                        )));
                    }
                };
                if !auth::constant_time_eq(&auth.proof, &secret.consumer_proof(&ours, &hello.nonce))
                {
                    let why = "wrong shared-secret proof";
                    let reason = RefuseReason::AuthFailed;
                    return self.refuse_handshake("auth_failed", &why, reason).await;
                }
                let encrypt = self.shared.config.encrypt;
                if auth.encrypt != encrypt {
                    let said = |e: bool| if e { "encrypted" } else { "unencrypted" };
                    let why = format!(
                        "asks for {} transfers, we serve {} (--p2p-encrypt on both ends or neither)",
                        said(auth.encrypt),
                        said(encrypt)
                    );
                    let reason = RefuseReason::Encryption {
                        ours: encrypt,
                        theirs: auth.encrypt,
                    };
                    return self
                        .refuse_handshake("encryption_mismatch", &why, reason)
                        .await;
                }
                let keys = SessionKeys::derive(
                    secret,
                    Protection::encrypted(encrypt),
                    Role::Producer,
                    &hello.nonce,
                    &ours,
                    &mac::transcript_hash(&hello_body),
                );
                (
                    Some(secret.producer_proof(&ours, &hello.nonce).to_vec()),
                    Some(keys),
                )
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
            let why = format!("its KV is incompatible: {m}");
            let reason = RefuseReason::Fingerprint {
                field: m.field.to_string(),
                ours: m.ours,
                theirs: m.theirs,
            };
            return self
                .refuse_handshake("fingerprint_mismatch", &why, reason)
                .await;
        }
        self.conn
            .write_message(&Message::HelloOk(HelloOk {
                version: PROTOCOL_VERSION,
                proof,
                // We read `Promote` during a background fetch (see `fetch`).
                promote: true,
                max_transfers: u32::try_from(self.shared.config.max_transfers_per_peer)
                    .unwrap_or(u32::MAX),
            }))
            .await?;
        // Accepted: the configured frame bound applies, and with a secret every frame from now
        // on, both ways, travels in protected records.
        self.accepted = true;
        self.conn.set_max_frame(self.shared.config.max_frame);
        if let Some(keys) = keys {
            self.conn.protect(&keys);
        }
        Ok(true)
    }

    /// Refuses the consumer in the handshake: counted and logged (once a minute per peer) as
    /// `label`, told `reason`; the connection then closes.
    async fn refuse_handshake(
        &mut self,
        label: &'static str,
        why: &(dyn std::fmt::Display + Sync),
        reason: RefuseReason,
    ) -> Result<bool, HandlerError> {
        self.shared.refuse(self.peer, label, why);
        self.conn
            .write_message(&Message::Refused(Refused { reason }))
            .await?;
        Ok(false)
    }

    /// Counts (and logs once) pins refused over the lookup cap or the peer's quota.
    fn refuse_pins(&self, refused: usize) {
        let cfg = &self.shared.config;
        self.shared.refuse(
            self.peer,
            "pin_quota",
            &format_args!(
                "{refused} blocks not pinned (max {} per lookup, {} per peer)",
                cfg.max_pins_per_lookup, cfg.max_pinned_per_peer
            ),
        );
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
        self.kv_request_id = if l.kv_request_id.len() <= MAX_KV_REQUEST_ID {
            l.kv_request_id
        } else {
            String::new()
        };
        let cfg = &self.shared.config;
        let lease = cfg.pin_lease;
        // Pins this lookup may take: its own cap, and what is left of the peer's quota. Hits
        // beyond are answered MISS (the consumer computes them).
        let want = l.hashes.len().min(cfg.max_pins_per_lookup);
        let allowed = self.shared.peers.reserve_pins(self.slot.ip(), want);
        let until = Instant::now() + lease;
        let statuses = self
            .shared
            .source
            .lookup_and_pin(&l.hashes[..allowed], lease);
        if statuses.len() != allowed {
            warn!(
                "p2p producer: BlockSource returned {} statuses for {} hashes",
                statuses.len(),
                allowed
            );
        }
        let leading = statuses
            .iter()
            .take_while(|s| **s == BlockStatus::Hit)
            .count()
            .min(allowed);
        self.shared
            .peers
            .release_pins(self.slot.ip(), allowed - leading);
        self.pins
            .extend(l.hashes[..leading].iter().map(|&h| (h, until)));
        if leading == allowed && allowed < l.hashes.len() {
            self.refuse_pins(l.hashes.len() - allowed);
        }
        debug!(peer = %self.peer, kv_request_id = %self.kv_request_id, blocks = l.hashes.len(), hits = leading, "p2p lookup");
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
        if !f.segments.is_empty() {
            return self.fetch_layers(f, deadline).await;
        }
        // Blocks pinned by the preceding lookup, in order.
        let looked_up: Vec<BlockHash> = self.pins.iter().map(|(h, _)| *h).collect();
        let (mut blocks, mut bytes) = (0u32, 0u64);
        let mut end = FetchEnd::Complete;
        let n = f.hashes.len();
        // Registered for every block asked for; dropped (deregistered) when the fetch ends,
        // early or not. A prefetch (`background`) yields our link to demand fetches until the
        // consumer promotes it.
        let class = if f.background {
            TrafficClass::Background
        } else {
            TrafficClass::Demand
        };
        let egress = cfg.egress.clone();
        let mut paced = egress
            .as_ref()
            .filter(|_| n > 0)
            .map(|p| (p.begin(n, class), p.chunk_blocks().max(1)));
        // Whether to watch for `Promote` while pacing: only a background fetch can be promoted,
        // and only a consumer that sent `background` (and saw our `HelloOk::promote`) sends one.
        let mut promotable = f.background;
        for (i, &hash) in f.hashes.iter().enumerate() {
            let index = u32::try_from(i).unwrap_or(u32::MAX);
            if let Some((p, chunk)) = paced.as_mut()
                && i % *chunk == 0
            {
                let upto = (i + *chunk).min(n);
                while promotable {
                    // Pacing is where a stalled prefetch waits, so that is where we listen.
                    // Reading is cancel safe: a frame cut short here resumes on the next read.
                    let read = tokio::select! {
                        biased;
                        () = p.reached(upto) => None,
                        m = self.conn.read_message() => Some(m),
                    };
                    let Some(read) = read else { break };
                    promotable = false;
                    match read? {
                        Some(Message::Promote(_)) => p.promote(),
                        None => {
                            return Err(HandlerError::Connection(ConnectionError::Io(
                                io::ErrorKind::UnexpectedEof.into(),
                            )));
                        }
                        Some(other) => {
                            return Err(HandlerError::Protocol(format!(
                                "unexpected {:?} frame during a fetch",
                                other.tag()
                            )));
                        }
                    }
                }
                p.reached(upto).await;
            }
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
            // Only the request the blocks were kept for releases a hand-off hold on them.
            self.shared.source.served(&self.kv_request_id, hash);
            self.shared.config.metrics.record_block(Direction::Out, len);
            if let Some(p) = &egress {
                let modelled = p.modelled_bytes_per_block();
                self.shared
                    .config
                    .metrics
                    .record_modelled(Direction::Out, modelled);
            }
            blocks += 1;
            bytes += len as u64;
        }
        drop(paced);
        self.release_pins();
        self.conn
            .write_message(&Message::Done(Done { blocks, bytes, end }))
            .await?;
        Ok(())
    }

    /// A layer-major fetch ([`crate::layers`]): resolves (pins and reads) the leading run of
    /// blocks it can serve, then sends segment 0 of each, segment 1 of each, … A layout that is
    /// malformed or does not match a block is refused (counted as `bad_layout`) and closes the
    /// connection, nothing sent.
    async fn fetch_layers(&mut self, f: Fetch, deadline: Instant) -> Result<(), HandlerError> {
        let layout = SegmentLayout::new(f.segments)
            .and_then(|l| l.check_positions(f.hashes.len()).map(|()| l))
            .map_err(|e| self.bad_layout(e))?;
        let looked_up: Vec<BlockHash> = self.pins.iter().map(|(h, _)| *h).collect();
        let mut served = Vec::with_capacity(f.hashes.len());
        let mut end = FetchEnd::Complete;
        for (i, &hash) in f.hashes.iter().enumerate() {
            let index = u32::try_from(i).unwrap_or(u32::MAX);
            if looked_up.get(i) != Some(&hash)
                && let Err(e) = self.pin_one(hash, deadline).await
            {
                end = e(index);
                break;
            }
            let Some(payload) = self.shared.source.read(hash) else {
                end = FetchEnd::Miss { index };
                break;
            };
            layout
                .check_block(payload.len())
                .map_err(|e| self.bad_layout(e))?;
            served.push((hash, payload));
        }
        let k = served.len();
        let requested = f.hashes.len();
        let block_len = layout.block_len().max(1);
        let egress = self.shared.config.egress.clone();
        let mut paced = egress
            .as_ref()
            .filter(|_| k > 0)
            .map(|p| p.begin(k, TrafficClass::Demand));
        let mut bytes = 0u64;
        for (segment, (offset, len)) in layout.ranges().enumerate() {
            for (block, (hash, payload)) in served.iter().enumerate() {
                if let Some(p) = paced.as_mut() {
                    // Each block-worth of bytes leaves when the pacer's link would carry it.
                    let upto = (bytes + len as u64).div_ceil(block_len);
                    p.reached((upto as usize).min(k)).await;
                }
                let part = payload.slice(offset..offset + len);
                let position = segment * requested + block;
                let index = u32::try_from(position).unwrap_or(u32::MAX);
                let frame = BlockFrame::new(index, *hash, part);
                self.conn.write_message(&Message::Block(frame)).await?;
                bytes += len as u64;
            }
        }
        drop(paced);
        let metrics = &self.shared.config.metrics;
        for (hash, payload) in &served {
            self.shared.source.served(&self.kv_request_id, *hash);
            metrics.record_block(Direction::Out, payload.len());
        }
        self.release_pins();
        let blocks = u32::try_from(k).unwrap_or(u32::MAX);
        self.conn
            .write_message(&Message::Done(Done { blocks, bytes, end }))
            .await?;
        Ok(())
    }

    /// Counts a refused segment layout; the protocol error that closes the connection.
    fn bad_layout(&self, e: LayoutError) -> HandlerError {
        self.shared.refuse(self.peer, "bad_layout", &e);
        HandlerError::Protocol(format!("{}: {e}", crate::session::BAD_LAYOUT))
    }

    /// Pin one block not covered by the lookup, waiting for it if pending; within the lookup
    /// cap and the peer's quota.
    async fn pin_one(
        &mut self,
        hash: BlockHash,
        deadline: Instant,
    ) -> Result<(), fn(u32) -> FetchEnd> {
        let ip = self.slot.ip();
        if self.pins.len() >= self.shared.config.max_pins_per_lookup
            || self.shared.peers.reserve_pins(ip, 1) == 0
        {
            self.refuse_pins(1);
            return Err(|index| FetchEnd::Miss { index });
        }
        let pinned = self.pin_one_reserved(hash, deadline).await;
        if pinned.is_err() {
            self.shared.peers.release_pins(ip, 1);
        }
        pinned
    }

    async fn pin_one_reserved(
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
                self.pins.push((hash, Instant::now() + lease));
                Ok(())
            }
            BlockStatus::Miss | BlockStatus::Pending => Err(|index| FetchEnd::Miss { index }),
        }
    }
}
