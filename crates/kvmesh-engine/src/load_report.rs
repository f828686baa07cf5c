//! The engine's own account of the work it holds, published for every router replica (the wire
//! format and why: [`kvmesh_core::load_report`]).
//!
//! [`LoadTracker`] is plain data behind a lock: each HTTP request holds a [`RequestLoad`] from
//! the moment it is parsed (before any pull) to its end, and the tracker sums them. Per router
//! replica it keeps a watermark: every request the replica marked below it has arrived. A
//! sequence number that never arrives (the replica gave up on the request before sending it)
//! would hold the watermark back for ever, so one missing for [`MISSING_GRACE`] while later ones
//! arrived is skipped. [`spawn_reporter`] publishes a report when the account changes (at most
//! every [`MIN_REPORT_INTERVAL`]) and every [`HEARTBEAT`] regardless, so a router can tell a
//! silent engine from an idle one.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvmesh_core::load_report::{LOAD_TOPIC, LoadReport, MAX_REPORTED_ROUTERS, RouterMark};
use kvmesh_events::PublisherHandle;
use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// How long a missing sequence number may hold a replica's watermark back.
pub const MISSING_GRACE: Duration = Duration::from_secs(1);
/// The shortest time between two reports (a burst of arrivals makes one report).
pub const MIN_REPORT_INTERVAL: Duration = Duration::from_millis(5);
/// A report goes out at least this often.
pub const HEARTBEAT: Duration = Duration::from_millis(500);
/// Out-of-order arrivals remembered per replica; past it the oldest gap is skipped at once.
const MAX_OUT_OF_ORDER: usize = 1024;
/// Replicas remembered (the most recently seen); twice what a report lists.
const MAX_ROUTERS: usize = 2 * MAX_REPORTED_ROUTERS;
/// A report lists only the replicas that sent a request this recently (a replica that died or
/// went idle drops out, so the others stop thinking they share the engine).
pub const ACTIVE_WITHIN: Duration = Duration::from_secs(30);

/// The sums of every request in flight, and the replicas' watermarks.
#[derive(Default)]
pub struct LoadTracker {
    state: Mutex<State>,
    changed: Notify,
}

#[derive(Default)]
struct State {
    requests: u64,
    prefill_tokens: u64,
    decode_tokens: u64,
    routers: HashMap<String, Arrivals>,
}

/// Which of one replica's sequence numbers have arrived.
struct Arrivals {
    /// Every sequence number below this has arrived (or was skipped).
    below: u64,
    /// Arrived above `below`, with when each arrived.
    above: BTreeMap<u64, Instant>,
    last_seen: Instant,
}

impl Arrivals {
    fn receive(&mut self, seq: u64, now: Instant) {
        self.last_seen = now;
        if seq < self.below {
            return;
        }
        self.above.insert(seq, now);
        self.settle(now);
        if self.above.len() > MAX_OUT_OF_ORDER
            && let Some((&first, _)) = self.above.first_key_value()
        {
            self.below = first;
            self.settle(now);
        }
    }

    /// Advances `below` over what has arrived, and over a gap that later arrivals have waited
    /// behind for [`MISSING_GRACE`].
    fn settle(&mut self, now: Instant) {
        loop {
            match self.above.first_key_value() {
                Some((&seq, _)) if seq == self.below => {
                    self.above.remove(&seq);
                    self.below += 1;
                }
                Some((&seq, &at)) if now.saturating_duration_since(at) >= MISSING_GRACE => {
                    self.below = seq;
                }
                _ => return,
            }
        }
    }
}

impl LoadTracker {
    /// Counts a request of `prompt_tokens` asking for `max_tokens`. Its prefill work is what the
    /// router's mark says is uncached (at most the prompt), or the whole prompt without a mark,
    /// until [`RequestLoad::started`] tells what the engine actually found cached.
    pub fn begin(
        self: &Arc<Self>,
        mark: Option<&RouterMark>,
        prompt_tokens: usize,
        max_tokens: usize,
        now: Instant,
    ) -> RequestLoad {
        let prompt = prompt_tokens as u64;
        let prefill = mark.map_or(prompt, |m| m.uncached_tokens.min(prompt));
        let decode = max_tokens as u64;
        {
            let mut s = self.state.lock();
            s.requests += 1;
            s.prefill_tokens += prefill;
            s.decode_tokens += decode;
            if let Some(m) = mark {
                s.arrived(m, now);
            }
        }
        self.changed.notify_one();
        RequestLoad {
            tracker: Arc::clone(self),
            prompt,
            prefill,
            decode,
        }
    }

    /// The report as of `now`.
    pub fn report(&self, now: Instant) -> LoadReport {
        let mut s = self.state.lock();
        let mut recent: Vec<(&String, &mut Arrivals)> = s.routers.iter_mut().collect();
        recent.sort_by_key(|(_, a)| std::cmp::Reverse(a.last_seen));
        let routers = recent
            .into_iter()
            .filter(|(_, a)| now.saturating_duration_since(a.last_seen) <= ACTIVE_WITHIN)
            .take(MAX_REPORTED_ROUTERS)
            .map(|(id, a)| {
                a.settle(now);
                (id.clone(), a.below)
            })
            .collect();
        LoadReport {
            v: 1,
            requests: s.requests,
            prefill_tokens: s.prefill_tokens,
            decode_tokens: s.decode_tokens,
            routers,
        }
    }

    fn update(&self, f: impl FnOnce(&mut State)) {
        f(&mut self.state.lock());
        self.changed.notify_one();
    }
}

impl State {
    fn arrived(&mut self, mark: &RouterMark, now: Instant) {
        if !self.routers.contains_key(&mark.router) && self.routers.len() >= MAX_ROUTERS {
            // Forget the replica seen least recently: its requests are then counted twice (by
            // itself and in the sums) until they end, never missed.
            if let Some(stale) = self
                .routers
                .iter()
                .min_by_key(|(_, a)| a.last_seen)
                .map(|(id, _)| id.clone())
            {
                self.routers.remove(&stale);
            }
        }
        self.routers
            .entry(mark.router.clone())
            .or_insert_with(|| Arrivals {
                below: 0,
                above: BTreeMap::new(),
                last_seen: now,
            })
            .receive(mark.seq, now);
    }
}

/// One request's share of the [`LoadTracker`]; released on drop, whatever ends the request.
pub struct RequestLoad {
    tracker: Arc<LoadTracker>,
    prompt: u64,
    prefill: u64,
    decode: u64,
}

impl RequestLoad {
    /// The compute loop looked the prompt up: `cached_tokens` of it need no computing.
    pub fn started(&mut self, cached_tokens: usize) {
        let now = self.prompt.saturating_sub(cached_tokens as u64);
        let before = std::mem::replace(&mut self.prefill, now);
        if before != now {
            self.tracker.update(|s| {
                s.prefill_tokens = s.prefill_tokens - before + now;
            });
        }
    }

    /// The first output token is out: the prefill is over.
    pub fn first_token(&mut self) {
        let before = std::mem::take(&mut self.prefill);
        if before > 0 {
            self.tracker.update(|s| s.prefill_tokens -= before);
        }
    }
}

impl Drop for RequestLoad {
    fn drop(&mut self) {
        let (prefill, decode) = (self.prefill, self.decode);
        self.tracker.update(|s| {
            s.requests -= 1;
            s.prefill_tokens -= prefill;
            s.decode_tokens -= decode;
        });
    }
}

/// Publishes `tracker`'s report under [`LOAD_TOPIC`] on `publisher` until `cancel`.
pub fn spawn_reporter(
    tracker: Arc<LoadTracker>,
    publisher: PublisherHandle,
    cancel: CancellationToken,
) {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tracker.changed.notified() => {}
                _ = tokio::time::sleep(HEARTBEAT) => {}
            }
            // Let a burst of changes settle into one report.
            tokio::time::sleep(MIN_REPORT_INTERVAL).await;
            let report = tracker.report(Instant::now());
            publisher.send_side(LOAD_TOPIC, Bytes::from(report.encode()));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(router: &str, seq: u64, uncached: u64) -> RouterMark {
        RouterMark {
            router: router.into(),
            seq,
            uncached_tokens: uncached,
        }
    }

    #[test]
    fn sums_follow_requests_from_arrival_through_first_token_to_end() {
        let t = Arc::new(LoadTracker::default());
        let now = Instant::now();
        let mut a = t.begin(Some(&mark("r1", 0, 3000)), 4000, 100, now);
        // Without a mark the whole prompt is work until the engine looks it up.
        let mut b = t.begin(None, 2000, 50, now);
        let r = t.report(now);
        assert_eq!(
            (r.requests, r.prefill_tokens, r.decode_tokens),
            (2, 5000, 150)
        );
        b.started(1500);
        assert_eq!(t.report(now).prefill_tokens, 3500);
        // A mark that claims more than the prompt is held to the prompt.
        let c = t.begin(Some(&mark("r1", 1, 1_000_000)), 100, 1, now);
        assert_eq!(t.report(now).prefill_tokens, 3600);
        a.first_token();
        a.first_token();
        assert_eq!(t.report(now).prefill_tokens, 600);
        drop(c);
        drop(a);
        drop(b);
        let r = t.report(now);
        assert_eq!((r.requests, r.prefill_tokens, r.decode_tokens), (0, 0, 0));
        assert_eq!(r.routers.get("r1"), Some(&2));
    }

    #[test]
    fn a_watermark_waits_for_a_late_request_but_not_for_ever() {
        let t = Arc::new(LoadTracker::default());
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let _r0 = t.begin(Some(&mark("r", 0, 1)), 1, 1, t0);
        // 1 is late: 2 and 3 arrive first.
        let _r2 = t.begin(Some(&mark("r", 2, 1)), 1, 1, ms(1));
        let _r3 = t.begin(Some(&mark("r", 3, 1)), 1, 1, ms(2));
        assert_eq!(t.report(ms(3)).routers["r"], 1);
        let r1 = t.begin(Some(&mark("r", 1, 1)), 1, 1, ms(10));
        assert_eq!(t.report(ms(11)).routers["r"], 4);
        drop(r1);
        // 4 never arrives: 5 waits behind it for the grace, then the watermark moves on.
        let _r5 = t.begin(Some(&mark("r", 5, 1)), 1, 1, ms(20));
        assert_eq!(t.report(ms(500)).routers["r"], 4);
        assert_eq!(t.report(ms(20) + MISSING_GRACE).routers["r"], 6);
        // A duplicate or an old number changes nothing.
        let _again = t.begin(Some(&mark("r", 2, 1)), 1, 1, ms(2000));
        assert_eq!(t.report(ms(2000)).routers["r"], 6);
    }

    #[test]
    fn replicas_are_bounded_and_the_report_lists_the_most_recent() {
        let t = Arc::new(LoadTracker::default());
        let t0 = Instant::now();
        for i in 0..(MAX_ROUTERS as u64 + 10) {
            drop(t.begin(
                Some(&mark(&format!("r{i}"), 0, 1)),
                1,
                1,
                t0 + Duration::from_millis(i),
            ));
        }
        assert_eq!(t.state.lock().routers.len(), MAX_ROUTERS);
        let r = t.report(t0);
        assert_eq!(r.routers.len(), MAX_REPORTED_ROUTERS);
        let newest = format!("r{}", MAX_ROUTERS + 9);
        assert!(r.routers.contains_key(&newest));
        assert!(!r.routers.contains_key("r0"));
        // A flood of out-of-order numbers from one replica stays bounded.
        for seq in (1..=(MAX_OUT_OF_ORDER as u64 + 5)).rev() {
            drop(t.begin(Some(&mark("flood", seq * 2, 1)), 1, 1, t0));
        }
        let s = t.state.lock();
        assert!(s.routers["flood"].above.len() <= MAX_OUT_OF_ORDER);
    }
}
