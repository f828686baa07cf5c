//! The HTTP surface: the axum app, the OpenAI endpoints (parsed once, then the aggregated or the
//! P/D route), and the operator endpoints (`/health`, `/metrics`, `/debug/prefix`,
//! `/debug/decisions`, `/v1/models`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use kvmesh_core::chain::chain_keys_from;
use kvmesh_sched::decisions::DecisionRecord;
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::fleet::prefix::match_of;
use crate::http::request::{self, ApiKind};
use crate::pd::route_pd;
use crate::route::aggregated::route_aggregated;
use crate::state::{CATCH_UP_TIMEOUT, InFlight, RouterState, enter};

/// Request header selecting a scheduling profile by name.
pub const PROFILE_HEADER: &str = "x-kvmesh-profile";

/// Bodies larger than this are parsed and tokenized on a blocking thread.
const BLOCKING_PARSE_BYTES: usize = 64 * 1024;

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
        .route("/debug/endpoints", get(debug_endpoints))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

async fn completions(
    State(s): State<Arc<RouterState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    serve(s, ApiKind::Completions, headers, body).await
}

async fn chat_completions(
    State(s): State<Arc<RouterState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    serve(s, ApiKind::Chat, headers, body).await
}

/// Parses an OpenAI request (400 on bad input, no engine touched) and routes it: the P/D path
/// when configured and no profile is named, else the named (or default) profile's aggregated path.
async fn serve(s: Arc<RouterState>, kind: ApiKind, headers: HeaderMap, body: Bytes) -> Response {
    let Some(slot) = enter(&s) else {
        s.metrics.error("overloaded");
        return ApiError::overloaded(
            format!(
                "the router holds {} requests (max_in_flight); retry shortly",
                s.config.max_in_flight
            ),
            1,
        )
        .into_response();
    };
    let resp = route_parsed(s, kind, headers, body).await;
    hold_until_body_ends(resp, slot)
}

/// The response with `slot` released only when its body is done (streamed, failed or dropped).
fn hold_until_body_ends(resp: Response, slot: InFlight) -> Response {
    let (parts, body) = resp.into_parts();
    let mut data = body.into_data_stream();
    let held = async_stream::stream! {
        let _slot = slot;
        while let Some(chunk) = data.next().await {
            yield chunk;
        }
    };
    Response::from_parts(parts, Body::from_stream(held))
}

async fn route_parsed(
    s: Arc<RouterState>,
    kind: ApiKind,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let t0 = Instant::now();
    // Big prompts (hundreds of thousands of tokens) take real CPU to parse and tokenize: keep that
    // off the async workers.
    let parsed = if body.len() > BLOCKING_PARSE_BYTES {
        let tokenizer = Arc::clone(&s.tokenizer);
        let max = s.config.max_prompt_tokens;
        match tokio::task::spawn_blocking(move || request::parse(kind, body, &*tokenizer, max))
            .await
        {
            Ok(r) => r,
            Err(e) => Err(ApiError::bad_request(format!(
                "request parsing failed: {e}"
            ))),
        }
    } else {
        request::parse(kind, body, &*s.tokenizer, s.config.max_prompt_tokens)
    };
    let mut parsed = match parsed {
        Ok(p) => p,
        Err(e) => {
            s.metrics.error("bad_request");
            return e.into_response();
        }
    };
    // The router names `remote_kv_source` and P/D parameters; a client's own would let it point
    // engines at any port of an allowed host, or hold pins.
    if !s.config.trust_client_kv_transfer_params
        && parsed.fields.remove("kv_transfer_params").is_some()
    {
        parsed.modified = true;
        s.metrics.client_params_dropped.inc();
    }
    let profile_name = headers.get(PROFILE_HEADER).and_then(|v| v.to_str().ok());
    // P/D: requests not pinned to a profile take the prefill + decode path.
    if profile_name.is_none()
        && let Some(pd) = s.pd.clone()
    {
        return route_pd(s, pd, kind, headers, parsed).await;
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
    route_aggregated(s, profile, kind, headers, parsed, t0).await
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
    // A replica that has not caught up on the engines' KV events would place blind: not ready
    // yet, within a bound.
    let caught_up = s.feed.caught_up() || s.started_at.elapsed() >= CATCH_UP_TIMEOUT;
    let (status, word) = match (healthy > 0, caught_up) {
        (false, _) => (StatusCode::SERVICE_UNAVAILABLE, "no healthy endpoint"),
        (true, false) => (StatusCode::SERVICE_UNAVAILABLE, "catching up"),
        (true, true) => (StatusCode::OK, "ok"),
    };
    let mut body = json!({"status": word, "healthy_endpoints": healthy, "endpoints": list.len(), "caught_up": caught_up, "replica": &*s.replica_id});
    if let Some(pd) = &s.pd {
        // vLLM's multi-turn proxy reports these two.
        let (cached, evicted) = pd.health();
        body["cached_conversations"] = json!(cached);
        body["evicted_stale"] = json!(evicted);
    }
    (status, axum::Json(body)).into_response()
}

async fn metrics(State(s): State<Arc<RouterState>>) -> Response {
    s.metrics
        .refresh(&s.endpoints, &s.cost_model, s.config.block_size);
    s.metrics
        .refresh_reputation(&s.endpoints, &s.reputation.standings());
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
    // The same bounded reading as the OpenAI endpoints: a field map of at most
    // `request::MAX_FIELDS` raw values, then `prompt` / `messages` read without a JSON tree.
    let fields = match request::read_fields(&body) {
        Ok(f) => f,
        Err(e) => return e.into_response(),
    };
    let max = s.config.max_prompt_tokens;
    let tokens = if let Some(ids) = fields.get("token_ids") {
        request::raw_prompt_tokens(ids, &*s.tokenizer, max)
    } else if let Some(p) = fields.get("prompt") {
        request::raw_prompt_tokens(p, &*s.tokenizer, max)
    } else if let Some(m) = fields.get("messages") {
        request::raw_chat_tokens(m, true, &*s.tokenizer, max)
    } else {
        Err(ApiError::bad_request(
            "give one of 'prompt', 'token_ids' or 'messages'",
        ))
    };
    let tokens = match tokens {
        Ok(t) => t,
        Err(e) => return e.into_response(),
    };
    // `model` and `cache_salt` pick the key space as they do for a real request.
    let tenant = match (
        request::opt_string(&fields, "model"),
        request::opt_string(&fields, "cache_salt"),
    ) {
        (Ok(model), Ok(salt)) => s.config.tenant_keys(model.as_deref(), salt.as_deref()),
        (Err(e), _) | (_, Err(e)) => return e.into_response(),
    };
    let bs = s.config.block_size;
    let keys = chain_keys_from(tenant.chain_root(), &tokens, bs);
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

/// Every endpoint as the router sees it: health and discovered readiness, role, addresses, what it has placed there and
/// whether its event stream has delivered anything (a silent one is routed blind).
async fn debug_endpoints(State(s): State<Arc<RouterState>>) -> Response {
    let list: Vec<Value> = s
        .endpoints
        .list()
        .iter()
        .map(|e| {
            json!({
                "name": e.name.as_ref(),
                "url": e.spec.url,
                "role": e.spec.role,
                "healthy": e.is_healthy(),
                // False for a Kubernetes pod that is not Ready (then `healthy` is false too).
                "ready": e.is_discovered_ready(),
                "p2p": e.spec.p2p,
                // Configured, or `fingerprint:<id>` learned from the engine's metrics.
                "kv_group": e.kv_group().as_deref(),
                "kv_events": e.spec.kv_events.as_ref().map(|k| &k.endpoint),
                "event_batches_received": s.feed.batches_received(e.id),
                "placed": e.placed.load(std::sync::atomic::Ordering::Relaxed),
                "events_silent": e.events_silent.load(std::sync::atomic::Ordering::Relaxed),
                // What placement reads (every replica's work while the engine's load reports
                // are fresh: `shared`), and what this replica alone sent.
                "load": e.load.snapshot(),
                "own_load": e.load.own_snapshot(),
            })
        })
        .collect();
    axum::Json(list).into_response()
}
