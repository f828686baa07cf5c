//! Prefetch ahead of arrival, the I/O half (the pure half is [`crate::prefetch::sessions`]).
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
//!
//! Most next turns are predicted back on their owner. There the history can still leave the GPU
//! tier during the gap (other sessions' work evicts it to the CPU tier), and the next turn would
//! restore it on its critical path. So, with `prefetch.restore` (the default), the router keeps
//! reading its index during the gap (every `restore_recheck_ms`) and, once the index shows the
//! owner's CPU tier holding blocks of the history that its GPU tier lost, asks the owner to
//! restore them now (`POST /kvmesh/prefetch` without `remote_kv_source`). A short gap in which
//! nothing was evicted costs index reads only, no request; one restore per gap.
//!
//! When is decided by the session's own pace (`prefetch.gap_timing`): a session whose recent gaps
//! agree is decided `lead_ms` before its earliest expected arrival, where the owner's load says
//! more about the next turn's placement than it does right after the answer, and a restored
//! history has little time to be evicted again. Restores wait for such an estimate; sessions
//! without one get pull prefetches `delay_ms` after the turn.

pub mod config;
pub mod sessions;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, StatusCode};
use kvmesh_core::chain::chain_keys;
use kvmesh_core::{ChainKey, RemoteKvSource, TokenId};
use kvmesh_sched::decisions::DecisionRecord;
use kvmesh_sched::plugins::p2p_source_producer::P2pDecision;
use kvmesh_sched::{Candidate, Decision, SchedulingContext};
use prometheus_client::registry::Registry;
use serde_json::{Value, json};

use crate::fleet::endpoints::Endpoint;
use crate::fleet::prefix::match_of;
use crate::http::request::ParsedRequest;
use crate::prefetch::config::{PrefetchConfig, SessionIdSource};
use crate::prefetch::sessions::{
    GapEstimate, Sessions, Ticket, TicketState, Verdict, decision_wait, verdict,
};
use crate::route::candidates::{by_id, gather};
use crate::route::forward::{PREFETCH_PATH, send_prefetch};
use crate::state::{Arrival, Hook, RequestHook, RouterState, unix_now};

/// Longest session id accepted (longer ones are ignored: the request is routed as sessionless).
const MAX_SESSION_ID_BYTES: usize = 256;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// The prefetch feature: the sessions it follows, hooked into the aggregated route.
pub struct Prefetch {
    sessions: Arc<Sessions>,
}

impl Prefetch {
    pub fn new(config: PrefetchConfig, registry: &mut Registry) -> Self {
        Prefetch {
            sessions: Arc::new(Sessions::new(config, registry)),
        }
    }
}

impl Hook for Prefetch {
    /// A turn of a session arrived: a prefetch decision still waiting for its delay will see it
    /// (there was no gap to use), and the turn is followed to its end.
    fn on_arrival(&self, s: &Arc<RouterState>, a: &Arrival<'_>) -> Option<Box<dyn RequestHook>> {
        let session = session_of(&self.sessions.config.session_id, a.headers, a.request)?;
        if !a.request.tenant(&s.config).is_shared() {
            // Prefetches and restores name bare token ids, which engines hash without salt or
            // adapter: for a tenant's session they would prepare the wrong blocks.
            self.sessions.count("skipped_tenant");
            return None;
        }
        self.sessions
            .table
            .lock()
            .turn_arrived(&session, Instant::now());
        Some(Box::new(Turn {
            sessions: Arc::clone(&self.sessions),
            session,
            tokens: Arc::new(a.request.tokens.clone()),
            answered: None,
        }))
    }
}

/// One turn of a session on its way through the router.
struct Turn {
    sessions: Arc<Sessions>,
    session: String,
    tokens: Arc<Vec<TokenId>>,
    /// The engine that answered it successfully (the turn's blocks exist there once it sent a
    /// byte).
    answered: Option<(Arc<RouterState>, Arc<Endpoint>)>,
}

impl RequestHook for Turn {
    /// Settled once the engine answered: a first try refused by a dead owner is not the
    /// placement that decides whether the session's prefetch was used.
    fn on_answer(&mut self, s: &Arc<RouterState>, ep: &Arc<Endpoint>, status: StatusCode) {
        settle(s, &self.sessions, &self.session, ep);
        self.answered = status.is_success().then(|| (Arc::clone(s), Arc::clone(ep)));
    }

    /// The turn's blocks exist on the engine that answered: prepare the session's next turn.
    fn on_end(self: Box<Self>) {
        if let Some((s, owner)) = self.answered {
            on_turn_end(&s, self.sessions, self.session, owner, self.tokens);
        }
    }
}

/// The request's session id, from where `prefetch.session_id` says (None when it carries none).
fn session_of(
    from: &SessionIdSource,
    headers: &HeaderMap,
    parsed: &ParsedRequest,
) -> Option<String> {
    let id = match from {
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

/// The session's next turn was placed on `placed`: settles the prefetch prepared for it.
fn settle(s: &RouterState, sessions: &Arc<Sessions>, session: &str, placed: &Endpoint) {
    let ticket = sessions.table.lock().take_ticket(session, Instant::now());
    let Some(ticket) = ticket else {
        return;
    };
    if ticket.restore {
        // A restore ran on the owner; it is quick and took no CPU-tier room: never cancelled.
        match verdict(&ticket, placed.id) {
            Verdict::Used | Verdict::UsedInFlight => {
                sessions.count("restore_used");
                sessions.count_bytes("restore_used", ticket.landed_bytes);
            }
            Verdict::Wasted { .. } => {
                sessions.count("restore_wasted");
                sessions.count_bytes("restore_wasted", ticket.landed_bytes);
            }
            Verdict::AlreadyFailed => {}
        }
        return;
    }
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
                cancel_on_target(s, sessions, &ticket);
            }
        }
        Verdict::AlreadyFailed => {}
    }
    tracing::debug!(session, prefetch = %ticket.id, target = %ticket.target_name,
        placed = %placed.name, "prefetch settled by the next turn");
}

/// Asks the target to stop a prefetch nobody will use (best effort, in the background).
fn cancel_on_target(s: &RouterState, sessions: &Arc<Sessions>, ticket: &Ticket) {
    let Some(target) = s.endpoints.get(ticket.target) else {
        return;
    };
    let url = target.url(&format!("{PREFETCH_PATH}/{}", ticket.id));
    let client = s.client.clone();
    let sessions = Arc::clone(sessions);
    tokio::spawn(async move {
        let r = client
            .delete(url)
            .timeout(Duration::from_secs(5))
            .send()
            .await;
        if r.is_ok_and(|r| r.status().is_success()) {
            sessions.count("cancelled");
        }
    });
}

/// A turn of `session` ended on `owner` (its prompt is `tokens`): remember it and, after
/// `prefetch.delay_ms`, decide whether to prepare the next turn elsewhere. Never fails a request.
fn on_turn_end(
    s: &Arc<RouterState>,
    sessions: Arc<Sessions>,
    session: String,
    owner: Arc<Endpoint>,
    tokens: Arc<Vec<TokenId>>,
) {
    let (dropped, generation) = {
        let mut table = sessions.table.lock();
        let dropped = table.turn_finished(&session, Instant::now());
        (dropped, table.generation(&session))
    };
    sessions.count_dropped(&dropped);
    sessions.refresh_gauges();
    if tokens.len() < sessions.config.min_tokens {
        sessions.count("skipped_short");
        return;
    }
    let estimate = sessions.gap_estimate(&session);
    if estimate.is_some() {
        sessions.count("timed_by_gap");
    }
    let delay = decision_wait(
        estimate,
        Duration::from_secs_f64(sessions.config.delay_ms / 1000.0),
        Duration::from_secs_f64(sessions.config.lead_ms / 1000.0),
    );
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
        let keys = chain_keys(&tokens, s.config.block_size);
        let mut next = prepare_next_turn(&s, &sessions, &session, &owner, &tokens, &keys);
        // Back on the owner with the history in its GPU tier: watch the index for the history
        // leaving it, until the next turn comes or the session is forgotten.
        let (recheck, ttl) = (
            sessions.config.restore_recheck(),
            Duration::from_secs_f64(sessions.config.session_ttl_s),
        );
        let started = Instant::now();
        while next == Next::OwnerResident {
            tokio::time::sleep(recheck).await;
            if sessions.table.lock().generation(&session) != generation || started.elapsed() > ttl {
                // The GPU tier kept the history for the whole gap: nothing to do.
                sessions.count("skipped_owner");
                return;
            }
            next = recheck_owner(&s, &sessions, &session, &owner, &tokens, &keys);
        }
    });
}

/// What the decision after a turn left to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    /// Decided (a prefetch issued, or skipped and counted).
    Done,
    /// The next turn goes back to the owner, whose GPU tier still holds the history: re-read
    /// the index later (restore-ahead).
    OwnerResident,
}

/// A re-read of the index during the gap: has the owner's GPU tier lost part of the history
/// that its CPU tier still holds?
fn recheck_owner(
    s: &Arc<RouterState>,
    sessions: &Arc<Sessions>,
    session: &str,
    owner: &Arc<Endpoint>,
    tokens: &Arc<Vec<TokenId>>,
    keys: &[ChainKey],
) -> Next {
    if !owner.is_healthy() {
        sessions.count("skipped_owner");
        return Next::Done;
    }
    // A one-block probe first: an engine releases a history tail first, so its GPU tier loses
    // the last block before any other. While that block is there, the full walk (thousands of
    // blocks, for every session in its gap, every recheck) is not worth doing.
    let last = &keys[keys.len().saturating_sub(1)..];
    if match_of(&s.prefix.find_matches(last), owner.id).gpu_blocks > 0 {
        return Next::OwnerResident;
    }
    let m = match_of(&s.prefix.find_matches(keys), owner.id);
    restore_on_owner(
        s,
        sessions,
        session,
        owner,
        tokens,
        keys.len(),
        (m.gpu_blocks, m.cpu_blocks),
    )
}

/// The next turn goes back to `owner`, whose index entry for the history's `blocks` full blocks
/// is `(gpu, cpu)` leading blocks: while the GPU tier holds them all there is nothing to do
/// (yet); once the CPU tier holds more than the GPU tier, the owner restores those blocks now,
/// within the in-flight budget. Nothing beyond the GPU prefix anywhere: keep watching (the CPU
/// tier cannot help, the next turn computes them).
fn restore_on_owner(
    s: &Arc<RouterState>,
    sessions: &Arc<Sessions>,
    session: &str,
    owner: &Arc<Endpoint>,
    tokens: &Arc<Vec<TokenId>>,
    blocks: usize,
    (gpu, cpu): (usize, usize),
) -> Next {
    if !sessions.config.restore {
        sessions.count("skipped_owner");
        return Next::Done;
    }
    if gpu >= blocks || cpu <= gpu {
        return Next::OwnerResident;
    }
    let estimate = sessions.gap_estimate(session);
    if sessions.config.gap_timing && estimate.is_none() {
        // Measured on `agentic`: restored whenever the eviction is seen, a history is evicted
        // again by other sessions' turns before its own comes back.
        sessions.count("restore_skipped_unpredictable");
        return Next::Done;
    }
    let bs = s.config.block_size;
    let bytes = ((cpu - gpu) * bs) as u64 * sessions.config.kv_bytes_per_token;
    let id = format!("pf-{}", NEXT_ID.fetch_add(1, Ordering::Relaxed));
    if !issue(sessions, session, &id, owner, bytes, true) {
        return Next::Done;
    }
    let restore = Restore {
        owner,
        blocks,
        gpu,
        cpu,
        block_size: bs,
    };
    s.decisions
        .push(Arc::new(restore.record(&id, tokens.len(), estimate)));
    // No `remote_kv_source`: the owner restores from its own CPU tier.
    let body = json!({"prefetch_id": id, "prompt_token_ids": tokens.as_slice()});
    send_and_settle(s, sessions, session, id, owner, body, bytes, true);
    Next::Done
}

/// A restore ahead on the session's owner, as `/debug/decisions` shows it.
struct Restore<'a> {
    owner: &'a Endpoint,
    /// The history's full blocks, and the owner's leading blocks of it per tier.
    blocks: usize,
    gpu: usize,
    cpu: usize,
    block_size: usize,
}

impl Restore<'_> {
    /// The decision record of restore `id` for a `prompt_tokens`-token history (outcome
    /// `prefetch_restore`; `why` names the session's pace when it has one).
    fn record(
        &self,
        id: &str,
        prompt_tokens: usize,
        estimate: Option<GapEstimate>,
    ) -> DecisionRecord {
        let (owner, blocks, gpu, cpu, bs) =
            (self.owner, self.blocks, self.gpu, self.cpu, self.block_size);
        let expected = estimate.map_or(String::new(), |e| {
            format!(
                " (the session's gaps: {:.1} s ± {:.0} %)",
                e.mean.as_secs_f64(),
                e.spread * 100.0
            )
        });
        let why = format!(
            "next turn predicted back on its owner {}, whose GPU tier holds {gpu} of the history's \
             {blocks} blocks and its CPU tier {cpu}: restore {} blocks ahead{expected}",
            owner.name,
            cpu - gpu
        );
        DecisionRecord {
            request_id: id.to_owned(),
            at: unix_now(),
            path: PREFETCH_PATH.to_owned(),
            prompt_tokens,
            blocks,
            scheduling_us: 0,
            held_ms: 0.0,
            outcome: "prefetch_restore",
            decision: Decision {
                profile: "prefetch-restore".to_owned(),
                chosen: Some(owner.id),
                endpoint: Some(owner.name.to_string()),
                picker: "session-owner".to_owned(),
                filters: Vec::new(),
                candidates: Vec::new(),
                p2p: Some(P2pDecision {
                    source: Some(owner.id),
                    source_endpoint: Some(owner.name.to_string()),
                    skipped: None,
                    source_tokens: (cpu * bs) as u64,
                    computing_tokens: (gpu * bs) as u64,
                    delta_tokens: ((cpu - gpu) * bs) as i64,
                    predicted_recompute_ms: None,
                    predicted_pull_ms: None,
                    band: Vec::new(),
                    penalised_sources: Vec::new(),
                    why,
                }),
            },
        }
    }
}

/// The prediction: where would the session's next turn go now? The profile decides over every
/// endpoint that could take it (the owner, and those of its KV group with a P2P consumer). The
/// owner → restore ahead on it if its GPU tier lost the history ([`restore_on_owner`]); another
/// endpoint → it pulls the missing history from the owner now, within the budget.
fn prepare_next_turn(
    s: &Arc<RouterState>,
    sessions: &Arc<Sessions>,
    session: &str,
    owner: &Arc<Endpoint>,
    tokens: &Arc<Vec<TokenId>>,
    keys: &[ChainKey],
) -> Next {
    let Some((host, port)) = owner.spec.p2p_host_port() else {
        sessions.count("skipped_no_target");
        return Next::Done;
    };
    let bs = s.config.block_size;
    let id = format!("pf-{}", NEXT_ID.fetch_add(1, Ordering::Relaxed));
    let t0 = Instant::now();
    let Some((decision, cand, target)) = next_turn_placement(s, sessions, owner, tokens, keys, &id)
    else {
        sessions.count("skipped_no_target");
        return Next::Done;
    };
    if target.id == owner.id {
        // The next turn would go back to its owner: nothing to move between engines.
        return restore_on_owner(
            s,
            sessions,
            session,
            owner,
            tokens,
            keys.len(),
            (cand.gpu_blocks, cand.cpu_blocks),
        );
    }
    if cand.any_blocks >= keys.len() {
        sessions.count("skipped_held");
        return Next::Done;
    }
    let missing_tokens = (keys.len() - cand.any_blocks.min(keys.len())) * bs;
    let bytes = missing_tokens as u64 * sessions.config.kv_bytes_per_token;
    let unused = sessions.table.lock().unused_bytes(target.id);
    if unused.saturating_add(bytes) > sessions.config.max_unused_bytes_per_endpoint {
        sessions.count("skipped_room");
        return Next::Done;
    }
    if !issue(sessions, session, &id, &target, bytes, false) {
        return Next::Done;
    }
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
    send_and_settle(s, sessions, session, id, &target, body, bytes, false);
    Next::Done
}

/// Where the profile would place the session's next turn if it arrived now (request id `id`):
/// the decision, the chosen candidate and its endpoint, among the owner and the endpoints of its
/// KV group with a P2P consumer. None when nothing could take it.
fn next_turn_placement(
    s: &RouterState,
    sessions: &Sessions,
    owner: &Endpoint,
    tokens: &[TokenId],
    keys: &[ChainKey],
    id: &str,
) -> Option<(Decision, Candidate, Arc<Endpoint>)> {
    let (eligible, mut candidates) = gather(s, keys, None);
    candidates.retain(|c| c.endpoint == owner.id || (c.has_p2p && c.kv_group == owner.kv_group()));
    let profile = s.scheduler.profile(sessions.config.profile.as_deref())?;
    let ctx = SchedulingContext {
        request_id: id,
        prompt_tokens: tokens.len(),
        total_blocks: keys.len(),
        block_size: s.config.block_size,
        max_tokens: None,
        backlog: Default::default(),
        may_pull: true,
    };
    let decision = s.scheduler.schedule(&profile, &ctx, &candidates);
    let chosen = decision.chosen_candidate(&candidates).cloned()?;
    let target = by_id(&eligible, chosen.endpoint).cloned()?;
    Some((decision, chosen, target))
}

/// Reserves `bytes` of the in-flight budget towards `target` and attaches a running prefetch
/// `id` (a restore ahead when `restore`) to the session, counted as issued; false, with the
/// budget untouched, when the budget is full (counted) or the session has one already.
fn issue(
    sessions: &Sessions,
    session: &str,
    id: &str,
    target: &Endpoint,
    bytes: u64,
    restore: bool,
) -> bool {
    let label = |what: &'static str, restore_what: &'static str| {
        if restore { restore_what } else { what }
    };
    let cap = sessions.config.max_inflight_bytes_per_endpoint;
    if !sessions.budget.lock().try_reserve(target.id, bytes, cap) {
        sessions.count(label("skipped_budget", "restore_skipped_budget"));
        return false;
    }
    let ticket = Ticket {
        id: id.to_owned(),
        target: target.id,
        target_name: Arc::clone(&target.name),
        bytes,
        landed_bytes: 0,
        state: TicketState::Running,
        restore,
    };
    if !sessions.table.lock().attach(session, ticket) {
        sessions.budget.lock().release(target.id, bytes);
        return false;
    }
    let issued = label("issued", "restore_issued");
    sessions.count(issued);
    sessions.count_bytes(issued, bytes);
    sessions.refresh_gauges();
    true
}

/// Sends the prefetch `body` to `target` in the background and, with the engine's report,
/// releases its budget and settles the session's ticket `id`: landed (counted `landed`, or
/// `restored` for a restore ahead) or failed (`failed`; a restore that found nothing missing —
/// the index was behind the engine, cheap — is `restore_nothing_missing`).
#[allow(clippy::too_many_arguments)]
fn send_and_settle(
    s: &Arc<RouterState>,
    sessions: &Arc<Sessions>,
    session: &str,
    id: String,
    target: &Arc<Endpoint>,
    body: Value,
    bytes: u64,
    restore: bool,
) {
    let (s, sessions, target) = (Arc::clone(s), Arc::clone(sessions), Arc::clone(target));
    let session = session.to_owned();
    tokio::spawn(async move {
        let timeout = Duration::from_secs_f64(sessions.config.timeout_s);
        let url = target.url(PREFETCH_PATH);
        let bs = s.config.block_size;
        let (report, blocks, tokens_per_block) = send_prefetch(&s, url, &body, timeout, bs).await;
        let landed = blocks * tokens_per_block * sessions.config.kv_bytes_per_token;
        let outcome = report
            .as_ref()
            .and_then(|r| r.get("outcome"))
            .and_then(Value::as_str);
        let state = if blocks > 0 {
            let label = if restore { "restored" } else { "landed" };
            sessions.count(label);
            sessions.count_bytes(label, landed);
            TicketState::Landed {
                blocks: blocks as usize,
            }
        } else {
            sessions.count(match (restore, outcome) {
                (true, Some("nothing_missing")) => "restore_nothing_missing",
                (true, _) => "restore_failed",
                (false, _) => "failed",
            });
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
