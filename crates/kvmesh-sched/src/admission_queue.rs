//! The admission queue: holds requests at the router while every endpoint already has enough prefill
//! work queued, and releases them shortest predicted work first (with aging).
//!
//! Why: engines prefill first come, first served. A 500-token prompt that reaches an engine behind
//! a 60K-token one waits for all of it, and once it is there nothing can reorder it. The router can:
//! while some endpoint has at most `max_queued_prefill_tokens` of prefill sent by this router and
//! not yet computed, requests pass straight through; beyond that they wait here, and whenever a
//! prefill finishes (first byte) the waiting request with the lowest `work_ms − aging × waited_ms`
//! goes next. Short prompts overtake long ones (shortest-job-first minimises mean waiting), aging
//! bounds how long a long prompt can be overtaken, and `max_hold` bounds the hold outright. A held
//! request is placed when it leaves the queue, with the index and queues as they are then (late
//! binding), not as they were when it arrived.
//!
//! This file is the pure part: [`Queue`] (the clock is an argument) and its config. The
//! router's `AdmissionQueue` wraps it with a wake-up signal and metrics.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// `admission_queue:` in the router config. Absent = off (every request is placed on arrival).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionQueueConfig {
    /// Requests pass straight through while some eligible endpoint has at most this many prompt
    /// tokens sent by this router and not yet computed (about one engine step of prefill keeps
    /// every engine busy).
    pub max_queued_prefill_tokens: u64,
    /// Milliseconds of priority a held request gains per millisecond it waits.
    pub aging: f64,
    /// Longest a request is held; then it is placed whatever the queues say.
    #[serde(with = "crate::config::duration_str")]
    pub max_hold: Duration,
    /// At most this many requests are held; later ones are placed on arrival.
    pub max_held: usize,
    /// Whether a request that waited here may be placed with a P2P pull (default true).
    /// Requests are held only while every endpoint has a full prefill queue; the pull of one
    /// released while others still wait is priced as landing after the ones released during
    /// it (`predict`'s `overtaken_ms`), which is what keeps such pulls from slowing a burst of
    /// first-seen prompts. `false` turns them off outright: with it, returning agent turns held
    /// at a busy holder could no longer move, and their p90 rose 55-74 % on agentic-paced with
    /// 8 engines (`docs/benchmarks.md`, hot prefixes).
    pub pulls_when_held: bool,
}

impl Default for AdmissionQueueConfig {
    fn default() -> Self {
        AdmissionQueueConfig {
            max_queued_prefill_tokens: 8192,
            aging: 2.0,
            max_hold: Duration::from_secs(10),
            max_held: 4096,
            pulls_when_held: true,
        }
    }
}

impl AdmissionQueueConfig {
    pub fn validate(&self) -> Result<(), String> {
        if !(self.aging.is_finite() && self.aging >= 0.0) {
            return Err("admission_queue.aging must be a finite number >= 0".to_owned());
        }
        if self.max_held == 0 {
            return Err("admission_queue.max_held must be >= 1".to_owned());
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    id: u64,
    work: Work,
    since: Instant,
}

/// A held request's prefill work.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Work {
    /// Predicted time (its priority).
    pub ms: f64,
    /// Tokens it would compute where the most of it is cached.
    pub tokens: u64,
    /// Nothing of it is cached anywhere: it can go to any endpoint.
    pub cold: bool,
}

/// The held requests (pure: the clock is an argument).
#[derive(Debug, Default)]
pub struct Queue {
    entries: Vec<Entry>,
}

impl Queue {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn push(&mut self, id: u64, work: Work, now: Instant) {
        let ms = if work.ms.is_finite() { work.ms } else { 0.0 };
        self.entries.push(Entry {
            id,
            work: Work { ms, ..work },
            since: now,
        });
    }

    /// The prefill tokens of each held request nothing is cached for, ascending.
    pub fn cold_tokens(&self) -> Vec<u64> {
        let mut cold: Vec<u64> = self
            .entries
            .iter()
            .filter(|e| e.work.cold)
            .map(|e| e.work.tokens)
            .collect();
        cold.sort_unstable();
        cold
    }

    pub fn remove(&mut self, id: u64) -> bool {
        let before = self.entries.len();
        self.entries.retain(|e| e.id != id);
        self.entries.len() != before
    }

    /// The entry that goes next: lowest `work_ms − aging × waited_ms`, the oldest on ties.
    pub fn next(&self, now: Instant, aging: f64) -> Option<u64> {
        let priority = |e: &Entry| {
            e.work.ms - aging * now.saturating_duration_since(e.since).as_secs_f64() * 1000.0
        };
        self.entries
            .iter()
            .min_by(|a, b| {
                priority(a)
                    .total_cmp(&priority(b))
                    .then(a.since.cmp(&b.since))
            })
            .map(|e| e.id)
    }

    /// Whether `id` has been held longer than `max_hold`.
    pub fn expired(&self, id: u64, now: Instant, max_hold: Duration) -> bool {
        self.entries
            .iter()
            .find(|e| e.id == id)
            .is_some_and(|e| now.saturating_duration_since(e.since) >= max_hold)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shortest_work_goes_first_until_aging_lets_a_long_one_through() {
        let t0 = Instant::now();
        let mut q = Queue::default();
        let work = |ms: f64, tokens: u64, cold: bool| Work { ms, tokens, cold };
        q.push(1, work(3000.0, 75_000, true), t0); // a 75K-token prompt
        q.push(2, work(40.0, 1000, true), t0 + Duration::from_millis(100));
        q.push(4, work(30.0, 800, false), t0 + Duration::from_millis(100));
        assert_eq!(q.cold_tokens(), vec![1000, 75_000]);
        assert!(q.remove(4));
        assert_eq!(q.next(t0 + Duration::from_millis(100), 2.0), Some(2));
        assert!(q.remove(2));
        q.push(3, work(40.0, 1000, true), t0 + Duration::from_millis(1500));
        // Entry 1 has waited 1.5 s: 3000 − 2×1500 = 0 < 40 → it goes before the newcomer.
        assert_eq!(q.next(t0 + Duration::from_millis(1500), 2.0), Some(1));
        assert!(q.expired(1, t0 + Duration::from_secs(10), Duration::from_secs(10)));
        assert!(!q.expired(3, t0 + Duration::from_secs(10), Duration::from_secs(10)));
    }
}
