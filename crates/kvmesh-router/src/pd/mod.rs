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
//! 3. prefill leg on the `prefill_profile`'s pick among `role: prefill` endpoints that have a
//!    decoder in their KV group (`kv_group`: blocks only move within one): body with
//!    `stream=false`, `max_tokens=1` (and `max_completion_tokens=1` if present), no
//!    `stream_options`, `kv_transfer_params` = [`KvTransferParams::prefill_leg`] merged with the
//!    conversation's decoder params (only when that decoder is in the prefiller's group);
//!    without those, the prefill profile's `p2p-source-producer` may name any endpoint of the
//!    prefiller's group (a decoder publishes its CPU-tier history) as `remote_kv_source`;
//! 4. decode leg on the `decode_profile`'s pick among `role: decode` endpoints (of the
//!    prefiller's KV group when it reads the hand-off) with the prefill
//!    response's `kv_transfer_params` verbatim; the decoder's answer streams to the client while
//!    its final `kv_transfer_params` (last chunk / non-stream body) is cached for the
//!    conversation. A failed prefill leg falls back to decode-only (the decoder computes).

pub mod config;
pub mod conversations;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use kvmesh_core::{ChainKey, KvTransferParams, RemoteKvSource};
use kvmesh_index::EndpointMatch;
use kvmesh_sched::plugins::p2p_source_producer::P2pDecision;
use kvmesh_sched::{Candidate, Decision, Profile, SchedulingContext};
use serde_json::Value;

use crate::config::Role;
use crate::error::ApiError;
use crate::fleet::endpoints::Endpoint;
use crate::fleet::load::LoadGuard;
use crate::fleet::prefix::match_of;
use crate::http::request::{ApiKind, ParsedRequest};
use crate::pd::config::Decider;
use crate::pd::conversations::PdRouter;
use crate::route::candidates::{by_id, candidates_of, with_role};
use crate::route::forward::{
    DECISION_HEADER, Failed, ParamsSink, StallCut, Tap, engine_request, error_chain,
    forwarded_headers, refused, request_id, send_to_engine, tap_body, wants_explanation,
};
use crate::route::remote_source::{NamedSource, judge_pull, name_source};
use crate::state::{Placement, RouterState, outcome};

/// Response header naming the endpoint that ran the prefill leg.
pub const PREFILL_ENDPOINT_HEADER: &str = "x-kvmesh-prefill-endpoint";
/// Request header carrying a conversation id (vLLM's multi-turn benchmark sends it).
pub const SESSION_HEADER: &str = "x-session-id";

/// The prefill leg's body fields (`docs/protocols.md#pd-and-bi-directional-transfer`), given the
/// client's request.
fn prefill_leg_body(
    parsed: &ParsedRequest,
    history: Option<&KvTransferParams>,
    source: Option<RemoteKvSource>,
    predicted_pull_ms: Option<f64>,
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
    // The pull's price bounds it on the prefiller, as on an aggregated route.
    kv.kvmesh_predicted_pull_ms = source.as_ref().and(predicted_pull_ms);
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

/// The P/D path (see the module docs).
pub(crate) async fn route_pd(
    s: Arc<RouterState>,
    pd: Arc<PdRouter>,
    kind: ApiKind,
    headers: HeaderMap,
    mut parsed: ParsedRequest,
) -> Response {
    let conv = conversation_key(&mut parsed, &headers);
    let rid = request_id(&headers);
    let bs = s.config.block_size;
    let keys = parsed.chain_keys(&s.config);
    let matches = s.prefix.find_matches(&keys);
    let list = s.endpoints.list();
    let mut decoders = with_role(&list, Role::Decode);
    if decoders.is_empty() {
        decoders = with_role(&list, Role::Both);
    }
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
        backlog: Default::default(),
        may_pull: true,
    };
    let legs = Legs {
        s: &s,
        pd: &pd,
        kind,
        headers: &headers,
        ctx: &ctx,
        list: &list,
        matches: &matches,
        keys: &keys,
    };
    let prefill = legs.prefill(&parsed, history, &decoders).await;
    legs.decode(&decoders, parsed, prefill, conv).await
}

/// What the prefill leg produced for the decode leg.
#[derive(Default)]
struct Prefilled {
    /// The prefill engine's `kv_transfer_params` (None: the decoder computes everything).
    decode_params: Option<Value>,
    /// The endpoint that ran it.
    endpoint: Option<Arc<str>>,
    /// Its KV group: the decode leg reading its hand-off must be in the same one.
    kv_group: Option<Arc<str>>,
    /// Its part of the `x-kvmesh-decision` summary.
    explain: Option<Value>,
}

/// One P/D request's shared inputs.
struct Legs<'a> {
    s: &'a RouterState,
    pd: &'a Arc<PdRouter>,
    kind: ApiKind,
    headers: &'a HeaderMap,
    ctx: &'a SchedulingContext<'a>,
    list: &'a [Arc<Endpoint>],
    matches: &'a [EndpointMatch],
    keys: &'a [ChainKey],
}

impl Legs<'_> {
    /// Decides whether to disaggregate and, if so, runs the prefill leg. A failed prefill leg is
    /// logged and counted; the decoder then computes the whole prompt.
    async fn prefill(
        &self,
        parsed: &ParsedRequest,
        history: Option<KvTransferParams>,
        decoders: &[Arc<Endpoint>],
    ) -> Prefilled {
        let Some((profile, pcands, uncached)) = self.disaggregate(parsed, decoders) else {
            return Prefilled::default();
        };
        let t0 = Instant::now();
        let mut decision = self.s.scheduler.schedule(&profile, self.ctx, &pcands);
        let chosen = decision.chosen_candidate(&pcands).cloned();
        let Some(chosen) = chosen else {
            self.record(t0, "pd_prefill", decision);
            return Prefilled::default();
        };
        let (history, source) =
            self.prefill_reads(&profile, &chosen, &pcands, history, &mut decision);
        let reads = history.is_some() || source.is_some();
        let mut out = Prefilled {
            explain: Some(self.placed_leg(&profile.name, &chosen, reads, &decision, t0)),
            ..Prefilled::default()
        };
        self.record(t0, "pd_prefill", decision);
        let Some(pep) = by_id(self.list, chosen.endpoint).cloned() else {
            return out;
        };
        self.s.note_placement(&pep);
        let predicted = source
            .as_ref()
            .and_then(|n| n.predicted_ms(&self.s.cost_model, pep.id, 0));
        let body = prefill_leg_body(
            parsed,
            history.as_ref(),
            source.as_ref().map(|n| n.params.clone()),
            predicted,
        );
        match body {
            Ok(body) => {
                self.send_prefill(&pep, body, source, uncached, &mut out)
                    .await
            }
            Err(e) => tracing::warn!(error = %e, "cannot encode prefill leg"),
        }
        out
    }

    /// Whether this request is disaggregated: the prefill profile and its candidates, and the
    /// prompt tokens left to compute where the most is cached. Only prefillers with a decoder of
    /// their KV group count: a hand-off only works between endpoints whose KV blocks are
    /// interchangeable.
    fn disaggregate(
        &self,
        parsed: &ParsedRequest,
        decoders: &[Arc<Endpoint>],
    ) -> Option<(Arc<Profile>, Vec<Candidate>, u64)> {
        let mut prefillers = with_role(self.list, Role::Prefill);
        prefillers.retain(|p| decoders.iter().any(|d| d.kv_group() == p.kv_group()));
        let pcands = candidates_of(&prefillers, self.matches, self.keys, self.ctx.block_size);
        let bs = self.ctx.block_size;
        let best_prefill_hit = pcands.iter().map(|c| c.any_blocks * bs).max().unwrap_or(0);
        let uncached = parsed.tokens.len().saturating_sub(best_prefill_hit) as u64;
        let disaggregate = !prefillers.is_empty()
            && match &self.pd.config.decider {
                Decider::MinUncached {
                    min_uncached_tokens,
                } => uncached >= *min_uncached_tokens,
                Decider::Named(_) => true,
            };
        let profile = self
            .s
            .scheduler
            .profile(Some(&self.pd.config.prefill_profile))
            .filter(|_| disaggregate)?;
        Some((profile, pcands, uncached))
    }

    /// What the prefiller `chosen` is told to read, recorded as the decision's P2P part: the
    /// conversation history from its decoder (only from a decoder of its KV group: another
    /// prefiller recomputes the history rather than be told to pull blocks it would refuse),
    /// else the profile's pick of a P2P source over every endpoint holding the prefix in its CPU
    /// tier (decoders publish theirs).
    fn prefill_reads(
        &self,
        profile: &Profile,
        chosen: &Candidate,
        pcands: &[Candidate],
        history: Option<KvTransferParams>,
        decision: &mut Decision,
    ) -> (Option<KvTransferParams>, Option<NamedSource>) {
        let history = history.filter(|h| {
            let prefiller_group = by_id(self.list, chosen.endpoint).map(|e| e.kv_group());
            let decoder_group = history_endpoint(h, self.list).map(|e| e.kv_group());
            match (prefiller_group, decoder_group) {
                (Some(p), Some(d)) => p == d,
                // An unknown decoder (left the list): keep today's behaviour and let it try.
                _ => true,
            }
        });
        if let Some(h) = &history {
            decision.p2p = Some(history_read(h, self.list));
            return (history, None);
        }
        let others: Vec<Arc<Endpoint>> = self
            .list
            .iter()
            .filter(|e| e.is_healthy() && e.spec.role != Role::Prefill)
            .cloned()
            .collect();
        let mut all = pcands.to_vec();
        all.extend(candidates_of(
            &others,
            self.matches,
            self.keys,
            self.ctx.block_size,
        ));
        self.s.reputation.fill(&mut all);
        decision.p2p = profile.select_source(self.ctx, &all, chosen.endpoint);
        let source = name_source(decision.p2p.as_mut(), self.list, self.ctx.request_id);
        (None, source)
    }

    /// Runs the prefill leg on `pep` with its load counted there; on success `out` carries the
    /// hand-off for the decode leg.
    async fn send_prefill(
        &self,
        pep: &Arc<Endpoint>,
        body: ParsedRequest,
        source: Option<NamedSource>,
        uncached: u64,
        out: &mut Prefilled,
    ) {
        let mut guard = pep.load.acquire(uncached, 1);
        guard.hold_context(self.keys);
        if let Some(src) = &source {
            // The prefill leg teaches the cost model nothing, so its sharing is not needed.
            let _ = src.track(&mut guard, &self.s.cost_model, pep.id);
        }
        match self.run_prefill(pep, body, &guard, source.as_ref()).await {
            Ok(params) => {
                self.pd.leg("prefill", "ok");
                out.decode_params = Some(params);
                out.endpoint = Some(Arc::clone(&pep.name));
                out.kv_group = pep.kv_group();
            }
            Err(e) => {
                self.pd.leg("prefill", "error");
                tracing::warn!(endpoint = %pep.name, error = %e, "prefill leg failed; decoding without it");
            }
        }
        drop(guard);
    }

    /// The decode leg (below), placed once more without its decoder when that one refused the
    /// connection or failed before sending any byte (the prefiller's hand-off is keyed by request
    /// id, so any decoder can read it).
    async fn decode(
        &self,
        decoders: &[Arc<Endpoint>],
        mut parsed: ParsedRequest,
        mut prefill: Prefilled,
        conv: Option<String>,
    ) -> Response {
        // A decoder reading the prefiller's hand-off must share its KV group (its blocks would be
        // refused otherwise). The prefiller was chosen among those with such a decoder; if they
        // all went away since, the decoder computes everything instead of failing a pull.
        let in_group: Vec<Arc<Endpoint>> = decoders
            .iter()
            .filter(|d| d.kv_group() == prefill.kv_group)
            .cloned()
            .collect();
        let decoders: &[Arc<Endpoint>] = if prefill.decode_params.is_none() {
            decoders
        } else if in_group.is_empty() {
            tracing::warn!(
                group = prefill.kv_group.as_deref().unwrap_or("(default)"),
                "no decoder left in the prefiller's KV group; decoding without the hand-off"
            );
            prefill.decode_params = None;
            decoders
        } else {
            &in_group
        };
        let first = self
            .decode_on(decoders, &mut parsed, &prefill, conv.clone())
            .await;
        let (failure, failed) = match first {
            Ok(resp) => return resp,
            Err(f) => f,
        };
        let rest: Vec<Arc<Endpoint>> = match &failed {
            Some(f) if failure.retryable => decoders
                .iter()
                .filter(|e| e.id != f.id && e.is_healthy())
                .cloned()
                .collect(),
            _ => Vec::new(),
        };
        if rest.is_empty() {
            return failure.error.into_response();
        }
        self.s.metrics.retries.inc();
        match self.decode_on(&rest, &mut parsed, &prefill, conv).await {
            Ok(resp) => resp,
            Err((second, _)) => second.error.into_response(),
        }
    }

    /// Places and forwards the decode leg (with the prefill leg's params, if any); its body
    /// streams to the client while the decoder's final params are cached for the conversation.
    async fn decode_on(
        &self,
        decoders: &[Arc<Endpoint>],
        parsed: &mut ParsedRequest,
        prefill: &Prefilled,
        conv: Option<String>,
    ) -> Result<Response, Failed> {
        let s = self.s;
        let reads = prefill.decode_params.is_some();
        let (dep, explain_decode) = self.place_decode(decoders, reads)?;
        if let Some(p) = &prefill.decode_params
            && let Err(e) = parsed.set_field("kv_transfer_params", p)
        {
            tracing::warn!(error = %e, "cannot encode decode-leg params");
        }
        let payload = parsed.body().map_err(|e| {
            s.metrics.error("internal");
            refused(ApiError::bad_request(format!("cannot re-encode body: {e}")))
        })?;
        let local = match_of(self.matches, dep.id).any_blocks as u64 * self.ctx.block_size as u64;
        let prompt = parsed.tokens.len() as u64;
        let read = if reads { prompt } else { local };
        let mut guard = dep
            .load
            .acquire(prompt.saturating_sub(read), parsed.max_tokens.unwrap_or(16));
        guard.hold_context(self.keys);
        let id = self.ctx.request_id;
        let req = engine_request(s, &dep, self.kind, id, self.headers, payload, &guard, None);
        let leg = if reads { "decode" } else { "decode_only" };
        let sent = Instant::now();
        let upstream = match send_to_engine(s, &dep, req).await {
            Ok(r) => r,
            Err(e) => {
                self.pd.leg(leg, "error");
                return Err((e, Some(dep)));
            }
        };
        let status = upstream.status();
        self.pd
            .leg(leg, if status.is_success() { "ok" } else { "error" });
        let mut resp_headers = forwarded_headers(&upstream, &dep);
        self.decode_headers(&mut resp_headers, prefill, explain_decode);
        let tap = Tap {
            stall: StallCut::new(s, &dep, sent, parsed.stream),
            guard,
            learn: None,
            admission_queue: None,
            capture: self.capture(conv, parsed.stream, status),
            on_end: Vec::new(),
        };
        let mut resp = Response::new(tap_body(upstream, tap));
        *resp.status_mut() = status;
        *resp.headers_mut() = resp_headers;
        Ok(resp)
    }

    /// With bi-directional transfer, where the decoder's final `kv_transfer_params` go: the
    /// conversation's entry in the cache (a failed decode leg stores nothing).
    fn capture(
        &self,
        conv: Option<String>,
        stream: bool,
        status: StatusCode,
    ) -> Option<(bool, ParamsSink)> {
        let key = conv.filter(|_| self.pd.config.bidirectional && status.is_success())?;
        let pd = Arc::clone(self.pd);
        let sink: ParamsSink = Box::new(move |p| pd.store(key.clone(), p));
        Some((stream, sink))
    }

    /// Schedules the decode leg among `decoders` and records it (`reads`: it reads the prefill
    /// leg's hand-off); its endpoint and its part of the `x-kvmesh-decision` summary.
    fn place_decode(
        &self,
        decoders: &[Arc<Endpoint>],
        reads: bool,
    ) -> Result<(Arc<Endpoint>, Option<Value>), Failed> {
        let s = self.s;
        let dcands = candidates_of(decoders, self.matches, self.keys, self.ctx.block_size);
        let dprofile = s
            .scheduler
            .profile(Some(&self.pd.config.decode_profile))
            .or_else(|| s.scheduler.profile(None));
        let Some(dprofile) = dprofile else {
            return Err(refused(ApiError::service_unavailable("no decode profile")));
        };
        let t0 = Instant::now();
        let decision = s.scheduler.schedule(&dprofile, self.ctx, &dcands);
        let chosen = decision.chosen_candidate(&dcands).cloned();
        let explain = chosen
            .as_ref()
            .map(|c| self.placed_leg(&dprofile.name, c, reads, &decision, t0));
        let outcome = if reads { "pd_decode" } else { "decode_only" };
        self.record(t0, outcome, decision);
        let Some(dep) = chosen.and_then(|c| by_id(decoders, c.endpoint).cloned()) else {
            s.metrics.error("no_endpoint");
            return Err(refused(ApiError::service_unavailable(
                "no decode endpoint chosen",
            )));
        };
        s.note_placement(&dep);
        Ok((dep, explain))
    }

    /// The decode leg's response headers: the prefiller's name and, when asked for, both legs'
    /// decisions.
    fn decode_headers(&self, headers: &mut HeaderMap, prefill: &Prefilled, decode: Option<Value>) {
        if let Some(p) = &prefill.endpoint
            && let Ok(v) = HeaderValue::from_str(p)
        {
            headers.insert(HeaderName::from_static(PREFILL_ENDPOINT_HEADER), v);
        }
        if wants_explanation(self.headers) {
            let summary = serde_json::json!({
                "request_id": self.ctx.request_id,
                "prefill": &prefill.explain,
                "decode": decode,
            });
            if let Ok(v) = HeaderValue::from_str(&summary.to_string()) {
                headers.insert(HeaderName::from_static(DECISION_HEADER), v);
            }
        }
    }

    /// Counts one scheduled leg (placed on `chosen`, reading KV from a peer or not) in the
    /// router's placement metrics; returns its part of the `x-kvmesh-decision` explanation.
    fn placed_leg(
        &self,
        profile: &str,
        chosen: &Candidate,
        reads_from_peer: bool,
        decision: &Decision,
        t0: Instant,
    ) -> Value {
        let outcome = outcome(reads_from_peer, chosen.any_blocks as u64);
        let p2p = decision.p2p.as_ref();
        self.s
            .count_placement(profile, &chosen.name, outcome, p2p, t0.elapsed());
        serde_json::json!({
            "endpoint": chosen.name.as_ref(),
            "outcome": outcome,
            "p2p_source": p2p.and_then(|p| p.source_endpoint.clone()),
            "p2p_why": p2p.map(|p| p.why.clone()),
        })
    }

    /// Adds a P/D leg's decision to `/debug/decisions` (outcome `pd_prefill`, `pd_decode` or
    /// `decode_only`).
    fn record(&self, t0: Instant, outcome: &'static str, decision: Decision) {
        let placement = Placement {
            kind: self.kind,
            ctx: self.ctx,
            outcome,
            scheduling: t0.elapsed(),
            held: Duration::ZERO,
        };
        self.s.record(placement, decision);
    }

    /// Sends the prefill leg and returns the engine's `kv_transfer_params` (must be an object).
    async fn run_prefill(
        &self,
        ep: &Endpoint,
        body: ParsedRequest,
        guard: &LoadGuard,
        source: Option<&NamedSource>,
    ) -> Result<Value, String> {
        let s = self.s;
        let payload = body.body().map_err(|e| e.to_string())?;
        let source_hp = source.map(NamedSource::host_port);
        let req = engine_request(
            s,
            ep,
            self.kind,
            self.ctx.request_id,
            self.headers,
            payload,
            guard,
            source_hp.as_deref(),
        );
        let fut = async {
            let r = req.send().await.map_err(|e| error_chain(&e))?;
            let status = r.status();
            if let Some(src) = source {
                // The prefiller's report on the pull it was named a source for.
                judge_pull(s, src, r.headers());
            }
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
}

/// The listed endpoint whose P2P address the conversation history names.
fn history_endpoint<'a>(
    h: &KvTransferParams,
    list: &'a [Arc<Endpoint>],
) -> Option<&'a Arc<Endpoint>> {
    let text = |v: &Option<Value>| match v {
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
        None => "?".to_owned(),
    };
    let host_port = format!("{}:{}", text(&h.remote_host), text(&h.remote_port));
    list.iter().find(|e| {
        e.spec
            .p2p_host_port()
            .is_some_and(|(host, port)| format!("{host}:{port}") == host_port)
    })
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
    let decoder =
        history_endpoint(h, list).map_or_else(|| host_port.clone(), |e| e.name.to_string());
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
        penalised_sources: Vec::new(),
        why: format!("conversation history held by its decoder at {host_port}"),
    }
}

#[cfg(test)]
mod tests {
    use axum::body::Bytes;
    use kvmesh_text::ByteTokenizer;
    use serde_json::json;

    use super::*;

    #[test]
    fn prefill_leg_body_follows_the_protocol() {
        let raw = Bytes::from(
            json!({"model": "m", "prompt": "hello", "stream": true, "max_tokens": 50,
                   "max_completion_tokens": 50, "stream_options": {"include_usage": true}})
            .to_string(),
        );
        let parsed =
            crate::http::request::parse(ApiKind::Completions, raw, &ByteTokenizer, 1 << 20)
                .unwrap();
        let hist = KvTransferParams {
            do_remote_decode: Some(true),
            remote_host: Some(json!("10.0.0.9")),
            remote_port: Some(json!(7777)),
            remote_block_ids: Some(json!([1, 2])),
            remote_num_tokens: Some(40),
            remote_blocks_expiry_time: Some(1.0e10),
            ..Default::default()
        };
        let body = prefill_leg_body(&parsed, Some(&hist), None, Some(40.0)).unwrap();
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
        assert!(
            kv.get("kvmesh_predicted_pull_ms")
                .is_none_or(Value::is_null),
            "a price only goes with a named source"
        );
        let src = RemoteKvSource {
            kv_request_id: "r".into(),
            remote_host: "10.0.0.3".into(),
            remote_port: 7100,
        };
        let named = prefill_leg_body(&parsed, None, Some(src), Some(40.0)).unwrap();
        let v: Value = serde_json::from_slice(&named.body().unwrap()).unwrap();
        let kv = &v["kv_transfer_params"];
        assert_eq!(kv["remote_kv_source"]["remote_port"], json!(7100));
        assert_eq!(kv["kvmesh_predicted_pull_ms"], json!(40.0));
        let plain = prefill_leg_body(&parsed, None, None, None).unwrap();
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
        let mut parsed =
            crate::http::request::parse(ApiKind::Completions, raw, &ByteTokenizer, 1 << 20)
                .unwrap();
        let key = conversation_key(&mut parsed, &HeaderMap::new());
        assert_eq!(key.as_deref(), Some("c-1"));
        let v: Value = serde_json::from_slice(&parsed.body().unwrap()).unwrap();
        assert!(v.get("conversation_id").is_none());
        let mut h = HeaderMap::new();
        h.insert(SESSION_HEADER, HeaderValue::from_static("s-9"));
        assert_eq!(conversation_key(&mut parsed, &h).as_deref(), Some("s-9"));
    }
}
