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

use std::collections::{HashMap, HashSet};
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
use crate::connection::Connection;
use crate::frame::{DEFAULT_MAX_FRAME, HEADER_LEN, PREAUTH_MAX_FRAME};
use crate::layers::{SegmentLayout, SegmentSink};
use crate::limits::IpNet;
use crate::mac::{self, Protection, Role, SessionKeys};
use crate::message::{
    Auth, BlockStatus, Hello, HelloOk, LookupReply, Message, PROTOCOL_VERSION, RefuseReason,
};
use crate::metrics::{Direction, TransferMetrics};
use crate::pacing::{LinkPacer, PacedTransfer, TrafficClass};
use crate::reorder::StripeWindow;
use crate::report::{LayerPullReport, Progress, PullOutcome, PullReason, PullReport};
use crate::session::{self, FetchPlan, Landing, LayerProgress, Steps, Stop, conn_reason, promoted};
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
    /// When set, the producer must share it (mutual challenge–response), and every frame after
    /// the handshake is authenticated ([`crate::mac`]).
    pub secret: Option<Secret>,
    /// Ask for KV encrypted in transit (AES-256-GCM; needs `secret`). The producer must be
    /// configured alike, or it refuses the connection (`PullReason::EncryptionMismatch`).
    pub encrypt: bool,
    /// Connections one pull may stripe its blocks over (block `i` on connection `i mod n`), for
    /// links one TCP stream cannot fill. At most the producer's fetch-stream cap per peer (it
    /// announces it in `HelloOk`); 1 = one connection, the protocol's plain sequence. Only one
    /// striped pull per peer runs at a time; others meanwhile pull over one connection.
    pub stripes: usize,
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

/// Default [`ClientConfig::stripes`]: one connection per pull. Measured with
/// `examples/p2p_bench.rs` (`docs/protocols.md#throughput-and-cpu-cost`): on loopback one stream
/// already moves more than the cores can process, and a second one only adds context switches.
pub const DEFAULT_STRIPES: usize = 1;

/// Blocks a stripe may read ahead of the next one the sink needs, per stripe of the pull.
const STRIPE_WINDOW_PER_STRIPE: usize = 4;

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
            encrypt: false,
            stripes: DEFAULT_STRIPES,
            max_frame: DEFAULT_MAX_FRAME,
            max_idle_per_peer: 4,
            max_pull_duration: None,
            metrics: TransferMetrics::default(),
            modelled_duration: None,
            ingress: None,
        }
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

/// Pulls KV blocks from peers. One per engine; share it (`&self` methods, internal pool).
pub struct PullClient {
    fingerprint: Fingerprint,
    config: ClientConfig,
    /// Handshaken idle connections per peer address.
    pool: Mutex<HashMap<SocketAddr, Vec<Connection>>>,
    /// Peers a striped pull is running against (one at a time per peer: see `stripe_gate`).
    striping: Mutex<HashSet<SocketAddr>>,
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
            striping: Mutex::default(),
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
        let outcome = PullOutcome::after(result, progress.blocks);
        let duration = start.elapsed();
        let experienced = match &self.config.modelled_duration {
            Some(m) if progress.blocks > 0 => {
                (m.0)(progress.blocks).map_or(duration, |d| d.max(duration))
            }
            _ => duration,
        };
        self.record_end(&peer, kv_request_id, &outcome, experienced, progress.blocks);
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
            self.record_end(&peer, kv_request_id, &outcome, start.elapsed(), 0);
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
        let reply = session::lookup(&mut conn, self.config.timeout, kv_request_id, hashes, false)
            .await
            .map_err(|stop| stop.reason)?;
        match leading_usable(&reply.statuses) {
            0 => Err(PullReason::Miss),
            usable => Ok(usable),
        }
    }

    /// Records a pull that ended (`blocks` delivered): its outcome and duration, and why it
    /// stopped early if it did.
    fn record_end(
        &self,
        peer: &PeerAddr,
        kv_request_id: &str,
        outcome: &PullOutcome,
        took: Duration,
        blocks: usize,
    ) {
        self.config.metrics.record_pull(outcome, took.as_secs_f64());
        if let Some(reason) = outcome.reason() {
            self.report_stop(peer, kv_request_id, reason, blocks);
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
        let mut first = None;
        let want = self.config.stripes.min(hashes.len());
        if want > 1
            && let Some(_gate) = self.stripe_gate(addr)
        {
            let (conn, reused) = self.acquire(addr).await?;
            // Never more stripes than the producer runs fetch streams for one peer: a stripe
            // waiting for a slot while the others wait for its blocks would stall the pull.
            let cap = match conn.peer_max_transfers() {
                0 => want,
                cap => want.min(cap as usize),
            };
            if cap > 1 {
                let job = Job {
                    kv_request_id,
                    hashes,
                    promote,
                };
                return self
                    .pull_striped(addr, (conn, reused), cap, job, sink, progress)
                    .await;
            }
            first = Some((conn, reused));
        }
        let mut retried = false;
        loop {
            let (mut conn, reused) = match first.take() {
                Some(c) => c,
                None => self.acquire(addr).await?,
            };
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

    /// A pooled connection to `addr`, or a new one; counted, and whether it was pooled.
    async fn acquire(&self, addr: SocketAddr) -> Result<(Connection, bool), PullReason> {
        let pooled = self.checkout(addr);
        let reused = pooled.is_some();
        let conn = match pooled {
            Some(c) => c,
            None => self.connect(addr).await?,
        };
        self.config.metrics.record_connection(reused);
        Ok((conn, reused))
    }

    /// The right to stripe a pull over several connections to `addr`, if no other pull of ours
    /// holds it. One striped pull per peer at a time: two would each hold some of the producer's
    /// fetch slots for that peer while waiting for the others (deadlock until the step timeout);
    /// plain pulls never wait for each other, so they always free their slots.
    fn stripe_gate(&self, addr: SocketAddr) -> Option<StripeGate<'_>> {
        let free = self.striping.lock().insert(addr);
        // Built only when taken: a gate dropped here would release another pull's right.
        free.then(|| StripeGate {
            striping: &self.striping,
            addr,
        })
    }

    fn steps(&self) -> Steps<'_> {
        Steps {
            timeout: self.config.timeout,
            pending_deadline: self.config.pending_deadline,
            metrics: &self.config.metrics,
            ingress: self.config.ingress.as_ref(),
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
        let (keys, ok) = match timeout(self.config.timeout, self.handshake(&mut conn)).await {
            Err(_) => return Err(PullReason::Timeout),
            Ok(r) => r?,
        };
        conn.set_max_frame(self.config.max_frame);
        conn.set_peer_capabilities(ok.promote, ok.max_transfers);
        if let Some(keys) = keys {
            conn.protect(&keys);
        }
        Ok(conn)
    }

    /// Returns the session keys when authenticated with a secret (then every later frame is
    /// protected), `None` for an open producer; and the producer's `HelloOk`.
    async fn handshake(
        &self,
        conn: &mut Connection,
    ) -> Result<(Option<SessionKeys>, HelloOk), PullReason> {
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
        let encrypt = self.config.encrypt;
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
                    conn.write_message(&Message::Auth(Auth { proof, encrypt }))
                        .await
                        .map_err(|e| conn_reason(&e))?;
                    challenged = Some(c.nonce);
                }
                Some(Message::HelloOk(ok)) => {
                    return match (&self.config.secret, challenged, &ok.proof) {
                        // An open producer cannot encrypt: never pull in clear what we meant to
                        // encrypt.
                        (None, None, _) if encrypt => Err(PullReason::EncryptionMismatch {
                            ours: true,
                            theirs: false,
                        }),
                        (None, None, _) => Ok((None, ok)),
                        (Some(secret), Some(theirs), Some(proof))
                            if auth::constant_time_eq(
                                proof,
                                &secret.producer_proof(&theirs, &ours),
                            ) =>
                        {
                            let keys = SessionKeys::derive(
                                secret,
                                Protection::encrypted(encrypt),
                                Role::Consumer,
                                &ours,
                                &theirs,
                                &transcript,
                            );
                            Ok((Some(keys), ok))
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
                        RefuseReason::Encryption { ours, theirs } => {
                            PullReason::EncryptionMismatch {
                                ours: theirs,
                                theirs: ours,
                            }
                        }
                    });
                }
                Some(_) => return Err(PullReason::Protocol),
            }
        }
    }

    /// Looks a pull's `hashes` up on `conn`: the leading run the producer can serve (at least
    /// one block; none is a clean `Miss`) and the index in it of the first pending block.
    /// `replied` turns true once the producer answered.
    async fn lookup_run(
        &self,
        conn: &mut Connection,
        kv_request_id: &str,
        hashes: &[BlockHash],
        replied: &mut bool,
    ) -> Result<(usize, usize), Stop> {
        let reply = session::lookup(conn, self.config.timeout, kv_request_id, hashes, true).await?;
        *replied = true;
        match leading_usable(&reply.statuses) {
            0 => Err(Stop::clean(PullReason::Miss)),
            usable => Ok((usable, first_pending(&reply.statuses[..usable]))),
        }
    }

    /// A plain pull's conversation on one connection: lookup, fetch of the leading run of
    /// blocks the producer holds (or is computing), each straight into the sink.
    async fn session(
        &self,
        conn: &mut Connection,
        kv_request_id: &str,
        hashes: &[BlockHash],
        sink: &mut dyn BlockSink,
        progress: &mut Progress,
        promote: Option<watch::Receiver<bool>>,
    ) -> Result<(), Stop> {
        let steps = self.steps();
        let (usable, first_pending) = self
            .lookup_run(conn, kv_request_id, hashes, &mut progress.replied)
            .await?;
        let plan = FetchPlan {
            hashes: &hashes[..usable],
            first_pending,
            // Still a prefetch nobody waits for (a promotion before this point makes it demand).
            background: promote.as_ref().is_some_and(|rx| !*rx.borrow()),
        };
        let mut landing = Landing::Sink { sink, progress };
        session::fetch(conn, &steps, plan, promote, &mut landing).await?;
        if usable < hashes.len() {
            return Err(Stop::clean(PullReason::Miss));
        }
        Ok(())
    }

    /// Pulls `hashes` layer-major ([`crate::layers`]): the producer sends segment 0 of every
    /// block it serves, then segment 1, …, each read straight into the memory `sink` gives for it,
    /// and the sink hears as each segment completes (so a consumer computing layer by layer can
    /// start on layer 0 while the rest is on the wire). Over one connection (never striped), not
    /// paced by an ingress model, bounded by `deadline`. Never fails: see the report, whose
    /// outcome counts whole blocks. A producer that cannot serve the layout (its blocks are
    /// another size) refuses it: `BadLayout`.
    pub async fn pull_layers(
        &self,
        peer: impl Into<PeerAddr>,
        kv_request_id: &str,
        hashes: &[BlockHash],
        layout: &SegmentLayout,
        sink: &mut dyn SegmentSink,
        deadline: Option<Instant>,
    ) -> LayerPullReport {
        let peer = peer.into();
        let start = Instant::now();
        let mut progress = LayerProgress::default();
        let result = {
            let inner =
                self.pull_layers_inner(&peer, kv_request_id, hashes, layout, sink, &mut progress);
            match deadline {
                None => inner.await,
                Some(d) => tokio::time::timeout_at(d, inner)
                    .await
                    .unwrap_or(Err(PullReason::Timeout)),
            }
        };
        let outcome = PullOutcome::after(result, progress.blocks);
        let duration = start.elapsed();
        self.record_end(&peer, kv_request_id, &outcome, duration, progress.blocks);
        LayerPullReport {
            outcome,
            blocks: progress.blocks,
            segments: progress.segments,
            segment_blocks: progress.segment_blocks,
            bytes: progress.bytes,
            duration,
        }
    }

    async fn pull_layers_inner(
        &self,
        peer: &PeerAddr,
        kv_request_id: &str,
        hashes: &[BlockHash],
        layout: &SegmentLayout,
        sink: &mut dyn SegmentSink,
        progress: &mut LayerProgress,
    ) -> Result<(), PullReason> {
        if !self.config.allowed_peers.permits(peer) {
            return Err(PullReason::NotAllowed);
        }
        if hashes.is_empty() {
            return Ok(());
        }
        if let Err(e) = layout.check_positions(hashes.len()) {
            tracing::warn!(error = %e, "p2p layer-major pull not started");
            return Err(PullReason::BadLayout);
        }
        let addr = self.resolve(peer).await?;
        let mut retried = false;
        loop {
            let (mut conn, reused) = self.acquire(addr).await?;
            progress.replied = false;
            let steps = self.steps();
            let result = async {
                let (usable, first_pending) = self
                    .lookup_run(&mut conn, kv_request_id, hashes, &mut progress.replied)
                    .await?;
                let plan = FetchPlan {
                    hashes: &hashes[..usable],
                    first_pending,
                    background: false,
                };
                session::fetch_layers(&mut conn, &steps, plan, layout, sink, progress).await?;
                if usable < hashes.len() {
                    return Err(Stop::clean(PullReason::Miss));
                }
                Ok(())
            }
            .await;
            match result {
                Ok(()) => {
                    self.checkin(addr, conn);
                    return Ok(());
                }
                Err(stop) => {
                    if stop.reusable {
                        self.checkin(addr, conn);
                    }
                    if reused && stop.stale && !progress.replied && !retried {
                        retried = true;
                        continue;
                    }
                    return Err(stop.reason);
                }
            }
        }
    }

    /// A pull striped over `want` connections (the first one given): stripe `s` of `k` looks up
    /// and fetches blocks `s, s + k, …` on its own connection, under its own pins; the blocks
    /// reach the sink in order through a bounded reorder window, and the first block missing
    /// (a miss, a dead stripe, a refusal) ends the prefix. Connections that cannot be opened only
    /// make the pull use fewer stripes.
    async fn pull_striped(
        &self,
        addr: SocketAddr,
        first: (Connection, bool),
        want: usize,
        job: Job<'_>,
        sink: &mut dyn BlockSink,
        progress: &mut Progress,
    ) -> Result<(), PullReason> {
        let mut conns = vec![first];
        let more = futures::future::join_all((1..want).map(|_| self.acquire(addr))).await;
        conns.extend(more.into_iter().flatten());
        let k = conns.len();
        let subsets: Vec<Vec<BlockHash>> = (0..k)
            .map(|s| job.hashes.iter().skip(s).step_by(k).copied().collect())
            .collect();
        let lookups = conns
            .into_iter()
            .zip(&subsets)
            .map(|((conn, reused), subset)| {
                self.stripe_lookup(addr, conn, reused, job.kv_request_id, subset)
            });
        let looked_up = futures::future::join_all(lookups).await;
        // The prefix every stripe can serve ends at the first block one of them cannot.
        let mut end = (job.hashes.len(), PullReason::Protocol);
        for (s, (_, reply)) in looked_up.iter().enumerate() {
            let boundary = match reply {
                Ok(r) => (s + k * leading_usable(&r.statuses), PullReason::Miss),
                Err(reason) => (s, reason.clone()),
            };
            if boundary.0 < end.0 {
                end = boundary;
            }
        }
        let usable = end.0;
        let steps = self.steps();
        let window = StripeWindow::new(STRIPE_WINDOW_PER_STRIPE * k, sink, progress);
        if usable < job.hashes.len() {
            window.fail(usable, end.1.clone());
        }
        let background = job.promote.as_ref().is_some_and(|rx| !*rx.borrow());
        let fetches = looked_up.into_iter().zip(&subsets).enumerate().filter_map(
            |(s, ((conn, reply), subset))| {
                let (mut conn, reply) = (conn?, reply.ok()?);
                let count = usable.saturating_sub(s).div_ceil(k).min(subset.len());
                let plan = FetchPlan {
                    hashes: &subset[..count],
                    first_pending: first_pending(&reply.statuses[..count]),
                    background,
                };
                let (window, steps, promote) = (&window, &steps, job.promote.clone());
                Some(async move {
                    if count == 0 {
                        // Nothing to fetch here: an empty lookup ends the pins this stripe's
                        // lookup took (without waiting for one of the producer's fetch slots).
                        let id = job.kv_request_id;
                        if session::lookup(&mut conn, steps.timeout, id, &[], false)
                            .await
                            .is_ok()
                        {
                            self.checkin(addr, conn);
                        }
                        return;
                    }
                    let mut landing = Landing::Stripe {
                        window,
                        stripe: s,
                        of: k,
                        received: 0,
                    };
                    let result =
                        session::fetch(&mut conn, steps, plan, promote, &mut landing).await;
                    let Landing::Stripe { received, .. } = landing else {
                        unreachable!("a stripe's landing")
                    };
                    match result {
                        Ok(()) => self.checkin(addr, conn),
                        Err(stop) => {
                            window.fail(s + received * k, stop.reason);
                            if stop.reusable {
                                self.checkin(addr, conn);
                            }
                        }
                    }
                })
            },
        );
        futures::future::join_all(fetches).await;
        match window.gap() {
            None => Ok(()),
            Some((_, reason)) => Err(reason),
        }
    }

    /// One stripe's lookup; a pooled connection that turns out dead before replying is replaced
    /// once by a fresh one. Returns the connection when it is still usable.
    async fn stripe_lookup(
        &self,
        addr: SocketAddr,
        mut conn: Connection,
        reused: bool,
        kv_request_id: &str,
        subset: &[BlockHash],
    ) -> (Option<Connection>, Result<LookupReply, PullReason>) {
        let step = self.config.timeout;
        match session::lookup(&mut conn, step, kv_request_id, subset, reused).await {
            Ok(r) => (Some(conn), Ok(r)),
            Err(stop) if stop.stale => {
                let mut fresh = match self.connect(addr).await {
                    Ok(c) => c,
                    Err(reason) => return (None, Err(reason)),
                };
                self.config.metrics.record_connection(false);
                match session::lookup(&mut fresh, step, kv_request_id, subset, false).await {
                    Ok(r) => (Some(fresh), Ok(r)),
                    Err(stop) => (None, Err(stop.reason)),
                }
            }
            Err(stop) => (None, Err(stop.reason)),
        }
    }
}

/// What a pull asks for, as the stripes of a striped pull share it.
struct Job<'a> {
    kv_request_id: &'a str,
    hashes: &'a [BlockHash],
    promote: Option<watch::Receiver<bool>>,
}

/// Held while a striped pull to `addr` runs ([`PullClient::stripe_gate`]).
struct StripeGate<'a> {
    striping: &'a Mutex<HashSet<SocketAddr>>,
    addr: SocketAddr,
}

impl Drop for StripeGate<'_> {
    fn drop(&mut self) {
        self.striping.lock().remove(&self.addr);
    }
}

/// Leading blocks a lookup reply makes worth fetching: up to the first `MISS`.
fn leading_usable(statuses: &[BlockStatus]) -> usize {
    statuses
        .iter()
        .take_while(|s| **s != BlockStatus::Miss)
        .count()
}

/// Index of the first `PENDING` status (the length if none).
fn first_pending(statuses: &[BlockStatus]) -> usize {
    statuses
        .iter()
        .position(|s| *s == BlockStatus::Pending)
        .unwrap_or(statuses.len())
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
