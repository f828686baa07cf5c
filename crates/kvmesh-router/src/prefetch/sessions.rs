//! The sessions the router follows for prefetch ahead of arrival (`prefetch:` in the config;
//! `docs/architecture.md#prefetch`): per session id, when its last turn ended, the gaps it left
//! between turns, and at most one prefetch prepared for the next turn (the decision after a turn
//! is handed that turn's engine and prompt; the table keeps neither); per endpoint, the bytes of prefetches in flight. [`SessionTable`], [`GapHistory`] and
//! [`PrefetchBudget`] are pure (the clock is an argument); [`Sessions`] puts them behind locks
//! next to the prefetch metrics. The I/O (asking an engine to pull, cancelling) is in
//! `crate::prefetch`.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_index::EndpointId;
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::prefetch::config::PrefetchConfig;

/// Where a prefetch is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TicketState {
    /// The target engine is pulling.
    Running,
    /// The target reported `blocks` landed (its block size).
    Landed { blocks: usize },
    /// The target pulled nothing (peer gone, blocks evicted, refused, busy).
    Failed,
}

/// One prefetch prepared for a session's next turn.
#[derive(Debug, Clone, PartialEq)]
pub struct Ticket {
    pub id: String,
    pub target: EndpointId,
    pub target_name: Arc<str>,
    /// Modelled bytes the prefetch was budgeted for (missing tokens × KV bytes per token).
    pub bytes: u64,
    /// Bytes that landed (0 until the target reports).
    pub landed_bytes: u64,
    pub state: TicketState,
    /// A restore ahead on the owner (its CPU tier into its GPU tier), not a pull: it takes no
    /// CPU-tier room and is counted under the `restore_*` outcomes.
    pub restore: bool,
}

#[derive(Debug)]
struct Session {
    at: Instant,
    ticket: Option<Ticket>,
    /// Bumped by every turn end and arrival: a prefetch decided after a delay checks that
    /// nothing happened to the session meanwhile.
    generation: u64,
    /// When the last turn ended, until the next one arrives (then it becomes a gap).
    ended_at: Option<Instant>,
    gaps: GapHistory,
}

/// Gaps kept per session: enough to tell a regular client from an irregular one, few enough
/// that a session changing pace is followed within a few turns.
const GAPS_KEPT: usize = 4;

/// The last few gaps between a session's turn end and its next arrival (pure).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GapHistory {
    gaps: VecDeque<Duration>,
}

/// A session's expected gap: `mean`, and the largest relative distance of a kept gap from it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GapEstimate {
    pub mean: Duration,
    pub spread: f64,
}

impl GapEstimate {
    /// The earliest the next turn is expected: the mean less its spread.
    pub fn earliest(&self) -> Duration {
        self.mean.mul_f64((1.0 - self.spread).max(0.0))
    }
}

impl GapHistory {
    pub fn push(&mut self, gap: Duration) {
        if self.gaps.len() == GAPS_KEPT {
            self.gaps.pop_front();
        }
        self.gaps.push_back(gap);
    }

    /// The expected next gap when the session has left at least two gaps and they agree within
    /// `tolerance` (relative to their mean); None for an unpredictable (or new) session.
    pub fn estimate(&self, tolerance: f64) -> Option<GapEstimate> {
        if self.gaps.len() < 2 {
            return None;
        }
        let secs: Vec<f64> = self.gaps.iter().map(Duration::as_secs_f64).collect();
        let mean = secs.iter().sum::<f64>() / secs.len() as f64;
        if mean <= 0.0 {
            return None;
        }
        let spread = secs
            .iter()
            .map(|g| (g - mean).abs() / mean)
            .fold(0.0, f64::max);
        (spread <= tolerance).then(|| GapEstimate {
            mean: Duration::from_secs_f64(mean),
            spread,
        })
    }
}

/// How long after a turn ends the router decides about the next one: `delay` when the session's
/// gap is unknown; with an estimate, `lead` before the earliest expected arrival (never sooner
/// than `delay`), so the owner's load is read near the arrival it predicts, and what is moved
/// ahead has little time to be evicted again.
pub fn decision_wait(estimate: Option<GapEstimate>, delay: Duration, lead: Duration) -> Duration {
    match estimate {
        Some(e) => e.earliest().saturating_sub(lead).max(delay),
        None => delay,
    }
}

/// What became of a prefetch when its session's next turn was placed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Placed on the prefetch's target after the blocks landed.
    Used,
    /// Placed on the target while the pull was still running: the request waits for it there
    /// (shorter than pulling from scratch), the prefetch counts as used.
    UsedInFlight,
    /// Placed elsewhere: whatever landed was for nothing; `cancel` when still running.
    Wasted { cancel: bool },
    /// The prefetch had failed: counted when it failed.
    AlreadyFailed,
}

/// The verdict for `ticket` when the next turn is placed on `placed_on`.
pub fn verdict(ticket: &Ticket, placed_on: EndpointId) -> Verdict {
    match (ticket.state, ticket.target == placed_on) {
        (TicketState::Failed, _) => Verdict::AlreadyFailed,
        (TicketState::Landed { .. }, true) => Verdict::Used,
        (TicketState::Running, true) => Verdict::UsedInFlight,
        (TicketState::Running, false) => Verdict::Wasted { cancel: true },
        (TicketState::Landed { .. }, false) => Verdict::Wasted { cancel: false },
    }
}

/// Sessions by id (pure; bounded by `max_sessions`, entries older than the TTL dropped).
#[derive(Debug)]
pub struct SessionTable {
    map: HashMap<String, Session>,
    max_sessions: usize,
    ttl: Duration,
}

impl SessionTable {
    pub fn new(max_sessions: usize, ttl: Duration) -> Self {
        Self {
            map: HashMap::new(),
            max_sessions,
            ttl,
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// A turn of `key` ended. Returns the tickets that will never be used: a previous one still
    /// attached (its turn never came back through placement) and those of sessions that expired
    /// or were pushed out by the bound. (The prefetch decision that follows is handed the turn's
    /// owner and prompt itself: the table keeps neither.)
    pub fn turn_finished(&mut self, key: &str, now: Instant) -> Vec<Ticket> {
        let mut dropped = self.expire(now);
        if !self.map.contains_key(key) && self.map.len() >= self.max_sessions {
            // Full of live sessions: the least recently active one makes room.
            if let Some(oldest) = self
                .map
                .iter()
                .min_by_key(|(_, s)| s.at)
                .map(|(k, _)| k.clone())
                && let Some(s) = self.map.remove(&oldest)
            {
                dropped.extend(s.ticket);
            }
        }
        let (generation, gaps) = self
            .map
            .get_mut(key)
            .map_or((0, GapHistory::default()), |s| {
                (s.generation + 1, std::mem::take(&mut s.gaps))
            });
        let previous = self.map.insert(
            key.to_owned(),
            Session {
                at: now,
                ticket: None,
                generation,
                ended_at: Some(now),
                gaps,
            },
        );
        dropped.extend(previous.and_then(|s| s.ticket));
        dropped
    }

    /// The next turn of `key` reached the router (before it is placed): a prefetch decision
    /// still waiting for its delay sees the session moved on, and the gap since the last turn
    /// ended joins the session's gap history.
    pub fn turn_arrived(&mut self, key: &str, now: Instant) {
        if let Some(s) = self.map.get_mut(key) {
            s.at = now;
            s.generation += 1;
            if let Some(ended) = s.ended_at.take() {
                s.gaps.push(now.saturating_duration_since(ended));
            }
        }
    }

    /// The session's expected next gap (see [`GapHistory::estimate`]).
    pub fn gap_estimate(&self, key: &str, tolerance: f64) -> Option<GapEstimate> {
        self.map.get(key)?.gaps.estimate(tolerance)
    }

    /// The next turn of `key` was placed: takes its ticket (the session stays, for its owner).
    pub fn take_ticket(&mut self, key: &str, now: Instant) -> Option<Ticket> {
        let s = self.map.get_mut(key)?;
        if now.saturating_duration_since(s.at) >= self.ttl {
            return None;
        }
        s.at = now;
        s.ticket.take()
    }

    /// The session's generation (see `Session::generation`); None when unknown.
    pub fn generation(&self, key: &str) -> Option<u64> {
        self.map.get(key).map(|s| s.generation)
    }

    /// Attaches a prefetch to `key`; false (nothing attached) when the session is gone or has one.
    pub fn attach(&mut self, key: &str, ticket: Ticket) -> bool {
        match self.map.get_mut(key) {
            Some(s) if s.ticket.is_none() => {
                s.ticket = Some(ticket);
                true
            }
            _ => false,
        }
    }

    /// The target reported prefetch `id` of `key`: records its state and returns true if the
    /// ticket is still attached (false: the next turn took it already, or the session is gone).
    pub fn settle(&mut self, key: &str, id: &str, state: TicketState, landed_bytes: u64) -> bool {
        match self
            .map
            .get_mut(key)
            .and_then(|s| s.ticket.as_mut())
            .filter(|t| t.id == id)
        {
            Some(t) => {
                t.state = state;
                t.landed_bytes = landed_bytes;
                true
            }
            None => false,
        }
    }

    /// Bytes of the prefetches towards `target` whose turn has not come yet (running or landed):
    /// what speculative copies occupy in its CPU tier, where they push out other blocks (restores
    /// add nothing there).
    pub fn unused_bytes(&self, target: EndpointId) -> u64 {
        self.map
            .values()
            .filter_map(|s| s.ticket.as_ref())
            .filter(|t| t.target == target && !t.restore && t.state != TicketState::Failed)
            .map(|t| t.bytes)
            .sum()
    }

    /// Drops sessions idle for the TTL; returns their tickets (never used).
    pub fn expire(&mut self, now: Instant) -> Vec<Ticket> {
        let ttl = self.ttl;
        let mut dropped = Vec::new();
        self.map.retain(|_, s| {
            let keep = now.saturating_duration_since(s.at) < ttl;
            if !keep {
                dropped.extend(s.ticket.take());
            }
            keep
        });
        dropped
    }
}

/// Bytes of prefetches in flight per endpoint, against a cap (pure).
#[derive(Debug, Default)]
pub struct PrefetchBudget {
    inflight: HashMap<EndpointId, u64>,
}

impl PrefetchBudget {
    /// Reserves `bytes` on `ep` if that keeps it within `cap` (a single prefetch larger than the
    /// cap is never admitted).
    pub fn try_reserve(&mut self, ep: EndpointId, bytes: u64, cap: u64) -> bool {
        let used = self.inflight.entry(ep).or_default();
        if used.saturating_add(bytes) > cap {
            return false;
        }
        *used += bytes;
        true
    }

    pub fn release(&mut self, ep: EndpointId, bytes: u64) {
        if let Some(used) = self.inflight.get_mut(&ep) {
            *used = used.saturating_sub(bytes);
            if *used == 0 {
                self.inflight.remove(&ep);
            }
        }
    }

    pub fn inflight(&self, ep: EndpointId) -> u64 {
        self.inflight.get(&ep).copied().unwrap_or(0)
    }

    pub fn total(&self) -> u64 {
        self.inflight.values().sum()
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BytesLabel {
    kind: &'static str,
}

/// The session table, the budget and the prefetch metrics, shared by the handlers.
pub struct Sessions {
    pub config: PrefetchConfig,
    pub table: Mutex<SessionTable>,
    pub budget: Mutex<PrefetchBudget>,
    prefetches: Family<OutcomeLabel, Counter>,
    bytes: Family<BytesLabel, Counter>,
    inflight_bytes: Gauge,
    sessions: Gauge,
}

impl Sessions {
    pub fn new(config: PrefetchConfig, registry: &mut Registry) -> Self {
        let s = Sessions {
            table: Mutex::new(SessionTable::new(
                config.max_sessions,
                Duration::from_secs_f64(config.session_ttl_s),
            )),
            config,
            budget: Mutex::default(),
            prefetches: Family::default(),
            bytes: Family::default(),
            inflight_bytes: Gauge::default(),
            sessions: Gauge::default(),
        };
        registry.register(
            "kvmesh_router_prefetches",
            "Prefetches ahead of arrival by outcome: issued, landed, failed, used, used_in_flight, \
             wasted, cancelled, expired, skipped_{short,owner,arrived,held,no_target,budget,room}; \
             restores on the owner: restore_{issued,nothing_missing,failed,used,wasted,expired,\
             skipped_budget,skipped_unpredictable}, restored; timed_by_gap: decisions timed by \
             the session's gap estimate",
            s.prefetches.clone(),
        );
        registry.register(
            "kvmesh_router_prefetch_bytes",
            "Modelled KV bytes of prefetches: issued (budgeted), landed, used, wasted; restores: \
             restore_issued, restored, restore_used, restore_wasted",
            s.bytes.clone(),
        );
        registry.register(
            "kvmesh_router_prefetch_inflight_bytes",
            "Modelled KV bytes of prefetches running now, all endpoints",
            s.inflight_bytes.clone(),
        );
        registry.register(
            "kvmesh_router_sessions",
            "Sessions the router follows for prefetch",
            s.sessions.clone(),
        );
        s
    }

    /// The session's gap estimate when decisions are timed by gaps (`prefetch.gap_timing`).
    pub fn gap_estimate(&self, session: &str) -> Option<GapEstimate> {
        if !self.config.gap_timing {
            return None;
        }
        self.table
            .lock()
            .gap_estimate(session, self.config.gap_tolerance)
    }

    pub fn count(&self, outcome: &'static str) {
        self.prefetches
            .get_or_create(&OutcomeLabel { outcome })
            .inc();
    }

    pub fn count_bytes(&self, kind: &'static str, bytes: u64) {
        self.bytes.get_or_create(&BytesLabel { kind }).inc_by(bytes);
    }

    /// Refreshes the gauges (after the table or the budget changed).
    pub fn refresh_gauges(&self) {
        let total = self.budget.lock().total();
        self.inflight_bytes
            .set(i64::try_from(total).unwrap_or(i64::MAX));
        let n = self.table.lock().len();
        self.sessions.set(n as i64);
    }

    /// Counts tickets that will never be used (expired sessions): their landed bytes are waste.
    pub fn count_dropped(&self, tickets: &[Ticket]) {
        for t in tickets {
            if t.restore {
                self.count("restore_expired");
                self.count_bytes("restore_wasted", t.landed_bytes);
            } else {
                self.count("expired");
                self.count_bytes("wasted", t.landed_bytes);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ticket(id: &str, target: u32, state: TicketState) -> Ticket {
        Ticket {
            id: id.to_owned(),
            target: EndpointId(target),
            target_name: Arc::from(format!("e{target}")),
            bytes: 100,
            landed_bytes: 0,
            state,
            restore: false,
        }
    }

    #[test]
    fn a_prefetch_is_used_only_where_the_next_turn_lands() {
        let landed = ticket("p", 2, TicketState::Landed { blocks: 4 });
        assert_eq!(verdict(&landed, EndpointId(2)), Verdict::Used);
        assert_eq!(
            verdict(&landed, EndpointId(1)),
            Verdict::Wasted { cancel: false }
        );
        let running = ticket("p", 2, TicketState::Running);
        assert_eq!(verdict(&running, EndpointId(2)), Verdict::UsedInFlight);
        assert_eq!(
            verdict(&running, EndpointId(3)),
            Verdict::Wasted { cancel: true },
            "a wrong prediction still pulling is cancelled"
        );
        let failed = ticket("p", 2, TicketState::Failed);
        assert_eq!(verdict(&failed, EndpointId(2)), Verdict::AlreadyFailed);
    }

    #[test]
    fn the_next_turn_takes_the_ticket_once() {
        let t0 = Instant::now();
        let mut t = SessionTable::new(8, Duration::from_secs(60));
        assert!(t.turn_finished("s", t0).is_empty());
        assert!(t.attach("s", ticket("p1", 2, TicketState::Running)));
        assert!(
            !t.attach("s", ticket("p2", 3, TicketState::Running)),
            "one prefetch per session"
        );
        assert!(!t.attach("other", ticket("p3", 3, TicketState::Running)));
        assert!(t.settle("s", "p1", TicketState::Landed { blocks: 4 }, 400));
        assert!(!t.settle("s", "nope", TicketState::Failed, 0));
        assert_eq!(t.unused_bytes(EndpointId(2)), 100);
        assert_eq!(t.unused_bytes(EndpointId(3)), 0);
        let g = t.generation("s").unwrap();
        t.turn_arrived("s", t0 + Duration::from_secs(5));
        assert_eq!(
            t.generation("s"),
            Some(g + 1),
            "an arrival is seen by a delayed decision"
        );
        let got = t.take_ticket("s", t0 + Duration::from_secs(5)).unwrap();
        assert_eq!(got.state, TicketState::Landed { blocks: 4 });
        assert_eq!(got.landed_bytes, 400);
        assert!(t.take_ticket("s", t0 + Duration::from_secs(6)).is_none());
        assert!(
            !t.settle("s", "p1", TicketState::Failed, 0),
            "a report after the turn took the ticket is not attached"
        );
    }

    #[test]
    fn sessions_expire_and_are_bounded_and_their_tickets_are_returned() {
        let t0 = Instant::now();
        let ttl = Duration::from_secs(10);
        let mut t = SessionTable::new(2, ttl);
        t.turn_finished("a", t0);
        assert!(t.attach("a", ticket("pa", 2, TicketState::Running)));
        t.turn_finished("b", t0 + Duration::from_secs(1));
        // A third live session pushes out the least recently active one, with its ticket.
        let dropped = t.turn_finished("c", t0 + Duration::from_secs(2));
        assert_eq!(dropped.len(), 1);
        assert_eq!(dropped[0].id, "pa");
        assert_eq!(t.len(), 2);
        assert!(t.generation("a").is_none(), "pushed out");
        // Idle past the TTL: gone.
        assert!(t.take_ticket("b", t0 + Duration::from_secs(11)).is_none());
        assert!(t.expire(t0 + Duration::from_secs(13)).is_empty());
        assert!(t.is_empty());
        // A new turn of a session with an unused ticket returns that ticket.
        t.turn_finished("d", t0);
        assert!(t.attach("d", ticket("pd", 2, TicketState::Running)));
        let dropped = t.turn_finished("d", t0);
        assert_eq!(dropped.len(), 1);
    }

    #[test]
    fn a_restore_takes_no_cpu_tier_room() {
        let mut t = SessionTable::new(8, Duration::from_secs(60));
        let now = Instant::now();
        t.turn_finished("a", now);
        t.turn_finished("b", now);
        assert!(t.attach("a", ticket("pa", 2, TicketState::Running)));
        let restore = Ticket {
            restore: true,
            ..ticket("rb", 2, TicketState::Running)
        };
        assert!(t.attach("b", restore));
        assert_eq!(t.unused_bytes(EndpointId(2)), 100, "only the pull's copy");
    }

    #[test]
    fn a_regular_session_gets_a_gap_estimate_and_an_irregular_one_none() {
        let secs = Duration::from_secs_f64;
        let t0 = Instant::now();
        let mut t = SessionTable::new(8, Duration::from_secs(600));
        // Turn ends at 0, next arrives 10 s later, ends 2 s after that, next arrives 11 s later.
        let mut at = t0;
        for (i, gap) in [10.0, 11.0, 9.5].into_iter().enumerate() {
            t.turn_finished("regular", at);
            assert_eq!(
                t.gap_estimate("regular", 0.25).is_some(),
                i >= 2,
                "it takes two gaps to make an estimate"
            );
            at += secs(gap);
            t.turn_arrived("regular", at);
            at += secs(2.0);
        }
        let e = t.gap_estimate("regular", 0.25).unwrap();
        assert!((e.mean.as_secs_f64() - 10.1667).abs() < 1e-3, "{e:?}");
        assert!(e.spread > 0.06 && e.spread < 0.09, "{e:?}");
        // A tool call of 1 s, then one of 20 s: nothing to time a transfer by.
        let mut at = t0;
        for gap in [1.0, 20.0, 8.0] {
            t.turn_finished("irregular", at);
            at += secs(gap);
            t.turn_arrived("irregular", at);
        }
        assert_eq!(t.gap_estimate("irregular", 0.25), None);
        // An arrival without a turn end before it (a retry, a first turn) is not a gap.
        t.turn_arrived("regular", at + secs(100.0));
        assert_eq!(t.gap_estimate("regular", 0.25), Some(e));
    }

    #[test]
    fn the_decision_waits_until_the_lead_before_the_earliest_expected_arrival() {
        let ms = Duration::from_millis;
        let (delay, lead) = (ms(500), ms(1000));
        assert_eq!(decision_wait(None, delay, lead), delay, "unknown gap");
        let regular = GapEstimate {
            mean: ms(10_000),
            spread: 0.1,
        };
        assert_eq!(decision_wait(Some(regular), delay, lead), ms(8_000));
        let short = GapEstimate {
            mean: ms(1_200),
            spread: 0.0,
        };
        assert_eq!(
            decision_wait(Some(short), delay, lead),
            delay,
            "never sooner than the delay"
        );
    }

    #[test]
    fn the_budget_caps_bytes_in_flight_per_endpoint() {
        let mut b = PrefetchBudget::default();
        assert!(b.try_reserve(EndpointId(1), 60, 100));
        assert!(
            !b.try_reserve(EndpointId(1), 50, 100),
            "would exceed the cap"
        );
        assert!(b.try_reserve(EndpointId(2), 50, 100), "per endpoint");
        assert!(
            !b.try_reserve(EndpointId(3), 101, 100),
            "larger than the cap"
        );
        b.release(EndpointId(1), 60);
        assert_eq!(b.inflight(EndpointId(1)), 0);
        assert!(b.try_reserve(EndpointId(1), 100, 100));
        assert_eq!(b.total(), 150);
    }
}
