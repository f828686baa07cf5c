//! Prefetch ahead of arrival, the I/O half (the pure half is [`crate::sessions`]).
//!
//! When a turn of a session ends on its owner, the router expects the next turn after the
//! client's gap (a tool call, a user reading) and prepares a second place for it: the profile
//! picks, among the endpoints that do not hold the history, the one the next turn would go to if
//! the owner were busy, and that engine pulls the history from the owner's CPU tier now
//! (`POST /kvmesh/prefetch`). When the next turn arrives the index shows two holders, so
//! placement can follow load without a pull on the critical path. Bounded by a per-endpoint
//! budget of in-flight bytes; a prefetch still running when the next turn lands elsewhere is
//! cancelled (`DELETE /kvmesh/prefetch/{id}`); every outcome is counted
//! (`kvmesh_router_prefetches_total`) and each prefetch decision is in `/debug/decisions`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use kvmesh_core::chain::chain_keys;
use kvmesh_core::{RemoteKvSource, TokenId};
use kvmesh_sched::SchedulingContext;
use kvmesh_sched::decisions::DecisionRecord;
use serde_json::{Value, json};

use crate::candidates::{by_id, gather};
use crate::config::SessionIdSource;
use crate::endpoints::Endpoint;
use crate::request::ParsedRequest;
use crate::sessions::{Ticket, TicketState, Verdict, verdict};
use crate::state::{RouterState, unix_now};

/// Longest session id accepted (longer ones are ignored: the request is routed as sessionless).
const MAX_SESSION_ID_BYTES: usize = 256;

/// Engine path of prefetches.
pub const PREFETCH_PATH: &str = "/kvmesh/prefetch";

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// The request's session id, from where `prefetch.session_id` says (None when prefetch is off
/// or the request carries none).
pub(crate) fn session_of(
    s: &RouterState,
    headers: &HeaderMap,
    parsed: &ParsedRequest,
) -> Option<String> {
    let sessions = s.sessions.as_ref()?;
    let id = match &sessions.config.session_id {
        SessionIdSource::Header(name) => headers
            .get(name.as_str())
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned),
        SessionIdSource::Body(field) => parsed.field::<Value>(field).and_then(id_text),
        SessionIdSource::Metadata(key) => parsed
            .field::<Value>("metadata")
            .and_then(|m| m.get(key).cloned())
            .and_then(id_text),
    }?;
    (!id.is_empty() && id.len() <= MAX_SESSION_ID_BYTES).then_some(id)
}

fn id_text(v: Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// The session's next turn reached the router: a prefetch decision still waiting for its delay
/// will see it (there was no gap to use).
pub(crate) fn on_arrival(s: &RouterState, session: &str) {
    if let Some(sessions) = &s.sessions {
        sessions.table.lock().turn_arrived(session, Instant::now());
    }
}

/// The session's next turn was placed on `placed`: settles the prefetch prepared for it.
pub(crate) fn on_placed(s: &Arc<RouterState>, session: &str, placed: &Endpoint) {
    let Some(sessions) = s.sessions.as_ref() else {
        return;
    };
    let ticket = sessions.table.lock().take_ticket(session, Instant::now());
    let Some(ticket) = ticket else {
        return;
    };
    match verdict(&ticket, placed.id) {
        Verdict::Used => {
            sessions.count("used");
            sessions.count_bytes("used", ticket.landed_bytes);
        }
        Verdict::UsedInFlight => {
            sessions.count("used_in_flight");
            sessions.count_bytes("used", ticket.bytes);
        }
        Verdict::Wasted { cancel } => {
            sessions.count("wasted");
            sessions.count_bytes("wasted", ticket.landed_bytes);
            if cancel {
                cancel_on_target(s, &ticket);
            }
        }
        Verdict::AlreadyFailed => {}
    }
    tracing::debug!(session, prefetch = %ticket.id, target = %ticket.target_name,
        placed = %placed.name, "prefetch settled by the next turn");
}

/// Asks an engine to pull blocks ahead of demand (`POST /kvmesh/prefetch` with `body`) and waits
/// for its report: the report (None when the engine refused or did not answer in `timeout`), the
/// blocks that landed and the engine's block size (`default_block_size` when it did not say).
pub(crate) async fn send_prefetch(
    s: &RouterState,
    url: String,
    body: &Value,
    timeout: Duration,
    default_block_size: usize,
) -> (Option<Value>, u64, u64) {
    let reply = s.client.post(url).json(body).timeout(timeout).send().await;
    let report: Option<Value> = match reply {
        Ok(r) if r.status().is_success() => r.json().await.ok(),
        _ => None,
    };
    let field = |k: &str| {
        report
            .as_ref()
            .and_then(|r| r.get(k))
            .and_then(Value::as_u64)
    };
    let blocks = field("blocks").unwrap_or(0);
    let block_size = field("block_size").unwrap_or(default_block_size as u64);
    (report, blocks, block_size)
}

/// Asks the target to stop a prefetch nobody will use (best effort, in the background).
fn cancel_on_target(s: &Arc<RouterState>, ticket: &Ticket) {
    let Some(target) = s.endpoints.get(ticket.target) else {
        return;
    };
    let url = target.url(&format!("{PREFETCH_PATH}/{}", ticket.id));
    let client = s.client.clone();
    let sessions = s.sessions.clone();
    tokio::spawn(async move {
        let r = client
            .delete(url)
            .timeout(Duration::from_secs(5))
            .send()
            .await;
        if r.is_ok_and(|r| r.status().is_success())
            && let Some(sessions) = sessions
        {
            sessions.count("cancelled");
        }
    });
}

/// A turn of `session` ended on `owner` (its prompt is `tokens`): remember it and, after
/// `prefetch.delay_ms`, decide whether to prepare the next turn elsewhere. Never fails a request.
pub(crate) fn on_turn_end(
    s: &Arc<RouterState>,
    session: String,
    owner: Arc<Endpoint>,
    tokens: Arc<Vec<TokenId>>,
) {
    let Some(sessions) = s.sessions.clone() else {
        return;
    };
    let (dropped, generation) = {
        let mut table = sessions.table.lock();
        let dropped = table.turn_finished(&session, owner.id, Arc::clone(&tokens), Instant::now());
        (dropped, table.generation(&session))
    };
    sessions.count_dropped(&dropped);
    sessions.refresh_gauges();
    if tokens.len() < sessions.config.min_tokens {
        sessions.count("skipped_short");
        return;
    }
    let delay = Duration::from_secs_f64(sessions.config.delay_ms / 1000.0);
    // Called from a response body's drop, which at shutdown may run outside the runtime.
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let s = Arc::clone(s);
    runtime.spawn(async move {
        tokio::time::sleep(delay).await;
        if sessions.table.lock().generation(&session) != generation {
            // The next turn came (or the session moved on) before the gap was worth a transfer.
            sessions.count("skipped_arrived");
            return;
        }
        prepare_next_turn(&s, session, &owner, &tokens);
    });
}

/// The prediction: where would the session's next turn go now? The profile decides over every
/// endpoint that could take it (the owner, and those of its KV group with a P2P consumer). The
/// owner (it holds the history) → nothing to do; another endpoint → it pulls the missing history
/// from the owner now, within the budget.
fn prepare_next_turn(
    s: &Arc<RouterState>,
    session: String,
    owner: &Arc<Endpoint>,
    tokens: &Arc<Vec<TokenId>>,
) {
    let Some(sessions) = s.sessions.clone() else {
        return;
    };
    let Some((host, port)) = owner.spec.p2p_host_port() else {
        sessions.count("skipped_no_target");
        return;
    };
    let bs = s.config.block_size;
    let keys = chain_keys(tokens, bs);
    let (eligible, mut candidates) = gather(s, &keys, None);
    candidates.retain(|c| c.endpoint == owner.id || (c.has_p2p && c.kv_group == owner.kv_group));
    let profile_name = sessions.config.profile.as_deref();
    let Some(profile) = s.scheduler.profile(profile_name) else {
        sessions.count("skipped_no_target");
        return;
    };
    let id = format!("pf-{}", NEXT_ID.fetch_add(1, Ordering::Relaxed));
    let t0 = Instant::now();
    let ctx = SchedulingContext {
        request_id: &id,
        prompt_tokens: tokens.len(),
        total_blocks: keys.len(),
        block_size: bs,
        max_tokens: None,
    };
    let decision = s.scheduler.schedule(&profile, &ctx, &candidates);
    let chosen = decision.chosen_candidate(&candidates).cloned();
    let Some(target) = chosen.and_then(|c| by_id(&eligible, c.endpoint).cloned().map(|e| (c, e)))
    else {
        sessions.count("skipped_no_target");
        return;
    };
    let (cand, target) = target;
    if target.id == owner.id {
        // The next turn would go back to its owner: nothing to move.
        sessions.count("skipped_owner");
        return;
    }
    if cand.any_blocks >= keys.len() {
        sessions.count("skipped_held");
        return;
    }
    let missing_tokens = (keys.len() - cand.any_blocks.min(keys.len())) * bs;
    let bytes = missing_tokens as u64 * sessions.config.kv_bytes_per_token;
    let unused = sessions.table.lock().unused_bytes(target.id);
    if unused.saturating_add(bytes) > sessions.config.max_unused_bytes_per_endpoint {
        sessions.count("skipped_room");
        return;
    }
    let cap = sessions.config.max_inflight_bytes_per_endpoint;
    if !sessions.budget.lock().try_reserve(target.id, bytes, cap) {
        sessions.count("skipped_budget");
        return;
    }
    let ticket = Ticket {
        id: id.clone(),
        target: target.id,
        target_name: Arc::clone(&target.name),
        bytes,
        landed_bytes: 0,
        state: TicketState::Running,
    };
    if !sessions.table.lock().attach(&session, ticket) {
        sessions.budget.lock().release(target.id, bytes);
        return;
    }
    sessions.count("issued");
    sessions.count_bytes("issued", bytes);
    sessions.refresh_gauges();
    s.decisions.push(Arc::new(DecisionRecord {
        request_id: id.clone(),
        at: unix_now(),
        path: PREFETCH_PATH.to_owned(),
        prompt_tokens: tokens.len(),
        blocks: keys.len(),
        scheduling_us: t0.elapsed().as_micros() as u64,
        held_ms: 0.0,
        outcome: "prefetch",
        decision,
    }));
    let body = json!({
        "prefetch_id": id,
        "prompt_token_ids": tokens.as_slice(),
        "remote_kv_source": RemoteKvSource {
            kv_request_id: id.clone(),
            remote_host: host,
            remote_port: port,
        },
    });
    let (s, url) = (Arc::clone(s), target.url(PREFETCH_PATH));
    tokio::spawn(async move {
        let timeout = Duration::from_secs_f64(sessions.config.timeout_s);
        let (report, blocks, tokens_per_block) = send_prefetch(&s, url, &body, timeout, bs).await;
        let landed = blocks * tokens_per_block * sessions.config.kv_bytes_per_token;
        let state = if blocks > 0 {
            sessions.count("landed");
            sessions.count_bytes("landed", landed);
            TicketState::Landed {
                blocks: blocks as usize,
            }
        } else {
            sessions.count("failed");
            TicketState::Failed
        };
        sessions.budget.lock().release(target.id, bytes);
        let attached = sessions.table.lock().settle(&session, &id, state, landed);
        if !attached && let Some(r) = &report {
            tracing::debug!(prefetch = %id, report = %r, "prefetch ended after its session moved on");
        }
        sessions.refresh_gauges();
    });
}
