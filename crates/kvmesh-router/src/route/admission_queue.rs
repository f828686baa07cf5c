//! The router's admission queue: [`kvmesh_sched::admission_queue::Queue`] (which request goes
//! next, and why — see that module) behind a wake-up signal, with tickets and metrics.
//!
//! A held request whose client goes away leaves the queue (the entry is removed on drop). A
//! request let through holds a [`Ticket`] until the gateway has counted its load, so capacity is
//! not handed out twice.
//!
//! With several router replicas each holds its own queue, and all of them see capacity free up
//! in the same engine load report; releasing at once, every replica would send its head (or a
//! new arrival) into the one free slot. A request that may take free capacity, held and next or
//! just arrived, therefore first waits a *stagger* that grows with its predicted work
//! ([`stagger`]) and goes only if the capacity is still free: the replica with the shortest
//! request goes first, and the others see that request in the engines' next report (a few ms)
//! before their own stagger ends. Such an arrival counts as held. A single router (no other
//! replica in the engines' reports) places at once.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvmesh_sched::admission_queue::{AdmissionQueueConfig, Queue, Work};
use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::Notify;

/// How a request left the admission queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
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
pub struct AdmissionQueue {
    config: AdmissionQueueConfig,
    queue: Mutex<Queue>,
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
    owner: &'a AdmissionQueue,
    id: u64,
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        if self.owner.queue.lock().remove(self.id) {
            self.owner.held_now.dec();
        }
        // The next in line may be able to go now.
        self.owner.wake.notify_waiters();
    }
}

/// A request let through by [`AdmissionQueue::admit`] whose load is not counted yet; dropping it
/// lets the next one be considered.
pub struct Ticket<'a> {
    owner: &'a AdmissionQueue,
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        self.owner.in_transit.fetch_sub(1, Ordering::SeqCst);
        self.owner.wake.notify_waiters();
    }
}

/// How often a held request re-checks without being woken (aging and `max_hold` move with time).
const RECHECK: Duration = Duration::from_millis(20);

/// The longest a released request staggers (see the module header).
pub const MAX_STAGGER: Duration = Duration::from_millis(40);

/// How long a held request of `work_ms` predicted prefill (the router's clock) waits before it
/// takes free capacity when other replicas may be releasing too: an eighth of its work, at most
/// [`MAX_STAGGER`]. Two heads 60 ms of work apart release ~8 ms apart, about an engine report's
/// round trip.
pub fn stagger(work_ms: f64) -> Duration {
    if !(work_ms.is_finite() && work_ms > 0.0) {
        return Duration::ZERO;
    }
    Duration::from_secs_f64(work_ms / 8.0 / 1000.0).min(MAX_STAGGER)
}

impl AdmissionQueue {
    pub fn new(config: AdmissionQueueConfig, registry: &mut Registry) -> Self {
        let d = AdmissionQueue {
            config,
            queue: Mutex::new(Queue::default()),
            wake: Notify::new(),
            next_id: AtomicU64::new(1),
            in_transit: AtomicU64::new(0),
            held_total: Counter::default(),
            held_now: Gauge::default(),
            expired_total: Counter::default(),
        };
        registry.register(
            "kvmesh_router_admission_queue_held",
            "Requests held by the admission queue (every endpoint had its prefill share queued, or other router replicas share the engines and the request staggered)",
            d.held_total.clone(),
        );
        registry.register(
            "kvmesh_router_admission_queue_waiting",
            "Requests waiting in the admission queue now",
            d.held_now.clone(),
        );
        registry.register(
            "kvmesh_router_admission_queue_expired",
            "Held requests released by admission_queue.max_hold rather than by priority",
            d.expired_total.clone(),
        );
        d
    }

    pub fn config(&self) -> &AdmissionQueueConfig {
        &self.config
    }

    /// Someone's prefill finished or a request ended: held requests re-check.
    pub fn wake(&self) {
        self.wake.notify_waiters();
    }

    /// The prefill tokens of each request held now that nothing is cached for, ascending.
    pub fn cold_tokens(&self) -> Vec<u64> {
        self.queue.lock().cold_tokens()
    }

    /// Waits until the request may be placed. `work` is its predicted prefill work (`work.ms`
    /// is its priority); `has_capacity` says whether some endpoint is below its prefill share
    /// right now.
    /// Keep the returned [`Ticket`] until the request's load is counted on its endpoint: until
    /// then nobody else is let through, since `has_capacity` cannot see that request yet.
    /// `replicas` says whether other router replicas may be releasing into the same engines
    /// (a released request then staggers).
    pub async fn admit(
        &self,
        work: Work,
        replicas: bool,
        has_capacity: impl Fn() -> bool,
    ) -> (Exit, Ticket<'_>) {
        let how = self.wait_turn(work, replicas, has_capacity).await;
        self.in_transit.fetch_add(1, Ordering::SeqCst);
        (how, Ticket { owner: self })
    }

    fn free(&self, has_capacity: &impl Fn() -> bool) -> bool {
        self.in_transit.load(Ordering::SeqCst) == 0 && has_capacity()
    }

    async fn wait_turn(&self, work: Work, replicas: bool, has_capacity: impl Fn() -> bool) -> Exit {
        {
            let q = self.queue.lock();
            // With other replicas, free capacity is contended by their arrivals too: a request
            // takes it only after its stagger, like a held one (see the module header).
            if q.is_empty() && self.free(&has_capacity) && (!replicas || stagger(work.ms).is_zero())
            {
                return Exit::Direct;
            }
            if q.len() >= self.config.max_held {
                return Exit::Overflow;
            }
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.queue.lock().push(id, work, Instant::now());
        self.held_total.inc();
        self.held_now.inc();
        let _leave = Leave { owner: self, id };
        let stagger = if replicas {
            stagger(work.ms)
        } else {
            Duration::ZERO
        };
        // When this request, next and with capacity free, may go (after its stagger).
        let mut go_at: Option<Instant> = None;
        loop {
            // Register for the wake-up before checking, so a wake between check and wait is kept.
            let woken = self.wake.notified();
            let now = Instant::now();
            {
                let q = self.queue.lock();
                if q.expired(id, now, self.config.max_hold) {
                    self.expired_total.inc();
                    return Exit::Expired;
                }
                if q.next(now, self.config.aging) == Some(id) && self.free(&has_capacity) {
                    match go_at {
                        Some(at) if now >= at => return Exit::Released,
                        None if stagger.is_zero() => return Exit::Released,
                        None => go_at = Some(now + stagger),
                        Some(_) => {}
                    }
                } else {
                    // Someone else took the capacity meanwhile: stagger again next time.
                    go_at = None;
                }
            }
            let wait = go_at.map_or(RECHECK, |at| at.saturating_duration_since(now).min(RECHECK));
            tokio::select! {
                _ = woken => {}
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;

    #[tokio::test]
    async fn held_requests_leave_in_priority_order_when_capacity_frees() {
        let mut reg = Registry::default();
        let d = Arc::new(AdmissionQueue::new(
            AdmissionQueueConfig::default(),
            &mut reg,
        ));
        let free = Arc::new(AtomicBool::new(false));
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (name, work) in [("long", 2000.0), ("short", 10.0), ("mid", 300.0)] {
            let work = Work {
                ms: work,
                tokens: (work * 25.0) as u64,
                cold: name != "mid",
            };
            let (d, free, order) = (Arc::clone(&d), Arc::clone(&free), Arc::clone(&order));
            tasks.push(tokio::spawn(async move {
                let (how, ticket) = d.admit(work, false, || free.load(Ordering::SeqCst)).await;
                order.lock().push(name);
                // Taking the capacity again: the next one waits for the next wake.
                free.store(false, Ordering::SeqCst);
                drop(ticket);
                how
            }));
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(d.queue.lock().len(), 3);
        assert_eq!(d.cold_tokens(), vec![250, 50_000]);
        for _ in 0..3 {
            free.store(true, Ordering::SeqCst);
            d.wake();
            tokio::time::sleep(Duration::from_millis(60)).await;
        }
        for t in tasks {
            assert_eq!(t.await.expect("task"), Exit::Released);
        }
        assert_eq!(*order.lock(), vec!["short", "mid", "long"]);
        assert_eq!(d.held_total.get(), 3);
        assert_eq!(d.held_now.get(), 0);
    }

    #[tokio::test]
    async fn replicas_release_the_shortest_head_first_into_one_free_slot() {
        assert_eq!(stagger(80.0), Duration::from_millis(10));
        assert_eq!(stagger(1e9), MAX_STAGGER);
        assert_eq!(stagger(f64::NAN), Duration::ZERO);
        // Two replicas' queues, one slot the engines' report says is free: the replica holding
        // the shorter request takes it; the other sees it taken before its stagger ends.
        let mut reg = Registry::default();
        let (a, b) = (
            Arc::new(AdmissionQueue::new(
                AdmissionQueueConfig::default(),
                &mut reg,
            )),
            Arc::new(AdmissionQueue::new(
                AdmissionQueueConfig::default(),
                &mut reg,
            )),
        );
        let free = Arc::new(AtomicBool::new(false));
        let work = |ms: f64| Work {
            ms,
            tokens: (ms * 25.0) as u64,
            cold: true,
        };
        let hold = |q: Arc<AdmissionQueue>, w: Work| {
            let free = Arc::clone(&free);
            tokio::spawn(async move {
                let (how, _ticket) = q.admit(w, true, || free.load(Ordering::SeqCst)).await;
                // Placed: the slot is taken.
                free.store(false, Ordering::SeqCst);
                how
            })
        };
        let long = hold(Arc::clone(&a), work(400.0));
        let short = hold(Arc::clone(&b), work(40.0));
        tokio::time::sleep(Duration::from_millis(30)).await;
        free.store(true, Ordering::SeqCst);
        a.wake();
        b.wake();
        assert_eq!(short.await.expect("task"), Exit::Released);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!long.is_finished(), "both replicas released into one slot");
        long.abort();
    }

    const SHORT: Work = Work {
        ms: 5.0,
        tokens: 125,
        cold: true,
    };

    #[tokio::test]
    async fn free_capacity_passes_straight_through_and_a_cancelled_wait_leaves_the_queue() {
        let mut reg = Registry::default();
        let d = AdmissionQueue::new(
            AdmissionQueueConfig {
                max_hold: Duration::from_millis(50),
                ..AdmissionQueueConfig::default()
            },
            &mut reg,
        );
        let (how, ticket) = d.admit(SHORT, false, || true).await;
        assert_eq!(how, Exit::Direct);
        // Until the first request's load is counted, capacity is not handed out again.
        let blocked =
            tokio::time::timeout(Duration::from_millis(30), d.admit(SHORT, false, || true)).await;
        assert!(blocked.is_err());
        drop(ticket);
        assert_eq!(d.admit(SHORT, false, || true).await.0, Exit::Direct);
        let gone =
            tokio::time::timeout(Duration::from_millis(10), d.admit(SHORT, false, || false)).await;
        assert!(gone.is_err());
        assert_eq!(d.queue.lock().len(), 0);
        assert_eq!(d.admit(SHORT, false, || false).await.0, Exit::Expired);
        assert!(
            AdmissionQueueConfig {
                aging: f64::NAN,
                ..AdmissionQueueConfig::default()
            }
            .validate()
            .is_err()
        );
    }
}
