//! The aggregated route: one engine computes the prompt and decodes.
//!
//! Block keys are computed once; the index lookup, the admission queue (when configured) and the
//! profile's pipeline decide the endpoint and, if the profile has a P2P plugin, a peer to pull the
//! prefix from (`remote_kv_source`, merged into the client's `kv_transfer_params`). Load is
//! reserved with a [`crate::load::LoadGuard`] before forwarding and released by the response tap.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use kvmesh_core::chain::chain_keys;
use kvmesh_core::{ChainKey, KvTransferParams};
use kvmesh_index::EndpointId;
use kvmesh_sched::hold_queue::Work;
use kvmesh_sched::{Backlog, Candidate, Profile, SchedulingContext};
use serde_json::json;

use crate::candidates::{by_id, eligible, gather};
use crate::dispatch::{Admission, Ticket};
use crate::endpoints::Endpoint;
use crate::error::ApiError;
use crate::forward::{
    DECISION_HEADER, Failed, Learn, Tap, engine_request, forwarded_headers, refused, request_id,
    send_to_engine, tap_body, wants_explanation,
};
use crate::prefetch;
use crate::remote_source::{NamedSource, name_source};
use crate::replicate;
use crate::request::{ApiKind, ParsedRequest};
use crate::state::{Placement, RouterState, outcome};

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
    let keys = chain_keys(&parsed.tokens, s.config.block_size);
    let session = prefetch::session_of(&s, &headers, &parsed);
    if let Some(session) = &session {
        prefetch::on_arrival(&s, session);
    }
    let req = Attempt {
        session: session.as_deref(),
        s: &s,
        profile: &profile,
        kind,
        headers: &headers,
        request_id: &request_id,
        keys: &keys,
        t0,
    };
    match req.run(&mut parsed, None).await {
        Ok(resp) => resp,
        Err((failure, Some(failed))) if failure.retryable => {
            s.metrics.retries.inc();
            tracing::info!(endpoint = %failed.name, request_id, "retrying on another endpoint");
            match client_params {
                Some(p) => parsed.fields.insert("kv_transfer_params".to_owned(), p),
                None => parsed.fields.remove("kv_transfer_params"),
            };
            match req.run(&mut parsed, Some(failed.id)).await {
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
    /// The request's session id, when the router follows sessions (`prefetch:`).
    session: Option<&'a str>,
}

impl Attempt<'_> {
    /// Places the request (never on `excluded`, the endpoint a first try failed on; a retry skips
    /// the admission queue, it was admitted already) and forwards it.
    async fn run(
        &self,
        parsed: &mut ParsedRequest,
        excluded: Option<EndpointId>,
    ) -> Result<Response, Failed> {
        let (s, kind, headers, t0) = (self.s, self.kind, self.headers, self.t0);
        let (profile, request_id, keys) = (self.profile, self.request_id, self.keys);
        let bs = s.config.block_size;
        let admitted = admit(s, keys, parsed.tokens.len(), excluded).await;
        let Some(Admitted {
            fleet,
            held,
            held_cold,
            share_tokens,
            may_pull,
            ticket: admission_ticket,
        }) = admitted
        else {
            s.metrics.error("no_endpoint");
            return Err(refused(ApiError::service_unavailable(
                "no healthy endpoint",
            )));
        };
        let ctx = SchedulingContext {
            request_id,
            prompt_tokens: parsed.tokens.len(),
            total_blocks: keys.len(),
            block_size: bs,
            max_tokens: parsed.max_tokens,
            backlog: Backlog {
                cold_tokens: &held_cold,
                share_tokens,
            },
            may_pull,
        };
        let mut decision = s.scheduler.schedule(profile, &ctx, &fleet.candidates);
        let chosen = decision.chosen_candidate(&fleet.candidates).cloned();
        let ep = chosen
            .as_ref()
            .and_then(|c| by_id(&fleet.eligible, c.endpoint).cloned());
        let (Some(chosen), Some(ep)) = (chosen, ep) else {
            s.metrics.error("no_endpoint");
            return Err(refused(ApiError::service_unavailable("no endpoint chosen")));
        };
        let source = name_source(decision.p2p.as_mut(), &fleet.eligible, request_id);
        let source = source.filter(|src| attach_source(parsed, src));
        let local_tokens = chosen.any_blocks as u64 * bs as u64;
        let outcome = outcome(source.is_some(), local_tokens);
        let pulled_tokens = source.as_ref().map_or(0, |p| p.delta_tokens);
        let uncached = (parsed.tokens.len() as u64)
            .saturating_sub(local_tokens)
            .saturating_sub(pulled_tokens);
        let decode = parsed.max_tokens.unwrap_or(DEFAULT_DECODE_TOKENS);
        let idle_before = ep.load.snapshot().requests == 0;
        let mut guard = ep.load.acquire(uncached, decode);
        guard.hold_context(keys);
        let pull_sharing = source
            .as_ref()
            .map_or(0, |src| src.track(&mut guard, &s.cost_model, ep.id));
        drop(admission_ticket);
        let scheduling = t0.elapsed();
        s.note_placement(&ep);
        s.count_placement(
            &profile.name,
            &ep.name,
            outcome,
            decision.p2p.as_ref(),
            scheduling,
        );
        let summary = wants_explanation(headers).then(|| {
            json!({
                "request_id": request_id,
                "profile": profile.name,
                "endpoint": ep.name.as_ref(),
                "outcome": outcome,
                "p2p_source": source.as_ref().map(|p| p.endpoint.name.to_string()),
                "p2p_why": decision.p2p.as_ref().map(|p| p.why.clone()),
                "scheduling_us": scheduling.as_micros() as u64,
            })
            .to_string()
        });
        let placement = Placement {
            kind,
            ctx: &ctx,
            outcome,
            scheduling: scheduling.saturating_sub(held),
            held,
        };
        s.record(placement, decision);
        replicate::after_placement(s, &parsed.tokens, keys, &fleet.candidates, &fleet.eligible);

        // Forward.
        let payload = match parsed.body() {
            Ok(p) => p,
            Err(e) => {
                s.metrics.error("internal");
                return Err(refused(ApiError::bad_request(format!(
                    "cannot re-encode body: {e}"
                ))));
            }
        };
        let source_hp = source.as_ref().map(NamedSource::host_port);
        let req = engine_request(
            s,
            &ep,
            kind,
            request_id,
            headers,
            payload,
            source_hp.as_deref(),
        );
        let dispatched = Instant::now();
        let upstream = match send_to_engine(s, &ep, req).await {
            Ok(r) => r,
            Err(e) => return Err((e, Some(ep))),
        };
        let status = upstream.status();
        if status.is_server_error() || status.is_client_error() {
            s.metrics.error("upstream_status");
        }
        // Settled once the engine answered: a first try refused by a dead owner is not the
        // placement that decides whether the session's prefetch was used.
        if let Some(session) = self.session {
            prefetch::on_placed(s, session, &ep);
        }
        let mut resp_headers = forwarded_headers(&upstream, &ep);
        if let Some(summary) = summary
            && let Ok(v) = HeaderValue::from_str(&summary)
        {
            resp_headers.insert(HeaderName::from_static(DECISION_HEADER), v);
        }
        // Learn rates only from clean samples: a prefill-bound first byte on an otherwise idle endpoint.
        let learn = (status.is_success()
            && idle_before
            && (parsed.stream || parsed.max_tokens.is_some_and(|m| m <= 1)))
        .then(|| Learn {
            cost_model: Arc::clone(&s.cost_model),
            endpoint: ep.id,
            computed_tokens: uncached,
            pulled: source.as_ref().map(|p| (p.endpoint.id, p.delta_tokens)),
            pull_sharing,
            dispatched,
        });
        // The turn's blocks exist on `ep` once it answers: prepare the session's next turn.
        let on_end = self.session.filter(|_| status.is_success()).map(|session| {
            let (s, ep) = (Arc::clone(s), Arc::clone(&ep));
            let (session, tokens) = (session.to_owned(), Arc::new(parsed.tokens.clone()));
            Box::new(move || prefetch::on_turn_end(&s, session, ep, tokens))
                as Box<dyn FnOnce() + Send>
        });
        let tap = Tap {
            guard,
            learn,
            dispatch: s.dispatch.clone(),
            capture: None,
            on_end,
        };
        let mut resp = Response::new(tap_body(upstream, tap));
        *resp.status_mut() = status;
        *resp.headers_mut() = resp_headers;
        Ok(resp)
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
    /// `dispatch.max_queued_prefill_tokens` (0 without an admission queue).
    share_tokens: u64,
    /// False when it was held and the config says held requests do not pull
    /// (`DispatchConfig::pulls_when_held`).
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
    let Some(d) = s.dispatch.as_ref().filter(|_| excluded.is_none()) else {
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
    let work_ms = s.cost_model.predict_recompute_ms_configured(work);
    let limit = d.config().max_queued_prefill_tokens;
    // The same endpoints the request may be placed on (all healthy ones when none is `both`).
    let has_capacity = || {
        eligible(&s.endpoints.list())
            .iter()
            .any(|e| e.load.snapshot().uncached_tokens <= limit)
    };
    let waited = Instant::now();
    let work = Work {
        ms: work_ms,
        tokens: work,
        cold: best_cached == 0,
    };
    let (how, ticket) = d.admit(work, has_capacity).await;
    if how == Admission::Direct {
        return Some(direct(fleet, Some(ticket)));
    }
    let held_cold = d.cold_tokens();
    // Placed as the fleet is now, not as it was when the request arrived.
    let held = waited.elapsed();
    let fleet = Fleet::now(s, keys, excluded)?;
    Some(Admitted {
        fleet,
        held,
        held_cold,
        share_tokens: limit,
        // Every endpoint had a full prefill queue (see `DispatchConfig::pulls_when_held`).
        may_pull: how == Admission::Overflow || d.config().pulls_when_held,
        ticket: Some(ticket),
    })
}

/// Puts `remote_kv_source` into the request's `kv_transfer_params` (keeping any other keys).
/// False (and nothing pulled) when the parameters cannot be encoded.
fn attach_source(parsed: &mut ParsedRequest, src: &NamedSource) -> bool {
    let mut params: KvTransferParams = parsed.field("kv_transfer_params").unwrap_or_default();
    params.remote_kv_source = Some(src.params.clone());
    match parsed.set_field("kv_transfer_params", &params) {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(error = %e, "could not encode kv_transfer_params; not pulling");
            false
        }
    }
}
