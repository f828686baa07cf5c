//! Admission queue: holds requests at the router while every endpoint already has enough prefill
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
//! [`HoldQueue`] is the pure part (clock passed in); [`Dispatcher`] wraps it with a `Notify`.
//! A held request whose client goes away leaves the queue (the entry is removed on drop).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

/// `dispatch:` in the router config. Absent = off (every request is placed on arrival).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DispatchConfig {
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
}

impl Default for DispatchConfig {
    fn default() -> Self {
        DispatchConfig {
            max_queued_prefill_tokens: 8192,
            aging: 2.0,
            max_hold: Duration::from_secs(10),
            max_held: 4096,
        }
    }
}

impl DispatchConfig {
    pub fn validate(&self) -> Result<(), String> {
        if !(self.aging.is_finite() && self.aging >= 0.0) {
            return Err("dispatch.aging must be a finite number >= 0".to_owned());
        }
        if self.max_held == 0 {
            return Err("dispatch.max_held must be >= 1".to_owned());
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    id: u64,
    work_ms: f64,
    since: Instant,
}

/// The held requests (pure: the clock is an argument).
#[derive(Debug, Default)]
pub struct HoldQueue {
    entries: Vec<Entry>,
}

impl HoldQueue {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn push(&mut self, id: u64, work_ms: f64, now: Instant) {
        let work_ms = if work_ms.is_finite() { work_ms } else { 0.0 };
        self.entries.push(Entry {
            id,
            work_ms,
            since: now,
        });
    }

    pub fn remove(&mut self, id: u64) -> bool {
        let before = self.entries.len();
        self.entries.retain(|e| e.id != id);
        self.entries.len() != before
    }

    /// The entry that goes next: lowest `work_ms − aging × waited_ms`, the oldest on ties.
    pub fn next(&self, now: Instant, aging: f64) -> Option<u64> {
        let priority = |e: &Entry| {
            e.work_ms - aging * now.saturating_duration_since(e.since).as_secs_f64() * 1000.0
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

/// How a request left the admission queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Capacity was free on arrival.
    Direct,
    /// Held, then released in priority order.
    Released,
    /// Held for `max_hold`, then released regardless.
    Expired,
    /// The queue was full (`max_held`): placed on arrival.
    Overflow,
}

/// The admission queue of one router.
pub struct Dispatcher {
    config: DispatchConfig,
    queue: Mutex<HoldQueue>,
    wake: Notify,
    next_id: AtomicU64,
    /// Requests let through whose load the gateway has not counted yet (see [`Ticket`]).
    in_transit: AtomicU64,
    held_total: Counter,
    held_now: Gauge,
    expired_total: Counter,
}

/// Removes a held request from the queue however its wait ends (released, or the client left).
struct Leave<'a> {
    dispatcher: &'a Dispatcher,
    id: u64,
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        if self.dispatcher.queue.lock().remove(self.id) {
            self.dispatcher.held_now.dec();
        }
        // The next in line may be able to go now.
        self.dispatcher.wake.notify_waiters();
    }
}

/// A request let through by [`Dispatcher::admit`] whose load is not counted yet; dropping it
/// lets the next one be considered.
pub struct Ticket<'a> {
    dispatcher: &'a Dispatcher,
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        self.dispatcher.in_transit.fetch_sub(1, Ordering::SeqCst);
        self.dispatcher.wake.notify_waiters();
    }
}

/// How often a held request re-checks without being woken (aging and `max_hold` move with time).
const RECHECK: Duration = Duration::from_millis(20);

impl Dispatcher {
    pub fn new(config: DispatchConfig, registry: &mut Registry) -> Self {
        let d = Dispatcher {
            config,
            queue: Mutex::new(HoldQueue::default()),
            wake: Notify::new(),
            next_id: AtomicU64::new(1),
            in_transit: AtomicU64::new(0),
            held_total: Counter::default(),
            held_now: Gauge::default(),
            expired_total: Counter::default(),
        };
        registry.register(
            "kvmesh_router_dispatch_held",
            "Requests held by the admission queue (every endpoint had its prefill share queued)",
            d.held_total.clone(),
        );
        registry.register(
            "kvmesh_router_dispatch_waiting",
            "Requests waiting in the admission queue now",
            d.held_now.clone(),
        );
        registry.register(
            "kvmesh_router_dispatch_expired",
            "Held requests released by dispatch.max_hold rather than by priority",
            d.expired_total.clone(),
        );
        d
    }

    pub fn config(&self) -> &DispatchConfig {
        &self.config
    }

    /// Someone's prefill finished or a request ended: held requests re-check.
    pub fn wake(&self) {
        self.wake.notify_waiters();
    }

    /// Waits until the request may be placed. `work_ms` is its predicted prefill work (its
    /// priority); `has_capacity` says whether some endpoint is below its prefill share right now.
    /// Keep the returned [`Ticket`] until the request's load is counted on its endpoint: until
    /// then nobody else is let through, since `has_capacity` cannot see that request yet.
    pub async fn admit(
        &self,
        work_ms: f64,
        has_capacity: impl Fn() -> bool,
    ) -> (Admission, Ticket<'_>) {
        let how = self.wait_turn(work_ms, has_capacity).await;
        self.in_transit.fetch_add(1, Ordering::SeqCst);
        (how, Ticket { dispatcher: self })
    }

    fn free(&self, has_capacity: &impl Fn() -> bool) -> bool {
        self.in_transit.load(Ordering::SeqCst) == 0 && has_capacity()
    }

    async fn wait_turn(&self, work_ms: f64, has_capacity: impl Fn() -> bool) -> Admission {
        {
            let q = self.queue.lock();
            if q.is_empty() && self.free(&has_capacity) {
                return Admission::Direct;
            }
            if q.len() >= self.config.max_held {
                return Admission::Overflow;
            }
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.queue.lock().push(id, work_ms, Instant::now());
        self.held_total.inc();
        self.held_now.inc();
        let _leave = Leave {
            dispatcher: self,
            id,
        };
        loop {
            // Register for the wake-up before checking, so a wake between check and wait is kept.
            let woken = self.wake.notified();
            let now = Instant::now();
            {
                let q = self.queue.lock();
                if q.expired(id, now, self.config.max_hold) {
                    self.expired_total.inc();
                    return Admission::Expired;
                }
                if q.next(now, self.config.aging) == Some(id) && self.free(&has_capacity) {
                    return Admission::Released;
                }
            }
            tokio::select! {
                _ = woken => {}
                _ = tokio::time::sleep(RECHECK) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;

    #[test]
    fn shortest_work_goes_first_until_aging_lets_a_long_one_through() {
        let t0 = Instant::now();
        let mut q = HoldQueue::default();
        q.push(1, 3000.0, t0); // a 75K-token prompt
        q.push(2, 40.0, t0 + Duration::from_millis(100));
        assert_eq!(q.next(t0 + Duration::from_millis(100), 2.0), Some(2));
        assert!(q.remove(2));
        q.push(3, 40.0, t0 + Duration::from_millis(1500));
        // Entry 1 has waited 1.5 s: 3000 − 2×1500 = 0 < 40 → it goes before the newcomer.
        assert_eq!(q.next(t0 + Duration::from_millis(1500), 2.0), Some(1));
        assert!(q.expired(1, t0 + Duration::from_secs(10), Duration::from_secs(10)));
        assert!(!q.expired(3, t0 + Duration::from_secs(10), Duration::from_secs(10)));
    }

    #[tokio::test]
    async fn held_requests_leave_in_priority_order_when_capacity_frees() {
        let mut reg = Registry::default();
        let d = Arc::new(Dispatcher::new(DispatchConfig::default(), &mut reg));
        let free = Arc::new(AtomicBool::new(false));
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (name, work) in [("long", 2000.0), ("short", 10.0), ("mid", 300.0)] {
            let (d, free, order) = (Arc::clone(&d), Arc::clone(&free), Arc::clone(&order));
            tasks.push(tokio::spawn(async move {
                let (how, ticket) = d.admit(work, || free.load(Ordering::SeqCst)).await;
                order.lock().push(name);
                // Taking the capacity again: the next one waits for the next wake.
                free.store(false, Ordering::SeqCst);
                drop(ticket);
                how
            }));
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(d.queue.lock().len(), 3);
        for _ in 0..3 {
            free.store(true, Ordering::SeqCst);
            d.wake();
            tokio::time::sleep(Duration::from_millis(60)).await;
        }
        for t in tasks {
            assert_eq!(t.await.expect("task"), Admission::Released);
        }
        assert_eq!(*order.lock(), vec!["short", "mid", "long"]);
        assert_eq!(d.held_total.get(), 3);
        assert_eq!(d.held_now.get(), 0);
    }

    #[tokio::test]
    async fn free_capacity_passes_straight_through_and_a_cancelled_wait_leaves_the_queue() {
        let mut reg = Registry::default();
        let d = Dispatcher::new(
            DispatchConfig {
                max_hold: Duration::from_millis(50),
                ..DispatchConfig::default()
            },
            &mut reg,
        );
        let (how, ticket) = d.admit(5.0, || true).await;
        assert_eq!(how, Admission::Direct);
        // Until the first request's load is counted, capacity is not handed out again.
        let blocked = tokio::time::timeout(Duration::from_millis(30), d.admit(5.0, || true)).await;
        assert!(blocked.is_err());
        drop(ticket);
        assert_eq!(d.admit(5.0, || true).await.0, Admission::Direct);
        let gone = tokio::time::timeout(Duration::from_millis(10), d.admit(5.0, || false)).await;
        assert!(gone.is_err());
        assert_eq!(d.queue.lock().len(), 0);
        assert_eq!(d.admit(5.0, || false).await.0, Admission::Expired);
        assert!(
            DispatchConfig {
                aging: f64::NAN,
                ..DispatchConfig::default()
            }
            .validate()
            .is_err()
        );
    }
}
