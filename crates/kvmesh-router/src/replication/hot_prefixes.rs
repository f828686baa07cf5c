//! Hot-prefix replication, the pure half (the I/O half is [`crate::replication`]): which shared
//! prefixes are hot, where a second copy of one should go, and the router's replication state
//! (the table, copies in flight per target, outcome counters).
//!
//! A prefix is *hot* when requests for it keep arriving (`hot_requests` within `window`) while
//! every endpoint that holds it has a prefill queue (`busy_tokens` of work the router placed and
//! the endpoint has not computed yet): the next request for it will either wait behind a holder's
//! queue or pull on its critical path. A copy made now, on the least loaded endpoint of the
//! holder's KV group, turns that into a local hit. One copy per `cooldown`, at most `max_holders`
//! holders: a hot prefix gets a second home, not the whole fleet.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use kvmesh_core::ChainKey;
use kvmesh_index::EndpointId;
use kvmesh_sched::Candidate;
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use crate::replication::config::ReplicationConfig;

/// Recent arrivals per prefix (keyed by the chain key of its last block).
#[derive(Debug)]
pub struct HotPrefixes {
    window: Duration,
    hot_requests: usize,
    cooldown: Duration,
    max_entries: usize,
    entries: HashMap<ChainKey, Seen>,
}

#[derive(Debug)]
struct Seen {
    /// The latest arrivals within the window, at most `hot_requests` of them.
    arrivals: VecDeque<Instant>,
    last_copy: Option<Instant>,
    /// The last skip shown in `/debug/decisions` and when: a prefix that stays hot while its
    /// holders stay idle would otherwise add an entry per request and push placements out.
    last_skip_shown: Option<(&'static str, Instant)>,
}

impl HotPrefixes {
    pub fn new(
        window: Duration,
        hot_requests: usize,
        cooldown: Duration,
        max_entries: usize,
    ) -> Self {
        HotPrefixes {
            window,
            hot_requests: hot_requests.max(1),
            cooldown,
            max_entries: max_entries.max(1),
            entries: HashMap::new(),
        }
    }

    /// Records a request for the prefix ending at `key`; whether the prefix is hot now and no copy
    /// of it was made within the cooldown.
    pub fn arrive(&mut self, key: ChainKey, now: Instant) -> bool {
        if !self.entries.contains_key(&key) && self.entries.len() >= self.max_entries {
            self.forget_stale(now);
        }
        let seen = self.entries.entry(key).or_insert_with(|| Seen {
            arrivals: VecDeque::new(),
            last_copy: None,
            last_skip_shown: None,
        });
        seen.arrivals.push_back(now);
        while seen.arrivals.len() > self.hot_requests
            || seen
                .arrivals
                .front()
                .is_some_and(|t| now.saturating_duration_since(*t) > self.window)
        {
            seen.arrivals.pop_front();
        }
        seen.arrivals.len() >= self.hot_requests
            && seen
                .last_copy
                .is_none_or(|t| now.saturating_duration_since(t) >= self.cooldown)
    }

    /// A copy of the prefix ending at `key` was started at `now`.
    pub fn copied(&mut self, key: ChainKey, now: Instant) {
        if let Some(seen) = self.entries.get_mut(&key) {
            seen.last_copy = Some(now);
        }
    }

    /// Whether a skip of the prefix ending at `key` for `reason` should be shown in
    /// `/debug/decisions` now: the first one, a changed reason, or once per cooldown (the
    /// counters count every skip).
    pub fn show_skip(&mut self, key: ChainKey, reason: &'static str, now: Instant) -> bool {
        let Some(seen) = self.entries.get_mut(&key) else {
            return true;
        };
        let show = seen.last_skip_shown.is_none_or(|(last, at)| {
            last != reason || now.saturating_duration_since(at) >= self.cooldown
        });
        if show {
            seen.last_skip_shown = Some((reason, now));
        }
        show
    }

    /// Drops prefixes with no arrival within the window and no copy within the cooldown; if none
    /// is that stale, the one seen least recently.
    fn forget_stale(&mut self, now: Instant) {
        let (window, cooldown) = (self.window, self.cooldown);
        self.entries.retain(|_, s| {
            let recent = s
                .arrivals
                .back()
                .is_some_and(|t| now.saturating_duration_since(*t) <= window);
            let cooling = s
                .last_copy
                .is_some_and(|t| now.saturating_duration_since(t) < cooldown);
            recent || cooling
        });
        if self.entries.len() >= self.max_entries
            && let Some(oldest) = self
                .entries
                .iter()
                .min_by_key(|(_, s)| s.arrivals.back().copied())
                .map(|(k, _)| *k)
        {
            self.entries.remove(&oldest);
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

/// The router's replication state (`replication:` in its config).
pub struct Replication {
    pub config: ReplicationConfig,
    hot: Mutex<HotPrefixes>,
    inflight: Mutex<HashMap<EndpointId, usize>>,
    outcomes: Family<OutcomeLabel, Counter>,
}

impl Replication {
    pub fn new(config: ReplicationConfig, registry: &mut Registry) -> Self {
        let r = Replication {
            hot: Mutex::new(HotPrefixes::new(
                Duration::from_secs_f64(config.window_s),
                config.hot_requests,
                Duration::from_secs_f64(config.cooldown_s),
                config.max_prefixes,
            )),
            config,
            inflight: Mutex::default(),
            outcomes: Family::default(),
        };
        registry.register(
            "kvmesh_router_replications",
            "Hot-prefix copies by outcome: issued, landed, failed, and for hot prefixes not \
             copied skipped_{holders,idle,no_source,no_target,budget}",
            r.outcomes.clone(),
        );
        r
    }

    pub(crate) fn count(&self, outcome: &'static str) {
        self.outcomes.get_or_create(&OutcomeLabel { outcome }).inc();
    }

    /// Takes a copy slot towards `target`; false when its copies in flight are at the cap.
    pub(crate) fn reserve(&self, target: EndpointId) -> bool {
        let mut inflight = self.inflight.lock();
        let n = inflight.entry(target).or_default();
        if *n >= self.config.max_inflight_per_endpoint {
            return false;
        }
        *n += 1;
        true
    }

    /// Records a request for the prefix ending at `key` ([`HotPrefixes::arrive`]).
    pub(crate) fn arrive(&self, key: ChainKey, now: Instant) -> bool {
        self.hot.lock().arrive(key, now)
    }

    pub(crate) fn copied(&self, key: ChainKey, now: Instant) {
        self.hot.lock().copied(key, now);
    }

    /// [`HotPrefixes::show_skip`].
    pub(crate) fn show_skip(&self, key: ChainKey, reason: &'static str, now: Instant) -> bool {
        self.hot.lock().show_skip(key, reason, now)
    }

    pub(crate) fn release(&self, target: EndpointId) {
        if let Some(n) = self.inflight.lock().get_mut(&target) {
            *n = n.saturating_sub(1);
        }
    }
}

/// Why a hot prefix was not copied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skip {
    /// `max_holders` endpoints hold it already.
    Holders,
    /// A holder has less than `busy_tokens` queued: it can take the next request promptly.
    HolderIdle,
    /// No holder can serve it to a peer (no P2P producer, or not in its CPU tier).
    NoSource,
    /// No endpoint of the source's KV group can take a copy.
    NoTarget,
}

impl Skip {
    pub fn label(self) -> &'static str {
        match self {
            Skip::Holders => "skipped_holders",
            Skip::HolderIdle => "skipped_idle",
            Skip::NoSource => "skipped_no_source",
            Skip::NoTarget => "skipped_no_target",
        }
    }
}

/// Where a copy goes: indices into the candidates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copy {
    pub source: usize,
    pub target: usize,
}

/// Decides whether the prefix of `prefix_blocks` blocks, held as `candidates` say, gets a copy
/// now and from where to where. The source is a holder whose CPU tier has the whole prefix (what
/// its P2P producer serves), preferring the one serving the fewest pulls; the target the endpoint
/// of the source's KV group with the least queued prefill (then the fewest requests).
pub fn pick_copy(
    candidates: &[Candidate],
    prefix_blocks: usize,
    busy_tokens: u64,
    max_holders: usize,
) -> Result<Copy, Skip> {
    let holds = |c: &Candidate| c.any_blocks >= prefix_blocks;
    let holders: Vec<(usize, &Candidate)> = candidates
        .iter()
        .enumerate()
        .filter(|(_, c)| holds(c))
        .collect();
    if holders.len() >= max_holders {
        return Err(Skip::Holders);
    }
    if holders
        .iter()
        .any(|(_, c)| c.in_flight_uncached_tokens < busy_tokens)
    {
        return Err(Skip::HolderIdle);
    }
    let (source, src) = holders
        .iter()
        .filter(|(_, c)| c.has_p2p && c.cpu_blocks >= prefix_blocks)
        .min_by_key(|(i, c)| (c.pulls_out, c.in_flight_uncached_tokens, *i))
        .copied()
        .ok_or(Skip::NoSource)?;
    let target = candidates
        .iter()
        .enumerate()
        .filter(|(_, c)| !holds(c) && c.has_p2p && c.kv_group == src.kv_group)
        .min_by_key(|(i, c)| (c.in_flight_uncached_tokens, c.in_flight_requests, *i))
        .map(|(i, _)| i)
        .ok_or(Skip::NoTarget)?;
    Ok(Copy { source, target })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn cand(id: u32, any: usize, cpu: usize, queued: u64) -> Candidate {
        let mut c = Candidate::idle(id, &format!("e{id}"));
        c.any_blocks = any;
        c.cpu_blocks = cpu;
        c.gpu_blocks = any;
        c.in_flight_uncached_tokens = queued;
        c.has_p2p = true;
        c
    }

    #[test]
    fn a_prefix_is_hot_after_enough_arrivals_within_the_window() {
        let mut hot = HotPrefixes::new(10 * S, 3, 30 * S, 16);
        let t = Instant::now();
        let k = ChainKey(7);
        assert!(!hot.arrive(k, t));
        assert!(!hot.arrive(k, t + S));
        assert!(hot.arrive(k, t + 2 * S), "third arrival within 10 s");
        // Spread thinner than the window: never hot.
        let other = ChainKey(8);
        for i in 0..6 {
            assert!(!hot.arrive(other, t + i * 11 * S));
        }
    }

    #[test]
    fn a_repeated_skip_is_shown_once_per_cooldown_or_when_its_reason_changes() {
        let t0 = Instant::now();
        let mut h = HotPrefixes::new(10 * S, 1, 30 * S, 16);
        let k = ChainKey(7);
        assert!(h.arrive(k, t0));
        assert!(h.show_skip(k, "skipped_idle", t0));
        assert!(!h.show_skip(k, "skipped_idle", t0 + S));
        assert!(h.show_skip(k, "skipped_holders", t0 + 2 * S), "new reason");
        assert!(!h.show_skip(k, "skipped_holders", t0 + 3 * S));
        assert!(
            h.show_skip(k, "skipped_holders", t0 + 32 * S),
            "a cooldown later"
        );
        assert!(
            h.show_skip(ChainKey(8), "skipped_idle", t0),
            "unknown prefix"
        );
    }

    #[test]
    fn one_copy_per_cooldown() {
        let mut hot = HotPrefixes::new(10 * S, 2, 30 * S, 16);
        let t = Instant::now();
        let k = ChainKey(1);
        hot.arrive(k, t);
        assert!(hot.arrive(k, t + S));
        hot.copied(k, t + S);
        assert!(!hot.arrive(k, t + 2 * S), "cooling down");
        assert!(hot.arrive(k, t + 32 * S) || hot.arrive(k, t + 33 * S));
    }

    #[test]
    fn the_table_is_bounded_and_keeps_recent_prefixes() {
        let mut hot = HotPrefixes::new(10 * S, 2, 30 * S, 4);
        let t = Instant::now();
        for i in 0..100u64 {
            hot.arrive(ChainKey(i), t + Duration::from_millis(i));
        }
        assert!(hot.entries.len() <= 4);
        assert!(hot.entries.contains_key(&ChainKey(99)));
        // Long after: everything old is dropped at once when room is needed.
        hot.arrive(ChainKey(1000), t + 100 * S);
        assert_eq!(hot.entries.len(), 1);
    }

    #[test]
    fn copies_from_a_busy_holder_to_the_least_loaded_endpoint_of_its_group() {
        let cands = vec![
            cand(0, 64, 64, 40_000), // holder, busy
            cand(1, 0, 0, 9_000),
            cand(2, 10, 10, 1_000), // holds a part: still a target
            cand(3, 0, 0, 500),
        ];
        let mut other_group = cands.clone();
        other_group[3].kv_group = Some(Arc::from("vllm"));
        assert_eq!(
            pick_copy(&cands, 64, 16_384, 2),
            Ok(Copy {
                source: 0,
                target: 3
            })
        );
        assert_eq!(
            pick_copy(&other_group, 64, 16_384, 2),
            Ok(Copy {
                source: 0,
                target: 2
            }),
            "never into another KV group"
        );
    }

    #[test]
    fn no_copy_when_a_holder_is_idle_enough_are_held_or_none_can_serve() {
        let busy = cand(0, 64, 64, 40_000);
        let idle_holder = cand(1, 64, 64, 100);
        let free = cand(2, 0, 0, 0);
        assert_eq!(
            pick_copy(
                &[busy.clone(), idle_holder.clone(), free.clone()],
                64,
                16_384,
                3
            ),
            Err(Skip::HolderIdle)
        );
        let mut second = idle_holder.clone();
        second.in_flight_uncached_tokens = 50_000;
        assert_eq!(
            pick_copy(&[busy.clone(), second, free.clone()], 64, 16_384, 2),
            Err(Skip::Holders)
        );
        let mut gpu_only = busy.clone();
        gpu_only.cpu_blocks = 0;
        assert_eq!(
            pick_copy(&[gpu_only, free.clone()], 64, 16_384, 2),
            Err(Skip::NoSource)
        );
        let mut no_p2p = free;
        no_p2p.has_p2p = false;
        assert_eq!(
            pick_copy(&[busy, no_p2p], 64, 16_384, 2),
            Err(Skip::NoTarget)
        );
    }
}
