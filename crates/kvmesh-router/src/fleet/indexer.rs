//! Feeds the prefix index from engines' KV-event streams.
//!
//! One task per [`EventSource`] consumes a `kvmesh_events::subscribe` stream and applies its
//! batches to the shared [`PrefixIndex`] in sequence order, so one endpoint's events apply in the
//! order the engine published them while endpoints ingest independently (a slow or absent engine
//! never delays another: connecting happens inside the subscriber task).
//!
//! Loss policy (keeps lookups truthful):
//! - **Gap** (sequence jumped forward): if the source has a replay endpoint, the missing batches
//!   are requested from it and applied before the batch that revealed the gap. Whatever replay
//!   cannot supply means removals may have been lost, so the endpoint is marked *suspect*: its
//!   entries keep answering lookups (most are still right) for [`IndexerConfig::gap_grace`], and
//!   blocks the engine stores again meanwhile are remembered; when the grace period ends, every
//!   entry that was not re-stored is aged out (`PrefixIndex::expire_suspect`). A grace of zero
//!   clears the stale entries at once.
//! - **Restart** (sequence went backwards): a new engine incarnation whose cache starts empty, so
//!   the endpoint's entries are cleared.
//! - **Malformed** frames are counted and skipped; events the index refuses (orphans, bad token
//!   counts, unknown hashes) are counted per kind and skipped.
//! - **Joining**: a source with a replay endpoint asks it for everything its ring holds as soon
//!   as the source starts, not when the engine next publishes (an idle engine may not publish
//!   for minutes); live batches the replay already covered are skipped. [`Indexer::caught_up`]
//!   says when every source has made that attempt, which the router's readiness waits for.
//!   Without a replay endpoint, earlier batches were published before we subscribed, so at worst
//!   the index under-estimates until those blocks are stored again.
//!
//! Engines also publish their load on the same socket (topic [`LOAD_TOPIC`]); those messages are
//! handed, undecoded, to the [`LoadReportSink`] the router installs, outside the sequence checks.
//!
//! Trust (issue 37):
//! - A **bound** source (`bind: true`, the engine connects to us) admits publishers only from its
//!   [`PeerFilter`]: by default the addresses of the endpoint's own URL host, so a process that
//!   merely reaches the port cannot inject events credited to the endpoint. Refusals are counted
//!   (`kvmesh_indexer_refused_publishers`) and logged.
//! - **Stored blocks are rate-capped** per source ([`IndexerConfig::max_blocks_per_second`],
//!   [`StoreRate`]): a store event beyond the cap is skipped whole and counted
//!   (`kvmesh_indexer_rate_limited_blocks`); the index under-estimates, never over-estimates.
//!   Removals and clears always apply.
//! - The index itself shares `max_blocks` out per endpoint (`kvmesh_index`), so a flood on one
//!   source evicts only that endpoint's blocks.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvmesh_core::events::{EventBatch, KvEvent};
use kvmesh_core::exposition::FloatGauge;
use kvmesh_core::load_report::LOAD_TOPIC;
use kvmesh_events::{
    AllowedPeers, SubscriberConfig, SubscriberItem, SubscriberStats, request_replay_outcome,
    subscribe_with_stats,
};
use kvmesh_index::{EndpointId, IndexStats, PrefixIndex, StoreRate};
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::runtime::Handle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Where one endpoint's KV events come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventSource {
    /// The index identity of the engine publishing on this stream.
    pub endpoint: EndpointId,
    /// The endpoint's name: the `endpoint` label of this source's metrics (as in the router's).
    pub name: String,
    /// ZMQ endpoint, e.g. `tcp://10.0.0.5:5557`.
    pub zmq_endpoint: String,
    /// Bind `zmq_endpoint` (the engine connects to us) instead of connecting to it.
    pub bind: bool,
    /// Topic prefix to subscribe to (`""` = all).
    pub topic: String,
    /// The engine's replay (ROUTER) endpoint, used to fill sequence gaps and, when the router
    /// joins a stream already running, to catch up on what the engine's ring still holds.
    pub replay_endpoint: Option<String>,
}

/// Which publishers a bound source admits.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum PeerFilter {
    /// Any address (within the socket's connection caps).
    #[default]
    Any,
    /// These networks.
    Networks(AllowedPeers),
    /// The addresses this host name or IP literal resolves to when the source starts (the
    /// endpoint's URL host: the engine connects from there).
    Host(String),
}

/// Feeder tuning.
#[derive(Debug, Clone, PartialEq)]
pub struct IndexerConfig {
    /// How long a suspect endpoint's unconfirmed entries keep answering lookups after an
    /// unrecoverable gap before they are aged out.
    pub gap_grace: Duration,
    /// How often the index-size gauges are refreshed.
    pub stats_interval: Duration,
    /// Block hashes one source may announce as stored per second (bursts of
    /// [`kvmesh_index::BURST_SECONDS`] of it); beyond, store events are skipped and counted.
    pub max_blocks_per_second: u64,
}

impl Default for IndexerConfig {
    fn default() -> Self {
        IndexerConfig {
            gap_grace: Duration::from_secs(10),
            stats_interval: Duration::from_secs(5),
            max_blocks_per_second: kvmesh_index::DEFAULT_MAX_BLOCKS_PER_SECOND,
        }
    }
}

/// An endpoint whose stream has delivered nothing for this long, and nothing since the previous
/// check, is reported silent ([`Indexer::events_silent`]): "connected, nothing arrives".
pub const SILENT_AFTER: Duration = Duration::from_secs(5);

/// Counters of one source, as last read.
#[derive(Debug, Clone, PartialEq)]
pub struct SourceMetricsSnapshot {
    pub endpoint: EndpointId,
    pub zmq_endpoint: String,
    /// The bound/connected address reported by the subscriber (real port when binding port 0).
    pub listening: Option<String>,
    /// Batches applied (live or replayed).
    pub batches: u64,
    /// KV events applied.
    pub events: u64,
    /// Block hashes carried by applied events (the unit of the ingestion rate).
    pub block_events: u64,
    /// Unrecoverable sequence gaps, and the batches they lost.
    pub gaps: u64,
    pub lost_batches: u64,
    pub malformed: u64,
    pub restarts: u64,
    /// Replay requests that filled their gap completely / that failed or fell short.
    pub replays: u64,
    pub replay_failures: u64,
    /// Replay requests made on joining a stream already past seq 0, and those that failed.
    pub catch_ups: u64,
    pub catch_up_failures: u64,
    /// Events the index refused, all kinds (orphans included).
    pub apply_errors: u64,
    /// `BlockStored` events skipped because their parent was unknown.
    pub orphans: u64,
    /// Engine blocks aged out after a gap.
    pub aged_out_blocks: u64,
    /// Socket-level errors reported by the subscriber.
    pub socket_errors: u64,
    /// Block hashes in store events skipped by the rate cap.
    pub rate_limited_blocks: u64,
    /// Publishers refused at a bound socket for an address not allowed.
    pub refused_publishers: u64,
    pub suspect: bool,
    pub last_seq: Option<u64>,
    /// Seconds between the last batch's engine timestamp and its arrival.
    pub lag_seconds: f64,
}

/// Everything the feeder and the index report.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct IndexerMetricsSnapshot {
    /// Per source, sorted by endpoint.
    pub sources: Vec<SourceMetricsSnapshot>,
    pub index: IndexStats,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndpointLabel {
    endpoint: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    endpoint: String,
    kind: String,
}

/// Prometheus families shared by all source tasks.
#[derive(Clone, Default)]
struct Families {
    batches: Family<EndpointLabel, Counter>,
    events: Family<KindLabel, Counter>,
    block_events: Family<EndpointLabel, Counter>,
    gaps: Family<EndpointLabel, Counter>,
    lost_batches: Family<EndpointLabel, Counter>,
    malformed: Family<EndpointLabel, Counter>,
    restarts: Family<EndpointLabel, Counter>,
    replays: Family<KindLabel, Counter>,
    apply_errors: Family<KindLabel, Counter>,
    aged_out: Family<EndpointLabel, Counter>,
    socket_errors: Family<EndpointLabel, Counter>,
    rate_limited: Family<EndpointLabel, Counter>,
    refused_publishers: Family<EndpointLabel, Counter>,
    suspect: Family<EndpointLabel, Gauge>,
    lag: Family<EndpointLabel, FloatGauge>,
    index_blocks: Gauge,
    index_memberships: Gauge,
    index_bytes: Gauge,
    index_bytes_per_membership: FloatGauge,
    index_evictions: Gauge,
    index_share_evictions: Gauge,
    index_orphans: Gauge,
}

/// Handles into the families for one source (cheap clones of shared atomics).
#[derive(Clone)]
struct SourceMetrics {
    batches: Counter,
    block_events: Counter,
    gaps: Counter,
    lost_batches: Counter,
    malformed: Counter,
    restarts: Counter,
    replays_ok: Counter,
    replays_failed: Counter,
    catch_ups: Counter,
    catch_ups_failed: Counter,
    aged_out: Counter,
    socket_errors: Counter,
    rate_limited: Counter,
    refused_publishers: Counter,
    suspect: Gauge,
    lag: FloatGauge,
    /// Per event kind / error kind counters are looked up on use (few kinds).
    families: Families,
    label: String,
    /// Things that are not counters.
    state: Arc<Mutex<SourceState>>,
}

#[derive(Debug, Default)]
struct SourceState {
    listening: Option<String>,
    last_seq: Option<u64>,
    /// When the source started, and when its last batch arrived (for [`SILENT_AFTER`]).
    started_at: Option<Instant>,
    last_batch_at: Option<Instant>,
    /// `batches` at the previous [`Indexer::events_silent`] check.
    batches_at_check: u64,
    /// The source made its first catch-up attempt (or has nothing to catch up from).
    caught_up: bool,
}

impl SourceMetrics {
    fn new(families: &Families, name: &str) -> Self {
        let label = name.to_owned();
        let l = EndpointLabel {
            endpoint: label.clone(),
        };
        let k = |kind: &str| KindLabel {
            endpoint: label.clone(),
            kind: kind.to_owned(),
        };
        SourceMetrics {
            batches: handle(&families.batches, &l),
            block_events: handle(&families.block_events, &l),
            gaps: handle(&families.gaps, &l),
            lost_batches: handle(&families.lost_batches, &l),
            malformed: handle(&families.malformed, &l),
            restarts: handle(&families.restarts, &l),
            replays_ok: handle(&families.replays, &k("ok")),
            replays_failed: handle(&families.replays, &k("failed")),
            catch_ups: handle(&families.replays, &k("catch_up")),
            catch_ups_failed: handle(&families.replays, &k("catch_up_failed")),
            aged_out: handle(&families.aged_out, &l),
            socket_errors: handle(&families.socket_errors, &l),
            rate_limited: handle(&families.rate_limited, &l),
            refused_publishers: handle(&families.refused_publishers, &l),
            suspect: handle(&families.suspect, &l),
            lag: handle(&families.lag, &l),
            families: families.clone(),
            label,
            state: Arc::default(),
        }
    }

    fn kind(&self, kind: &str) -> KindLabel {
        KindLabel {
            endpoint: self.label.clone(),
            kind: kind.to_owned(),
        }
    }

    fn event(&self, kind: &str) -> Counter {
        self.families.events.get_or_create(&self.kind(kind)).clone()
    }

    fn apply_error(&self, kind: &str) -> Counter {
        self.families
            .apply_errors
            .get_or_create(&self.kind(kind))
            .clone()
    }

    fn snapshot(&self, source: &EventSource) -> SourceMetricsSnapshot {
        let fam = &self.families;
        let sum_kinds = |f: &Family<KindLabel, Counter>, kinds: &[&str]| -> u64 {
            kinds
                .iter()
                .map(|k| f.get(&self.kind(k)).map_or(0, |c| c.get()))
                .sum()
        };
        let state = self.state.lock();
        SourceMetricsSnapshot {
            endpoint: source.endpoint,
            zmq_endpoint: source.zmq_endpoint.clone(),
            listening: state.listening.clone(),
            batches: self.batches.get(),
            events: sum_kinds(&fam.events, &EVENT_KINDS),
            block_events: self.block_events.get(),
            gaps: self.gaps.get(),
            lost_batches: self.lost_batches.get(),
            malformed: self.malformed.get(),
            restarts: self.restarts.get(),
            replays: self.replays_ok.get(),
            replay_failures: self.replays_failed.get(),
            catch_ups: self.catch_ups.get(),
            catch_up_failures: self.catch_ups_failed.get(),
            apply_errors: sum_kinds(&fam.apply_errors, &ERROR_KINDS),
            orphans: sum_kinds(&fam.apply_errors, &["orphan"]),
            aged_out_blocks: self.aged_out.get(),
            socket_errors: self.socket_errors.get(),
            rate_limited_blocks: self.rate_limited.get(),
            refused_publishers: self.refused_publishers.get(),
            suspect: self.suspect.get() != 0,
            last_seq: state.last_seq,
            lag_seconds: self.lag.get(),
        }
    }

    /// Drops this source's series so removed endpoints do not linger in `/metrics`.
    fn forget(&self) {
        let f = &self.families;
        let l = EndpointLabel {
            endpoint: self.label.clone(),
        };
        for fam in [
            &f.batches,
            &f.block_events,
            &f.gaps,
            &f.lost_batches,
            &f.malformed,
            &f.restarts,
            &f.aged_out,
            &f.socket_errors,
            &f.rate_limited,
            &f.refused_publishers,
        ] {
            fam.remove(&l);
        }
        f.suspect.remove(&l);
        f.lag.remove(&l);
        for k in EVENT_KINDS {
            f.events.remove(&self.kind(k));
        }
        for k in ERROR_KINDS {
            f.apply_errors.remove(&self.kind(k));
        }
        for k in ["ok", "failed", "catch_up", "catch_up_failed"] {
            f.replays.remove(&self.kind(k));
        }
    }
}

/// A clone of the family's metric for `label`. A function on purpose: the read guard returned by
/// `get_or_create` must be dropped before the next `get_or_create` on the same family (which may
/// need the write lock), and a temporary inside a struct literal would live until the literal ends.
fn handle<L, M>(family: &Family<L, M>, label: &L) -> M
where
    L: Clone + std::hash::Hash + Eq,
    M: Clone + Default,
{
    family.get_or_create(label).clone()
}

const EVENT_KINDS: [&str; 3] = ["stored", "removed", "cleared"];
const ERROR_KINDS: [&str; 5] = [
    "token_count_mismatch",
    "block_size_mismatch",
    "orphan",
    "unresolved",
    "too_many_endpoints",
];

struct Running {
    source: EventSource,
    metrics: SourceMetrics,
    cancel: CancellationToken,
}

/// Where the engines' load reports go: the endpoint and the raw payload (the router decodes,
/// bounds and counts it).
pub type LoadReportSink = Arc<dyn Fn(EndpointId, &[u8]) + Send + Sync>;

struct Shared {
    index: Arc<PrefixIndex>,
    config: IndexerConfig,
    load_sink: std::sync::OnceLock<LoadReportSink>,
    families: Families,
    runtime: Handle,
    cancel: CancellationToken,
    sources: Mutex<HashMap<EndpointId, Running>>,
}

/// The KV-event feeder: owns one subscriber task per source.
pub struct Indexer {
    shared: Arc<Shared>,
}

impl Indexer {
    /// Starts one task per source (inside the current tokio runtime) with default tuning. Tasks
    /// stop when `cancel` fires.
    pub fn start(
        index: Arc<PrefixIndex>,
        sources: Vec<EventSource>,
        cancel: CancellationToken,
    ) -> Indexer {
        Self::start_with_config(index, sources, IndexerConfig::default(), cancel)
    }

    /// [`Indexer::start`] with explicit tuning.
    pub fn start_with_config(
        index: Arc<PrefixIndex>,
        sources: Vec<EventSource>,
        config: IndexerConfig,
        cancel: CancellationToken,
    ) -> Indexer {
        let shared = Arc::new(Shared {
            index,
            config,
            load_sink: std::sync::OnceLock::new(),
            families: Families::default(),
            runtime: Handle::current(),
            cancel,
            sources: Mutex::new(HashMap::new()),
        });
        let stats = Arc::downgrade(&shared);
        let interval = shared.config.stats_interval.max(Duration::from_millis(100));
        let stats_cancel = shared.cancel.clone();
        shared.runtime.spawn(async move {
            let mut tick = tokio::time::interval(interval);
            loop {
                tokio::select! {
                    _ = stats_cancel.cancelled() => return,
                    _ = tick.tick() => {}
                }
                let Some(shared) = stats.upgrade() else {
                    return;
                };
                // stats() walks every shard: keep it off the async worker.
                let s2 = Arc::clone(&shared);
                if let Ok(st) = tokio::task::spawn_blocking(move || s2.index.stats()).await {
                    publish_index_stats(&shared.families, &st);
                }
            }
        });
        let indexer = Indexer { shared };
        for s in sources {
            indexer.add_source(s);
        }
        indexer
    }

    /// Hands engines' load reports to `sink` from now on (sources added later; set it before
    /// adding any). Only the first call counts.
    pub fn set_load_sink(&self, sink: LoadReportSink) {
        let _ = self.shared.load_sink.set(sink);
    }

    /// Whether every source has made its first catch-up attempt (see the module header).
    pub fn caught_up(&self) -> bool {
        self.shared
            .sources
            .lock()
            .values()
            .all(|r| r.metrics.state.lock().caught_up)
    }

    /// The index this feeder fills.
    pub fn index(&self) -> &Arc<PrefixIndex> {
        &self.shared.index
    }

    /// Starts (or restarts, if the endpoint already has a source) consuming `source`, admitting
    /// any publisher if it binds. Restarting clears the endpoint's entries, since events may be
    /// lost in between.
    pub fn add_source(&self, source: EventSource) {
        self.add_source_admitting(source, PeerFilter::Any);
    }

    /// [`Indexer::add_source`], a bound source admitting only publishers `filter` allows.
    pub fn add_source_admitting(&self, source: EventSource, filter: PeerFilter) {
        let endpoint = source.endpoint;
        if let Some(old) = self.shared.sources.lock().remove(&endpoint) {
            old.cancel.cancel();
            self.shared.index.clear_endpoint(endpoint);
        }
        let metrics = SourceMetrics::new(&self.shared.families, &source.name);
        let cancel = self.shared.cancel.child_token();
        metrics.state.lock().started_at = Some(Instant::now());
        let task = SourceTask {
            source: source.clone(),
            index: Arc::clone(&self.shared.index),
            metrics: metrics.clone(),
            gap_grace: self.shared.config.gap_grace,
            rate: Mutex::new(StoreRate::new(self.shared.config.max_blocks_per_second)),
            rate_limited_logged: Default::default(),
            load_sink: self.shared.load_sink.get().cloned(),
        };
        self.shared.runtime.spawn(task.run(filter, cancel.clone()));
        self.shared.sources.lock().insert(
            endpoint,
            Running {
                source,
                metrics,
                cancel,
            },
        );
    }

    /// Stops consuming `endpoint`'s events and removes it from the index.
    pub fn remove_source(&self, endpoint: EndpointId) {
        if let Some(old) = self.shared.sources.lock().remove(&endpoint) {
            old.cancel.cancel();
            old.metrics.forget();
        }
        self.shared.index.remove_endpoint(endpoint);
    }

    /// The sources currently consumed.
    pub fn sources(&self) -> Vec<EventSource> {
        let mut v: Vec<EventSource> = self
            .shared
            .sources
            .lock()
            .values()
            .map(|r| r.source.clone())
            .collect();
        v.sort_by_key(|s| s.endpoint);
        v
    }

    /// The address a source's socket is bound/connected to, once it is (for `bind` sources on
    /// port 0 this carries the real port).
    pub fn listening(&self, endpoint: EndpointId) -> Option<String> {
        self.shared
            .sources
            .lock()
            .get(&endpoint)
            .and_then(|r| r.metrics.state.lock().listening.clone())
    }

    /// Batches received from `endpoint`'s event stream so far (None: no such source). Cheap.
    pub fn batches_received(&self, endpoint: EndpointId) -> Option<u64> {
        self.shared
            .sources
            .lock()
            .get(&endpoint)
            .map(|r| r.metrics.batches.get())
    }

    /// Whether `endpoint`'s stream is silent: no batch since the previous call, and none ever or
    /// none for [`SILENT_AFTER`] (a stream that went quiet while connected counts as much as one
    /// that never delivered). None: no such source. The router calls it every few placements.
    pub fn events_silent(&self, endpoint: EndpointId) -> Option<bool> {
        let sources = self.shared.sources.lock();
        let running = sources.get(&endpoint)?;
        let batches = running.metrics.batches.get();
        let mut state = running.metrics.state.lock();
        let new = batches.saturating_sub(std::mem::replace(&mut state.batches_at_check, batches));
        let quiet = state
            .last_batch_at
            .is_none_or(|at| at.elapsed() >= SILENT_AFTER);
        Some(new == 0 && quiet)
    }

    /// Counters of every source and the index's stats (walks the index: not for hot paths).
    pub fn metrics(&self) -> IndexerMetricsSnapshot {
        let mut sources: Vec<SourceMetricsSnapshot> = self
            .shared
            .sources
            .lock()
            .values()
            .map(|r| r.metrics.snapshot(&r.source))
            .collect();
        sources.sort_by_key(|s| s.endpoint);
        let index = self.shared.index.stats();
        publish_index_stats(&self.shared.families, &index);
        IndexerMetricsSnapshot { sources, index }
    }

    /// Registers the feeder's and the index's metrics (`kvmesh_indexer_*`, `kvmesh_index_*`).
    pub fn register_metrics(&self, registry: &mut Registry) {
        let f = self.shared.families.clone();
        registry.register(
            "kvmesh_indexer_batches",
            "KV-event batches applied",
            f.batches,
        );
        registry.register(
            "kvmesh_indexer_events",
            "KV events applied, by kind",
            f.events,
        );
        registry.register(
            "kvmesh_indexer_block_events",
            "Block hashes carried by applied KV events",
            f.block_events,
        );
        registry.register(
            "kvmesh_indexer_gaps",
            "Sequence gaps that replay could not fill",
            f.gaps,
        );
        registry.register(
            "kvmesh_indexer_lost_batches",
            "Batches lost in unrecoverable gaps",
            f.lost_batches,
        );
        registry.register(
            "kvmesh_indexer_malformed",
            "Undecodable KV-event messages skipped",
            f.malformed,
        );
        registry.register(
            "kvmesh_indexer_restarts",
            "Publisher restarts (sequence went backwards)",
            f.restarts,
        );
        registry.register(
            "kvmesh_indexer_replays",
            "Replay requests by kind: ok / failed (gap fills), catch_up / catch_up_failed (joining a running stream)",
            f.replays,
        );
        registry.register(
            "kvmesh_indexer_apply_errors",
            "KV events the index refused, by kind (orphan = unknown parent)",
            f.apply_errors,
        );
        registry.register(
            "kvmesh_indexer_aged_out_blocks",
            "Engine blocks aged out after a gap",
            f.aged_out,
        );
        registry.register(
            "kvmesh_indexer_socket_errors",
            "Subscriber socket errors",
            f.socket_errors,
        );
        registry.register(
            "kvmesh_indexer_rate_limited_blocks",
            "Block hashes in store events skipped for exceeding the per-source rate cap (index.max_blocks_per_second)",
            f.rate_limited,
        );
        registry.register(
            "kvmesh_indexer_refused_publishers",
            "Publishers refused at a bound KV-event socket for an address not allowed",
            f.refused_publishers,
        );
        registry.register(
            "kvmesh_indexer_suspect",
            "1 while an endpoint's entries may be stale",
            f.suspect,
        );
        registry.register(
            "kvmesh_indexer_lag_seconds",
            "Arrival time minus engine timestamp of the last batch",
            f.lag,
        );
        registry.register(
            "kvmesh_index_blocks",
            "Distinct router blocks in the prefix index",
            f.index_blocks,
        );
        registry.register(
            "kvmesh_index_memberships",
            "(block, endpoint, tier) memberships in the prefix index",
            f.index_memberships,
        );
        registry.register(
            "kvmesh_index_bytes",
            "Approximate heap bytes of the prefix index",
            f.index_bytes,
        );
        registry.register(
            "kvmesh_index_bytes_per_membership",
            "Approximate index bytes per membership",
            f.index_bytes_per_membership,
        );
        registry.register(
            "kvmesh_index_evicted_blocks",
            "Blocks evicted by the max_blocks bound",
            f.index_evictions,
        );
        registry.register(
            "kvmesh_index_share_evicted_blocks",
            "Blocks an endpoint evicted of its own for exceeding its share of index.max_blocks",
            f.index_share_evictions,
        );
        registry.register(
            "kvmesh_index_orphan_events",
            "BlockStored events skipped for an unknown parent",
            f.index_orphans,
        );
    }
}

fn publish_index_stats(f: &Families, st: &IndexStats) {
    let i = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    f.index_blocks.set(i(st.blocks));
    f.index_memberships.set(i(st.memberships));
    f.index_bytes.set(i(st.approx_bytes));
    f.index_bytes_per_membership.set(st.bytes_per_membership);
    f.index_evictions.set(i(st.evictions));
    f.index_share_evictions.set(i(st.share_evictions));
    f.index_orphans.set(i(st.orphan_events));
}

/// Where one source's stream stands.
#[derive(Default)]
struct StreamState {
    /// A first batch has been seen (a later first batch with seq > 0 means catching up).
    joined: bool,
    /// Catching up on connect applied every batch below this; the live stream resumes there.
    replayed_below: Option<u64>,
    /// When the suspect entries age out, if a gap could not be filled.
    expire_at: Option<Instant>,
}

/// One source's consumer.
struct SourceTask {
    source: EventSource,
    index: Arc<PrefixIndex>,
    metrics: SourceMetrics,
    gap_grace: Duration,
    /// The cap on stored blocks announced per second.
    rate: Mutex<StoreRate>,
    /// `rate_limited` when last logged.
    rate_limited_logged: std::sync::atomic::AtomicU64,
    load_sink: Option<LoadReportSink>,
}

/// How often a source's subscriber counters are copied into its metrics.
const SUBSCRIBER_STATS_INTERVAL: Duration = Duration::from_secs(1);

impl SourceTask {
    async fn run(self, filter: PeerFilter, cancel: CancellationToken) {
        let allowed_peers = match self.source.bind {
            true => match self.allowed_peers(filter, &cancel).await {
                Some(allowed) => allowed,
                None => return,
            },
            false => None,
        };
        let config = SubscriberConfig {
            endpoint: self.source.zmq_endpoint.clone(),
            bind: self.source.bind,
            topic: self.source.topic.clone(),
            side_topics: match self.load_sink {
                Some(_) => vec![LOAD_TOPIC.to_owned()],
                None => Vec::new(),
            },
            // Replay is driven here, so it can be counted and the loss policy applied.
            replay_endpoint: None,
            allowed_peers,
        };
        let (mut rx, stats) = subscribe_with_stats(config, cancel.child_token());
        let mut stream = StreamState::default();
        // Subscribed first, so nothing published after the replay's snapshot is missed.
        tokio::select! {
            _ = cancel.cancelled() => return,
            below = self.catch_up_on_connect() => {
                stream.replayed_below = below;
                stream.joined = below.is_some();
            }
        }
        self.metrics.state.lock().caught_up = true;
        let mut sync_stats = tokio::time::interval(SUBSCRIBER_STATS_INTERVAL);
        loop {
            let item = tokio::select! {
                _ = cancel.cancelled() => return,
                _ = sleep_until_opt(stream.expire_at) => {
                    stream.expire_at = None;
                    self.expire();
                    continue;
                }
                _ = sync_stats.tick() => {
                    self.sync_subscriber_stats(&stats);
                    continue;
                }
                item = rx.recv() => item,
            };
            let Some(item) = item else { return };
            self.handle(item, &mut stream).await;
        }
    }

    /// The allow-list of a bound source: `filter` with a host name resolved (retried every
    /// second until it resolves, since a bound socket that admitted anyone meanwhile would
    /// defeat it). `Some(None)` admits anyone; `None` means cancelled.
    async fn allowed_peers(
        &self,
        filter: PeerFilter,
        cancel: &CancellationToken,
    ) -> Option<Option<AllowedPeers>> {
        let host = match filter {
            PeerFilter::Any => return Some(None),
            PeerFilter::Networks(n) => return Some(Some(n)),
            PeerFilter::Host(host) => host,
        };
        loop {
            match tokio::net::lookup_host((host.as_str(), 0)).await {
                Ok(addrs) => {
                    let allowed = AllowedPeers::addresses(addrs.map(|a| a.ip()));
                    tracing::info!(endpoint = %self.source.name, allowed = %allowed.describe(), "KV-event socket admits publishers from the endpoint's own addresses");
                    return Some(Some(allowed));
                }
                Err(e) => {
                    tracing::warn!(endpoint = %self.source.name, host = %host, error = %e, "cannot resolve the endpoint's host to admit its KV-event publisher; retrying");
                }
            }
            tokio::select! {
                _ = cancel.cancelled() => return None,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    }

    /// Copies the subscriber's refusal counter into the metrics, and warns (at most once a
    /// second) when publishers were refused or stores were cut by the rate cap.
    fn sync_subscriber_stats(&self, stats: &SubscriberStats) {
        let limited = self.metrics.rate_limited.get();
        let logged = self
            .rate_limited_logged
            .swap(limited, std::sync::atomic::Ordering::Relaxed);
        if limited > logged {
            tracing::warn!(endpoint = %self.source.name, blocks = limited - logged, "KV-event store announcements skipped: beyond index.max_blocks_per_second (an engine cannot store that fast)");
        }
        let refused = stats.peers_not_allowed();
        let before = self.metrics.refused_publishers.get();
        if refused > before {
            self.metrics.refused_publishers.inc_by(refused - before);
            tracing::warn!(endpoint = %self.source.name, refused = refused - before, "KV-event publishers refused: their address is not the endpoint's (set kv_events.allowed_peers if the engine connects from another address)");
        }
    }

    async fn handle(&self, item: SubscriberItem, stream: &mut StreamState) {
        match item {
            SubscriberItem::Batch { seq, batch, .. } => {
                if let Some(below) = stream.replayed_below {
                    if seq < below {
                        return; // applied from the replay already
                    }
                    stream.replayed_below = None;
                    if seq > below && !self.fill_gap(below, seq).await {
                        self.suspect(stream);
                    }
                } else if !std::mem::replace(&mut stream.joined, true) && seq > 0 {
                    self.catch_up(seq).await;
                }
                self.apply_batch(seq, &batch);
            }
            SubscriberItem::Side { payload, .. } => {
                if let Some(sink) = &self.load_sink {
                    sink(self.source.endpoint, &payload);
                }
            }
            SubscriberItem::Gap { expected, got, .. } => {
                stream.joined = true;
                if !self.fill_gap(expected, got).await {
                    self.suspect(stream);
                }
            }
            other => self.note(other, stream),
        }
    }

    /// The subscriber's reports that need no replay: listening, publisher restart, malformed
    /// message, socket error.
    fn note(&self, item: SubscriberItem, stream: &mut StreamState) {
        match item {
            SubscriberItem::Listening { endpoint } => {
                tracing::info!(endpoint = %self.source.name, address = %endpoint, "KV-event subscriber ready");
                self.metrics.state.lock().listening = Some(endpoint);
            }
            SubscriberItem::Restart {
                last_seq, new_seq, ..
            } => self.restarted(last_seq, new_seq, stream),
            SubscriberItem::Malformed { seq, error } => {
                tracing::debug!(endpoint = %self.source.name, ?seq, %error, "malformed KV-event message skipped");
                self.metrics.malformed.inc();
            }
            SubscriberItem::Error { error } => {
                tracing::debug!(endpoint = %self.source.name, %error, "KV-event socket error");
                self.metrics.socket_errors.inc();
            }
            // Handled by `handle` (they need replay).
            SubscriberItem::Batch { .. }
            | SubscriberItem::Gap { .. }
            | SubscriberItem::Side { .. } => {}
        }
    }

    /// The publisher restarted (its sequence went backwards): everything it said before is void.
    fn restarted(&self, last_seq: u64, new_seq: u64, stream: &mut StreamState) {
        stream.joined = true;
        stream.replayed_below = None;
        tracing::info!(endpoint = %self.source.name, last_seq, new_seq, "KV-event publisher restarted; clearing its entries");
        self.metrics.restarts.inc();
        self.index.clear_endpoint(self.source.endpoint);
        self.metrics.suspect.set(0);
        stream.expire_at = None;
    }

    /// A gap that replay could not fill: the endpoint's entries may be stale. They are marked
    /// suspect and aged out after `gap_grace` unless confirmed by later events (at once when the
    /// grace is zero).
    fn suspect(&self, stream: &mut StreamState) {
        if self.gap_grace.is_zero() {
            self.index.mark_suspect(self.source.endpoint);
            self.expire();
        } else if stream.expire_at.is_none() {
            self.index.mark_suspect(self.source.endpoint);
            self.metrics.suspect.set(1);
            stream.expire_at = Some(Instant::now() + self.gap_grace);
        }
    }

    fn expire(&self) {
        let n = self.index.expire_suspect(self.source.endpoint);
        self.metrics.aged_out.inc_by(n as u64);
        self.metrics.suspect.set(0);
        tracing::info!(endpoint = %self.source.name, aged_out = n, "suspect endpoint's unconfirmed entries aged out");
    }

    fn apply_batch(&self, seq: u64, batch: &EventBatch) {
        let ep = self.source.endpoint;
        let arrived = Instant::now();
        for event in &batch.events {
            let (kind, blocks) = match event {
                KvEvent::BlockStored(s) => ("stored", s.block_hashes.len()),
                KvEvent::BlockRemoved(r) => ("removed", r.block_hashes.len()),
                KvEvent::AllBlocksCleared => ("cleared", 0),
            };
            self.metrics.event(kind).inc();
            self.metrics.block_events.inc_by(blocks as u64);
            if kind == "stored" && !self.rate.lock().admit(blocks, arrived.into_std()) {
                self.metrics.rate_limited.inc_by(blocks as u64);
                continue;
            }
            if let Err(e) = self.index.apply_event(ep, event) {
                tracing::debug!(endpoint = %ep, seq, error = %e, "KV event not (fully) applied");
                self.metrics.apply_error(e.kind()).inc();
            }
        }
        self.metrics.batches.inc();
        {
            let mut state = self.metrics.state.lock();
            state.last_seq = Some(seq);
            state.last_batch_at = Some(arrived);
        }
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        // The timestamp is the publisher's word: one from the future or more than a day old is a
        // clock problem (or garbage), not a lag, and would make the gauge read nonsense.
        let lag = now - batch.ts;
        if batch.ts.is_finite() && (0.0..86_400.0).contains(&lag) {
            self.metrics.lag.set(lag);
        }
    }

    /// Joining a stream already at `got` (the router started after the engine, or restarted):
    /// applies what the engine's replay ring still holds before it. History older than the ring
    /// is unknown rather than lost, so it raises no gap and no suspicion.
    async fn catch_up(&self, got: u64) {
        let Some(replay) = &self.source.replay_endpoint else {
            return;
        };
        self.metrics.catch_ups.inc();
        match request_replay_outcome(replay, 0).await {
            Ok(outcome) => {
                self.metrics.malformed.inc_by(outcome.malformed);
                let mut applied = 0usize;
                for (seq, batch) in outcome.batches {
                    if seq < got {
                        self.apply_batch(seq, &batch);
                        applied += 1;
                    }
                }
                tracing::info!(endpoint = %self.source.name, batches = applied, before_seq = got, "caught up on KV events published before the router joined");
            }
            Err(e) => {
                self.metrics.catch_ups_failed.inc();
                tracing::warn!(endpoint = %self.source.name, error = %e, "KV-event catch-up replay failed; starting from the live stream");
            }
        }
    }

    /// Joining: applies everything the engine's replay ring holds now. Returns the sequence
    /// number the live stream should resume at, or None when there is no replay endpoint, it did
    /// not answer, or its ring is empty (the first live batch then catches up as before).
    async fn catch_up_on_connect(&self) -> Option<u64> {
        let replay = self.source.replay_endpoint.as_ref()?;
        self.metrics.catch_ups.inc();
        match request_replay_outcome(replay, 0).await {
            Ok(outcome) => {
                self.metrics.malformed.inc_by(outcome.malformed);
                let mut next = None;
                for (seq, batch) in &outcome.batches {
                    self.apply_batch(*seq, batch);
                    next = Some(seq + 1);
                }
                tracing::info!(endpoint = %self.source.name, batches = outcome.batches.len(), "caught up on the engine's KV events on connect");
                next
            }
            Err(e) => {
                self.metrics.catch_ups_failed.inc();
                tracing::warn!(endpoint = %self.source.name, error = %e, "KV-event catch-up on connect failed; catching up on the first live batch instead");
                None
            }
        }
    }

    /// Applies batches `expected..got` from the replay endpoint; returns whether all came back.
    async fn fill_gap(&self, expected: u64, got: u64) -> bool {
        let mut next = expected;
        if let Some(replay) = &self.source.replay_endpoint {
            match request_replay_outcome(replay, expected).await {
                Ok(outcome) => {
                    self.metrics.malformed.inc_by(outcome.malformed);
                    for (seq, batch) in outcome.batches {
                        if seq == next && seq < got {
                            self.apply_batch(seq, &batch);
                            next += 1;
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(endpoint = %self.source.name, error = %e, "KV-event replay failed");
                }
            }
            if next >= got {
                self.metrics.replays_ok.inc();
                return true;
            }
            self.metrics.replays_failed.inc();
        }
        tracing::warn!(endpoint = %self.source.name, expected = next, got, "KV events lost; endpoint marked suspect");
        self.metrics.gaps.inc();
        self.metrics.lost_batches.inc_by(got - next);
        false
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_core::BlockHash;
    use kvmesh_core::events::{BlockStored, Medium};
    use kvmesh_index::IndexConfig;

    #[tokio::test]
    async fn index_size_in_metrics_follows_the_index_without_being_asked() {
        let index = Arc::new(PrefixIndex::new(IndexConfig {
            block_size: 16,
            ..IndexConfig::default()
        }));
        let config = IndexerConfig {
            stats_interval: Duration::from_millis(100),
            ..IndexerConfig::default()
        };
        let cancel = CancellationToken::new();
        let indexer =
            Indexer::start_with_config(Arc::clone(&index), Vec::new(), config, cancel.clone());
        tokio::time::sleep(Duration::from_millis(150)).await;
        let stored = BlockStored::run(
            Medium::Gpu,
            None,
            16,
            vec![BlockHash(1), BlockHash(2)],
            (0..32).collect(),
        );
        index
            .apply_event(EndpointId(0), &KvEvent::BlockStored(stored))
            .unwrap();
        let published = || indexer.shared.families.index_blocks.get();
        let deadline = Instant::now() + Duration::from_secs(5);
        while published() != 2 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(published(), 2, "kvmesh_index_blocks was not refreshed");
        cancel.cancel();
    }
}
