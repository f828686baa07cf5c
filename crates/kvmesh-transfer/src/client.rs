//! The consumer: pulls a prefix of blocks from a peer into a [`BlockSink`].
//!
//! `pull` never returns an error: every failure becomes a typed [`PullOutcome`] and the report says
//! how many leading blocks reached the sink, so the caller computes the rest. The peer comes from
//! request input and is untrusted: it must match the allow-list before anything touches the
//! network (host names are matched as written and resolved only after they pass). Each step
//! (connect, handshake, every reply or block frame) is bounded by `timeout`; a block the producer
//! reported `Pending` may take `pending_deadline` longer. Handshaken connections are kept in a
//! small per-peer pool; a pooled connection that turns out dead before its first reply is replaced
//! once by a fresh one.
//!
//! A pull has a [`PullClass`]: demand (a request waits) or background (a prefetch). A background
//! pull is registered as background traffic on the consumer's modelled link and asks the producer
//! to pace it likewise (`Fetch::background`); when its promotion signal turns true (a request now
//! waits for its blocks) the rest of it becomes demand on the consumer's link and, if the
//! producer announced support, on the producer's (`Promote`, sent on the same connection).

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;
use std::time::Duration;

use kvmesh_core::{BlockHash, Fingerprint, RemoteKvSource};
use parking_lot::Mutex;
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::{Instant, timeout};

use crate::auth::{self, Secret};
use crate::connection::{Connection, ConnectionError};
use crate::frame::{DEFAULT_MAX_FRAME, HEADER_LEN, PREAUTH_MAX_FRAME};
use crate::limits::IpNet;
use crate::mac::{self, Role, SessionKeys};
use crate::message::{
    Auth, BlockStatus, Fetch, FetchEnd, Hello, Lookup, Message, PROTOCOL_VERSION, Promote,
    RefuseReason,
};
use crate::metrics::{Direction, TransferMetrics};
use crate::pacing::{LinkPacer, PacedTransfer, TrafficClass};
use crate::report::{PullOutcome, PullReason, PullReport};
use crate::source::BlockSink;

/// A peer to pull from: an address, or a host name as given in `remote_host`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum PeerAddr {
    Socket(SocketAddr),
    Host { host: String, port: u16 },
}

impl PeerAddr {
    /// From a `remote_host`/`remote_port` pair: IP literals (with or without `[]`) become socket
    /// addresses, anything else a lower-cased host name.
    pub fn new(host: &str, port: u16) -> Self {
        let bare = host.trim().trim_start_matches('[').trim_end_matches(']');
        match bare.parse::<IpAddr>() {
            Ok(ip) => PeerAddr::Socket(SocketAddr::new(ip, port)),
            Err(_) => PeerAddr::Host {
                host: bare.to_ascii_lowercase(),
                port,
            },
        }
    }

    pub fn port(&self) -> u16 {
        match self {
            PeerAddr::Socket(s) => s.port(),
            PeerAddr::Host { port, .. } => *port,
        }
    }
}

impl fmt::Display for PeerAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PeerAddr::Socket(s) => write!(f, "{s}"),
            PeerAddr::Host { host, port } => write!(f, "{host}:{port}"),
        }
    }
}

impl From<SocketAddr> for PeerAddr {
    fn from(s: SocketAddr) -> Self {
        PeerAddr::Socket(s)
    }
}

impl From<(&str, u16)> for PeerAddr {
    fn from((h, p): (&str, u16)) -> Self {
        PeerAddr::new(h, p)
    }
}

impl From<(String, u16)> for PeerAddr {
    fn from((h, p): (String, u16)) -> Self {
        PeerAddr::new(&h, p)
    }
}

impl From<&RemoteKvSource> for PeerAddr {
    fn from(r: &RemoteKvSource) -> Self {
        PeerAddr::new(&r.remote_host, r.remote_port)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum AllowEntry {
    Ip(IpAddr),
    Net(IpNet),
    Socket(SocketAddr),
    Host(String),
    HostPort(String, u16),
}

/// Which peers a consumer may contact. Entries: `ip`, `ip:port`, `[v6]:port`, a network
/// (`10.0.0.0/8`, `fd00::/8`: a pod network whose addresses are not known in advance), `host`,
/// `host:port`, or `*` (any peer — for closed test networks only). Empty = nobody.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllowList {
    any: bool,
    entries: Vec<AllowEntry>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid allow-list entry {0:?}")]
pub struct AllowListError(pub String);

impl AllowList {
    /// Allows no peer.
    pub fn none() -> Self {
        Self::default()
    }

    /// Allows every peer.
    pub fn any() -> Self {
        Self {
            any: true,
            entries: Vec::new(),
        }
    }

    pub fn parse<I, S>(items: I) -> Result<Self, AllowListError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut list = Self::none();
        for item in items {
            list.add(item.as_ref())?;
        }
        Ok(list)
    }

    /// Add one entry.
    pub fn add(&mut self, item: &str) -> Result<(), AllowListError> {
        let item = item.trim();
        let bad = || AllowListError(item.to_string());
        if item.is_empty() {
            return Err(bad());
        }
        if item == "*" {
            self.any = true;
            return Ok(());
        }
        let entry = if item.contains('/') {
            AllowEntry::Net(item.parse::<IpNet>().map_err(|_| bad())?)
        } else if let Ok(s) = item.parse::<SocketAddr>() {
            AllowEntry::Socket(s)
        } else if let Ok(ip) = item
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
        {
            AllowEntry::Ip(ip)
        } else if let Some((host, port)) = item.rsplit_once(':') {
            let port = port.parse::<u16>().map_err(|_| bad())?;
            if !valid_host(host) {
                return Err(bad());
            }
            AllowEntry::HostPort(host.to_ascii_lowercase(), port)
        } else {
            if !valid_host(item) {
                return Err(bad());
            }
            AllowEntry::Host(item.to_ascii_lowercase())
        };
        self.entries.push(entry);
        Ok(())
    }

    pub fn add_socket(&mut self, addr: SocketAddr) {
        self.entries.push(AllowEntry::Socket(addr));
    }

    /// May we contact this peer? Pure: no name resolution happens here.
    pub fn permits(&self, peer: &PeerAddr) -> bool {
        if self.any {
            return true;
        }
        self.entries.iter().any(|e| match (e, peer) {
            (AllowEntry::Ip(ip), PeerAddr::Socket(s)) => *ip == s.ip(),
            (AllowEntry::Net(net), PeerAddr::Socket(s)) => net.contains(s.ip()),
            (AllowEntry::Socket(a), PeerAddr::Socket(s)) => a == s,
            (AllowEntry::Host(h), PeerAddr::Host { host, .. }) => h == host,
            (AllowEntry::HostPort(h, p), PeerAddr::Host { host, port }) => h == host && p == port,
            _ => false,
        })
    }
}

fn valid_host(h: &str) -> bool {
    !h.is_empty()
        && h.len() <= 253
        && h.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_')
}

impl FromStr for AllowList {
    type Err = AllowListError;

    /// Comma-separated entries (the form of a `--p2p-allowed-peers` flag).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s.split(',').map(str::trim).filter(|x| !x.is_empty()))
    }
}

/// Consumer settings.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Peers we may contact; anything else fails with `NotAllowed` without touching the network.
    pub allowed_peers: AllowList,
    /// Bound on each step: connect, handshake, each reply and each block frame.
    pub timeout: Duration,
    /// Extra time the producer may take for blocks it reported `Pending`.
    pub pending_deadline: Duration,
    /// When set, the producer must share it (mutual challenge–response).
    pub secret: Option<Secret>,
    /// Largest frame accepted or sent.
    pub max_frame: usize,
    /// Idle handshaken connections kept per peer.
    pub max_idle_per_peer: usize,
    /// Overall bound on one `pull` (None = only the per-step `timeout`).
    pub max_pull_duration: Option<Duration>,
    pub metrics: TransferMetrics,
    /// Time-modelled consumers (the sim backend): the modelled transfer time of n blocks. The
    /// consumer holds a pulled prefix until then, so `kvmesh_p2p_pull_duration_seconds` records
    /// the longer of the wall time and this — what a request experienced, and what a router
    /// learning pull rates from these counters must see (loopback is faster than the model).
    pub modelled_duration: Option<ModelledDuration>,
    /// A time-modelled engine's link ([`crate::pacing`]): each pull is registered on it as an
    /// ingress transfer of the blocks it asks for when it starts, corrected to the blocks that
    /// arrived, and returns only once both the real pull and the modelled transfer are done.
    /// The pull-duration histogram then records that, contention included.
    pub ingress: Option<std::sync::Arc<dyn LinkPacer>>,
}

/// Who waits for a pull: decides its [`TrafficClass`] on both ends' modelled links.
#[derive(Debug, Clone, Default)]
pub enum PullClass {
    /// A request waits for the blocks.
    #[default]
    Demand,
    /// A prefetch: background traffic until `promote` reads true (a request now waits for the
    /// blocks), then demand for what is left. Already true at the start: a demand pull. A dropped
    /// sender leaves the class as it is.
    Background { promote: watch::Receiver<bool> },
}

impl PullClass {
    /// The promotion signal of a background pull not promoted yet (`None`: a demand pull).
    fn pending_promotion(&self) -> Option<watch::Receiver<bool>> {
        match self {
            PullClass::Demand => None,
            PullClass::Background { promote } => (!*promote.borrow()).then(|| promote.clone()),
        }
    }
}

/// Waits until `promote` reads true; `false` if its sender is gone first (never promoted).
async fn promoted(promote: &mut watch::Receiver<bool>) -> bool {
    promote.wait_for(|p| *p).await.is_ok()
}

/// Modelled transfer time of a number of blocks (see [`ClientConfig::modelled_duration`]).
#[derive(Clone)]
pub struct ModelledDuration(pub std::sync::Arc<dyn Fn(usize) -> Option<Duration> + Send + Sync>);

impl std::fmt::Debug for ModelledDuration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ModelledDuration(..)")
    }
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            allowed_peers: AllowList::none(),
            timeout: Duration::from_secs(5),
            pending_deadline: Duration::from_secs(2),
            secret: None,
            max_frame: DEFAULT_MAX_FRAME,
            max_idle_per_peer: 4,
            max_pull_duration: None,
            metrics: TransferMetrics::default(),
            modelled_duration: None,
            ingress: None,
        }
    }
}

/// Why one attempt ended early, and what that means for the connection.
#[derive(Debug)]
struct Stop {
    reason: PullReason,
    /// The stream ended cleanly (`Done`), so the connection can go back to the pool.
    reusable: bool,
    /// Failed before any reply on a pooled connection: try once more on a fresh one.
    stale: bool,
}

impl Stop {
    fn broken(reason: PullReason) -> Self {
        Self {
            reason,
            reusable: false,
            stale: false,
        }
    }

    fn clean(reason: PullReason) -> Self {
        Self {
            reason,
            reusable: true,
            stale: false,
        }
    }
}

fn conn_reason(e: &ConnectionError) -> PullReason {
    match e {
        ConnectionError::Checksum { .. } => PullReason::Checksum,
        ConnectionError::Mac { .. } => PullReason::MacFailed,
        ConnectionError::Message(_) => PullReason::Protocol,
        e if e.is_closed() => PullReason::PeerClosed,
        ConnectionError::Io(_) | ConnectionError::ClosedMidFrame => PullReason::PeerClosed,
    }
}

/// Logs a pull that stopped early: loudly when every pull to the peer will fail the same way until
/// an operator acts (allow-list, fingerprint, secret), quietly otherwise.
fn log_early_stop(peer: &PeerAddr, kv_request_id: &str, reason: &PullReason, blocks: usize) {
    if reason.is_misconfiguration() {
        tracing::warn!(%peer, kv_request_id, %reason, "p2p pull refused: fleet misconfigured");
    } else {
        tracing::debug!(%peer, kv_request_id, %reason, blocks, "p2p pull stopped early");
    }
}

/// Blocks and bytes delivered so far (survives an attempt being dropped on timeout).
#[derive(Debug, Default)]
struct Progress {
    blocks: usize,
    bytes: u64,
    /// Any reply arrived on this connection during this pull.
    replied: bool,
}

/// Pulls KV blocks from peers. One per engine; share it (`&self` methods, internal pool).
pub struct PullClient {
    fingerprint: Fingerprint,
    config: ClientConfig,
    /// Handshaken idle connections per peer address.
    pool: Mutex<HashMap<SocketAddr, Vec<Connection>>>,
}

impl fmt::Debug for PullClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PullClient")
            .field("fingerprint", &self.fingerprint)
            .field("config", &self.config)
            .finish()
    }
}

impl PullClient {
    pub fn new(fingerprint: Fingerprint, config: ClientConfig) -> Self {
        Self {
            fingerprint,
            config,
            pool: Mutex::default(),
        }
    }

    pub fn metrics(&self) -> &TransferMetrics {
        &self.config.metrics
    }

    pub fn config(&self) -> &ClientConfig {
        &self.config
    }

    /// Idle pooled connections to `addr` (for tests and debugging).
    pub fn idle_connections(&self, addr: SocketAddr) -> usize {
        self.pool.lock().get(&addr).map_or(0, Vec::len)
    }

    /// Pull `hashes` (a prefix, in order) from `peer` into `sink`, bounded overall by
    /// `max_pull_duration` if configured. Never fails: see the report.
    pub async fn pull(
        &self,
        peer: impl Into<PeerAddr>,
        kv_request_id: &str,
        hashes: &[BlockHash],
        sink: &mut dyn BlockSink,
    ) -> PullReport {
        let deadline = self.config.max_pull_duration.map(|d| Instant::now() + d);
        self.pull_with_deadline(peer, kv_request_id, hashes, sink, deadline)
            .await
    }

    /// As [`PullClient::pull`], with an explicit overall deadline (e.g. the moment recomputing
    /// would have finished). At the deadline the pull stops with `Timeout`, keeping the blocks
    /// already delivered.
    pub async fn pull_with_deadline(
        &self,
        peer: impl Into<PeerAddr>,
        kv_request_id: &str,
        hashes: &[BlockHash],
        sink: &mut dyn BlockSink,
        deadline: Option<Instant>,
    ) -> PullReport {
        self.pull_with_class(
            peer,
            kv_request_id,
            hashes,
            sink,
            deadline,
            PullClass::Demand,
        )
        .await
    }

    /// As [`PullClient::pull_with_deadline`], for a pull of `class`: a background pull (a
    /// prefetch) yields both ends' modelled links to demand pulls until it is promoted.
    pub async fn pull_with_class(
        &self,
        peer: impl Into<PeerAddr>,
        kv_request_id: &str,
        hashes: &[BlockHash],
        sink: &mut dyn BlockSink,
        deadline: Option<Instant>,
        class: PullClass,
    ) -> PullReport {
        let peer = peer.into();
        let start = Instant::now();
        let mut progress = Progress::default();
        let mut promote = class.pending_promotion();
        let traffic = if promote.is_some() {
            TrafficClass::Background
        } else {
            TrafficClass::Demand
        };
        // Registered for what we ask for, before the first byte: the modelled link starts its
        // setup while the real pull runs.
        let mut paced = self
            .config
            .ingress
            .as_ref()
            .filter(|_| !hashes.is_empty())
            .map(|p| p.begin(hashes.len(), traffic));
        // The real pull, promoting our ingress transfer if a request starts waiting meanwhile
        // (the session tells the producer itself). Scoped: `work` borrows the progress.
        let result = {
            let inner = self.pull_inner(
                &peer,
                kv_request_id,
                hashes,
                sink,
                &mut progress,
                promote.clone(),
            );
            let work = async {
                match deadline {
                    None => inner.await,
                    // Dropping the attempt drops its connection (it is mid-stream), never pools it.
                    Some(d) => tokio::time::timeout_at(d, inner)
                        .await
                        .unwrap_or(Err(PullReason::Timeout)),
                }
            };
            tokio::pin!(work);
            loop {
                let Some(rx) = promote.as_mut() else {
                    break (&mut work).await;
                };
                let now_demand = tokio::select! {
                    biased;
                    p = promoted(rx) => p,
                    r = &mut work => break r,
                };
                promote = None;
                if now_demand && let Some(p) = paced.as_mut() {
                    p.promote();
                }
            }
        };
        if let Some(p) = paced.as_mut() {
            // Only what arrived crosses the modelled link; nothing arrived, nothing to wait for.
            p.truncate(progress.blocks);
            if progress.blocks > 0 {
                Self::await_paced(p.as_mut(), progress.blocks, promote.take()).await;
            }
        }
        drop(paced);
        let outcome = match result {
            Ok(()) => PullOutcome::Complete,
            Err(reason) if progress.blocks > 0 => PullOutcome::Partial { reason },
            Err(reason) => PullOutcome::Failed { reason },
        };
        let duration = start.elapsed();
        let experienced = match &self.config.modelled_duration {
            Some(m) if progress.blocks > 0 => {
                (m.0)(progress.blocks).map_or(duration, |d| d.max(duration))
            }
            _ => duration,
        };
        self.config
            .metrics
            .record_pull(&outcome, experienced.as_secs_f64());
        if let Some(reason) = outcome.reason() {
            self.report_stop(&peer, kv_request_id, reason, progress.blocks);
        }
        PullReport {
            outcome,
            blocks: progress.blocks,
            bytes: progress.bytes,
            duration,
        }
    }

    /// Waits until `blocks` have crossed the modelled ingress link, promoting the transfer if
    /// `promote` turns true first (a request started waiting for a prefetch that has all its
    /// bytes from the wire but not yet from the model).
    async fn await_paced(
        p: &mut dyn PacedTransfer,
        blocks: usize,
        mut promote: Option<watch::Receiver<bool>>,
    ) {
        loop {
            let Some(rx) = promote.as_mut() else {
                return p.reached(blocks).await;
            };
            let now_demand = tokio::select! {
                biased;
                d = promoted(rx) => d,
                () = p.reached(blocks) => return,
            };
            promote = None;
            if now_demand {
                p.promote();
            }
        }
    }

    /// How many leading blocks of `hashes` `peer` can serve now (held, or being computed there),
    /// without fetching any: for a consumer split over processes, where one decides and another
    /// pulls (vLLM's scheduler and worker). The connection is not pooled: closing it releases
    /// the producer's pins, so nothing stays pinned for a fetch that may never come; the later
    /// pull pins again, and a block evicted in between is a miss there. A failure (refused,
    /// unreachable, nothing held: `Miss`) is counted as a failed pull with its reason; a
    /// successful lookup is not a pull.
    pub async fn lookup(
        &self,
        peer: impl Into<PeerAddr>,
        kv_request_id: &str,
        hashes: &[BlockHash],
    ) -> Result<usize, PullReason> {
        let peer = peer.into();
        let start = Instant::now();
        let result = self.lookup_inner(&peer, kv_request_id, hashes).await;
        if let Err(reason) = &result {
            let outcome = PullOutcome::Failed {
                reason: reason.clone(),
            };
            self.config
                .metrics
                .record_pull(&outcome, start.elapsed().as_secs_f64());
            self.report_stop(&peer, kv_request_id, reason, 0);
        }
        result
    }

    async fn lookup_inner(
        &self,
        peer: &PeerAddr,
        kv_request_id: &str,
        hashes: &[BlockHash],
    ) -> Result<usize, PullReason> {
        if !self.config.allowed_peers.permits(peer) {
            return Err(PullReason::NotAllowed);
        }
        if hashes.is_empty() {
            return Ok(0);
        }
        let addr = self.resolve(peer).await?;
        let mut conn = self.connect(addr).await?;
        self.config.metrics.record_connection(false);
        let step = self.config.timeout;
        let lookup = Message::Lookup(Lookup {
            kv_request_id: kv_request_id.to_string(),
            hashes: hashes.to_vec(),
        });
        Self::write(&mut conn, step, &lookup, false)
            .await
            .map_err(|stop| stop.reason)?;
        let reply = match Self::read(&mut conn, step, false)
            .await
            .map_err(|stop| stop.reason)?
        {
            Message::LookupReply(r) if r.statuses.len() == hashes.len() => r,
            _ => return Err(PullReason::Protocol),
        };
        match reply
            .statuses
            .iter()
            .take_while(|s| **s != BlockStatus::Miss)
            .count()
        {
            0 => Err(PullReason::Miss),
            usable => Ok(usable),
        }
    }

    /// Counts and logs why a pull stopped early, at a level that says who must act.
    fn report_stop(
        &self,
        peer: &PeerAddr,
        kv_request_id: &str,
        reason: &PullReason,
        blocks: usize,
    ) {
        if matches!(reason, PullReason::Protocol | PullReason::MacFailed) {
            self.config.metrics.record_protocol_error(Direction::In);
        }
        if *reason == PullReason::MacFailed {
            // Someone on the path altered or injected a frame; the pooled connection is gone.
            tracing::warn!(%peer, kv_request_id, "p2p pull stopped: a frame failed authentication");
        } else {
            log_early_stop(peer, kv_request_id, reason, blocks);
        }
    }

    async fn pull_inner(
        &self,
        peer: &PeerAddr,
        kv_request_id: &str,
        hashes: &[BlockHash],
        sink: &mut dyn BlockSink,
        progress: &mut Progress,
        promote: Option<watch::Receiver<bool>>,
    ) -> Result<(), PullReason> {
        if !self.config.allowed_peers.permits(peer) {
            return Err(PullReason::NotAllowed);
        }
        if hashes.is_empty() {
            return Ok(());
        }
        let addr = self.resolve(peer).await?;
        let mut retried = false;
        loop {
            let pooled = self.checkout(addr);
            let reused = pooled.is_some();
            let mut conn = match pooled {
                Some(c) => c,
                None => self.connect(addr).await?,
            };
            self.config.metrics.record_connection(reused);
            progress.replied = false;
            match self
                .session(
                    &mut conn,
                    kv_request_id,
                    hashes,
                    sink,
                    progress,
                    promote.clone(),
                )
                .await
            {
                Ok(()) => {
                    self.checkin(addr, conn);
                    return Ok(());
                }
                Err(stop) => {
                    if stop.reusable {
                        self.checkin(addr, conn);
                    }
                    if reused && stop.stale && !progress.replied && progress.blocks == 0 && !retried
                    {
                        retried = true;
                        continue;
                    }
                    return Err(stop.reason);
                }
            }
        }
    }

    async fn resolve(&self, peer: &PeerAddr) -> Result<SocketAddr, PullReason> {
        match peer {
            PeerAddr::Socket(s) => Ok(*s),
            PeerAddr::Host { host, port } => {
                let lookup = tokio::net::lookup_host((host.as_str(), *port));
                match timeout(self.config.timeout, lookup).await {
                    Err(_) => Err(PullReason::Timeout),
                    Ok(Err(_)) => Err(PullReason::Connect),
                    Ok(Ok(mut addrs)) => addrs.next().ok_or(PullReason::Connect),
                }
            }
        }
    }

    fn checkout(&self, addr: SocketAddr) -> Option<Connection> {
        self.pool.lock().get_mut(&addr).and_then(Vec::pop)
    }

    fn checkin(&self, addr: SocketAddr, conn: Connection) {
        let mut pool = self.pool.lock();
        let idle = pool.entry(addr).or_default();
        if idle.len() < self.config.max_idle_per_peer {
            idle.push(conn);
        }
    }

    async fn connect(&self, addr: SocketAddr) -> Result<Connection, PullReason> {
        let stream = match timeout(self.config.timeout, TcpStream::connect(addr)).await {
            Err(_) => return Err(PullReason::Timeout),
            Ok(Err(_)) => return Err(PullReason::Connect),
            Ok(Ok(s)) => s,
        };
        // Whatever the producer sends before accepting us is bounded small.
        let mut conn = Connection::new(stream, PREAUTH_MAX_FRAME);
        let (keys, promotes) = match timeout(self.config.timeout, self.handshake(&mut conn)).await {
            Err(_) => return Err(PullReason::Timeout),
            Ok(r) => r?,
        };
        conn.set_max_frame(self.config.max_frame);
        conn.set_peer_promotes(promotes);
        if let Some(keys) = keys {
            conn.enable_mac(&keys);
        }
        Ok(conn)
    }

    /// Returns the session keys when authenticated with a secret (then every later frame is
    /// MACed), `None` for an open producer; and whether the producer reads `Promote`.
    async fn handshake(
        &self,
        conn: &mut Connection,
    ) -> Result<(Option<SessionKeys>, bool), PullReason> {
        let ours = auth::nonce();
        let hello = Message::Hello(Hello {
            version: PROTOCOL_VERSION,
            fingerprint: self.fingerprint.clone(),
            nonce: ours,
        });
        // The keys are bound to the Hello exactly as the producer receives it.
        let transcript = match hello.encode(PREAUTH_MAX_FRAME) {
            Ok(f) => mac::transcript_hash(f.head.get(HEADER_LEN..).unwrap_or_default()),
            Err(_) => return Err(PullReason::Protocol),
        };
        conn.write_message(&hello)
            .await
            .map_err(|e| conn_reason(&e))?;
        let mut challenged = None;
        loop {
            let msg = conn.read_message().await.map_err(|e| conn_reason(&e))?;
            match msg {
                None => return Err(PullReason::PeerClosed),
                Some(Message::Challenge(c)) if challenged.is_none() => {
                    let Some(secret) = &self.config.secret else {
                        return Err(PullReason::AuthFailed);
                    };
                    let proof = secret.consumer_proof(&c.nonce, &ours).to_vec();
                    conn.write_message(&Message::Auth(Auth { proof }))
                        .await
                        .map_err(|e| conn_reason(&e))?;
                    challenged = Some(c.nonce);
                }
                Some(Message::HelloOk(ok)) => {
                    let promotes = ok.promote;
                    return match (&self.config.secret, challenged, ok.proof) {
                        (None, None, _) => Ok((None, promotes)),
                        (Some(secret), Some(theirs), Some(proof))
                            if auth::constant_time_eq(
                                &proof,
                                &secret.producer_proof(&theirs, &ours),
                            ) =>
                        {
                            let keys = SessionKeys::derive(
                                secret,
                                Role::Consumer,
                                &ours,
                                &theirs,
                                &transcript,
                            );
                            Ok((Some(keys), promotes))
                        }
                        // We hold a secret but the producer did not prove it holds it too.
                        _ => Err(PullReason::AuthFailed),
                    };
                }
                Some(Message::Refused(r)) => {
                    return Err(match r.reason {
                        RefuseReason::Fingerprint { field, .. } => {
                            PullReason::FingerprintMismatch { field }
                        }
                        RefuseReason::AuthFailed => PullReason::AuthFailed,
                        RefuseReason::NotAllowed => PullReason::NotAllowed,
                        RefuseReason::TooManyConnections => PullReason::Busy,
                        // Theirs from the producer's side: its `ours` is the version it speaks.
                        RefuseReason::Version { ours, .. } => PullReason::Version {
                            ours: PROTOCOL_VERSION,
                            theirs: ours,
                        },
                    });
                }
                Some(_) => return Err(PullReason::Protocol),
            }
        }
    }

    /// Read one message within `limit`, mapping every failure to a stop.
    async fn read(conn: &mut Connection, limit: Duration, stale_ok: bool) -> Result<Message, Stop> {
        match timeout(limit, conn.read_message()).await {
            Err(_) => Err(Stop::broken(PullReason::Timeout)),
            Ok(Ok(Some(m))) => Ok(m),
            Ok(Ok(None)) => Err(Stop {
                reason: PullReason::PeerClosed,
                reusable: false,
                stale: stale_ok,
            }),
            Ok(Err(e)) => {
                let reason = conn_reason(&e);
                let stale = stale_ok && reason == PullReason::PeerClosed;
                Err(Stop {
                    reason,
                    reusable: false,
                    stale,
                })
            }
        }
    }

    async fn write(
        conn: &mut Connection,
        limit: Duration,
        msg: &Message,
        stale_ok: bool,
    ) -> Result<(), Stop> {
        match timeout(limit, conn.write_message(msg)).await {
            Err(_) => Err(Stop::broken(PullReason::Timeout)),
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(Stop {
                reason: conn_reason(&e),
                reusable: false,
                stale: stale_ok,
            }),
        }
    }

    async fn session(
        &self,
        conn: &mut Connection,
        kv_request_id: &str,
        hashes: &[BlockHash],
        sink: &mut dyn BlockSink,
        progress: &mut Progress,
        promote: Option<watch::Receiver<bool>>,
    ) -> Result<(), Stop> {
        let step = self.config.timeout;
        let lookup = Lookup {
            kv_request_id: kv_request_id.to_string(),
            hashes: hashes.to_vec(),
        };
        Self::write(conn, step, &Message::Lookup(lookup), true).await?;
        let reply = match Self::read(conn, step, true).await? {
            Message::LookupReply(r) if r.statuses.len() == hashes.len() => r,
            _ => return Err(Stop::broken(PullReason::Protocol)),
        };
        progress.replied = true;
        let usable = reply
            .statuses
            .iter()
            .take_while(|s| **s != BlockStatus::Miss)
            .count();
        if usable == 0 {
            return Err(Stop::clean(PullReason::Miss));
        }
        let first_pending = reply.statuses[..usable]
            .iter()
            .position(|s| *s == BlockStatus::Pending)
            .unwrap_or(usable);
        let pending_wait_ms =
            u32::try_from(self.config.pending_deadline.as_millis()).unwrap_or(u32::MAX);
        // Still a prefetch nobody waits for (a promotion before this point makes it demand).
        let background = promote.as_ref().is_some_and(|rx| !*rx.borrow());
        let fetch = Fetch {
            hashes: hashes[..usable].to_vec(),
            pending_wait_ms,
            background,
        };
        Self::write(conn, step, &Message::Fetch(fetch), false).await?;
        // Listen for a promotion during the stream only where a `Promote` can be sent: an
        // older producer would close the connection on the unknown frame.
        let mut promote = promote.filter(|_| background && conn.peer_promotes());
        // Blocks from the first pending one on may take until the producer's wait deadline.
        let pending_limit = step + self.config.pending_deadline;
        loop {
            let next = progress.blocks;
            let limit = if next >= first_pending {
                pending_limit
            } else {
                step
            };
            let msg = if let Some(rx) = promote.as_mut() {
                // Reading is cancel safe: a frame cut short resumes on the next read.
                let event = tokio::select! {
                    biased;
                    d = promoted(rx) => Err(d),
                    m = Self::read(conn, limit, false) => Ok(m),
                };
                match event {
                    Ok(m) => m?,
                    Err(now_demand) => {
                        promote = None;
                        if now_demand {
                            // A request waits for the rest of this fetch: the producer paces
                            // it as demand from now on.
                            let promote = Message::Promote(Promote {});
                            Self::write(conn, step, &promote, false).await?;
                        }
                        continue;
                    }
                }
            } else {
                Self::read(conn, limit, false).await?
            };
            match msg {
                Message::Block(b) => {
                    let Some(&want) = hashes[..usable].get(next) else {
                        return Err(Stop::broken(PullReason::Protocol));
                    };
                    if b.index as usize != next || b.hash != want {
                        return Err(Stop::broken(PullReason::Protocol));
                    }
                    // The connection verified the checksum while the bytes arrived.
                    let len = b.payload.len();
                    if sink.accept(next, want, b.payload).is_err() {
                        return Err(Stop::broken(PullReason::SinkRejected));
                    }
                    progress.blocks += 1;
                    progress.bytes += len as u64;
                    self.config.metrics.record_block(Direction::In, len);
                    if let Some(p) = &self.config.ingress {
                        let modelled = p.modelled_bytes_per_block();
                        self.config.metrics.record_modelled(Direction::In, modelled);
                    }
                }
                Message::Done(d) => {
                    if d.blocks as usize != progress.blocks || d.bytes != progress.bytes {
                        return Err(Stop::broken(PullReason::Protocol));
                    }
                    return match d.end {
                        FetchEnd::Complete if progress.blocks == hashes.len() => Ok(()),
                        FetchEnd::Complete if progress.blocks == usable => {
                            Err(Stop::clean(PullReason::Miss))
                        }
                        FetchEnd::Complete => Err(Stop::broken(PullReason::Protocol)),
                        FetchEnd::Miss { .. } => Err(Stop::clean(PullReason::Miss)),
                        FetchEnd::PendingDeadline { .. } => {
                            Err(Stop::clean(PullReason::PendingDeadline))
                        }
                    };
                }
                _ => return Err(Stop::broken(PullReason::Protocol)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allow_list_matches_literally_without_resolving() {
        let list: AllowList = "10.0.0.1, 10.0.0.2:7777, engine-a:7777, engine-b, [::1]:9"
            .parse()
            .expect("parse");
        assert!(list.permits(&PeerAddr::new("10.0.0.1", 1)));
        assert!(list.permits(&PeerAddr::new("10.0.0.2", 7777)));
        assert!(!list.permits(&PeerAddr::new("10.0.0.2", 7778)));
        assert!(list.permits(&PeerAddr::new("Engine-A", 7777)));
        assert!(!list.permits(&PeerAddr::new("engine-a", 7778)));
        assert!(list.permits(&PeerAddr::new("engine-b", 1)));
        assert!(list.permits(&PeerAddr::new("[::1]", 9)));
        assert!(!list.permits(&PeerAddr::new("evil.example", 7777)));
        assert!(!AllowList::none().permits(&PeerAddr::new("10.0.0.1", 1)));
        assert!(AllowList::any().permits(&PeerAddr::new("anything", 1)));
        assert!("bad host!".parse::<AllowList>().is_err());
        assert!("h:notaport".parse::<AllowList>().is_err());
    }

    #[test]
    fn allow_list_networks_admit_their_addresses_only() {
        let list: AllowList = "10.244.0.0/16, fd00::/8".parse().expect("parse");
        assert!(list.permits(&PeerAddr::new("10.244.3.7", 7100)));
        assert!(list.permits(&PeerAddr::new("[fd00::5]", 7100)));
        assert!(!list.permits(&PeerAddr::new("10.245.0.1", 7100)));
        assert!(!list.permits(&PeerAddr::new("[fe80::1]", 7100)));
        // A host name is never matched against a network: the list does not resolve.
        assert!(!list.permits(&PeerAddr::new("pod.example", 7100)));
        assert!("10.0.0.0/33".parse::<AllowList>().is_err());
        assert!("host/8".parse::<AllowList>().is_err());
    }
}
