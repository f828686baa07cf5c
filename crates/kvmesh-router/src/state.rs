//! What every handler shares ([`RouterState`]); the hooks features register into the aggregated
//! route ([`Hook`], [`RequestHook`]); and how a placed request is recorded: the placement
//! metrics, `/debug/decisions`, and the `x-kvmesh-decision` summary.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::http::{HeaderMap, StatusCode};
use kvmesh_core::{ChainKey, TokenId};
use kvmesh_sched::Candidate;
use kvmesh_sched::cost_model::CostModel;
use kvmesh_sched::decisions::{DecisionLog, DecisionRecord};
use kvmesh_sched::plugins::p2p_source_producer::P2pDecision;
use kvmesh_sched::{Decision, Scheduler, SchedulingContext};
use kvmesh_text::Tokenizer;
use prometheus_client::registry::Registry;

use crate::config::RouterConfig;
use crate::fleet::endpoints::{Endpoint, EndpointSet};
use crate::fleet::feed::EventFeed;
use crate::fleet::prefix::PrefixLookup;
use crate::http::request::{ApiKind, ParsedRequest};
use crate::metrics::RouterMetrics;
use crate::pd::conversations::PdRouter;
use crate::route::admission_queue::AdmissionQueue;
use crate::route::reputation::SourceReputations;

/// Everything the handlers share.
pub struct RouterState {
    pub config: RouterConfig,
    pub endpoints: Arc<EndpointSet>,
    pub prefix: Arc<dyn PrefixLookup>,
    pub scheduler: Scheduler,
    pub cost_model: Arc<CostModel>,
    pub decisions: DecisionLog,
    pub metrics: Arc<RouterMetrics>,
    pub registry: Registry,
    pub client: reqwest::Client,
    pub tokenizer: Arc<dyn Tokenizer>,
    /// P/D disaggregation, when the config has a `pd:` section.
    pub pd: Option<Arc<PdRouter>>,
    /// The admission queue, when the config has a `admission_queue:` section.
    pub admission_queue: Option<Arc<AdmissionQueue>>,
    /// Client requests held now (bounded by `config.max_in_flight`).
    pub in_flight: AtomicUsize,
    /// The KV-event feed (what each endpoint's event stream has delivered).
    pub feed: Arc<dyn EventFeed>,
    /// The features hooked into the aggregated route (`prefetch:`, `replication:`), in order.
    pub hooks: Vec<Arc<dyn Hook>>,
    /// This replica's id in the marks on forwarded requests (`kvmesh_core::load_report`).
    pub replica_id: Arc<str>,
    /// When the router started: `/health` reports ready once the feed caught up or
    /// [`CATCH_UP_TIMEOUT`] after this.
    pub started_at: std::time::Instant,
    /// How each P2P source's pulls have gone lately (`p2p_reputation:`).
    pub reputation: SourceReputations,
}

/// The longest a starting router waits for its KV-event sources to catch up before it reports
/// ready anyway (an engine whose replay endpoint does not answer must not hold a replica out of
/// its Service for ever).
pub const CATCH_UP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// A feature around the aggregated route (prefetch, hot-prefix replication), registered at start
/// in [`RouterState::hooks`]. The route calls every hook at fixed points of each request and knows
/// nothing of what it does; a hook never delays or fails a request.
pub trait Hook: Send + Sync {
    /// A client request arrived, before placement: what this feature follows it with through the
    /// rest of its way (None: nothing for this request).
    fn on_arrival(
        &self,
        _s: &Arc<RouterState>,
        _arrival: &Arrival<'_>,
    ) -> Option<Box<dyn RequestHook>> {
        None
    }

    /// The request was placed (its decision recorded, its load reserved), before it is
    /// forwarded; once per attempt.
    fn after_placement(&self, _s: &Arc<RouterState>, _placed: &Placed<'_>) {}
}

/// A client request as it arrives.
pub struct Arrival<'a> {
    pub headers: &'a HeaderMap,
    pub request: &'a ParsedRequest,
}

/// A placement as hooks see it.
pub struct Placed<'a> {
    pub tokens: &'a [TokenId],
    /// The prompt's chain keys (full blocks), in the request's key space.
    pub keys: &'a [ChainKey],
    /// Whether that is the shared space (no LoRA adapter, no `cache_salt`). Copies ahead of
    /// demand send bare token ids, which engines hash unsalted, so they skip the others.
    pub shared: bool,
    /// The router's view of `eligible` just before the placement.
    pub candidates: &'a [Candidate],
    pub eligible: &'a [Arc<Endpoint>],
    /// Where it went.
    pub endpoint: &'a Arc<Endpoint>,
}

/// One feature's part in one request (see [`Hook::on_arrival`]).
pub trait RequestHook: Send {
    /// The engine `ep` answered with `status` (an attempt that got no answer is not reported).
    fn on_answer(&mut self, _s: &Arc<RouterState>, _ep: &Arc<Endpoint>, _status: StatusCode) {}

    /// The answer's body ended after at least one byte, however it ended: the prompt's blocks
    /// exist on the engine that answered.
    fn on_end(self: Box<Self>) {}
}

/// Placements on an endpoint after which an event stream that delivered nothing is reported: an
/// engine publishes a batch for every request that stores a block, so a dozen placements with no
/// batch means the router is routing blind (wrong address, bind/connect mismatch, topic).
pub const SILENT_EVENTS_AFTER_PLACEMENTS: u64 = 16;

/// One client request counted against `max_in_flight`; released when dropped (with the response
/// body, so streaming requests count until their stream ends).
pub(crate) struct InFlight(Arc<RouterState>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.0.metrics.in_flight.dec();
    }
}

/// Takes an in-flight slot, or None when the router is at `max_in_flight`.
pub(crate) fn enter(s: &Arc<RouterState>) -> Option<InFlight> {
    let max = s.config.max_in_flight;
    s.in_flight
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < max).then_some(n + 1)
        })
        .ok()?;
    s.metrics.in_flight.inc();
    Some(InFlight(Arc::clone(s)))
}

/// Seconds since the Unix epoch (decision records carry wall-clock time).
pub(crate) fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// How a placed request gets its prompt's KV: `pull_named` (told to read it from a peer),
/// `local_hit` (the chosen endpoint holds some of it) or `cold`.
pub(crate) fn outcome(reads_from_peer: bool, local_tokens: u64) -> &'static str {
    if reads_from_peer {
        "pull_named"
    } else if local_tokens > 0 {
        "local_hit"
    } else {
        "cold"
    }
}

/// One scheduled placement, as the router reports it.
pub(crate) struct Placement<'a> {
    pub kind: ApiKind,
    pub ctx: &'a SchedulingContext<'a>,
    /// `pull_named` / `local_hit` / `cold`, or a P/D leg's record outcome.
    pub outcome: &'static str,
    /// Tokenize + keys + lookup + pipeline, without time held by the admission queue.
    pub scheduling: Duration,
    pub held: Duration,
}

impl RouterState {
    /// Counts a placement on `ep` and, every [`SILENT_EVENTS_AFTER_PLACEMENTS`] placements,
    /// checks that its configured event stream delivered something since the previous check
    /// (connected or not, a stream quiet while the endpoint gets work is blind); if not, warns once
    /// (log, `kvmesh_router_endpoint_events_silent`, `/debug/endpoints`).
    pub(crate) fn note_placement(&self, ep: &Endpoint) {
        let placed = ep.placed.fetch_add(1, Ordering::Relaxed) + 1;
        // Checked every N-th placement, not on each: the feed's source table is behind a lock.
        if !placed.is_multiple_of(SILENT_EVENTS_AFTER_PLACEMENTS) || ep.spec.kv_events.is_none() {
            return;
        }
        let silent = self.feed.events_silent(ep.id) == Some(true);
        let was = ep.events_silent.swap(silent, Ordering::Relaxed);
        if silent && !was {
            let events = ep
                .spec
                .kv_events
                .as_ref()
                .map_or("", |k| k.endpoint.as_str());
            tracing::warn!(
                endpoint = %ep.name,
                kv_events = events,
                placed,
                "no KV event from this endpoint after {placed} requests: the router places it as if it \
                 held nothing (check the events address, bind vs connect, and topic)"
            );
        }
    }

    /// Counts a placement on `endpoint` in the placement metrics.
    pub(crate) fn count_placement(
        &self,
        profile: &str,
        endpoint: &str,
        outcome: &'static str,
        p2p: Option<&P2pDecision>,
        scheduling: Duration,
    ) {
        self.metrics.placed(profile, endpoint, outcome, p2p);
        self.metrics
            .scheduling_seconds
            .observe(scheduling.as_secs_f64());
    }

    /// Adds a decision to `/debug/decisions`.
    pub(crate) fn record(&self, p: Placement<'_>, decision: Decision) {
        self.decisions.push(Arc::new(DecisionRecord {
            request_id: p.ctx.request_id.to_owned(),
            at: unix_now(),
            path: p.kind.path().to_owned(),
            prompt_tokens: p.ctx.prompt_tokens,
            blocks: p.ctx.total_blocks,
            scheduling_us: p.scheduling.as_micros() as u64,
            held_ms: p.held.as_secs_f64() * 1000.0,
            outcome: p.outcome,
            decision,
        }));
    }
}
