//! The aggregated route: one engine computes the prompt and decodes.
//!
//! Block keys are computed once; the index lookup, the admission queue (when configured) and the
//! profile's pipeline decide the endpoint and, if the profile has a P2P plugin, a peer to pull the
//! prefix from (`remote_kv_source`, merged into the client's `kv_transfer_params`). Load is
//! reserved with a [`crate::fleet::load::LoadGuard`] before forwarding and released by the
//! response tap. The features registered as hooks ([`crate::state::Hook`]) are called at fixed
//! points: on arrival, after each placement, when an engine answers and when its answer ends.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use kvmesh_core::{ChainKey, KvTransferParams};
use kvmesh_index::EndpointId;
use kvmesh_sched::admission_queue::Work;
use kvmesh_sched::{Backlog, Candidate, Decision, Profile, SchedulingContext};
use serde_json::json;

use crate::error::ApiError;
use crate::fleet::endpoints::Endpoint;
use crate::fleet::load::LoadGuard;
use crate::http::request::{ApiKind, ParsedRequest};
use crate::route::admission_queue::{Exit, Ticket};
use crate::route::candidates::{by_id, eligible, gather};
use crate::route::forward::{
    DECISION_HEADER, Failed, Learn, StallCut, Tap, engine_request, forwarded_headers, refused,
    request_id, send_to_engine, tap_body, wants_explanation,
};
use crate::route::remote_source::{NamedSource, judge_pull, name_source};
use crate::state::{Arrival, Placed, Placement, RequestHook, RouterState, outcome};

/// Decode tokens assumed for load accounting when a request does not say (vLLM's completions default).
const DEFAULT_DECODE_TOKENS: u64 = 16;

/// The endpoints a request may be placed on, and what the scheduler is told about each.
struct Fleet {
    eligible: Vec<Arc<Endpoint>>,
    candidates: Vec<Candidate>,
}

impl Fleet {
    /// As the router sees it now (never `excluded`); None when no endpoint may take the request.
    fn now(s: &RouterState, keys: &[ChainKey], excluded: Option<EndpointId>) -> Option<Fleet> {
        let (eligible, candidates) = gather(s, keys, excluded);
        (!eligible.is_empty()).then_some(Fleet {
            eligible,
            candidates,
        })
    }
}

/// Places and forwards an aggregated request (`t0`: when the router received it). An engine that
/// refuses the connection or fails before sending any byte gets the request placed once more,
/// without it (the client sees nothing of the first try); a timeout or a response already
/// started is never retried.
pub(crate) async fn route_aggregated(
    s: Arc<RouterState>,
    profile: Arc<Profile>,
    kind: ApiKind,
    headers: HeaderMap,
    mut parsed: ParsedRequest,
    t0: Instant,
) -> Response {
    let request_id = request_id(&headers);
    // A first try may name a pull source in the body; a retry starts from the client's params.
    let client_params = parsed.fields.get("kv_transfer_params").cloned();
    // In the request's tenant and adapter key space: it only matches blocks of its own.
    let keys = parsed.chain_keys(&s.config);
    let arrival = Arrival {
        headers: &headers,
        request: &parsed,
    };
    let mut hooks: Vec<Box<dyn RequestHook>> = s
        .hooks
        .iter()
        .filter_map(|h| h.on_arrival(&s, &arrival))
        .collect();
    let req = Attempt {
        s: &s,
        profile: &profile,
        kind,
        headers: &headers,
        request_id: &request_id,
        keys: &keys,
        t0,
    };
    match req.run(&mut parsed, None, &mut hooks).await {
        Ok(resp) => resp,
        Err((failure, Some(failed))) if failure.retryable => {
            s.metrics.retries.inc();
            tracing::info!(endpoint = %failed.name, request_id, "retrying on another endpoint");
            match client_params {
                Some(p) => parsed.fields.insert("kv_transfer_params".to_owned(), p),
                None => parsed.fields.remove("kv_transfer_params"),
            };
            match req.run(&mut parsed, Some(failed.id), &mut hooks).await {
                Ok(resp) => resp,
                Err((second, Some(_))) => second.error.into_response(),
                // No other endpoint to try: the first failure says what went wrong.
                Err((_, None)) => failure.error.into_response(),
            }
        }
        Err((failure, _)) => failure.error.into_response(),
    }
}

/// One placement + forward of an aggregated request.
struct Attempt<'a> {
    s: &'a Arc<RouterState>,
    profile: &'a Profile,
    kind: ApiKind,
    headers: &'a HeaderMap,
    request_id: &'a str,
    keys: &'a [ChainKey],
    t0: Instant,
}

/// Where an attempt placed the request, and what it reserved there.
struct Reserved {
    ep: Arc<Endpoint>,
    /// The fleet the request was placed among (hooks see it).
    fleet: Fleet,
    source: Option<NamedSource>,
    /// The request's load on `ep`, released by the response tap.
    guard: LoadGuard,
    /// Prompt tokens `ep` computes itself.
    uncached: u64,
    /// Transfers already on the pull's links when it was named.
    pull_sharing: u64,
    /// Nothing else was in flight on `ep`: its first byte is a clean rate sample.
    idle_before: bool,
    /// The `x-kvmesh-decision` summary, when the client asked for it.
    summary: Option<String>,
}

impl Attempt<'_> {
    /// Places the request (never on `excluded`, the endpoint a first try failed on; a retry skips
    /// the admission queue, it was admitted already), lets the hooks see the placement, and
    /// forwards it.
    async fn run(
        &self,
        parsed: &mut ParsedRequest,
        excluded: Option<EndpointId>,
        hooks: &mut Vec<Box<dyn RequestHook>>,
    ) -> Result<Response, Failed> {
        let reserved = self.place(parsed, excluded).await?;
        let placed = Placed {
            tokens: &parsed.tokens,
            keys: self.keys,
            shared: parsed.tenant(&self.s.config).is_shared(),
            candidates: &reserved.fleet.candidates,
            eligible: &reserved.fleet.eligible,
            endpoint: &reserved.ep,
        };
        for h in &self.s.hooks {
            h.after_placement(self.s, &placed);
        }
        self.forward(parsed, reserved, hooks).await
    }

    /// Admits, schedules and reserves: the request's endpoint, its pull (named in the body) and
    /// its load there, recorded in the metrics and `/debug/decisions`.
    async fn place(
        &self,
        parsed: &mut ParsedRequest,
        excluded: Option<EndpointId>,
    ) -> Result<Reserved, Failed> {
        let s = self.s;
        let Some(admitted) = admit(s, self.keys, parsed.tokens.len(), excluded).await else {
            s.metrics.error("no_endpoint");
            return Err(refused(ApiError::service_unavailable(
                "no healthy endpoint",
            )));
        };
        let ctx = SchedulingContext {
            request_id: self.request_id,
            prompt_tokens: parsed.tokens.len(),
            total_blocks: self.keys.len(),
            block_size: s.config.block_size,
            max_tokens: parsed.max_tokens,
            backlog: Backlog {
                cold_tokens: &admitted.held_cold,
                share_tokens: admitted.share_tokens,
            },
            may_pull: admitted.may_pull,
        };
        let mut decision = s
            .scheduler
            .schedule(self.profile, &ctx, &admitted.fleet.candidates);
        let chosen = decision
            .chosen_candidate(&admitted.fleet.candidates)
            .cloned();
        let ep = chosen
            .as_ref()
            .and_then(|c| by_id(&admitted.fleet.eligible, c.endpoint).cloned());
        let (Some(chosen), Some(ep)) = (chosen, ep) else {
            s.metrics.error("no_endpoint");
            return Err(refused(ApiError::service_unavailable("no endpoint chosen")));
        };
        let source = name_source(
            decision.p2p.as_mut(),
            &admitted.fleet.eligible,
            self.request_id,
        )
        .filter(|src| {
            let predicted = predicted_pull_ms(s, src, &chosen, &admitted.fleet.candidates);
            attach_source(parsed, src, predicted)
        });
        let reserved = self.reserve(parsed, &chosen, ep, source, admitted.fleet);
        drop(admitted.ticket);
        Ok(self.report(&ctx, decision, admitted.held, reserved))
    }

    /// Counts the request's load on `ep` (and its pull on both ends' links).
    fn reserve(
        &self,
        parsed: &ParsedRequest,
        chosen: &Candidate,
        ep: Arc<Endpoint>,
        source: Option<NamedSource>,
        fleet: Fleet,
    ) -> Reserved {
        let s = self.s;
        let local_tokens = chosen.any_blocks as u64 * s.config.block_size as u64;
        let pulled_tokens = source.as_ref().map_or(0, |p| p.delta_tokens);
        let uncached = (parsed.tokens.len() as u64)
            .saturating_sub(local_tokens)
            .saturating_sub(pulled_tokens);
        let decode = parsed.max_tokens.unwrap_or(DEFAULT_DECODE_TOKENS);
        let idle_before = ep.load.snapshot().requests == 0;
        let mut guard = ep.load.acquire(uncached, decode);
        guard.hold_context(self.keys);
        let pull_sharing = source
            .as_ref()
            .map_or(0, |src| src.track(&mut guard, &s.cost_model, ep.id));
        Reserved {
            ep,
            fleet,
            source,
            guard,
            uncached,
            pull_sharing,
            idle_before,
            summary: None,
        }
    }

    /// Records the placement: metrics, `/debug/decisions`, and the summary for
    /// `x-kvmesh-decision` when the client asked for one.
    fn report(
        &self,
        ctx: &SchedulingContext<'_>,
        decision: Decision,
        held: Duration,
        mut r: Reserved,
    ) -> Reserved {
        let (s, profile) = (self.s, self.profile);
        let local_tokens = r
            .fleet
            .candidates
            .iter()
            .find(|c| c.endpoint == r.ep.id)
            .map_or(0, |c| c.any_blocks as u64 * s.config.block_size as u64);
        let outcome = outcome(r.source.is_some(), local_tokens);
        let scheduling = self.t0.elapsed();
        s.note_placement(&r.ep);
        let p2p = decision.p2p.as_ref();
        s.count_placement(&profile.name, &r.ep.name, outcome, p2p, scheduling);
        r.summary = wants_explanation(self.headers).then(|| {
            json!({
                "request_id": self.request_id,
                "profile": profile.name,
                "endpoint": r.ep.name.as_ref(),
                "outcome": outcome,
                "p2p_source": r.source.as_ref().map(|p| p.endpoint.name.to_string()),
                "p2p_why": p2p.map(|p| p.why.clone()),
                "scheduling_us": scheduling.as_micros() as u64,
            })
            .to_string()
        });
        let placement = Placement {
            kind: self.kind,
            ctx,
            outcome,
            scheduling: scheduling.saturating_sub(held),
            held,
        };
        s.record(placement, decision);
        r
    }

    /// Sends the placed request to its engine and streams the answer back through the tap,
    /// which releases the load, teaches the cost model, wakes the admission queue and, when the
    /// body ends, hands `hooks` the finished turn.
    async fn forward(
        &self,
        parsed: &ParsedRequest,
        r: Reserved,
        hooks: &mut Vec<Box<dyn RequestHook>>,
    ) -> Result<Response, Failed> {
        let s = self.s;
        let payload = parsed.body().map_err(|e| {
            s.metrics.error("internal");
            refused(ApiError::bad_request(format!("cannot re-encode body: {e}")))
        })?;
        let source_hp = r.source.as_ref().map(NamedSource::host_port);
        let req = engine_request(
            s,
            &r.ep,
            self.kind,
            self.request_id,
            self.headers,
            payload,
            &r.guard,
            source_hp.as_deref(),
        );
        let dispatched = Instant::now();
        let upstream = match send_to_engine(s, &r.ep, req).await {
            Ok(u) => u,
            Err(e) => return Err((e, Some(r.ep))),
        };
        let status = upstream.status();
        if status.is_server_error() || status.is_client_error() {
            s.metrics.error("upstream_status");
        }
        if let Some(src) = &r.source {
            judge_pull(s, src, upstream.headers());
        }
        for h in hooks.iter_mut() {
            h.on_answer(s, &r.ep, status);
        }
        let mut resp_headers = forwarded_headers(&upstream, &r.ep);
        if let Some(summary) = &r.summary
            && let Ok(v) = HeaderValue::from_str(summary)
        {
            resp_headers.insert(HeaderName::from_static(DECISION_HEADER), v);
        }
        let tap = Tap {
            stall: StallCut::new(s, &r.ep, dispatched, parsed.stream),
            learn: self.learn(parsed, &r, status, dispatched),
            guard: r.guard,
            admission_queue: s.admission_queue.clone(),
            capture: None,
            on_end: std::mem::take(hooks),
        };
        let mut resp = Response::new(tap_body(upstream, tap));
        *resp.status_mut() = status;
        *resp.headers_mut() = resp_headers;
        Ok(resp)
    }
}

impl Attempt<'_> {
    /// What the tap teaches the cost model, if anything: rates are learned only from clean
    /// samples, a prefill-bound first byte on an otherwise idle endpoint.
    fn learn(
        &self,
        parsed: &ParsedRequest,
        r: &Reserved,
        status: StatusCode,
        dispatched: Instant,
    ) -> Option<Learn> {
        let prefill_bound = parsed.stream || parsed.max_tokens.is_some_and(|m| m <= 1);
        (status.is_success() && r.idle_before && prefill_bound).then(|| Learn {
            cost_model: Arc::clone(&self.s.cost_model),
            endpoint: r.ep.id,
            computed_tokens: r.uncached,
            pulled: r.source.as_ref().map(|p| (p.endpoint.id, p.delta_tokens)),
            pull_sharing: r.pull_sharing,
            dispatched,
        })
    }
}

/// A request the admission queue (when configured) let through.
struct Admitted<'a> {
    /// The fleet to place on, as it is now.
    fleet: Fleet,
    /// How long the request waited in the queue.
    held: Duration,
    /// The prefill tokens of the cold requests still waiting there when it left (ascending).
    held_cold: Vec<u64>,
    /// `admission_queue.max_queued_prefill_tokens` (0 without an admission queue).
    share_tokens: u64,
    /// False when it was held and the config says held requests do not pull
    /// (`AdmissionQueueConfig::pulls_when_held`).
    may_pull: bool,
    /// Holds its place until its load is counted.
    ticket: Option<Ticket<'a>>,
}

/// Waits for the admission queue, if any. None when no endpoint is healthy.
async fn admit<'a>(
    s: &'a RouterState,
    keys: &[ChainKey],
    prompt_tokens: usize,
    excluded: Option<EndpointId>,
) -> Option<Admitted<'a>> {
    let fleet = Fleet::now(s, keys, excluded)?;
    let direct = |fleet, ticket| Admitted {
        fleet,
        held: Duration::ZERO,
        held_cold: Vec::new(),
        share_tokens: 0,
        may_pull: true,
        ticket,
    };
    let Some(d) = s.admission_queue.as_ref().filter(|_| excluded.is_none()) else {
        return Some(direct(fleet, None));
    };
    let bs = s.config.block_size;
    let best_cached = fleet
        .candidates
        .iter()
        .map(|c| c.any_blocks.saturating_mul(bs))
        .max()
        .unwrap_or(0);
    let work = prompt_tokens.saturating_sub(best_cached) as u64;
    let limit = d.config().max_queued_prefill_tokens;
    // The same endpoints the request may be placed on (all healthy ones when none is `both`).
    let has_capacity = || {
        eligible(&s.endpoints.list())
            .iter()
            .any(|e| e.load.snapshot().uncached_tokens <= limit)
    };
    let waited = Instant::now();
    let work = Work {
        ms: s.cost_model.predict_recompute_ms_configured(work),
        tokens: work,
        cold: best_cached == 0,
    };
    let replicas = fleet_endpoints_have_other_replicas(s);
    let (how, ticket) = d.admit(work, replicas, has_capacity).await;
    if how == Exit::Direct {
        return Some(direct(fleet, Some(ticket)));
    }
    Some(Admitted {
        held_cold: d.cold_tokens(),
        // Placed as the fleet is now, not as it was when the request arrived.
        held: waited.elapsed(),
        fleet: Fleet::now(s, keys, excluded)?,
        share_tokens: limit,
        // Every endpoint had a full prefill queue (see `AdmissionQueueConfig::pulls_when_held`).
        may_pull: how == Exit::Overflow || d.config().pulls_when_held,
        ticket: Some(ticket),
    })
}

/// The pull time the engine is told for `src` into `chosen` (see [`NamedSource::predicted_ms`]),
/// with the transfers the router has on the pull's links now.
fn predicted_pull_ms(
    s: &RouterState,
    src: &NamedSource,
    chosen: &Candidate,
    candidates: &[Candidate],
) -> Option<f64> {
    let out = candidates
        .iter()
        .find(|c| c.endpoint == src.endpoint.id)
        .map_or(0, |c| c.pulls_out);
    src.predicted_ms(&s.cost_model, chosen.endpoint, out.max(chosen.pulls_in))
}

/// Whether another router replica places on any eligible endpoint (its engine's load report says
/// so): held requests then stagger their release (`AdmissionQueue`).
fn fleet_endpoints_have_other_replicas(s: &RouterState) -> bool {
    eligible(&s.endpoints.list())
        .iter()
        .any(|e| e.load.other_replicas())
}

/// Puts `remote_kv_source` and the predicted pull time into the request's `kv_transfer_params`
/// (keeping any other keys). False (and nothing pulled) when the parameters cannot be encoded.
fn attach_source(parsed: &mut ParsedRequest, src: &NamedSource, predicted_ms: Option<f64>) -> bool {
    let mut params: KvTransferParams = parsed.field("kv_transfer_params").unwrap_or_default();
    params.remote_kv_source = Some(src.params.clone());
    params.kvmesh_predicted_pull_ms = predicted_ms;
    match parsed.set_field("kv_transfer_params", &params) {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(error = %e, "could not encode kv_transfer_params; not pulling");
            false
        }
    }
}
