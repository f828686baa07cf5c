//! The router's own in-flight accounting per endpoint.
//!
//! Every forwarded request holds a [`LoadGuard`]; its `Drop` releases what it added, so the counts
//! are right on every path — success, engine error, timeout, client disconnect (the response body,
//! which owns the guard, is dropped) and stream end. Uncached prompt tokens are released as soon as
//! the first byte of the response arrives (prefill is over), decode tokens at the end. A request
//! whose engine pulls its prefix also counts as a transfer into that endpoint and out of the
//! source until its first byte (the pull is over by then): the cost of the next pull over the
//! same links depends on it.
//!
//! Separately, a pull is *landing* until the time the router expects its transfer to end (its
//! predicted duration with some slack, [`LoadGuard::expect_landing_by`]). Only a request still
//! landing joins its engine's queue behind work placed there now; once its blocks have landed it
//! is queued ahead of any newcomer, even though its first byte may be far off. Charging newcomers
//! for delaying it until the first byte sent a burst's first-seen prompts away from the engines
//! that had just received a pull, onto engines predicted 160–450 ms slower (`docs/benchmarks.md`,
//! hot prefixes).
//!
//! A request also holds its prompt's blocks in the endpoint's in-flight working set until it ends
//! (shared prefixes counted once, as the engine's prefix cache shares them): what the engine's GPU
//! tier must hold for everything this router sent it. Past the tier's capacity a request waits for
//! running ones to finish, so the router also learns how fast requests decode there (first byte to
//! end, per requested output token: requests ask for very different lengths).
//!
//! With several router replicas, each sees only the work it sent. Every request therefore carries
//! a mark (this replica's sequence number for the endpoint, see [`kvmesh_core::load_report`]), and
//! the engine reports what it holds from every replica and which marks it has received. While
//! such a report is fresh (younger than [`REPORT_STALE_AFTER`]) a snapshot is the report plus this
//! replica's requests it does not cover yet, and never less than this replica's own count (an
//! engine under-reporting cannot hide work this replica knows it sent); without one it is this
//! replica's own view, as with a single router.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvmesh_core::ChainKey;
use kvmesh_core::load_report::LoadReport;
use parking_lot::Mutex;
use serde::Serialize;

/// Weight of a new decode-time sample in the running average.
const DECODE_EWMA_ALPHA: f64 = 0.1;

/// An engine's load report older than this no longer counts: the engine heartbeats every 500 ms,
/// so four missed reports mean the channel is down and this replica falls back to its own view.
pub const REPORT_STALE_AFTER: Duration = Duration::from_secs(2);

/// At most this many reports are taken per endpoint per [`REPORT_WINDOW`] (an engine sends at
/// most 20: one per 5 ms; the slack absorbs reports that queued up on the way and arrive
/// together); past it a report is dropped unread but counted, so a flood costs a comparison each.
pub const MAX_REPORTS_PER_WINDOW: u32 = 50;
pub const REPORT_WINDOW: Duration = Duration::from_millis(100);

/// What an engine last said about itself, as it concerns this replica.
#[derive(Debug, Clone, Copy)]
struct Reported {
    requests: u64,
    prefill_tokens: u64,
    decode_tokens: u64,
    /// This replica's marks below this are counted in the report.
    covers_below: u64,
    /// The report names a replica other than this one (several replicas place on this engine).
    others: bool,
    at: Instant,
}

/// Why a load report was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReportRefused {
    /// More than [`MAX_REPORTS_PER_WINDOW`] arrived within [`REPORT_WINDOW`].
    Flood,
}

/// Atomic counters; read without locks on the scheduling path.
#[derive(Debug, Default)]
pub struct EndpointLoad {
    requests: AtomicU64,
    uncached_tokens: AtomicU64,
    decode_tokens: AtomicU64,
    pulls_in: AtomicU64,
    pulls_out: AtomicU64,
    /// Pulls ever named into the endpoint, and the sum of their `1 + sharing` (transfers already
    /// on the busier end when each was named): the scrape loop divides the engine's own pull
    /// times by their mean over an interval, so the learned rate is the link's, not the
    /// contended one ([`kvmesh_sched::cost_model::uncontended_time`]).
    pulls_named_in: AtomicU64,
    pull_share_sum: AtomicU64,
    /// Pulls into the endpoint: landing id, when each is expected to have landed, and the
    /// prompt tokens its request computes once it has.
    landing: Mutex<Vec<(u64, Instant, u64)>>,
    next_landing_id: AtomicU64,
    /// Distinct prompt blocks of in-flight requests, by chain key, with how many requests hold each.
    context: Mutex<HashMap<ChainKey, u32>>,
    /// `context.len()`, readable without the lock.
    context_blocks: AtomicU64,
    /// Running average of decode time per requested output token here (ms, f64 bits; 0 = no
    /// sample yet).
    decode_ms_per_token_bits: AtomicU64,
    /// The mark the next request gets.
    next_mark: AtomicU64,
    /// Requests in flight by mark: the uncached tokens (0 after the first byte) and decode
    /// tokens each adds until the engine's report covers it.
    marked: Mutex<BTreeMap<u64, (u64, u64)>>,
    /// The engine's last report (see the module header).
    reported: Mutex<Option<Reported>>,
    /// The current flood window's start and the reports taken in it.
    report_window: Mutex<(Option<Instant>, u32)>,
}

/// A point-in-time copy of [`EndpointLoad`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct LoadSnapshot {
    pub requests: u64,
    pub uncached_tokens: u64,
    pub decode_tokens: u64,
    pub pulls_in: u64,
    pub pulls_out: u64,
    /// Pulls into the endpoint expected to be still in transfer (see [`LoadGuard::expect_landing_by`]).
    pub pulls_landing_in: u64,
    /// The prompt tokens those pulls' requests compute once landed.
    pub pulls_landing_uncached_tokens: u64,
    /// Distinct prompt blocks in-flight requests hold (see [`LoadGuard::hold_context`]).
    pub context_blocks: u64,
    /// `requests`, `uncached_tokens` and `decode_tokens` include other replicas' work, from a
    /// fresh engine report.
    pub shared: bool,
}

impl EndpointLoad {
    pub fn snapshot(&self) -> LoadSnapshot {
        self.snapshot_at(Instant::now())
    }

    /// [`Self::snapshot`] as of `now` (which pulls are still landing, and whether the engine's
    /// report is fresh, depend on the time).
    fn snapshot_at(&self, now: Instant) -> LoadSnapshot {
        let own = self.own_snapshot_at(now);
        let Some(r) = *self.reported.lock() else {
            return own;
        };
        if now.saturating_duration_since(r.at) > REPORT_STALE_AFTER {
            return own;
        }
        let (mut requests, mut uncached, mut decode) = (0u64, 0u64, 0u64);
        for (u, d) in self.marked.lock().range(r.covers_below..).map(|(_, v)| v) {
            requests += 1;
            uncached += u;
            decode += d;
        }
        LoadSnapshot {
            requests: own.requests.max(r.requests.saturating_add(requests)),
            uncached_tokens: own
                .uncached_tokens
                .max(r.prefill_tokens.saturating_add(uncached)),
            decode_tokens: own
                .decode_tokens
                .max(r.decode_tokens.saturating_add(decode)),
            shared: true,
            ..own
        }
    }

    /// Whether, by the engine's fresh report, other router replicas also send work here.
    pub fn other_replicas(&self) -> bool {
        self.reported.lock().is_some_and(|r| {
            r.others && Instant::now().saturating_duration_since(r.at) <= REPORT_STALE_AFTER
        })
    }

    /// What this replica alone has in flight here.
    pub fn own_snapshot(&self) -> LoadSnapshot {
        self.own_snapshot_at(Instant::now())
    }

    fn own_snapshot_at(&self, now: Instant) -> LoadSnapshot {
        let (pulls_landing_in, pulls_landing_uncached_tokens) = self
            .landing
            .lock()
            .iter()
            .filter(|(_, by, _)| *by > now)
            .fold((0, 0), |(n, t), (_, _, u)| (n + 1, t + u));
        LoadSnapshot {
            requests: self.requests.load(Ordering::Relaxed),
            uncached_tokens: self.uncached_tokens.load(Ordering::Relaxed),
            decode_tokens: self.decode_tokens.load(Ordering::Relaxed),
            pulls_in: self.pulls_in.load(Ordering::Relaxed),
            pulls_out: self.pulls_out.load(Ordering::Relaxed),
            pulls_landing_in,
            pulls_landing_uncached_tokens,
            context_blocks: self.context_blocks.load(Ordering::Relaxed),
            shared: false,
        }
    }

    /// Takes the engine's load report, received at `now`, as it concerns replica `replica_id`.
    pub fn accept_report(
        &self,
        report: &LoadReport,
        replica_id: &str,
        now: Instant,
    ) -> Result<(), ReportRefused> {
        {
            let mut window = self.report_window.lock();
            match window.0 {
                Some(start) if now.saturating_duration_since(start) < REPORT_WINDOW => {
                    if window.1 >= MAX_REPORTS_PER_WINDOW {
                        return Err(ReportRefused::Flood);
                    }
                    window.1 += 1;
                }
                _ => *window = (Some(now), 1),
            }
        }
        *self.reported.lock() = Some(Reported {
            requests: report.requests,
            prefill_tokens: report.prefill_tokens,
            decode_tokens: report.decode_tokens,
            covers_below: report.routers.get(replica_id).copied().unwrap_or(0),
            others: report.routers.keys().any(|id| id != replica_id),
            at: now,
        });
        Ok(())
    }

    /// Pulls ever named into this endpoint and the sum of their `1 + sharing` (see
    /// [`LoadGuard::track_pull`]); both only grow.
    pub fn pull_share_totals(&self) -> (u64, u64) {
        (
            self.pulls_named_in.load(Ordering::Relaxed),
            self.pull_share_sum.load(Ordering::Relaxed),
        )
    }

    /// How many of a prompt's leading blocks `keys` in-flight requests already hold here (blocks
    /// a new request would share). A chain key stands for its whole prefix, so the held ones are
    /// a leading run: a binary search finds its end.
    pub fn shared_blocks(&self, keys: &[ChainKey]) -> u64 {
        let held = self.context.lock();
        if held.is_empty() {
            return 0;
        }
        keys.partition_point(|k| held.contains_key(k)) as u64
    }

    /// Average decode time per requested output token here (ms), once a request has finished.
    pub fn decode_ms_per_token(&self) -> Option<f64> {
        let v = f64::from_bits(self.decode_ms_per_token_bits.load(Ordering::Relaxed));
        (v > 0.0).then_some(v)
    }

    /// How long the requests in flight here (as of `load`, a snapshot of this endpoint) take to
    /// decode, on average (ms): their mean requested output length at the learned per-token time.
    pub fn in_flight_decode_ms(&self, load: &LoadSnapshot) -> Option<f64> {
        let per_token = self.decode_ms_per_token()?;
        let mean_tokens = load
            .decode_tokens
            .checked_div(load.requests)
            .unwrap_or(0)
            .max(1);
        Some(per_token * mean_tokens as f64)
    }

    fn observe_decode(&self, ms: f64, tokens: u64) {
        let sample = ms / tokens.max(1) as f64;
        if !sample.is_finite() || sample <= 0.0 {
            return;
        }
        let avg = match self.decode_ms_per_token() {
            Some(prev) => prev + DECODE_EWMA_ALPHA * (sample - prev),
            None => sample,
        };
        self.decode_ms_per_token_bits
            .store(avg.to_bits(), Ordering::Relaxed);
    }

    /// Counts one request with `uncached` prompt tokens to compute and `decode` tokens to generate.
    pub fn acquire(self: &Arc<Self>, uncached: u64, decode: u64) -> LoadGuard {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.uncached_tokens.fetch_add(uncached, Ordering::Relaxed);
        self.decode_tokens.fetch_add(decode, Ordering::Relaxed);
        let mark = self.next_mark.fetch_add(1, Ordering::Relaxed);
        self.marked.lock().insert(mark, (uncached, decode));
        LoadGuard {
            load: Arc::clone(self),
            mark,
            marked_uncached: uncached,
            uncached,
            decode,
            pull_source: None,
            landing_id: None,
            context: Vec::new(),
            first_byte_at: None,
            streamed: false,
        }
    }
}

/// Releases its request's share of [`EndpointLoad`] when dropped.
#[derive(Debug)]
pub struct LoadGuard {
    load: Arc<EndpointLoad>,
    /// This request's mark (see the module header), and the uncached tokens it was sent with.
    mark: u64,
    marked_uncached: u64,
    uncached: u64,
    decode: u64,
    /// The source of a pull this request's engine makes, until the pull is over.
    pull_source: Option<Arc<EndpointLoad>>,
    /// This request's entry in the endpoint's landing pulls, until the pull is over.
    landing_id: Option<u64>,
    /// The prompt blocks this request holds in the endpoint's working set.
    context: Vec<ChainKey>,
    first_byte_at: Option<Instant>,
    /// Output came in more than one piece (a stream): first byte to end is the decode.
    streamed: bool,
}

impl LoadGuard {
    /// The request's mark for the engine: this replica's sequence number for the endpoint and
    /// the uncached prompt tokens it expects the engine to compute.
    pub fn mark(&self) -> (u64, u64) {
        (self.mark, self.marked_uncached)
    }

    /// Counts a pull from `source` into this request's endpoint until the first byte. Returns
    /// the transfers already on the busier end (the source's egress or this endpoint's
    /// ingress), the sharing the pull was priced with; 0 when this guard already tracks one.
    pub fn track_pull(&mut self, source: &Arc<EndpointLoad>) -> u64 {
        if self.pull_source.is_some() {
            return 0;
        }
        let ingress = self.load.pulls_in.fetch_add(1, Ordering::Relaxed);
        let egress = source.pulls_out.fetch_add(1, Ordering::Relaxed);
        let sharing = ingress.max(egress);
        self.load.pulls_named_in.fetch_add(1, Ordering::Relaxed);
        self.load
            .pull_share_sum
            .fetch_add(1 + sharing, Ordering::Relaxed);
        self.pull_source = Some(Arc::clone(source));
        sharing
    }

    /// The tracked pull is expected to have landed by `deadline`: until then work placed on the
    /// endpoint goes ahead of this request (see the module header). Called once, after
    /// [`Self::track_pull`]; later calls and calls without a tracked pull are ignored.
    pub fn expect_landing_by(&mut self, deadline: Instant) {
        if self.pull_source.is_none() || self.landing_id.is_some() {
            return;
        }
        let id = self.load.next_landing_id.fetch_add(1, Ordering::Relaxed);
        let mut landing = self.load.landing.lock();
        // Entries of pulls whose requests are still waiting for their first byte outlive their
        // deadline; drop those here so the list stays as long as the pulls actually landing.
        let now = Instant::now();
        landing.retain(|(_, by, _)| *by > now);
        landing.push((id, deadline, self.uncached));
        self.landing_id = Some(id);
    }

    fn pull_done(&mut self) {
        if let Some(source) = self.pull_source.take() {
            self.load.pulls_in.fetch_sub(1, Ordering::Relaxed);
            source.pulls_out.fetch_sub(1, Ordering::Relaxed);
        }
        if let Some(id) = self.landing_id.take() {
            self.load.landing.lock().retain(|(i, _, _)| *i != id);
        }
    }

    /// Holds `keys` (the prompt's full blocks) in the endpoint's working set until the request
    /// ends. Called once; later calls are ignored.
    pub fn hold_context(&mut self, keys: &[ChainKey]) {
        if !self.context.is_empty() || keys.is_empty() {
            return;
        }
        let mut held = self.load.context.lock();
        for k in keys {
            *held.entry(*k).or_insert(0) += 1;
        }
        self.load
            .context_blocks
            .store(held.len() as u64, Ordering::Relaxed);
        drop(held);
        self.context = keys.to_vec();
    }

    /// Prefill finished (first byte seen): the uncached tokens are no longer pending work.
    pub fn prefill_done(&mut self) {
        if self.first_byte_at.is_none() {
            self.first_byte_at = Some(Instant::now());
        }
        self.load
            .uncached_tokens
            .fetch_sub(std::mem::take(&mut self.uncached), Ordering::Relaxed);
        if let Some(entry) = self.load.marked.lock().get_mut(&self.mark) {
            entry.0 = 0;
        }
        self.pull_done();
    }

    /// More output arrived after the first byte: the response is streamed.
    pub fn output_continues(&mut self) {
        self.streamed = self.first_byte_at.is_some();
    }

    /// The response ended normally: learn how long requests decode here, from a streamed
    /// response's first byte to its end. A response that came in one piece says nothing about
    /// its decode (its time is mostly queue and prefill for a long prompt), so it teaches nothing.
    pub fn output_done(&mut self) {
        let Some(first) = self.first_byte_at.filter(|_| self.streamed) else {
            return;
        };
        self.load
            .observe_decode(first.elapsed().as_secs_f64() * 1000.0, self.decode);
    }

    fn release_context(&mut self) {
        if self.context.is_empty() {
            return;
        }
        let mut held = self.load.context.lock();
        for k in std::mem::take(&mut self.context) {
            if let Entry::Occupied(mut e) = held.entry(k) {
                *e.get_mut() -= 1;
                if *e.get() == 0 {
                    e.remove();
                }
            }
        }
        self.load
            .context_blocks
            .store(held.len() as u64, Ordering::Relaxed);
    }
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        self.pull_done();
        self.release_context();
        self.load.marked.lock().remove(&self.mark);
        self.load.requests.fetch_sub(1, Ordering::Relaxed);
        self.load
            .uncached_tokens
            .fetch_sub(self.uncached, Ordering::Relaxed);
        self.load
            .decode_tokens
            .fetch_sub(self.decode, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_releases_everything_once() {
        let load = Arc::new(EndpointLoad::default());
        let mut g1 = load.acquire(100, 10);
        let g2 = load.acquire(50, 5);
        assert_eq!(
            load.snapshot(),
            LoadSnapshot {
                requests: 2,
                uncached_tokens: 150,
                decode_tokens: 15,
                ..LoadSnapshot::default()
            }
        );
        g1.prefill_done();
        g1.prefill_done();
        assert_eq!(
            load.snapshot(),
            LoadSnapshot {
                requests: 2,
                uncached_tokens: 50,
                decode_tokens: 15,
                ..LoadSnapshot::default()
            }
        );
        drop(g1);
        assert_eq!(
            load.snapshot(),
            LoadSnapshot {
                requests: 1,
                uncached_tokens: 50,
                decode_tokens: 5,
                ..LoadSnapshot::default()
            }
        );
        drop(g2);
        assert_eq!(load.snapshot(), LoadSnapshot::default());
    }

    #[test]
    fn shared_prompt_blocks_count_once_and_leave_with_the_last_holder() {
        let load = Arc::new(EndpointLoad::default());
        let keys = |r: std::ops::Range<u64>| r.map(ChainKey).collect::<Vec<_>>();
        let mut a = load.acquire(0, 0);
        a.hold_context(&keys(0..10));
        a.hold_context(&keys(100..200)); // once per request
        let mut b = load.acquire(0, 0);
        b.hold_context(&keys(0..14)); // the same 10-block prefix and 4 more
        assert_eq!(load.snapshot().context_blocks, 14);
        // Held: 0..14 (and 100..200). A prompt sharing the first 12 blocks of that chain shares
        // 12; one starting elsewhere shares none.
        assert_eq!(load.shared_blocks(&keys(0..12)), 12);
        let mut longer = keys(0..12);
        longer.extend(keys(500..510));
        assert_eq!(load.shared_blocks(&longer), 12);
        assert_eq!(load.shared_blocks(&keys(300..320)), 0);
        drop(a);
        assert_eq!(load.snapshot().context_blocks, 14);
        drop(b);
        assert_eq!(load.snapshot().context_blocks, 0);
        assert_eq!(load.shared_blocks(&keys(0..4)), 0);
    }

    #[test]
    fn decode_time_is_learned_only_from_responses_that_ended_normally() {
        let load = Arc::new(EndpointLoad::default());
        // No first byte (refused, cut before any output): nothing learned.
        let mut g = load.acquire(10, 10);
        g.output_done();
        drop(g);
        assert_eq!(load.decode_ms_per_token(), None);
        // A response in one piece: its time is not a decode time.
        let mut g = load.acquire(10, 10);
        g.prefill_done();
        g.output_done();
        drop(g);
        assert_eq!(load.decode_ms_per_token(), None);
        // A stream asking for 10 tokens: first byte, more output, normal end after ≥ 20 ms.
        let mut g = load.acquire(10, 10);
        g.prefill_done();
        g.output_continues();
        std::thread::sleep(std::time::Duration::from_millis(20));
        g.output_done();
        drop(g);
        let first = load.decode_ms_per_token().expect("learned");
        assert!((1.5..200.0).contains(&first), "{first}");
        // A later sample moves the average a tenth of the way.
        load.observe_decode((first + 100.0) * 4.0, 4);
        let avg = load.decode_ms_per_token().expect("learned");
        assert!((avg - (first + 10.0)).abs() < 1e-6, "{avg}");
        // In flight: two requests asking for 100 and 300 tokens decode ~200 tokens' time.
        let (_a, _b) = (load.acquire(0, 100), load.acquire(0, 300));
        let d = load.in_flight_decode_ms(&load.snapshot()).expect("known");
        assert!((d - avg * 200.0).abs() < 1e-6, "{d}");
    }

    #[test]
    fn a_pull_is_landing_until_its_expected_end_or_its_first_byte() {
        let (dest, src) = (
            Arc::new(EndpointLoad::default()),
            Arc::new(EndpointLoad::default()),
        );
        let t0 = Instant::now();
        let ms = |n: u64| std::time::Duration::from_millis(n);
        // Without a tracked pull there is nothing to land.
        let mut plain = dest.acquire(10, 1);
        plain.expect_landing_by(t0 + ms(500));
        assert_eq!(dest.snapshot_at(t0).pulls_landing_in, 0);
        let mut a = dest.acquire(10, 1);
        a.track_pull(&src);
        a.expect_landing_by(t0 + ms(100));
        a.expect_landing_by(t0 + ms(900)); // ignored: one landing per pull
        let mut b = dest.acquire(10, 1);
        b.track_pull(&src);
        b.expect_landing_by(t0 + ms(300));
        assert_eq!(dest.snapshot_at(t0).pulls_landing_in, 2);
        assert_eq!(dest.snapshot_at(t0).pulls_landing_uncached_tokens, 20);
        // Past A's expected end only B is still landing; both still count as pulls in flight.
        let later = dest.snapshot_at(t0 + ms(150));
        assert_eq!((later.pulls_landing_in, later.pulls_in), (1, 2));
        // B's first byte ends its pull early.
        b.prefill_done();
        assert_eq!(dest.snapshot_at(t0).pulls_landing_in, 1);
        drop(a);
        drop(b);
        drop(plain);
        assert_eq!(dest.snapshot_at(t0), LoadSnapshot::default());
    }

    fn report(requests: u64, prefill: u64, decode: u64, ours: Option<u64>) -> LoadReport {
        LoadReport {
            v: 1,
            requests,
            prefill_tokens: prefill,
            decode_tokens: decode,
            routers: ours.map(|b| ("me".to_owned(), b)).into_iter().collect(),
        }
    }

    #[test]
    fn a_fresh_engine_report_adds_other_replicas_work_and_our_requests_it_has_not_seen() {
        let load = Arc::new(EndpointLoad::default());
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let mut a = load.acquire(1000, 10); // mark 0
        let b = load.acquire(500, 20); // mark 1
        assert_eq!(a.mark(), (0, 1000));
        assert_eq!(b.mark(), (1, 500));
        // No report: our own view.
        let own = load.snapshot_at(t0);
        assert_eq!(
            (own.requests, own.uncached_tokens, own.shared),
            (2, 1500, false)
        );
        // The engine has mark 0 (and another replica's 3 requests, 9000 tokens); mark 1 is on
        // its way, so it is added.
        load.accept_report(&report(4, 10_000, 100, Some(1)), "me", t0)
            .unwrap();
        let s = load.snapshot_at(ms(1));
        assert_eq!(
            (s.requests, s.uncached_tokens, s.decode_tokens, s.shared),
            (5, 10_500, 120, true)
        );
        // Our first byte arrives before the engine's next report: nothing is counted twice
        // beyond what the report still says.
        a.prefill_done();
        assert_eq!(load.snapshot_at(ms(1)).uncached_tokens, 10_500);
        // An engine reporting less than we know we sent cannot hide our work.
        load.accept_report(&report(0, 0, 0, Some(2)), "me", ms(10))
            .unwrap();
        let s = load.snapshot_at(ms(11));
        assert_eq!((s.requests, s.uncached_tokens), (2, 500));
        // A flood: past the window's allowance reports are refused until the next window.
        let t = ms(500);
        for _ in 0..MAX_REPORTS_PER_WINDOW {
            load.accept_report(&report(2, 500, 0, Some(2)), "me", t)
                .unwrap();
        }
        assert_eq!(
            load.accept_report(&report(9, 9, 9, None), "me", t),
            Err(ReportRefused::Flood)
        );
        load.accept_report(&report(0, 0, 0, Some(2)), "me", t + REPORT_WINDOW)
            .unwrap();
        // Stale: back to our own view.
        let s = load.snapshot_at(t + REPORT_WINDOW + REPORT_STALE_AFTER + Duration::from_millis(1));
        assert_eq!((s.requests, s.uncached_tokens, s.shared), (2, 500, false));
        drop(a);
        drop(b);
        assert!(load.marked.lock().is_empty());
    }

    #[test]
    fn a_tracked_pull_counts_on_both_ends_until_first_byte_or_drop() {
        let (dest, src) = (
            Arc::new(EndpointLoad::default()),
            Arc::new(EndpointLoad::default()),
        );
        let mut g = dest.acquire(10, 1);
        assert_eq!(g.track_pull(&src), 0);
        assert_eq!(g.track_pull(&src), 0);
        assert_eq!((dest.snapshot().pulls_in, src.snapshot().pulls_out), (1, 1));
        // A second pull out of the same source shares its link with the first.
        let other = Arc::new(EndpointLoad::default());
        let mut g3 = other.acquire(10, 1);
        assert_eq!(g3.track_pull(&src), 1);
        assert_eq!(other.pull_share_totals(), (1, 2));
        assert_eq!(dest.pull_share_totals(), (1, 1));
        drop(g3);
        g.prefill_done();
        assert_eq!((dest.snapshot().pulls_in, src.snapshot().pulls_out), (0, 0));
        let mut g2 = dest.acquire(10, 1);
        g2.track_pull(&src);
        drop(g2);
        drop(g);
        assert_eq!(dest.snapshot(), LoadSnapshot::default());
        assert_eq!(src.snapshot(), LoadSnapshot::default());
    }
}
