//! P/D disaggregation in the gateway (`docs/protocols.md#pd-and-bi-directional-transfer`,
//! `docs/architecture.md#pd-disaggregation`), NixlConnector-compatible.
//!
//! For each request (when `pd:` is configured and no `x-kvmesh-profile` header names a profile):
//! 1. the conversation key is the top-level body field `conversation_id` (removed before
//!    forwarding) or the `X-Session-ID` header; with `bidirectional: true` the decoder params
//!    cached for it (single use, `conversation_ttl_s` < the engines' `--decoder-kv-blocks-ttl`)
//!    are taken;
//! 2. the decider picks P/D (`always`, or `{min_uncached_tokens: N}`: only when the prompt's
//!    best prefill-side cache match leaves at least N tokens to compute) or decode-only;
//! 3. prefill leg on the `prefill_profile`'s pick among `role: prefill` endpoints: body with
//!    `stream=false`, `max_tokens=1` (and `max_completion_tokens=1` if present), no
//!    `stream_options`, `kv_transfer_params` = [`KvTransferParams::prefill_leg`] merged with the
//!    conversation's decoder params; without those, the prefill profile's `p2p-source-producer`
//!    may name any endpoint (a decoder publishes its CPU-tier history) as `remote_kv_source`;
//! 4. decode leg on the `decode_profile`'s pick among `role: decode` endpoints with the prefill
//!    response's `kv_transfer_params` verbatim; the decoder's answer streams to the client while
//!    its final `kv_transfer_params` (last chunk / non-stream body) is cached for the
//!    conversation. A failed prefill leg falls back to decode-only (the decoder computes).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use kvmesh_core::chain::chain_keys;
use kvmesh_core::sse::SseDataReader;
use kvmesh_core::{KvTransferParams, RemoteKvSource};
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::{ConfigError, Role};
use crate::endpoints::Endpoint;
use crate::error::ApiError;
use crate::gateway::{
    DECISION_HEADER, RouterState, SOURCE_HEADER, candidate, engine_request, forwarded_headers,
    request_id, send_to_engine, wants_explanation,
};
use crate::load::LoadGuard;
use crate::plugins::p2p_source_producer::P2pDecision;
use crate::plugins::{Candidate, SchedulingContext};
use crate::prefix::match_of;
use crate::request::{ApiKind, ParsedRequest};
use crate::scheduler::Scheduler;

/// Response header naming the endpoint that ran the prefill leg.
pub const PREFILL_ENDPOINT_HEADER: &str = "x-kvmesh-prefill-endpoint";
/// Request header carrying a conversation id (vLLM's multi-turn benchmark sends it).
pub const SESSION_HEADER: &str = "x-session-id";

/// When to disaggregate.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Decider {
    /// `always`.
    Named(String),
    /// Disaggregate only when at least this many prompt tokens are uncached on the prefill side;
    /// otherwise the decoder serves the whole request.
    MinUncached { min_uncached_tokens: u64 },
}

impl Default for Decider {
    fn default() -> Self {
        Decider::Named("always".to_owned())
    }
}

fn default_ttl() -> f64 {
    450.0
}

/// The `pd:` section of the router config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PdConfig {
    pub prefill_profile: String,
    pub decode_profile: String,
    #[serde(default)]
    pub decider: Decider,
    /// Cache decoders' returned params per conversation and attach them to the next prefill leg.
    #[serde(default)]
    pub bidirectional: bool,
    /// Lifetime of a cached conversation entry (keep it below the engines' 480 s TTL).
    #[serde(default = "default_ttl")]
    pub conversation_ttl_s: f64,
}

impl PdConfig {
    pub fn validate(&self, scheduler: &Scheduler) -> Result<(), ConfigError> {
        for p in [&self.prefill_profile, &self.decode_profile] {
            if scheduler.profile(Some(p)).is_none() {
                return Err(ConfigError::Invalid(format!(
                    "pd: unknown scheduling profile {p:?}"
                )));
            }
        }
        if let Decider::Named(n) = &self.decider
            && n != "always"
        {
            return Err(ConfigError::Invalid(format!(
                "pd.decider: `always` or {{min_uncached_tokens: N}}, not {n:?}"
            )));
        }
        if !(self.conversation_ttl_s.is_finite() && self.conversation_ttl_s > 0.0) {
            return Err(ConfigError::Invalid(
                "pd.conversation_ttl_s must be > 0".into(),
            ));
        }
        Ok(())
    }
}

/// Result of a conversation-cache lookup.
#[derive(Debug, Clone, PartialEq)]
pub enum Lookup {
    Hit(Box<KvTransferParams>),
    Miss,
    Expired,
}

/// Decoder params per conversation: single use, TTL-bounded (pure; clock passed in).
#[derive(Debug, Default)]
pub struct ConversationCache {
    map: HashMap<String, (KvTransferParams, Instant)>,
    evicted_stale: u64,
}

impl ConversationCache {
    pub fn store(&mut self, key: String, params: KvTransferParams, now: Instant, ttl: Duration) {
        self.evict_stale(now, ttl);
        self.map.insert(key, (params, now));
    }

    /// Takes the entry (single use); an entry older than `ttl` is dropped and reported expired.
    pub fn take(&mut self, key: &str, now: Instant, ttl: Duration) -> Lookup {
        match self.map.remove(key) {
            None => Lookup::Miss,
            Some((_, at)) if now.saturating_duration_since(at) >= ttl => {
                self.evicted_stale += 1;
                Lookup::Expired
            }
            Some((p, _)) => Lookup::Hit(Box::new(p)),
        }
    }

    pub fn evict_stale(&mut self, now: Instant, ttl: Duration) {
        let before = self.map.len();
        self.map
            .retain(|_, (_, at)| now.saturating_duration_since(*at) < ttl);
        self.evicted_stale += (before - self.map.len()) as u64;
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn evicted_stale(&self) -> u64 {
        self.evicted_stale
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LegLabel {
    pub leg: &'static str,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConvLabel {
    pub result: &'static str,
}

/// The router's P/D state.
pub struct PdRouter {
    pub config: PdConfig,
    conversations: Mutex<ConversationCache>,
    pub legs: Family<LegLabel, Counter>,
    pub conversation_lookups: Family<ConvLabel, Counter>,
    pub cached_conversations: Gauge,
}

impl PdRouter {
    pub fn new(
        config: PdConfig,
        scheduler: &Scheduler,
        registry: &mut Registry,
    ) -> Result<Self, ConfigError> {
        config.validate(scheduler)?;
        let r = PdRouter {
            config,
            conversations: Mutex::new(ConversationCache::default()),
            legs: Family::default(),
            conversation_lookups: Family::default(),
            cached_conversations: Gauge::default(),
        };
        registry.register(
            "kvmesh_router_pd_legs",
            "P/D legs by leg (prefill, decode, decode_only) and outcome",
            r.legs.clone(),
        );
        registry.register(
            "kvmesh_router_pd_conversations",
            "Conversation-cache lookups and stores by result (hit, miss, expired, stored)",
            r.conversation_lookups.clone(),
        );
        registry.register(
            "kvmesh_router_pd_cached_conversations",
            "Conversations with cached decoder params",
            r.cached_conversations.clone(),
        );
        Ok(r)
    }

    fn ttl(&self) -> Duration {
        Duration::from_secs_f64(self.config.conversation_ttl_s)
    }

    fn leg(&self, leg: &'static str, outcome: &'static str) {
        self.legs.get_or_create(&LegLabel { leg, outcome }).inc();
    }

    fn conv(&self, result: &'static str) {
        self.conversation_lookups
            .get_or_create(&ConvLabel { result })
            .inc();
    }

    pub fn take(&self, key: &str) -> Option<KvTransferParams> {
        let (r, n) = {
            let mut c = self.conversations.lock();
            let r = c.take(key, Instant::now(), self.ttl());
            (r, c.len())
        };
        self.cached_conversations.set(n as i64);
        match r {
            Lookup::Hit(p) => {
                self.conv("hit");
                Some(*p)
            }
            Lookup::Miss => {
                self.conv("miss");
                None
            }
            Lookup::Expired => {
                self.conv("expired");
                None
            }
        }
    }

    pub fn store(&self, key: String, params: KvTransferParams) {
        let n = {
            let mut c = self.conversations.lock();
            c.store(key, params, Instant::now(), self.ttl());
            c.len()
        };
        self.cached_conversations.set(n as i64);
        self.conv("stored");
    }

    /// `(cached_conversations, evicted_stale)` for `/health`, after evicting stale entries.
    pub fn health(&self) -> (usize, u64) {
        let mut c = self.conversations.lock();
        c.evict_stale(Instant::now(), self.ttl());
        (c.len(), c.evicted_stale())
    }
}

/// The prefill leg's body fields (`docs/protocols.md#pd-and-bi-directional-transfer`), given the
/// client's request.
pub fn prefill_leg_body(
    parsed: &ParsedRequest,
    history: Option<&KvTransferParams>,
    source: Option<RemoteKvSource>,
) -> Result<ParsedRequest, serde_json::Error> {
    let mut p = parsed.clone();
    p.set_field("stream", &false)?;
    p.set_field("max_tokens", &1)?;
    if p.fields.contains_key("max_completion_tokens") {
        p.set_field("max_completion_tokens", &1)?;
    }
    p.fields.remove("stream_options");
    let mut kv = KvTransferParams::prefill_leg();
    if let Some(h) = history {
        // The decoder's location of the conversation so far: the prefill engine reads it.
        kv.remote_engine_id = h.remote_engine_id.clone();
        kv.remote_block_ids = h.remote_block_ids.clone();
        kv.remote_host = h.remote_host.clone();
        kv.remote_port = h.remote_port.clone();
        kv.remote_request_id = h.remote_request_id.clone();
        kv.remote_num_tokens = h.remote_num_tokens;
        kv.remote_blocks_expiry_time = h.remote_blocks_expiry_time;
        kv.tp_size = h.tp_size;
    }
    kv.remote_kv_source = source;
    p.set_field("kv_transfer_params", &kv)?;
    Ok(p)
}

/// Takes the conversation key out of the request (`conversation_id` is never forwarded).
fn conversation_key(parsed: &mut ParsedRequest, headers: &HeaderMap) -> Option<String> {
    let from_body = parsed.fields.remove("conversation_id").map(|raw| {
        parsed.modified = true;
        serde_json::from_str::<Value>(raw.get())
            .ok()
            .map(|v| match v {
                Value::String(s) => s,
                other => other.to_string(),
            })
    });
    from_body.flatten().or_else(|| {
        headers
            .get(SESSION_HEADER)
            .and_then(|v| v.to_str().ok())
            .filter(|s| !s.is_empty() && s.len() <= 256)
            .map(str::to_owned)
    })
}

fn with_role(list: &[Arc<Endpoint>], role: Role) -> Vec<Arc<Endpoint>> {
    list.iter()
        .filter(|e| e.is_healthy() && e.spec.role == role)
        .cloned()
        .collect()
}

/// The P/D path of the gateway (see the module docs).
pub async fn route_pd(
    s: Arc<RouterState>,
    pd: Arc<PdRouter>,
    kind: ApiKind,
    headers: HeaderMap,
    mut parsed: ParsedRequest,
) -> Response {
    let conv = conversation_key(&mut parsed, &headers);
    let rid = request_id(&headers);
    let bs = s.config.block_size;
    let keys = chain_keys(&parsed.tokens, bs);
    let matches = s.prefix.find_matches(&keys);
    let list = s.endpoints.list();
    let mut decoders = with_role(&list, Role::Decode);
    if decoders.is_empty() {
        decoders = with_role(&list, Role::Both);
    }
    let prefillers = with_role(&list, Role::Prefill);
    if decoders.is_empty() {
        s.metrics.error("no_endpoint");
        return ApiError::service_unavailable("no healthy decode endpoint").into_response();
    }
    let history = match (&conv, pd.config.bidirectional) {
        (Some(c), true) => pd.take(c),
        _ => None,
    };
    let ctx = SchedulingContext {
        request_id: &rid,
        prompt_tokens: parsed.tokens.len(),
        total_blocks: keys.len(),
        block_size: bs,
        max_tokens: parsed.max_tokens,
    };
    let pcands: Vec<Candidate> = prefillers
        .iter()
        .map(|e| candidate(e, match_of(&matches, e.id)))
        .collect();
    let best_prefill_hit = pcands.iter().map(|c| c.any_blocks * bs).max().unwrap_or(0);
    let uncached = parsed.tokens.len().saturating_sub(best_prefill_hit) as u64;
    let disaggregate = !prefillers.is_empty()
        && match &pd.config.decider {
            Decider::MinUncached {
                min_uncached_tokens,
            } => uncached >= *min_uncached_tokens,
            Decider::Named(_) => true,
        };

    // Prefill leg.
    let mut prefill_name: Option<Arc<str>> = None;
    let mut decode_params: Option<Value> = None;
    let mut explain_prefill: Option<Value> = None;
    if disaggregate && let Some(profile) = s.scheduler.profile(Some(&pd.config.prefill_profile)) {
        let t0 = Instant::now();
        let mut decision = s.scheduler.schedule(&profile, &ctx, &pcands);
        let chosen = decision.chosen;
        // What the prefiller is told to read, recorded as the decision's P2P part: the
        // conversation history from its decoder, else (the profile's pick over every endpoint
        // holding the prefix in its CPU tier — decoders publish theirs) a P2P source.
        let source = match (chosen, &history) {
            (Some(_), Some(h)) => {
                decision.p2p = Some(history_read(h, &list));
                None
            }
            (Some(pi), None) => {
                let (source, p2p) = p2p_source(&s, &profile, &ctx, &pcands, pi, &list, &matches);
                decision.p2p = p2p;
                source
            }
            (None, _) => None,
        };
        if let Some(pi) = chosen {
            let reads = history.is_some() || source.is_some();
            explain_prefill = Some(placed_leg(
                &s,
                &profile.name,
                &pcands[pi],
                reads,
                &decision,
                t0,
            ));
        }
        record(&s, &rid, kind, &ctx, t0, "pd_prefill", decision);
        if let Some(pi) = chosen {
            let pep = Arc::clone(&prefillers[pi]);
            let source_hp = source
                .as_ref()
                .map(|s| format!("{}:{}", s.remote_host, s.remote_port));
            match prefill_leg_body(&parsed, history.as_ref(), source) {
                Ok(body) => {
                    let guard = pep.load.acquire(uncached, 1);
                    match run_prefill(&s, &pep, kind, &headers, &rid, body, source_hp).await {
                        Ok(params) => {
                            pd.leg("prefill", "ok");
                            decode_params = Some(params);
                            prefill_name = Some(Arc::clone(&pep.name));
                        }
                        Err(e) => {
                            pd.leg("prefill", "error");
                            tracing::warn!(endpoint = %pep.name, error = %e, "prefill leg failed; decoding without it");
                        }
                    }
                    drop(guard);
                }
                Err(e) => tracing::warn!(error = %e, "cannot encode prefill leg"),
            }
        }
    }

    // Decode leg.
    let dcands: Vec<Candidate> = decoders
        .iter()
        .map(|e| candidate(e, match_of(&matches, e.id)))
        .collect();
    let dprofile = s
        .scheduler
        .profile(Some(&pd.config.decode_profile))
        .or_else(|| s.scheduler.profile(None));
    let Some(dprofile) = dprofile else {
        return ApiError::service_unavailable("no decode profile").into_response();
    };
    let t0 = Instant::now();
    let decision = s.scheduler.schedule(&dprofile, &ctx, &dcands);
    let chosen = decision.chosen;
    let leg = if decode_params.is_some() {
        "decode"
    } else {
        "decode_only"
    };
    let explain_decode = chosen.map(|di| {
        let reads = decode_params.is_some();
        placed_leg(&s, &dprofile.name, &dcands[di], reads, &decision, t0)
    });
    record(
        &s,
        &rid,
        kind,
        &ctx,
        t0,
        if leg == "decode" {
            "pd_decode"
        } else {
            "decode_only"
        },
        decision,
    );
    let Some(di) = chosen else {
        s.metrics.error("no_endpoint");
        return ApiError::service_unavailable("no decode endpoint chosen").into_response();
    };
    let dep = Arc::clone(&decoders[di]);
    if let Some(p) = &decode_params
        && let Err(e) = parsed.set_field("kv_transfer_params", p)
    {
        tracing::warn!(error = %e, "cannot encode decode-leg params");
    }
    let payload = match parsed.body() {
        Ok(p) => p,
        Err(e) => {
            s.metrics.error("internal");
            return ApiError::bad_request(format!("cannot re-encode body: {e}")).into_response();
        }
    };
    let local = dcands[di].any_blocks as u64 * bs as u64;
    let pulled = if decode_params.is_some() {
        parsed.tokens.len() as u64
    } else {
        local
    };
    let guard = dep.load.acquire(
        (parsed.tokens.len() as u64).saturating_sub(pulled),
        parsed.max_tokens.unwrap_or(16),
    );
    let req = engine_request(&s, &dep, kind, &rid, &headers, payload);
    let upstream = match send_to_engine(&s, &dep, req).await {
        Ok(r) => r,
        Err(e) => {
            pd.leg(leg, "error");
            return e.into_response();
        }
    };
    let status = upstream.status();
    pd.leg(leg, if status.is_success() { "ok" } else { "error" });
    let mut resp_headers = forwarded_headers(&upstream, &dep);
    if let Some(p) = &prefill_name
        && let Ok(v) = HeaderValue::from_str(p)
    {
        resp_headers.insert(HeaderName::from_static(PREFILL_ENDPOINT_HEADER), v);
    }
    if wants_explanation(&headers) {
        let summary = serde_json::json!({
            "request_id": rid,
            "prefill": explain_prefill,
            "decode": explain_decode,
        });
        if let Ok(v) = HeaderValue::from_str(&summary.to_string()) {
            resp_headers.insert(HeaderName::from_static(DECISION_HEADER), v);
        }
    }
    let store = (pd.config.bidirectional && status.is_success())
        .then_some(conv)
        .flatten()
        .map(|c| (pd, c));
    let mut resp = Response::new(tapped_body(upstream, guard, parsed.stream, store));
    *resp.status_mut() = status;
    *resp.headers_mut() = resp_headers;
    resp
}

/// Counts one scheduled leg (placed on `chosen`, reading KV from a peer or not) in the router's
/// placement metrics; returns its part of the `x-kvmesh-decision` explanation.
fn placed_leg(
    s: &RouterState,
    profile: &str,
    chosen: &Candidate,
    reads_from_peer: bool,
    decision: &crate::scheduler::Decision,
    t0: Instant,
) -> Value {
    let outcome = if reads_from_peer {
        "pull_named"
    } else if chosen.any_blocks > 0 {
        "local_hit"
    } else {
        "cold"
    };
    let p2p = decision.p2p.as_ref();
    s.metrics.placed(profile, &chosen.name, outcome, p2p);
    s.metrics
        .scheduling_seconds
        .observe(t0.elapsed().as_secs_f64());
    serde_json::json!({
        "endpoint": chosen.name.as_ref(),
        "outcome": outcome,
        "p2p_source": p2p.and_then(|p| p.source_endpoint.clone()),
        "p2p_why": p2p.map(|p| p.why.clone()),
    })
}

/// Adds a P/D leg's decision to `/debug/decisions` (outcome `pd_prefill`, `pd_decode` or
/// `decode_only`).
fn record(
    s: &RouterState,
    rid: &str,
    kind: ApiKind,
    ctx: &SchedulingContext<'_>,
    t0: Instant,
    outcome: &'static str,
    decision: crate::scheduler::Decision,
) {
    let at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    s.decisions.push(Arc::new(crate::decisions::DecisionRecord {
        request_id: rid.to_owned(),
        at,
        path: kind.path().to_owned(),
        prompt_tokens: ctx.prompt_tokens,
        blocks: ctx.total_blocks,
        scheduling_us: t0.elapsed().as_micros() as u64,
        held_ms: 0.0,
        outcome,
        decision,
    }));
}

/// The prefill profile's P2P source over prefill + decode candidates (computing = the prefill
/// pick), as `remote_kv_source` for the prefill leg, with the profile's decision (None when the
/// profile has no P2P plugin).
fn p2p_source(
    s: &RouterState,
    profile: &crate::scheduler::Profile,
    ctx: &SchedulingContext<'_>,
    pcands: &[Candidate],
    computing: usize,
    list: &[Arc<Endpoint>],
    matches: &[kvmesh_index::EndpointMatch],
) -> (Option<RemoteKvSource>, Option<P2pDecision>) {
    let others: Vec<Arc<Endpoint>> = list
        .iter()
        .filter(|e| e.is_healthy() && e.spec.role != Role::Prefill)
        .cloned()
        .collect();
    let mut all: Vec<Candidate> = pcands.to_vec();
    all.extend(others.iter().map(|e| candidate(e, match_of(matches, e.id))));
    let Some(mut d) = profile.select_source(ctx, &all, computing) else {
        return (None, None);
    };
    let ep = d.source.and_then(|si| {
        if si < pcands.len() {
            s.endpoints
                .list()
                .iter()
                .find(|e| e.id == all[si].endpoint)
                .cloned()
        } else {
            others.get(si - pcands.len()).cloned()
        }
    });
    let source = ep.and_then(|ep| {
        let (host, port) = ep.spec.p2p_host_port()?;
        Some(RemoteKvSource {
            kv_request_id: ctx.request_id.to_owned(),
            remote_host: host,
            remote_port: port,
        })
    });
    if source.is_none() && d.source.is_some() {
        // Picked, but it has no P2P address: nothing is sent, so the record must not name it.
        d.why = format!(
            "{} (not named: {} has no p2p address)",
            d.why,
            d.source_endpoint.as_deref().unwrap_or("?")
        );
        d.source = None;
        d.source_endpoint = None;
    }
    // `source` indexes `all`, not the prefill candidates the decision record describes.
    d.source = None;
    (source, Some(d))
}

/// The prefill leg's read of a conversation's history from the decoder that holds it, as a P2P
/// decision for `/debug/decisions`.
fn history_read(h: &KvTransferParams, list: &[Arc<Endpoint>]) -> P2pDecision {
    let text = |v: &Option<Value>| match v {
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
        None => "?".to_owned(),
    };
    let host_port = format!("{}:{}", text(&h.remote_host), text(&h.remote_port));
    let decoder = list
        .iter()
        .find(|e| {
            e.spec
                .p2p_host_port()
                .is_some_and(|(host, port)| format!("{host}:{port}") == host_port)
        })
        .map_or_else(|| host_port.clone(), |e| e.name.to_string());
    P2pDecision {
        source: None,
        source_endpoint: Some(decoder),
        skipped: None,
        source_tokens: h.remote_num_tokens.unwrap_or(0),
        computing_tokens: 0,
        delta_tokens: 0,
        predicted_recompute_ms: None,
        predicted_pull_ms: None,
        band: Vec::new(),
        why: format!("conversation history held by its decoder at {host_port}"),
    }
}

/// Sends the prefill leg and returns the engine's `kv_transfer_params` (must be an object).
async fn run_prefill(
    s: &RouterState,
    ep: &Endpoint,
    kind: ApiKind,
    headers: &HeaderMap,
    rid: &str,
    body: ParsedRequest,
    source_host_port: Option<String>,
) -> Result<Value, String> {
    let payload = body.body().map_err(|e| e.to_string())?;
    let mut req = engine_request(s, ep, kind, rid, headers, payload);
    if s.config.source_header
        && let Some(hp) = source_host_port
    {
        req = req.header(SOURCE_HEADER, hp);
    }
    let fut = async {
        let r = req.send().await.map_err(|e| error_chain(&e))?;
        let status = r.status();
        let bytes = r.bytes().await.map_err(|e| error_chain(&e))?;
        if !status.is_success() {
            return Err(format!("status {status}"));
        }
        let v: Value = serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
        match v.get("kv_transfer_params") {
            Some(p @ Value::Object(_)) => Ok(p.clone()),
            _ => Err("no kv_transfer_params in the prefill response".to_owned()),
        }
    };
    tokio::time::timeout(s.config.request_timeout, fut)
        .await
        .map_err(|_| "timeout".to_owned())?
}

/// An error with its causes (`reqwest`'s message alone is "error sending request for url"; the
/// cause — connect timeout, reset, closed connection — is in its source chain).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cur = c.source();
    }
    out
}

/// Largest non-stream body kept to read its `kv_transfer_params`.
const MAX_TAP_BYTES: usize = 16 << 20;

/// Finds a non-null `kv_transfer_params` in one JSON document.
fn params_in(doc: &[u8]) -> Option<KvTransferParams> {
    let v: Value = serde_json::from_slice(doc).ok()?;
    let p = v.get("kv_transfer_params")?;
    if p.is_null() {
        return None;
    }
    serde_json::from_value(p.clone()).ok()
}

/// The decoder's body passed through unchanged, owning the load guard, watching for the final
/// `kv_transfer_params` (SSE `data:` lines, or the whole non-stream body) to cache.
///
/// The entry is stored before the chunk that completes it is handed on: a non-stream body comes
/// with the engine's `Content-Length`, and hyper drops the body stream as soon as that many
/// bytes are written, so code after the last chunk never runs. A non-stream body therefore holds
/// back its latest chunk until the next one (or the end) arrives — its client reads the whole
/// document anyway — and an SSE stream stores the params as soon as their line is complete.
fn tapped_body(
    upstream: reqwest::Response,
    mut guard: LoadGuard,
    stream: bool,
    store: Option<(Arc<PdRouter>, String)>,
) -> Body {
    let out = async_stream::stream! {
        let mut chunks = upstream.bytes_stream();
        let mut first = true;
        let mut buf: Vec<u8> = Vec::new();
        let mut sse = SseDataReader::new();
        let mut overflow = false;
        let mut held: Option<Bytes> = None;
        while let Some(chunk) = chunks.next().await {
            match chunk {
                Ok(bytes) => {
                    if first {
                        first = false;
                        guard.prefill_done();
                    }
                    let Some((pd, key)) = &store else {
                        yield Ok::<Bytes, std::io::Error>(bytes);
                        continue;
                    };
                    if stream {
                        sse.push(&bytes);
                        while let Some(doc) = sse.next_data() {
                            if let Some(p) = params_in(doc.trim_ascii()) {
                                pd.store(key.clone(), p);
                            }
                        }
                        yield Ok(bytes);
                    } else {
                        if !overflow {
                            buf.extend_from_slice(&bytes);
                            if buf.len() > MAX_TAP_BYTES {
                                overflow = true;
                                buf = Vec::new();
                            }
                        }
                        if let Some(prev) = held.replace(bytes) {
                            yield Ok(prev);
                        }
                    }
                }
                Err(e) => {
                    // The body is cut short: hand on what arrived, cache nothing.
                    if let Some(prev) = held.take() {
                        yield Ok(prev);
                    }
                    yield Err(std::io::Error::other(e));
                    break;
                }
            }
        }
        if let Some(last) = held.take() {
            if let Some((pd, key)) = &store
                && !overflow
                && let Some(p) = params_in(&buf)
            {
                pd.store(key.clone(), p);
            }
            yield Ok(last);
        }
        drop(guard);
    };
    Body::from_stream(out)
}

#[cfg(test)]
mod tests {
    use kvmesh_text::ByteTokenizer;
    use serde_json::json;

    use super::*;

    #[test]
    fn conversation_cache_is_single_use_and_expires() {
        let mut c = ConversationCache::default();
        let t0 = Instant::now();
        let ttl = Duration::from_secs(450);
        let p = KvTransferParams {
            remote_num_tokens: Some(7),
            ..Default::default()
        };
        c.store("a".into(), p.clone(), t0, ttl);
        assert_eq!(
            c.take("a", t0 + Duration::from_secs(1), ttl),
            Lookup::Hit(Box::new(p.clone()))
        );
        assert_eq!(c.take("a", t0, ttl), Lookup::Miss, "single use");
        c.store("b".into(), p.clone(), t0, ttl);
        assert_eq!(c.take("b", t0 + ttl, ttl), Lookup::Expired);
        c.store("c".into(), p, t0, ttl);
        c.evict_stale(t0 + ttl * 2, ttl);
        assert!(c.is_empty());
        assert_eq!(c.evicted_stale(), 2);
    }

    #[test]
    fn prefill_leg_body_follows_the_protocol() {
        let raw = Bytes::from(
            json!({"model": "m", "prompt": "hello", "stream": true, "max_tokens": 50,
                   "max_completion_tokens": 50, "stream_options": {"include_usage": true}})
            .to_string(),
        );
        let parsed = crate::request::parse(ApiKind::Completions, raw, &ByteTokenizer).unwrap();
        let hist = KvTransferParams {
            do_remote_decode: Some(true),
            remote_host: Some(json!("10.0.0.9")),
            remote_port: Some(json!(7777)),
            remote_block_ids: Some(json!([1, 2])),
            remote_num_tokens: Some(40),
            remote_blocks_expiry_time: Some(1.0e10),
            ..Default::default()
        };
        let body = prefill_leg_body(&parsed, Some(&hist), None).unwrap();
        let v: Value = serde_json::from_slice(&body.body().unwrap()).unwrap();
        assert_eq!(v["stream"], json!(false));
        assert_eq!(v["max_tokens"], json!(1));
        assert_eq!(v["max_completion_tokens"], json!(1));
        assert!(v.get("stream_options").is_none());
        let kv = &v["kv_transfer_params"];
        assert_eq!(kv["do_remote_decode"], json!(true));
        assert_eq!(kv["do_remote_prefill"], json!(false));
        assert_eq!(kv["remote_host"], json!("10.0.0.9"));
        assert_eq!(kv["remote_num_tokens"], json!(40));
        let plain = prefill_leg_body(&parsed, None, None).unwrap();
        let v: Value = serde_json::from_slice(&plain.body().unwrap()).unwrap();
        assert_eq!(
            v["kv_transfer_params"],
            serde_json::to_value(KvTransferParams::prefill_leg()).unwrap()
        );
    }

    #[test]
    fn conversation_id_is_removed_before_forwarding() {
        let raw =
            Bytes::from(json!({"model": "m", "prompt": "x", "conversation_id": "c-1"}).to_string());
        let mut parsed = crate::request::parse(ApiKind::Completions, raw, &ByteTokenizer).unwrap();
        let key = conversation_key(&mut parsed, &HeaderMap::new());
        assert_eq!(key.as_deref(), Some("c-1"));
        let v: Value = serde_json::from_slice(&parsed.body().unwrap()).unwrap();
        assert!(v.get("conversation_id").is_none());
        let mut h = HeaderMap::new();
        h.insert(SESSION_HEADER, HeaderValue::from_static("s-9"));
        assert_eq!(conversation_key(&mut parsed, &h).as_deref(), Some("s-9"));
    }

    #[test]
    fn example_config_is_valid() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../configs/router-pd.yaml");
        let cfg = crate::config::RouterConfig::load(std::path::Path::new(path)).unwrap();
        let pd = cfg.pd.clone().unwrap();
        assert!(pd.bidirectional);
        assert_eq!(
            pd.decider,
            Decider::MinUncached {
                min_uncached_tokens: 512
            }
        );
        let cm = Arc::new(crate::cost_model::CostModel::new(cfg.cost_model.clone()));
        let s = Scheduler::build(
            &cfg.plugins,
            &cfg.scheduling_profiles,
            cfg.default_profile.as_deref(),
            cfg.seed,
            &cm,
        )
        .unwrap();
        pd.validate(&s).unwrap();
        let mut bad = pd.clone();
        bad.decode_profile = "nope".into();
        assert!(bad.validate(&s).is_err());
        bad = pd;
        bad.decider = Decider::Named("sometimes".into());
        assert!(bad.validate(&s).is_err());
    }

    #[test]
    fn prefill_leg_errors_name_their_cause() {
        #[derive(Debug, thiserror::Error)]
        #[error("error sending request for url (http://p0/v1/completions)")]
        struct Send(#[source] std::io::Error);
        let e = Send(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "connection reset by peer",
        ));
        assert_eq!(
            error_chain(&e),
            "error sending request for url (http://p0/v1/completions): connection reset by peer"
        );
    }

    #[test]
    fn decider_parses_both_forms() {
        let d: Decider = serde_norway::from_str("always").unwrap();
        assert_eq!(d, Decider::Named("always".into()));
        let d: Decider = serde_norway::from_str("{min_uncached_tokens: 256}").unwrap();
        assert_eq!(
            d,
            Decider::MinUncached {
                min_uncached_tokens: 256
            }
        );
    }
}
