//! P2P KV transfer wired into the engine (`docs/architecture.md#p2p-pull`): the producer serves
//! this engine's CPU tier to peers; the consumer's pull client lands a peer's blocks in it.
//!
//! - [`CpuTierSource`] adapts the [`CpuTier`] to the transfer crate's [`BlockSource`]
//!   (atomic lookup + counted pins, checksums kept from store time, pending waiters);
//!   [`start_producer`] serves it, with the engine's secret, consumer allow-list, per-IP
//!   connection cap and pin quotas.
//! - [`Handoffs`] remembers which P/D reader (`remote_request_id`) each retained block was kept
//!   for, so that only that reader's fetch releases the retention: any other peer reading the
//!   same block leaves it held (before, any client's read freed blocks kept for a decoder).
//! - [`P2pConsumer`] owns the one shared [`PullClient`] of the engine (allow-list from
//!   `--p2p-allowed-peers`; `remote_host` is untrusted input), the pulls in flight (so a burst
//!   on one prefix moves it once) and the pull itself (blocks land in the CPU tier, verified,
//!   pinned, published as `BlockStored` CPU).
//! - Which blocks a request reads, and when, is decided once for every caller in
//!   [`crate::remote_read`] (llm-d `remote_kv_source` and P/D reads alike).
//! - A prefetch's pull ([`crate::prefetch`]) is background traffic on both ends' modelled links
//!   (it moves only while no demand pull does); a request that starts waiting for one of its
//!   blocks (joining it, or held until it lands) promotes it to demand for what is left, on this
//!   engine's link and, through the same connection, on the producer's.
//!
//! A pull never fails a request: whatever did not arrive is computed. Every outcome is counted
//! by reason in `kvmesh_p2p_pulls_total` (the engine's [`crate::metrics::EngineMetrics::p2p`]).

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::BoxFuture;
use kvmesh_core::{BlockHash, Fingerprint, RemoteKvSource, TokenId};
use kvmesh_transfer::{
    AllowList, AllowListError, BindError, BlockSink, BlockSource, BlockStatus as WireStatus,
    ClientConfig, IpNetError, ModelledDuration, PeerAddr, ProducerServer, PullClass, PullClient,
    PullReport, ServerConfig, SinkError, TrafficClass,
};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::compute::sim::verify_sim_block_payload;
use crate::cpu_tier::{BlockStatus, CpuTier, Landed, OffloadBlock, PinKind};
use crate::engine::{EngineHandle, EngineRequest};

/// How long blocks a pull landed stay pinned in our CPU tier if the request never finishes
/// normally (client gone before scheduling); normally they are unpinned at finish.
pub(crate) const LANDED_LEASE: Duration = Duration::from_secs(60);

/// How long to wait for the compute loop to report the GPU-tier prefix before using the CPU
/// tier's alone (a long step can hold the loop; a stale answer only costs a redundant pull).
const GPU_LOOKUP_WAIT: Duration = Duration::from_millis(50);

/// Most P/D hand-offs remembered at once; beyond it (after dropping expired ones) a new one is
/// not recorded and its retention simply runs to its expiry.
const MAX_HANDOFFS: usize = 65_536;

/// One request's retained blocks, each with the retentions a read by that request may release.
#[derive(Debug)]
struct Handoff {
    blocks: HashMap<BlockHash, usize>,
    expires: Instant,
}

/// Which blocks are retained for which P/D reader (the `remote_request_id` the engine returned),
/// shared by the P/D hook that retains them and the producer that serves them. The request id is
/// a key, not a proof: it travels in `kv_transfer_params` (the router's to hand out) and in the
/// reader's `Lookup`; it keeps other peers' reads from freeing what a decoder still needs.
#[derive(Debug, Default)]
pub struct Handoffs {
    map: parking_lot::Mutex<HashMap<String, Handoff>>,
}

impl Handoffs {
    /// Remember that `hashes` hold one retention each for `request_id`, until `expires`.
    pub fn record(&self, request_id: &str, hashes: &[BlockHash], expires: Instant) {
        if request_id.is_empty() || hashes.is_empty() {
            return;
        }
        let mut map = self.map.lock();
        if map.len() >= MAX_HANDOFFS && !map.contains_key(request_id) {
            let now = Instant::now();
            map.retain(|_, h| h.expires > now);
            if map.len() >= MAX_HANDOFFS {
                tracing::debug!(
                    request_id,
                    "p2p: hand-off table full; retention expires unread"
                );
                return;
            }
        }
        let entry = map.entry(request_id.to_owned()).or_insert_with(|| Handoff {
            blocks: HashMap::new(),
            expires,
        });
        entry.expires = entry.expires.max(expires);
        for h in hashes {
            *entry.blocks.entry(*h).or_default() += 1;
        }
    }

    /// Whether `request_id` holds a retention on `hash` it may release now; takes it if so.
    pub fn take(&self, request_id: &str, hash: BlockHash) -> bool {
        if request_id.is_empty() {
            return false;
        }
        let mut map = self.map.lock();
        let Entry::Occupied(mut slot) = map.entry(request_id.to_owned()) else {
            return false;
        };
        if slot.get().expires <= Instant::now() {
            slot.remove();
            return false;
        }
        let handoff = slot.get_mut();
        let taken = match handoff.blocks.get_mut(&hash) {
            Some(n) if *n > 1 => {
                *n -= 1;
                true
            }
            Some(_) => {
                handoff.blocks.remove(&hash);
                true
            }
            None => false,
        };
        if handoff.blocks.is_empty() {
            slot.remove();
        }
        taken
    }

    /// Requests with blocks still held for them (tests, debugging).
    pub fn len(&self) -> usize {
        self.map.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The CPU tier as a transfer [`BlockSource`].
#[derive(Debug, Clone)]
pub struct CpuTierSource {
    tier: Arc<CpuTier>,
    fingerprint: Fingerprint,
    handoffs: Arc<Handoffs>,
}

impl CpuTierSource {
    pub fn new(tier: Arc<CpuTier>, fingerprint: Fingerprint, handoffs: Arc<Handoffs>) -> Self {
        Self {
            tier,
            fingerprint,
            handoffs,
        }
    }
}

fn wire(s: BlockStatus) -> WireStatus {
    match s {
        BlockStatus::Hit => WireStatus::Hit,
        BlockStatus::Pending => WireStatus::Pending,
        BlockStatus::Miss => WireStatus::Miss,
    }
}

impl BlockSource for CpuTierSource {
    fn fingerprint(&self) -> Fingerprint {
        self.fingerprint.clone()
    }

    fn lookup_and_pin(&self, hashes: &[BlockHash], lease: Duration) -> Vec<WireStatus> {
        self.tier
            .lookup_and_pin(hashes, Instant::now() + lease)
            .into_iter()
            .map(wire)
            .collect()
    }

    fn read(&self, hash: BlockHash) -> Option<Bytes> {
        self.tier.get(hash)
    }

    fn read_with_checksum(&self, hash: BlockHash) -> Option<(Bytes, u32)> {
        // Releases nothing: only the reader a retention is for may release it (`served`).
        self.tier.get_with_checksum(hash)
    }

    fn served(&self, kv_request_id: &str, hash: BlockHash) {
        // The reader a P/D retention was kept for has its block: release that one retention.
        if self.handoffs.take(kv_request_id, hash) {
            self.tier.unpin_as(PinKind::Retain, &[hash]);
        }
    }

    fn unpin(&self, hashes: &[BlockHash]) {
        self.tier.unpin(hashes);
    }

    fn wait_ready(
        &self,
        hash: BlockHash,
        deadline: tokio::time::Instant,
    ) -> BoxFuture<'static, bool> {
        let tier = Arc::clone(&self.tier);
        Box::pin(async move { tier.wait_ready(hash, deadline).await })
    }
}

/// A running producer: the bound address and the server task.
#[derive(Debug)]
pub struct P2pProducer {
    pub addr: SocketAddr,
    pub task: JoinHandle<()>,
}

/// The producer's settings from the engine's `p2p` config: secret, consumer allow-list
/// (`--p2p-allowed-consumers`; empty = none), per-IP connection cap and pin quotas.
pub fn producer_config(engine: &EngineHandle) -> Result<ServerConfig, P2pConfigError> {
    let cfg = &engine.config().p2p;
    let allowed = crate::config::parse_allowed_consumers(&cfg.allowed_consumers)?;
    Ok(ServerConfig {
        secret: cfg.secret.clone(),
        encrypt: cfg.encrypt,
        allowed_ips: (!allowed.is_empty()).then_some(allowed),
        max_connections_per_ip: cfg.max_connections_per_ip,
        max_transfers_per_peer: cfg.max_fetches_per_peer,
        max_pins_per_lookup: cfg.max_pins_per_lookup,
        max_pinned_per_peer: cfg.max_pinned_per_peer,
        metrics: engine.metrics().p2p.clone(),
        // Serving is paced by this node's modelled link (sim), shared with its own pulls.
        egress: engine.link_pacer(),
        ..ServerConfig::default()
    })
}

/// Binds the producer on `host:port` when `--p2p-port` is set (port 0 picks a free one).
/// `handoffs` is shared with the P/D hook ([`P2pConsumer::handoffs`]). Beyond loopback the
/// engine's config must set a secret or an allow-list ([`P2pConfigError::Unprotected`]).
pub async fn start_producer(
    engine: &EngineHandle,
    host: &str,
    port: u16,
    handoffs: Arc<Handoffs>,
    cancel: CancellationToken,
) -> Result<P2pProducer, P2pConfigError> {
    let server = producer_config(engine)?;
    let source = CpuTierSource::new(engine.cpu_tier().clone(), engine.fingerprint(), handoffs);
    // A bracketed IPv6 host (`[::1]`, as `--host` may be written) does not resolve as a tuple.
    let bare = host.trim().trim_start_matches('[').trim_end_matches(']');
    let (addr, task) = ProducerServer::bind((bare, port), Arc::new(source), server, cancel)
        .await
        .map_err(|e| match e {
            BindError::Io(source) => P2pConfigError::Bind {
                addr: crate::config::host_port(host, port),
                source,
            },
            // (Encryption without a secret is refused by the config first.)
            refused @ (BindError::Unprotected { .. } | BindError::EncryptionWithoutSecret) => {
                P2pConfigError::Unprotected(refused)
            }
        })?;
    Ok(P2pProducer { addr, task })
}

/// What one pull did ([`crate::remote_read::ReadOutcome::Pulled`]).
#[derive(Debug, Clone)]
pub struct PrefixPull {
    pub report: PullReport,
    /// Blocks this pull newly stored in the CPU tier, in order: they count as external hits.
    pub external: Vec<BlockHash>,
    /// Those of `external` it also pinned (`Pull`): release them with [`release_pulled`] once
    /// the request is scheduled.
    pub pinned: Vec<BlockHash>,
    /// When the pull started (a modelled pull time runs from here).
    pub started: tokio::time::Instant,
}

/// When a pull must end, and how it ranks on the modelled links (a prefetch: background).
pub(crate) struct PullTerms {
    pub deadline: tokio::time::Instant,
    pub class: PullClass,
}

/// Checks each arriving block and lands it in the CPU tier as an ordinary cached block.
struct TierSink<'a> {
    tier: &'a CpuTier,
    prompt: &'a [TokenId],
    hashes: &'a [BlockHash],
    first: usize,
    block_size: usize,
    bytes_per_block: usize,
    /// Sim payloads are a function of the hash: verify content, not just the transport CRC.
    verify_sim: bool,
    lease_until: Instant,
    external: Vec<BlockHash>,
    pinned: Vec<BlockHash>,
    /// Why the sink refused a block (the pull stops there), for the log and
    /// `kvmesh_engine_p2p_sink_rejected_total{reason}`.
    rejected: Option<&'static str>,
}

impl BlockSink for TierSink<'_> {
    fn accept(&mut self, index: usize, hash: BlockHash, payload: Bytes) -> Result<(), SinkError> {
        let mut reject = |reason: &'static str| {
            self.rejected = Some(reason);
            SinkError {
                index,
                reason: reason.to_owned(),
            }
        };
        let i = self.first + index;
        let (hashes, prompt, bs) = (self.hashes, self.prompt, self.block_size);
        if hashes.get(i) != Some(&hash) {
            return Err(reject("unexpected block hash"));
        }
        if payload.len() != self.bytes_per_block {
            return Err(reject("payload_size"));
        }
        if self.verify_sim && !verify_sim_block_payload(hash, &payload) {
            return Err(reject("sim_payload_mismatch"));
        }
        let Some(tokens) = prompt.get(i * bs..(i + 1) * bs) else {
            return Err(reject("beyond_prompt"));
        };
        let block = OffloadBlock {
            hash,
            parent: i.checked_sub(1).map(|p| hashes[p]),
            tokens: tokens.to_vec(),
            payload,
        };
        match self.tier.insert_external_pinned(block, self.lease_until) {
            Landed::Pinned => {
                self.external.push(hash);
                self.pinned.push(hash);
            }
            // Pull pins hold their share of the tier; the block may be evicted before the
            // request is scheduled (then it is computed), but it does not stop the pull.
            Landed::Unpinned => self.external.push(hash),
            // Computed here meanwhile: a local hit, nothing to do.
            Landed::Present => {}
            Landed::Rejected => return Err(reject("cpu_tier_hard_pinned")),
        }
        Ok(())
    }
}

/// Why the P2P consumer or producer could not be built from the engine's config.
#[derive(Debug, thiserror::Error)]
pub enum P2pConfigError {
    #[error("--p2p-allowed-peers: {0}")]
    AllowList(#[from] AllowListError),
    #[error("--p2p-allowed-consumers: {0}")]
    AllowedConsumers(#[from] IpNetError),
    #[error("p2p producer: {0}")]
    Unprotected(BindError),
    #[error("cannot listen on {addr} (p2p): {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
}

/// The engine's P2P consumer: one shared pull client (pooled connections per peer).
#[derive(Debug)]
pub struct P2pConsumer {
    client: PullClient,
    timeout: Duration,
    pending_deadline: Duration,
    /// Pulls in flight, by every block they fetch. Concurrent requests for one prefix (a
    /// burst on a popular prefix) would each move the whole prefix; a later one waits for the
    /// first's blocks instead (they become local) and pulls only what is still missing. Every
    /// block is a key, not just the first, because a request arriving mid-pull already sees the
    /// landed blocks as local: its first missing block is one the pull has not landed yet.
    inflight: parking_lot::Mutex<HashMap<BlockHash, InflightPull>>,
    /// Blocks this engine retains for P/D readers, by request (shared with the producer).
    handoffs: Arc<Handoffs>,
}

/// One pull in flight, as seen by a request that needs its blocks.
#[derive(Debug, Clone)]
struct InflightPull {
    /// Changes (the sender drops) when the pull ends.
    done: watch::Receiver<()>,
    /// True once a request waits for the pull's blocks: a prefetch's pull then moves the rest
    /// as demand traffic. Demand pulls start true.
    urgent: Arc<watch::Sender<bool>>,
}

impl InflightPull {
    /// A request waits for this pull: make it demand (no-op if it already is).
    fn promote(&self) {
        self.urgent
            .send_if_modified(|urgent| !std::mem::replace(urgent, true));
    }
}

/// Holds a claim on an in-flight pull; dropping it wakes the requests waiting for it.
pub(crate) struct InflightClaim<'a> {
    map: &'a parking_lot::Mutex<HashMap<BlockHash, InflightPull>>,
    keys: Vec<BlockHash>,
    urgent: Arc<watch::Sender<bool>>,
    _done: watch::Sender<()>,
}

impl InflightClaim<'_> {
    /// The class the claimed pull runs in: a background claim (a prefetch) stays background
    /// until a request waiting for its blocks promotes it.
    pub(crate) fn pull_class(&self) -> PullClass {
        if *self.urgent.borrow() {
            PullClass::Demand
        } else {
            PullClass::Background {
                promote: self.urgent.subscribe(),
            }
        }
    }
}

impl Drop for InflightClaim<'_> {
    fn drop(&mut self) {
        let mut map = self.map.lock();
        for key in &self.keys {
            map.remove(key);
        }
        // `_done` drops right after: waiters' `changed()` returns.
    }
}

/// Either we pull (holding the claim) or someone else already is (wait on the receiver).
pub(crate) enum Inflight<'a> {
    Claimed(InflightClaim<'a>),
    Busy(watch::Receiver<()>),
}

impl P2pConsumer {
    /// From the engine's `p2p` config: allow-list, timeout, pending deadline, secret; counters
    /// go to the engine's `kvmesh_p2p_*` metrics.
    pub fn new(engine: &EngineHandle) -> Result<Self, P2pConfigError> {
        let cfg = &engine.config().p2p;
        let allowed = AllowList::parse(cfg.allowed_peers.iter().filter(|s| !s.trim().is_empty()))?;
        let client = PullClient::new(
            engine.fingerprint(),
            ClientConfig {
                allowed_peers: allowed,
                timeout: cfg.timeout,
                pending_deadline: cfg.pending_deadline,
                secret: cfg.secret.clone(),
                encrypt: cfg.encrypt,
                stripes: cfg.stripes,
                metrics: engine.metrics().p2p.clone(),
                // A modelled link paces the pull itself (its wall time is then the modelled
                // time, contention included); the ladder only gives a duration to report.
                modelled_duration: engine
                    .link_pacer()
                    .is_none()
                    .then(|| ModelledDuration(engine.modelled_block_pull_time())),
                ingress: engine.link_pacer(),
                ..ClientConfig::default()
            },
        );
        Ok(Self {
            client,
            timeout: cfg.timeout,
            pending_deadline: cfg.pending_deadline,
            inflight: parking_lot::Mutex::default(),
            handoffs: Arc::default(),
        })
    }

    /// The hand-off ledger: the P/D hook records retentions in it, the producer releases them
    /// only for the request they were kept for.
    pub fn handoffs(&self) -> &Arc<Handoffs> {
        &self.handoffs
    }

    /// Claims the blocks `want` (non-empty) for one pull of `class`, unless its first block is
    /// already part of another pull. Blocks further on that another pull holds are left to it
    /// (not re-keyed). A demand caller that finds another pull will wait for it, so that pull is
    /// promoted to demand (a prefetch must not delay the request now waiting for it).
    pub(crate) fn claim(&self, want: &[BlockHash], class: TrafficClass) -> Inflight<'_> {
        let mut map = self.inflight.lock();
        if let Some(pull) = want.first().and_then(|first| map.get(first)) {
            if class == TrafficClass::Demand {
                pull.promote();
            }
            return Inflight::Busy(pull.done.clone());
        }
        let (tx, rx) = watch::channel(());
        let urgent = Arc::new(watch::Sender::new(class == TrafficClass::Demand));
        let entry = InflightPull {
            done: rx,
            urgent: Arc::clone(&urgent),
        };
        let mut keys = Vec::with_capacity(want.len());
        for &hash in want {
            if let std::collections::hash_map::Entry::Vacant(slot) = map.entry(hash) {
                slot.insert(entry.clone());
                keys.push(hash);
            }
        }
        Inflight::Claimed(InflightClaim {
            map: &self.inflight,
            keys,
            urgent,
            _done: tx,
        })
    }

    /// Whether the pull in flight holding `hash` (if any) still runs as background traffic.
    pub fn inflight_is_background(&self, hash: BlockHash) -> Option<bool> {
        self.inflight.lock().get(&hash).map(|p| !*p.urgent.borrow())
    }

    /// Waits (until `deadline` at most) while any of `hashes` belongs to a pull in flight, which
    /// a request waiting for it makes demand traffic (a prefetch's pull is promoted).
    ///
    /// For the sim backend: a pull's blocks land in the CPU tier at loopback speed, but the
    /// pull holds its claim until the modelled transfer is done (the modelled link, or the
    /// profile's ladder in `--sim-link ladder` mode). A request that would use those blocks
    /// meanwhile (routed here as a local hit, say) must not get them sooner than the modelled
    /// link delivers them, or P2P arms would win time no real link gives.
    pub async fn wait_for_pulls_in_flight(
        &self,
        hashes: &[BlockHash],
        deadline: tokio::time::Instant,
    ) {
        loop {
            let busy = {
                let map = self.inflight.lock();
                hashes.iter().find_map(|h| map.get(h).cloned())
            };
            let Some(pull) = busy else {
                return;
            };
            pull.promote();
            let mut rx = pull.done;
            // Err from `changed` is the claim's drop (the pull ended): look again.
            if tokio::time::timeout_at(deadline, rx.changed())
                .await
                .is_err()
            {
                return;
            }
        }
    }

    /// Blocks being pulled right now (for tests and debugging): 0 when no pull is in flight.
    pub fn inflight_pulls(&self) -> usize {
        self.inflight.lock().len()
    }

    pub fn client(&self) -> &PullClient {
        &self.client
    }

    /// The budget of one read: a pull's timeout plus the pending deadline, from now.
    pub(crate) fn read_deadline(&self) -> tokio::time::Instant {
        tokio::time::Instant::now() + self.timeout + self.pending_deadline
    }

    /// Pulls blocks `hashes[first..]` of `prompt` (whose full-block hashes are `hashes`) from
    /// `source` into the CPU tier, within `deadline` (a request that already spent part of its
    /// budget waiting for another pull does not get a fresh one). Each block is verified (size;
    /// content when payloads derive from hashes; transport CRC), stored as an ordinary cached
    /// block (publishing `BlockStored` CPU) and pinned for [`LANDED_LEASE`] as it arrives.
    /// Never fails: see the report; blocks `first..first + report.blocks` are in the tier
    /// afterwards.
    pub(crate) async fn pull_prefix_until(
        &self,
        engine: &EngineHandle,
        source: &RemoteKvSource,
        prompt: &[TokenId],
        hashes: &[BlockHash],
        first: usize,
        terms: PullTerms,
    ) -> PrefixPull {
        let PullTerms { deadline, class } = terms;
        let started = tokio::time::Instant::now();
        let want = hashes.get(first..).unwrap_or_default();
        let mut sink = TierSink {
            tier: engine.cpu_tier(),
            prompt,
            hashes,
            first,
            block_size: engine.kv_layout().block_size,
            bytes_per_block: engine.kv_layout().bytes_per_block,
            verify_sim: engine.capabilities().hash_derived_payloads,
            lease_until: Instant::now() + LANDED_LEASE,
            external: Vec::new(),
            pinned: Vec::new(),
            rejected: None,
        };
        // The whole pull is bounded too (per-step timeouts alone could add up on a long prefix).
        let report = self
            .client
            .pull_with_class(
                PeerAddr::from(source),
                &source.kv_request_id,
                want,
                &mut sink,
                Some(deadline),
                class,
            )
            .await;
        if let Some(reason) = sink.rejected {
            let stats = engine.cpu_tier().stats();
            tracing::warn!(
                peer = %PeerAddr::from(source),
                reason,
                landed = sink.external.len(),
                cpu_used_bytes = stats.used_bytes,
                cpu_capacity_bytes = stats.capacity_bytes,
                "p2p pull stopped: our sink refused a block"
            );
            engine.metrics().p2p_sink_rejected(reason);
        }
        PrefixPull {
            report,
            external: sink.external,
            pinned: sink.pinned,
            started,
        }
    }
}

/// Leading blocks of `hashes` this engine holds: the GPU tier's prefix (asked of the compute
/// loop, briefly) continued by the CPU tier's, or the CPU tier's alone if longer.
pub async fn local_prefix_blocks(engine: &EngineHandle, hashes: &[BlockHash]) -> usize {
    let tier = engine.cpu_tier();
    let cpu_only = tier.lookup_prefix(hashes);
    if cpu_only == hashes.len() {
        return cpu_only;
    }
    let owned = hashes.to_vec();
    let gpu = tokio::time::timeout(
        GPU_LOOKUP_WAIT,
        engine.inspect_pool(move |p| p.lookup_prefix(&owned)),
    )
    .await
    .ok()
    .flatten()
    .unwrap_or(0)
    .min(hashes.len());
    (gpu + tier.lookup_prefix(&hashes[gpu..])).max(cpu_only)
}

/// Releases the pins a pull took on the blocks it landed for `req` (its
/// `pull_pinned_hashes`: not the blocks that landed unpinned at the pull-pin cap, whose release
/// would drop another request's pin on the same block). Call when the request finished
/// (requests that never finish lose them at lease expiry).
pub fn release_pulled(engine: &EngineHandle, req: &EngineRequest) {
    if !req.pull_pinned_hashes.is_empty() {
        engine
            .cpu_tier()
            .unpin_as(PinKind::Pull, &req.pull_pinned_hashes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_core::HashAlgo;

    fn consumer() -> P2pConsumer {
        let fingerprint = Fingerprint {
            model_id: "m".into(),
            kv_dtype: "sim".into(),
            block_size: 16,
            num_layers: 1,
            num_kv_heads: 1,
            head_dim: 1,
            hash_algo: HashAlgo::Sha256Cbor,
            none_hash: "00".into(),
        };
        P2pConsumer {
            client: PullClient::new(fingerprint, ClientConfig::default()),
            timeout: Duration::from_secs(1),
            pending_deadline: Duration::from_secs(1),
            inflight: parking_lot::Mutex::default(),
            handoffs: Arc::default(),
        }
    }

    #[test]
    fn a_hand_off_is_released_only_by_its_request_once_per_retention() {
        let h = Handoffs::default();
        let far = Instant::now() + Duration::from_secs(60);
        h.record("r1", &[BlockHash(1), BlockHash(2)], far);
        h.record("r1", &[BlockHash(1)], far); // retained twice for the same reader
        assert!(
            !h.take("evil", BlockHash(1)),
            "another request releases nothing"
        );
        assert!(!h.take("", BlockHash(1)));
        assert!(!h.take("r1", BlockHash(3)), "not retained for r1");
        assert!(h.take("r1", BlockHash(1)));
        assert!(h.take("r1", BlockHash(1)));
        assert!(!h.take("r1", BlockHash(1)), "two retentions, two releases");
        assert!(h.take("r1", BlockHash(2)));
        assert!(h.is_empty(), "a fully read hand-off is forgotten");
        // An expired hand-off releases nothing (its retention already ran out).
        h.record("r2", &[BlockHash(5)], Instant::now());
        assert!(!h.take("r2", BlockHash(5)));
        assert!(h.is_empty());
    }

    #[test]
    fn a_request_arriving_mid_pull_waits_for_the_blocks_still_on_the_wire() {
        let c = consumer();
        let prefix: Vec<BlockHash> = (1..=256).map(BlockHash).collect();
        let Inflight::Claimed(first) = c.claim(&prefix, D) else {
            panic!("nothing was in flight");
        };
        // 7 blocks have landed: a second request's first missing block is the 8th.
        assert!(matches!(c.claim(&prefix[7..], D), Inflight::Busy(_)));
        // A prefix the pull does not cover is pulled independently.
        assert!(matches!(
            c.claim(&[BlockHash(1000), BlockHash(1001)], D),
            Inflight::Claimed(_)
        ));
        drop(first);
        assert_eq!(
            c.inflight_pulls(),
            0,
            "a finished pull releases all its blocks"
        );
        assert!(matches!(c.claim(&prefix[7..], D), Inflight::Claimed(_)));
    }

    const D: TrafficClass = TrafficClass::Demand;
    const B: TrafficClass = TrafficClass::Background;

    /// A prefetch's pull stays background while only other prefetches meet it, and becomes
    /// demand the moment a request joins it; its pull class follows.
    #[tokio::test]
    async fn a_request_joining_a_prefetch_promotes_its_pull() {
        let c = consumer();
        let prefix: Vec<BlockHash> = (1..=64).map(BlockHash).collect();
        let Inflight::Claimed(prefetch) = c.claim(&prefix, B) else {
            panic!("nothing was in flight");
        };
        let PullClass::Background { mut promote } = prefetch.pull_class() else {
            panic!("a prefetch's pull is background");
        };
        assert_eq!(c.inflight_is_background(prefix[10]), Some(true));
        // Another prefetch of the same history waits for it without promoting it.
        assert!(matches!(c.claim(&prefix[3..], B), Inflight::Busy(_)));
        assert!(!*promote.borrow_and_update());
        // A request whose first missing block is in it joins, and promotes it.
        assert!(matches!(c.claim(&prefix[5..], D), Inflight::Busy(_)));
        assert!(*promote.borrow_and_update(), "joined but not promoted");
        assert_eq!(c.inflight_is_background(prefix[10]), Some(false));
        assert!(matches!(prefetch.pull_class(), PullClass::Demand));
        drop(prefetch);
        assert_eq!(c.inflight_is_background(prefix[10]), None);

        // A request held until a prefetch's blocks land (the sim's local-hit wait) promotes it.
        let Inflight::Claimed(prefetch) = c.claim(&prefix, B) else {
            panic!("nothing was in flight");
        };
        let soon = tokio::time::Instant::now() + Duration::from_millis(10);
        c.wait_for_pulls_in_flight(&prefix[40..41], soon).await;
        assert!(matches!(prefetch.pull_class(), PullClass::Demand));
        // A demand claim is demand from the start.
        drop(prefetch);
        let Inflight::Claimed(demand) = c.claim(&prefix, D) else {
            panic!("nothing was in flight");
        };
        assert!(matches!(demand.pull_class(), PullClass::Demand));
    }

    #[tokio::test]
    async fn a_request_using_blocks_of_a_pull_in_flight_waits_until_the_pull_ends() {
        let c = consumer();
        let prefix: Vec<BlockHash> = (1..=16).map(BlockHash).collect();
        let far = tokio::time::Instant::now() + Duration::from_secs(30);
        // Blocks nobody is pulling: no wait.
        tokio::time::timeout(
            Duration::from_secs(5),
            c.wait_for_pulls_in_flight(&[BlockHash(99)], far),
        )
        .await
        .expect("waited on blocks no pull holds");
        let Inflight::Claimed(pull) = c.claim(&prefix, D) else {
            panic!("nothing was in flight");
        };
        let wait = c.wait_for_pulls_in_flight(&prefix[3..5], far);
        tokio::pin!(wait);
        assert!(
            tokio::time::timeout(Duration::from_millis(50), &mut wait)
                .await
                .is_err(),
            "returned while the pull was still in flight"
        );
        drop(pull);
        tokio::time::timeout(Duration::from_secs(5), wait)
            .await
            .expect("the pull ended, the wait did not");
        // A pull that never ends holds a request no longer than its deadline.
        let Inflight::Claimed(_stuck) = c.claim(&prefix, D) else {
            panic!("nothing was in flight");
        };
        let soon = tokio::time::Instant::now() + Duration::from_millis(20);
        tokio::time::timeout(
            Duration::from_secs(5),
            c.wait_for_pulls_in_flight(&prefix, soon),
        )
        .await
        .expect("waited past its deadline");
    }
}
