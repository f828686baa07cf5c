//! The OpenAI gateway: parse → schedule → inject P2P source → forward → stream back.
//!
//! One admission path per request: parse (400 on bad input, no engine touched), compute block
//! keys once, look up the index, run the profile, reserve load with a [`LoadGuard`], forward, and
//! stream the engine's bytes back unbuffered. The guard lives inside the response body stream, so
//! load is released on success, engine error, timeout, stream end and client disconnect alike;
//! dropping the body also drops the upstream response, which closes the engine connection and
//! cancels the request there.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Query, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use kvmesh_core::chain::chain_keys;
use kvmesh_core::{KvTransferParams, RemoteKvSource};
use kvmesh_text::Tokenizer;
use prometheus_client::registry::Registry;
use serde_json::{Value, json};

use crate::config::RouterConfig;
use crate::cost_model::{CostModel, Observation};
use crate::decisions::{DecisionLog, DecisionRecord};
use crate::dispatch::{Admission, Dispatcher};
use crate::endpoints::{Endpoint, EndpointSet};
use crate::error::ApiError;
use crate::load::LoadGuard;
use crate::metrics::RouterMetrics;
use crate::plugins::{Candidate, SchedulingContext};
use crate::prefix::{PrefixLookup, match_of};
use crate::request::{self, ApiKind};
use crate::scheduler::Scheduler;

/// llm-d's header naming the P2P source (stripped inbound; optionally set outbound).
pub const SOURCE_HEADER: &str = "x-kv-cache-source-host-port";
/// Request header asking for the decision summary in the response.
pub const EXPLAIN_HEADER: &str = "x-kvmesh-explain";
/// Response header with the decision summary (JSON).
pub const DECISION_HEADER: &str = "x-kvmesh-decision";
/// Response header naming the endpoint that served the request.
pub const ENDPOINT_HEADER: &str = "x-kvmesh-endpoint";
/// Request header selecting a scheduling profile by name.
pub const PROFILE_HEADER: &str = "x-kvmesh-profile";

/// Bodies larger than this are parsed and tokenized on a blocking thread.
const BLOCKING_PARSE_BYTES: usize = 64 * 1024;

/// Decode tokens assumed for load accounting when a request does not say (vLLM's completions default).
const DEFAULT_DECODE_TOKENS: u64 = 16;

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
    pub pd: Option<Arc<crate::pd::PdRouter>>,
    /// The admission queue, when the config has a `dispatch:` section.
    pub dispatch: Option<Arc<Dispatcher>>,
}

/// The axum app.
pub fn app(state: Arc<RouterState>) -> Router {
    let limit = state.config.max_body_bytes;
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/debug/prefix", post(debug_prefix))
        .route("/debug/decisions", get(debug_decisions))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

async fn completions(
    State(s): State<Arc<RouterState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    route(s, ApiKind::Completions, headers, body).await
}

async fn chat_completions(
    State(s): State<Arc<RouterState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    route(s, ApiKind::Chat, headers, body).await
}

pub(crate) fn request_id(headers: &HeaderMap) -> String {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty() && s.len() <= 128 && s.bytes().all(|b| b.is_ascii_graphic()))
        .map_or_else(|| format!("kvmesh-{}", uuid::Uuid::new_v4()), str::to_owned)
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Endpoints that may serve an aggregated request: healthy `both` endpoints, or every healthy
/// endpoint when none is `both`.
fn eligible(list: &[Arc<Endpoint>]) -> Vec<Arc<Endpoint>> {
    let healthy: Vec<Arc<Endpoint>> = list.iter().filter(|e| e.is_healthy()).cloned().collect();
    let both: Vec<Arc<Endpoint>> = healthy
        .iter()
        .filter(|e| e.serves_aggregated())
        .cloned()
        .collect();
    if both.is_empty() { healthy } else { both }
}

/// The endpoints that may serve an aggregated request now, and what the router knows about each.
fn gather(s: &RouterState, keys: &[kvmesh_core::ChainKey]) -> (Vec<Arc<Endpoint>>, Vec<Candidate>) {
    let matches = s.prefix.find_matches(keys);
    let list = s.endpoints.list();
    let eligible = eligible(&list);
    let candidates = eligible
        .iter()
        .map(|e| candidate(e, match_of(&matches, e.id)))
        .collect();
    (eligible, candidates)
}

pub(crate) fn candidate(e: &Endpoint, m: kvmesh_index::EndpointMatch) -> Candidate {
    let load = e.load.snapshot();
    let scraped = e.metrics();
    Candidate {
        endpoint: e.id,
        name: Arc::clone(&e.name),
        gpu_blocks: m.gpu_blocks,
        cpu_blocks: m.cpu_blocks,
        any_blocks: m.any_blocks,
        in_flight_requests: load.requests,
        in_flight_uncached_tokens: load.uncached_tokens,
        in_flight_decode_tokens: load.decode_tokens,
        waiting: scraped.map(|m| m.waiting),
        running: scraped.map(|m| m.running),
        kv_usage: scraped.map(|m| m.kv_usage),
        has_p2p: e.spec.p2p_host_port().is_some(),
        pulls_in: load.pulls_in,
        pulls_out: load.pulls_out,
    }
}

async fn route(s: Arc<RouterState>, kind: ApiKind, headers: HeaderMap, body: Bytes) -> Response {
    let t0 = Instant::now();
    // Big prompts (hundreds of thousands of tokens) take real CPU to parse and tokenize: keep that
    // off the async workers.
    let parsed = if body.len() > BLOCKING_PARSE_BYTES {
        let tokenizer = Arc::clone(&s.tokenizer);
        match tokio::task::spawn_blocking(move || request::parse(kind, body, &*tokenizer)).await {
            Ok(r) => r,
            Err(e) => Err(ApiError::bad_request(format!(
                "request parsing failed: {e}"
            ))),
        }
    } else {
        request::parse(kind, body, &*s.tokenizer)
    };
    let parsed = match parsed {
        Ok(p) => p,
        Err(e) => {
            s.metrics.error("bad_request");
            return e.into_response();
        }
    };
    let profile_name = headers.get(PROFILE_HEADER).and_then(|v| v.to_str().ok());
    // P/D: requests not pinned to a profile take the prefill + decode path.
    if profile_name.is_none()
        && let Some(pd) = s.pd.clone()
    {
        return crate::pd::route_pd(s, pd, kind, headers, parsed).await;
    }
    let Some(profile) = s.scheduler.profile(profile_name) else {
        s.metrics.error("bad_request");
        return ApiError::bad_request(format!(
            "unknown scheduling profile {:?}; configured: {:?}",
            profile_name.unwrap_or_default(),
            s.scheduler.profile_names()
        ))
        .into_response();
    };
    let request_id = request_id(&headers);
    let bs = s.config.block_size;
    let keys = chain_keys(&parsed.tokens, bs);
    let (mut eligible, mut candidates) = gather(&s, &keys);
    if eligible.is_empty() {
        s.metrics.error("no_endpoint");
        return ApiError::service_unavailable("no healthy endpoint").into_response();
    }
    let mut held = Duration::ZERO;
    // Held until this request's load is counted below (then the next one may be let through).
    let mut admission_ticket = None;
    if let Some(d) = &s.dispatch {
        let best_cached = candidates
            .iter()
            .map(|c| c.any_blocks.saturating_mul(bs))
            .max()
            .unwrap_or(0);
        let work = parsed.tokens.len().saturating_sub(best_cached) as u64;
        let work_ms = s.cost_model.predict_recompute_ms_configured(work);
        let limit = d.config().max_queued_prefill_tokens;
        // The same endpoints the request may be placed on (all healthy ones when none is `both`).
        let has_capacity = || {
            crate::gateway::eligible(&s.endpoints.list())
                .iter()
                .any(|e| e.load.snapshot().uncached_tokens <= limit)
        };
        let waited = Instant::now();
        let (how, ticket) = d.admit(work_ms, has_capacity).await;
        admission_ticket = Some(ticket);
        if how != Admission::Direct {
            // Placed as the fleet is now, not as it was when the request arrived.
            held = waited.elapsed();
            (eligible, candidates) = gather(&s, &keys);
            if eligible.is_empty() {
                s.metrics.error("no_endpoint");
                return ApiError::service_unavailable("no healthy endpoint").into_response();
            }
        }
    }
    let ctx = SchedulingContext {
        request_id: &request_id,
        prompt_tokens: parsed.tokens.len(),
        total_blocks: keys.len(),
        block_size: bs,
        max_tokens: parsed.max_tokens,
    };
    let decision = s.scheduler.schedule(&profile, &ctx, &candidates);
    let Some(chosen) = decision.chosen else {
        s.metrics.error("no_endpoint");
        return ApiError::service_unavailable("no endpoint chosen").into_response();
    };
    let ep = Arc::clone(&eligible[chosen]);
    let mut parsed = parsed;

    // P2P source: inject kv_transfer_params.remote_kv_source (keeping any other keys).
    let mut pulled: Option<(Arc<Endpoint>, u64, String)> = None;
    if let Some(si) = decision.p2p_source()
        && let Some(src) = eligible.get(si)
        && let Some((host, port)) = src.spec.p2p_host_port()
    {
        let delta = decision
            .p2p
            .as_ref()
            .map_or(0, |p| p.delta_tokens.max(0) as u64);
        let mut params: KvTransferParams = parsed.field("kv_transfer_params").unwrap_or_default();
        params.remote_kv_source = Some(RemoteKvSource {
            kv_request_id: request_id.clone(),
            remote_host: host.clone(),
            remote_port: port,
        });
        match parsed.set_field("kv_transfer_params", &params) {
            Ok(()) => {
                pulled = Some((Arc::clone(src), delta, format!("{host}:{port}")));
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not encode kv_transfer_params; not pulling")
            }
        }
    }
    let local_tokens = candidates[chosen].any_blocks as u64 * bs as u64;
    let outcome = if pulled.is_some() {
        "pull_named"
    } else if local_tokens > 0 {
        "local_hit"
    } else {
        "cold"
    };
    s.metrics
        .placed(&profile.name, &ep.name, outcome, decision.p2p.as_ref());
    let pulled_tokens = pulled.as_ref().map_or(0, |p| p.1);
    let uncached = (parsed.tokens.len() as u64)
        .saturating_sub(local_tokens)
        .saturating_sub(pulled_tokens);
    let decode = parsed.max_tokens.unwrap_or(DEFAULT_DECODE_TOKENS);
    let idle_before = ep.load.snapshot().requests == 0;
    let mut guard = ep.load.acquire(uncached, decode);
    if let Some((src, _, _)) = &pulled {
        guard.track_pull(&src.load);
    }
    drop(admission_ticket);
    let scheduling = t0.elapsed();
    s.metrics
        .scheduling_seconds
        .observe(scheduling.as_secs_f64());

    let summary = wants_explanation(&headers).then(|| {
        json!({
            "request_id": request_id,
            "profile": profile.name,
            "endpoint": ep.name.as_ref(),
            "outcome": outcome,
            "p2p_source": pulled.as_ref().map(|p| p.0.name.to_string()),
            "p2p_why": decision.p2p.as_ref().map(|p| p.why.clone()),
            "scheduling_us": scheduling.as_micros() as u64,
        })
        .to_string()
    });
    s.decisions.push(Arc::new(DecisionRecord {
        request_id: request_id.clone(),
        at: unix_now(),
        path: kind.path().to_owned(),
        prompt_tokens: parsed.tokens.len(),
        blocks: keys.len(),
        scheduling_us: scheduling.saturating_sub(held).as_micros() as u64,
        held_ms: held.as_secs_f64() * 1000.0,
        outcome,
        decision,
    }));

    // Forward.
    let payload = match parsed.body() {
        Ok(p) => p,
        Err(e) => {
            s.metrics.error("internal");
            return ApiError::bad_request(format!("cannot re-encode body: {e}")).into_response();
        }
    };
    let mut req = engine_request(&s, &ep, kind, &request_id, &headers, payload);
    if s.config.source_header
        && let Some((_, _, hp)) = &pulled
    {
        req = req.header(SOURCE_HEADER, hp);
    }
    let dispatched = Instant::now();
    let upstream = match send_to_engine(&s, &ep, req).await {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let status = upstream.status();
    if status.is_server_error() || status.is_client_error() {
        s.metrics.error("upstream_status");
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
    .then(|| {
        (
            Arc::clone(&s.cost_model),
            ep.id,
            uncached,
            pulled.as_ref().map(|p| (p.0.id, p.1)),
        )
    });
    let body = tracked_body(upstream, guard, dispatched, learn, s.dispatch.clone());
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    *resp.headers_mut() = resp_headers;
    resp
}

type Learn = Option<(
    Arc<CostModel>,
    kvmesh_index::EndpointId,
    u64,
    Option<(kvmesh_index::EndpointId, u64)>,
)>;

/// The engine's body, chunk by chunk, owning the load guard.
fn tracked_body(
    upstream: reqwest::Response,
    mut guard: LoadGuard,
    dispatched: Instant,
    learn: Learn,
    dispatch: Option<Arc<Dispatcher>>,
) -> Body {
    // Held requests re-check when this one's prefill is over and when it ends (however it ends).
    let wake = WakeOnDrop(dispatch.clone());
    let stream = async_stream::stream! {
        let mut chunks = upstream.bytes_stream();
        let mut first = true;
        while let Some(chunk) = chunks.next().await {
            match chunk {
                Ok(bytes) => {
                    if first {
                        first = false;
                        guard.prefill_done();
                        if let Some(d) = &dispatch {
                            d.wake();
                        }
                        if let Some((cm, endpoint, computed, pulled)) = &learn {
                            cm.observe(Observation { endpoint: *endpoint, computed_tokens: *computed, pulled: *pulled, ttft: dispatched.elapsed() });
                        }
                    }
                    yield Ok::<Bytes, std::io::Error>(bytes);
                }
                Err(e) => {
                    yield Err(std::io::Error::other(e));
                    break;
                }
            }
        }
        drop(guard);
        drop(wake);
    };
    Body::from_stream(stream)
}

/// Wakes the admission queue when dropped (after the load guard it follows).
struct WakeOnDrop(Option<Arc<Dispatcher>>);

impl Drop for WakeOnDrop {
    fn drop(&mut self) {
        if let Some(d) = &self.0 {
            d.wake();
        }
    }
}

/// Whether the client asked for the routing decision in a response header (`x-kvmesh-explain`).
pub(crate) fn wants_explanation(headers: &HeaderMap) -> bool {
    headers
        .get(EXPLAIN_HEADER)
        .is_some_and(|v| v.as_bytes() == b"1" || v.as_bytes() == b"true")
}

/// The engine-bound POST of one client request: its body re-encoded, its id and its
/// credentials passed on.
pub(crate) fn engine_request(
    s: &RouterState,
    ep: &Endpoint,
    kind: ApiKind,
    request_id: &str,
    client_headers: &HeaderMap,
    payload: Bytes,
) -> reqwest::RequestBuilder {
    let mut req = s
        .client
        .post(ep.url(kind.path()))
        .header(header::CONTENT_TYPE, "application/json")
        .header("x-request-id", request_id)
        .body(payload);
    if let Some(auth) = client_headers.get(header::AUTHORIZATION) {
        req = req.header(header::AUTHORIZATION, auth);
    }
    req
}

/// Sends a request to an engine within the router's request timeout. An engine that cannot be
/// reached becomes a counted OpenAI-style 502, one that does not answer in time a 504.
pub(crate) async fn send_to_engine(
    s: &RouterState,
    ep: &Endpoint,
    req: reqwest::RequestBuilder,
) -> Result<reqwest::Response, ApiError> {
    match tokio::time::timeout(s.config.request_timeout, req.send()).await {
        Ok(Ok(r)) => Ok(r),
        Ok(Err(e)) => {
            s.metrics.error("upstream_connect");
            tracing::warn!(endpoint = %ep.name, error = %e, "engine request failed");
            Err(ApiError::bad_gateway(format!(
                "endpoint {} failed: {e}",
                ep.name
            )))
        }
        Err(_) => {
            s.metrics.error("upstream_timeout");
            Err(ApiError::gateway_timeout(format!(
                "endpoint {} did not answer in time",
                ep.name
            )))
        }
    }
}

/// The engine's response headers a client should see (hop-by-hop ones dropped), plus which
/// endpoint served it.
pub(crate) fn forwarded_headers(upstream: &reqwest::Response, ep: &Endpoint) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (k, v) in upstream.headers() {
        if !is_hop_by_hop(k) {
            headers.append(k.clone(), v.clone());
        }
    }
    if let Ok(v) = HeaderValue::from_str(&ep.name) {
        headers.insert(HeaderName::from_static(ENDPOINT_HEADER), v);
    }
    headers
}

pub(crate) fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
    )
}

async fn models(State(s): State<Arc<RouterState>>) -> Response {
    let list = s.endpoints.list();
    let Some(ep) = list.iter().find(|e| e.is_healthy()) else {
        return ApiError::service_unavailable("no healthy endpoint").into_response();
    };
    match tokio::time::timeout(
        Duration::from_secs(10),
        s.client.get(ep.url("/v1/models")).send(),
    )
    .await
    {
        Ok(Ok(r)) => {
            let status = r.status();
            let ct = r.headers().get(header::CONTENT_TYPE).cloned();
            match r.bytes().await {
                Ok(b) => {
                    let mut resp = Response::new(Body::from(b));
                    *resp.status_mut() = status;
                    if let Some(ct) = ct {
                        resp.headers_mut().insert(header::CONTENT_TYPE, ct);
                    }
                    resp
                }
                Err(e) => {
                    ApiError::bad_gateway(format!("endpoint {}: {e}", ep.name)).into_response()
                }
            }
        }
        Ok(Err(e)) => ApiError::bad_gateway(format!("endpoint {}: {e}", ep.name)).into_response(),
        Err(_) => ApiError::gateway_timeout(format!("endpoint {} did not answer", ep.name))
            .into_response(),
    }
}

async fn health(State(s): State<Arc<RouterState>>) -> Response {
    let list = s.endpoints.list();
    let healthy = list.iter().filter(|e| e.is_healthy()).count();
    let status = if healthy > 0 {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let mut body = json!({"status": if healthy > 0 {"ok"} else {"no healthy endpoint"}, "healthy_endpoints": healthy, "endpoints": list.len()});
    if let Some(pd) = &s.pd {
        // vLLM's multi-turn proxy reports these two.
        let (cached, evicted) = pd.health();
        body["cached_conversations"] = json!(cached);
        body["evicted_stale"] = json!(evicted);
    }
    (status, axum::Json(body)).into_response()
}

async fn metrics(State(s): State<Arc<RouterState>>) -> Response {
    s.metrics.refresh(&s.endpoints, &s.cost_model);
    let mut text = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut text, &s.registry) {
        return ApiError::service_unavailable(format!("encoding metrics: {e}")).into_response();
    }
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn debug_prefix(State(s): State<Arc<RouterState>>, body: Bytes) -> Response {
    let value: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return ApiError::bad_request(format!("invalid JSON: {e}")).into_response(),
    };
    let tokens = if let Some(ids) = value.get("token_ids") {
        request::prompt_tokens(ids, &*s.tokenizer)
    } else if let Some(p) = value.get("prompt") {
        request::prompt_tokens(p, &*s.tokenizer)
    } else if let Some(m) = value.get("messages") {
        request::chat_tokens(m, true, &*s.tokenizer)
    } else {
        Err(ApiError::bad_request(
            "give one of 'prompt', 'token_ids' or 'messages'",
        ))
    };
    let tokens = match tokens {
        Ok(t) => t,
        Err(e) => return e.into_response(),
    };
    let bs = s.config.block_size;
    let keys = chain_keys(&tokens, bs);
    let matches = s.prefix.find_matches(&keys);
    let mut per = serde_json::Map::new();
    for e in s.endpoints.list().iter() {
        let m = match_of(&matches, e.id);
        per.insert(
            e.name.to_string(),
            json!({"gpu_tokens": m.gpu_blocks * bs, "cpu_tokens": m.cpu_blocks * bs, "any_tokens": m.any_blocks * bs, "healthy": e.is_healthy()}),
        );
    }
    axum::Json(json!({"prompt_tokens": tokens.len(), "blocks": keys.len(), "block_size": bs, "endpoints": per})).into_response()
}

#[derive(serde::Deserialize)]
struct LastN {
    last: Option<usize>,
}

async fn debug_decisions(State(s): State<Arc<RouterState>>, Query(q): Query<LastN>) -> Response {
    let last = s.decisions.last(q.last.unwrap_or(10));
    let refs: Vec<&DecisionRecord> = last.iter().map(|r| &**r).collect();
    axum::Json(refs).into_response()
}
