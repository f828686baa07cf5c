//! The sim engine's modelled network link: a plain data structure with injected time (modelled
//! seconds), no clock and no tokio. [`crate::link_pacer`] drives it from async code.
//!
//! One [`LinkModel`] per node models the node's **shared NIC / host-copy path**: everything the
//! node moves — blocks it pulls in (ingress) and blocks it serves out (egress) — shares one
//! capacity. This is deliberately not a full-duplex link: on the modelled hardware a pull lands
//! through the same host staging buffers and PCIe path a serve reads from, so a consumer that is
//! also serving pulls slower (issue 17).
//!
//! A transfer costs a per-transfer setup latency (connection, descriptor exchange, registration),
//! during which it uses no bandwidth, then its bytes at its share of the link. Sharing is
//! processor sharing within a class and strict priority between the two classes
//! ([`TrafficClass`]): while `d > 0` **demand** transfers (a request waits for them) move bytes,
//! each gets `bandwidth / d` and the **background** ones (prefetches) get nothing; with no demand
//! transfer moving, the `b` background ones each get `bandwidth / b`. So a prefetch never delays
//! a request's transfer, and takes whatever the link has spare. The setup latency is paid per
//! transfer whatever its class (it uses no bandwidth, so a background transfer's setup runs even
//! while demand transfers move). Rates are recomputed at every event (a transfer starts moving
//! after its setup, finishes, is cancelled, truncated or promoted from background to demand);
//! progress is advanced to the event time before the rates change.
//!
//! Across processes: every engine is its own process with its own link, so a max-min fair
//! allocation over the whole fleet cannot be computed. Instead the producer paces what it serves
//! by its own link (egress) and the consumer paces what it receives by its own link (ingress); a
//! pull completes when both ends are done, i.e. it is limited by the slower end. The
//! approximation: share a flow leaves unused at one end because it is limited at the other end is
//! not redistributed to the other flows there (true max-min fairness would hand it out), so under
//! mixed bottlenecks modelled times are somewhat pessimistic.

use std::collections::BTreeMap;

pub use kvmesh_transfer::TrafficClass;

/// Bandwidth and per-transfer setup latency of one node's link (modelled, unscaled time).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkParams {
    /// Capacity shared by every transfer in progress, bytes per second.
    pub bytes_per_sec: f64,
    /// Latency paid by each transfer before its bytes move, seconds.
    pub setup_s: f64,
}

impl LinkParams {
    /// From Gb/s (decimal, as NICs are sold) and milliseconds.
    pub fn from_gbps_ms(gbps: f64, setup_ms: f64) -> Self {
        Self {
            bytes_per_sec: gbps * 1e9 / 8.0,
            setup_s: setup_ms / 1000.0,
        }
    }

    pub fn gbps(&self) -> f64 {
        self.bytes_per_sec * 8.0 / 1e9
    }

    /// Seconds one transfer of `bytes` takes alone on the link (0 for nothing to move).
    pub fn uncontended_s(&self, bytes: f64) -> f64 {
        if bytes <= 0.0 {
            return 0.0;
        }
        self.setup_s + bytes / self.bytes_per_sec
    }

    /// Whether both numbers are usable (positive finite bandwidth, finite non-negative setup).
    pub fn is_valid(&self) -> bool {
        self.bytes_per_sec.is_finite()
            && self.bytes_per_sec > 0.0
            && self.setup_s.is_finite()
            && self.setup_s >= 0.0
    }
}

/// Fits `ms = setup + tokens × bytes_per_token / bandwidth` to a published `(tokens, ms)` pull
/// ladder by least squares on the *relative* error (weights 1/ms²): the acceptance criterion is
/// relative, and an unweighted fit lets the long pulls dominate (for llm-d's gpt-oss ladder it
/// misses the 2K point by 12 %, the relative fit by 3 %). `None` for fewer than two distinct
/// points or a non-increasing ladder.
pub fn fit_ladder(points: &[(f64, f64)], bytes_per_token: f64) -> Option<LinkParams> {
    let (mut s, mut sx, mut sy, mut sxx, mut sxy) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(tokens, ms) in points {
        if ms <= 0.0 {
            return None;
        }
        let w = 1.0 / (ms * ms);
        let x = tokens * bytes_per_token;
        s += w;
        sx += w * x;
        sy += w * ms;
        sxx += w * x * x;
        sxy += w * x * ms;
    }
    let det = s * sxx - sx * sx;
    if points.len() < 2 || det.abs() < f64::EPSILON * s * sxx {
        return None;
    }
    let ms_per_byte = (s * sxy - sx * sy) / det;
    let setup_ms = (sy - ms_per_byte * sx) / s;
    let params = LinkParams {
        bytes_per_sec: 1000.0 / ms_per_byte,
        setup_s: setup_ms.max(0.0) / 1000.0,
    };
    (ms_per_byte > 0.0 && params.is_valid()).then_some(params)
}

/// A transfer's id on one link.
pub type FlowId = u64;

#[derive(Debug, Clone)]
struct Flow {
    /// Modelled time at which its setup ends and its bytes start moving.
    ready_at: f64,
    total: f64,
    delivered: f64,
    class: TrafficClass,
}

impl Flow {
    fn done(&self) -> bool {
        self.delivered >= self.total
    }
}

/// Transfers moving bytes (setup over, not done) at one instant, per class.
#[derive(Debug, Clone, Copy)]
struct Active {
    demand: usize,
    background: usize,
}

/// Two-class processor-sharing model of one node's link (see the module docs). Time is modelled seconds
/// from any origin; it only moves forward (an earlier `now` is treated as the current time).
#[derive(Debug, Clone)]
pub struct LinkModel {
    params: LinkParams,
    now: f64,
    flows: BTreeMap<FlowId, Flow>,
    next_id: FlowId,
}

impl LinkModel {
    pub fn new(params: LinkParams) -> Self {
        Self {
            params,
            now: 0.0,
            flows: BTreeMap::new(),
            next_id: 0,
        }
    }

    pub fn params(&self) -> LinkParams {
        self.params
    }

    /// The model's current time (the latest `now` it was advanced to).
    pub fn now(&self) -> f64 {
        self.now
    }

    /// Registers a transfer of `bytes` of `class` starting at `now` (setup first).
    pub fn start(&mut self, now: f64, bytes: f64, class: TrafficClass) -> FlowId {
        self.advance(now);
        let id = self.next_id;
        self.next_id += 1;
        self.flows.insert(
            id,
            Flow {
                ready_at: self.now + self.params.setup_s,
                total: bytes.max(0.0),
                delivered: 0.0,
                class,
            },
        );
        id
    }

    /// Changes transfer `id` to `class` from `now` on (progress so far is kept; a setup still
    /// running keeps running). Background → demand is a promotion: a request now waits for the
    /// rest of a prefetch, which from then on shares the link like any demand transfer.
    fn set_class(&mut self, now: f64, id: FlowId, class: TrafficClass) {
        self.advance(now);
        if let Some(f) = self.flows.get_mut(&id) {
            f.class = class;
        }
    }

    /// Promotes transfer `id` to demand from `now` (see [`LinkModel::set_class`]).
    pub fn promote(&mut self, now: f64, id: FlowId) {
        self.set_class(now, id, TrafficClass::Demand);
    }

    /// Transfer `id`'s class.
    pub fn class(&self, id: FlowId) -> Option<TrafficClass> {
        self.flows.get(&id).map(|f| f.class)
    }

    /// Deregisters a transfer (finished or cancelled); its share goes to the others from `now`.
    pub fn remove(&mut self, now: f64, id: FlowId) {
        self.advance(now);
        self.flows.remove(&id);
    }

    /// Shrinks a transfer to `bytes` (fewer blocks than asked for arrived), from `now`.
    pub fn truncate(&mut self, now: f64, id: FlowId, bytes: f64) {
        self.advance(now);
        if let Some(f) = self.flows.get_mut(&id) {
            f.total = f.total.min(bytes.max(0.0));
            f.delivered = f.delivered.min(f.total);
        }
    }

    /// Bytes of transfer `id` delivered so far.
    pub fn delivered(&self, id: FlowId) -> Option<f64> {
        self.flows.get(&id).map(|f| f.delivered)
    }

    /// Transfers registered (in setup, moving, or finished but not yet removed).
    pub fn registered(&self) -> usize {
        self.flows.len()
    }

    /// Transfers past their setup and not done, per class, at the current time.
    fn active(&self) -> Active {
        let mut a = Active {
            demand: 0,
            background: 0,
        };
        for f in self.flows.values() {
            if f.ready_at <= self.now && !f.done() {
                match f.class {
                    TrafficClass::Demand => a.demand += 1,
                    TrafficClass::Background => a.background += 1,
                }
            }
        }
        a
    }

    /// Transfers moving bytes at the current time (they split the bandwidth): the demand ones,
    /// or, when there are none, the background ones.
    pub fn moving(&self) -> usize {
        let a = self.active();
        if a.demand > 0 { a.demand } else { a.background }
    }

    /// Background transfers past their setup that get no bandwidth right now (demand ones move).
    pub fn stalled(&self) -> usize {
        let a = self.active();
        if a.demand > 0 { a.background } else { 0 }
    }

    /// The share of the bandwidth a transfer of `class` past its setup gets with `a` active:
    /// strict priority between the classes, processor sharing within one. 0 for a stalled
    /// background transfer.
    fn rate_of(&self, a: Active, class: TrafficClass) -> f64 {
        let bw = self.params.bytes_per_sec;
        match class {
            TrafficClass::Demand => bw / a.demand.max(1) as f64,
            TrafficClass::Background if a.demand > 0 => 0.0,
            TrafficClass::Background => bw / a.background.max(1) as f64,
        }
    }

    /// When a moving transfer would finish at `rate` (> 0). `advance` and `next_event` use this
    /// one expression, so the transfer that defines the next event is recognised as done there
    /// exactly, with no tolerance (and no stall when `now` is large and the remaining time is
    /// below its float resolution).
    fn finish_at(now: f64, f: &Flow, rate: f64) -> f64 {
        now + (f.total - f.delivered) / rate
    }

    /// The next time the sharing changes on its own (a setup ends or a transfer finishes), if any.
    /// A stalled background transfer defines no event: the demand transfers it waits for do.
    fn next_event(&self) -> Option<f64> {
        let a = self.active();
        self.flows
            .values()
            .filter(|f| !f.done())
            .filter_map(|f| {
                if f.ready_at > self.now {
                    return Some(f.ready_at);
                }
                let rate = self.rate_of(a, f.class);
                (rate > 0.0).then(|| Self::finish_at(self.now, f, rate))
            })
            .min_by(f64::total_cmp)
    }

    /// Moves to event time `e`: every moving transfer progresses at its class's current rate,
    /// those whose finish is at or before `e` are done. A setup ending at `e` starts moving from
    /// there.
    fn step_to(&mut self, e: f64) {
        let now = self.now;
        let a = self.active();
        let (demand, background) = (
            self.rate_of(a, TrafficClass::Demand),
            self.rate_of(a, TrafficClass::Background),
        );
        let dt = (e - now).max(0.0);
        for f in self.flows.values_mut() {
            let rate = match f.class {
                TrafficClass::Demand => demand,
                TrafficClass::Background => background,
            };
            if f.ready_at <= now && !f.done() && rate > 0.0 {
                if Self::finish_at(now, f, rate) <= e {
                    f.delivered = f.total;
                } else {
                    f.delivered = (f.delivered + rate * dt).min(f.total);
                }
            }
        }
        self.now = now.max(e);
    }

    /// Moves every transfer's progress forward to `to`, event by event (each event finishes a
    /// transfer or ends a setup, so this takes at most two steps per transfer).
    pub fn advance(&mut self, to: f64) {
        loop {
            match self.next_event() {
                Some(e) if e <= to => self.step_to(e),
                _ => {
                    if to > self.now {
                        self.step_to(to);
                    }
                    return;
                }
            }
        }
    }

    /// When transfer `id` will have delivered `bytes` (its total at most), in modelled time,
    /// given the transfers registered now and no new ones (a start, removal, truncation or class
    /// change changes the answer: ask again). A transfer reaches 0 bytes when its setup ends.
    pub fn time_of(&self, id: FlowId, bytes: f64) -> Option<f64> {
        let mut m = self.clone();
        loop {
            let f = m.flows.get(&id)?;
            let target = bytes.min(f.total);
            if f.delivered >= target - 1e-9 * target.max(1.0) {
                return Some(m.now.max(f.ready_at));
            }
            let next = m.next_event();
            let rate = m.rate_of(m.active(), f.class);
            if f.ready_at <= m.now && rate > 0.0 {
                // Moving: at this rate it reaches `target` then, unless the sharing changes first.
                let own = m.now + (target - f.delivered) / rate;
                if next.is_none_or(|e| own <= e) {
                    return Some(own);
                }
            }
            // The sharing changes first (or the setup is still running, or it is a background
            // transfer stalled behind demand ones, whose finishes are events): step to that event.
            m.advance(next?);
        }
    }

    /// When transfer `id` will be done (see [`LinkModel::time_of`]).
    #[cfg(test)]
    fn finish_time(&self, id: FlowId) -> Option<f64> {
        let total = self.flows.get(&id)?.total;
        self.time_of(id, total)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    const D: TrafficClass = TrafficClass::Demand;
    const B: TrafficClass = TrafficClass::Background;

    /// 1 GB/s, 10 ms setup: a 100 MB transfer takes 110 ms alone.
    fn link() -> LinkModel {
        LinkModel::new(LinkParams {
            bytes_per_sec: 1e9,
            setup_s: 0.010,
        })
    }
    const MB100: f64 = 1e8;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-6
    }

    #[test]
    fn one_transfer_takes_setup_plus_bytes_over_bandwidth() {
        let mut l = link();
        let id = l.start(0.0, MB100, D);
        assert!(close(l.finish_time(id).unwrap(), 0.110));
        assert!(close(l.params().uncontended_s(MB100), 0.110));
        // Half way, measured by bytes.
        assert!(close(l.time_of(id, MB100 / 2.0).unwrap(), 0.060));
        l.advance(0.060);
        assert!(close(l.delivered(id).unwrap(), MB100 / 2.0));
    }

    /// Acceptance (issue 17): N equal concurrent transfers on one holder's link each take
    /// setup + N × bytes/bandwidth, i.e. N× the single transfer's time within the setup latency.
    #[test]
    fn n_equal_concurrent_transfers_each_take_n_times_as_long() {
        let single = link().params().uncontended_s(MB100);
        for n in [2usize, 4, 8] {
            let mut l = link();
            let ids: Vec<FlowId> = (0..n).map(|_| l.start(0.0, MB100, D)).collect();
            for id in ids {
                let t = l.finish_time(id).unwrap();
                assert!(close(t, 0.010 + n as f64 * 0.100), "n={n}: {t}");
                let setup = l.params().setup_s;
                assert!(
                    (t - n as f64 * single).abs() <= (n as f64 - 1.0) * setup + 1e-9,
                    "n={n}: {t} vs {}",
                    n as f64 * single
                );
            }
        }
    }

    /// Acceptance (issue 17): a pull limited by its consumer's link is slower when that consumer
    /// is also serving (ingress and egress share the node's link).
    #[test]
    fn a_pull_is_slower_when_its_consumer_is_also_serving() {
        let mut idle = link();
        let pull = idle.start(0.0, MB100, D);
        let alone = idle.finish_time(pull).unwrap();

        let mut busy = link();
        let _serving = busy.start(0.0, 4.0 * MB100, D);
        let pull = busy.start(0.0, MB100, D);
        let shared = busy.finish_time(pull).unwrap();
        assert!(close(alone, 0.110));
        assert!(close(shared, 0.210), "{shared}");
        assert!(shared > 1.5 * alone);
    }

    /// Rates are recomputed at every start and finish: a short transfer starting later finishes
    /// before a long one, and the long one speeds up again once it is alone.
    #[test]
    fn a_later_short_transfer_finishes_first_and_the_long_one_speeds_up_after() {
        let mut l = link();
        let long = l.start(0.0, 4.0 * MB100, D);
        assert!(close(l.finish_time(long).unwrap(), 0.410));
        let short = l.start(0.100, MB100, D);
        // Long moves 100 MB alone until 0.110; then both at 0.5 GB/s: short's 100 MB end at
        // 0.310, when long has 200 MB; long's last 200 MB alone -> 0.510.
        let s = l.finish_time(short).unwrap();
        let g = l.finish_time(long).unwrap();
        assert!(close(s, 0.310), "{s}");
        assert!(close(g, 0.510), "{g}");
        assert!(s < g);
        // The prediction made at the start holds when time actually passes.
        l.advance(0.310);
        assert!(close(l.delivered(short).unwrap(), MB100));
        l.remove(0.310, short);
        assert!(close(l.finish_time(long).unwrap(), 0.510));
    }

    /// A cancelled (dropped) transfer gives its share back at once.
    #[test]
    fn removing_a_transfer_gives_its_share_back() {
        let mut l = link();
        let a = l.start(0.0, MB100, D);
        let b = l.start(0.0, MB100, D);
        assert!(close(l.finish_time(a).unwrap(), 0.210));
        l.remove(0.060, b);
        assert_eq!(l.registered(), 1);
        // 25 MB by 0.060 at half rate; 75 MB left alone -> 0.135.
        assert!(close(l.finish_time(a).unwrap(), 0.135));
        assert_eq!(l.finish_time(b), None);
    }

    /// Truncating a pull to what arrived ends it early (fewer blocks than asked for).
    #[test]
    fn truncation_shortens_a_transfer() {
        let mut l = link();
        let a = l.start(0.0, MB100, D);
        l.truncate(0.020, a, MB100 / 10.0);
        assert!(close(l.finish_time(a).unwrap(), 0.020));
        let b = l.start(0.0, MB100, D);
        l.truncate(0.0, b, 0.0);
        assert!(close(l.finish_time(b).unwrap(), 0.030), "setup still ends");
    }

    /// Transfers in setup use no bandwidth.
    #[test]
    fn setup_uses_no_bandwidth() {
        let mut l = link();
        let a = l.start(0.0, MB100, D);
        let _b = l.start(0.105, MB100, D); // moving from 0.115, after `a` is done
        assert!(close(l.finish_time(a).unwrap(), 0.110));
        assert_eq!(l.moving(), 1);
    }

    /// A background transfer alone on the link runs at full speed (setup included).
    #[test]
    fn a_background_transfer_alone_runs_at_full_speed() {
        let mut l = link();
        let id = l.start(0.0, MB100, B);
        assert_eq!(l.class(id), Some(B));
        assert!(close(l.finish_time(id).unwrap(), 0.110));
        l.advance(0.060);
        assert!(close(l.delivered(id).unwrap(), MB100 / 2.0));
        assert_eq!((l.moving(), l.stalled()), (1, 0));
    }

    /// A demand transfer starting while a background one moves gets the whole link from the end
    /// of its setup (it takes exactly its uncontended time); the background one stalls meanwhile
    /// and resumes where it was once the demand transfer is done.
    #[test]
    fn a_demand_transfer_takes_the_whole_link_and_the_background_one_resumes_after() {
        let mut l = link();
        let bg = l.start(0.0, 4.0 * MB100, B);
        assert!(close(l.finish_time(bg).unwrap(), 0.410));
        let demand = l.start(0.100, MB100, D);
        // The demand setup uses no bandwidth: the prefetch keeps moving until 0.110 (100 MB).
        let d = l.finish_time(demand).unwrap();
        assert!(close(d, 0.100 + l.params().uncontended_s(MB100)), "{d}");
        // Stalled 0.110..0.210, then its last 300 MB alone.
        assert!(close(l.finish_time(bg).unwrap(), 0.510));
        assert!(close(l.time_of(bg, 1.5 * MB100).unwrap(), 0.260));
        l.advance(0.150);
        assert!(close(l.delivered(bg).unwrap(), MB100), "stalled");
        assert!(close(l.delivered(demand).unwrap(), 0.4 * MB100));
        assert_eq!((l.moving(), l.stalled()), (1, 1));
        l.advance(0.210);
        l.remove(0.210, demand);
        assert_eq!((l.moving(), l.stalled()), (1, 0));
        assert!(close(l.finish_time(bg).unwrap(), 0.510));
        l.advance(0.310);
        assert!(
            close(l.delivered(bg).unwrap(), 2.0 * MB100),
            "resumed at full speed"
        );
    }

    /// Demand transfers share among themselves as before; a background one waits for both.
    #[test]
    fn demand_transfers_share_and_background_ones_wait_for_all_of_them() {
        let mut l = link();
        let bg = l.start(0.0, MB100, B);
        let a = l.start(0.0, MB100, D);
        let b = l.start(0.0, MB100, D);
        assert!(close(l.finish_time(a).unwrap(), 0.210));
        assert!(close(l.finish_time(b).unwrap(), 0.210));
        assert!(close(l.finish_time(bg).unwrap(), 0.310));
        // Two background transfers alone share processor-fairly too.
        let mut l = link();
        let x = l.start(0.0, MB100, B);
        let y = l.start(0.0, MB100, B);
        assert!(close(l.finish_time(x).unwrap(), 0.210));
        assert!(close(l.finish_time(y).unwrap(), 0.210));
    }

    /// Setup is paid per transfer whatever the class: a background transfer's setup runs while a
    /// demand one moves (it uses no bandwidth), and a demand transfer in setup does not yet stall
    /// the background one.
    #[test]
    fn setup_is_paid_per_transfer_whatever_the_class() {
        let mut l = link();
        let a = l.start(0.0, MB100, D);
        let bg = l.start(0.0, MB100, B);
        // `bg`'s setup ended at 0.010 long before `a` is done: it moves right at 0.110.
        assert!(close(l.finish_time(bg).unwrap(), 0.210));
        assert!(close(l.finish_time(a).unwrap(), 0.110));
        let mut l = link();
        let bg = l.start(0.0, MB100, B);
        let d = l.start(0.050, MB100, D); // moving from 0.060
        l.advance(0.055);
        assert!(close(l.delivered(bg).unwrap(), 0.45 * MB100));
        assert!(close(l.finish_time(d).unwrap(), 0.160));
        assert!(close(l.finish_time(bg).unwrap(), 0.210));
    }

    /// Promotion: a background transfer stalled behind a demand one becomes demand at `now` and
    /// from there shares the link like any demand transfer; the projections follow the change.
    #[test]
    fn a_promoted_transfer_shares_like_any_demand_transfer() {
        let mut l = link();
        let a = l.start(0.0, 4.0 * MB100, D);
        let bg = l.start(0.0, MB100, B);
        assert!(close(l.finish_time(bg).unwrap(), 0.510), "after all of `a`");
        l.promote(0.110, bg);
        assert_eq!(l.class(bg), Some(D));
        assert_eq!((l.moving(), l.stalled()), (2, 0));
        // From 0.110 both at 0.5 GB/s: `bg`'s 100 MB end at 0.310, `a` has 200 MB left then.
        assert!(close(l.finish_time(bg).unwrap(), 0.310));
        assert!(close(l.finish_time(a).unwrap(), 0.510));
        assert!(close(l.time_of(bg, MB100 / 2.0).unwrap(), 0.210));
        // Demoting back is allowed by `set_class`: it stalls again from `now`.
        l.set_class(0.210, bg, B);
        assert!(close(l.delivered(bg).unwrap(), MB100 / 2.0));
        // `a` has 250 MB left alone (done 0.460), then `bg` its last 50 MB.
        assert!(close(l.finish_time(a).unwrap(), 0.460));
        assert!(close(l.finish_time(bg).unwrap(), 0.510));
        // Promoting a transfer still in setup: it is demand when its bytes start moving.
        let mut l = link();
        let a = l.start(0.0, MB100, D);
        let bg = l.start(0.0, MB100, B);
        l.promote(0.005, bg);
        assert!(close(l.finish_time(bg).unwrap(), 0.210));
        assert!(close(l.finish_time(a).unwrap(), 0.210));
        // Promoting an unknown or removed transfer is a no-op.
        l.remove(0.010, bg);
        l.promote(0.010, bg);
        assert_eq!(l.class(bg), None);
    }

    /// Far from the origin (a long run at a high time scale) the remaining time of a transfer can
    /// fall below the float resolution of `now`: the model still terminates and finishes it.
    #[test]
    fn a_late_clock_still_finishes_transfers() {
        let mut l = link();
        let t0 = 1e9;
        let ids: Vec<FlowId> = (0..5).map(|i| l.start(t0, MB100 + i as f64, D)).collect();
        let last = l.finish_time(ids[4]).unwrap();
        assert!((last - (t0 + 0.010 + 0.5)).abs() < 1e-5, "{last}");
        l.advance(last + 1.0);
        assert_eq!(l.moving(), 0);
        for id in ids {
            assert_eq!(l.delivered(id), l.flows.get(&id).map(|f| f.total));
        }
    }

    /// Random starts of both classes, removals, truncations and promotions: the link never
    /// carries more than its bandwidth, nothing is delivered beyond its total, background
    /// transfers get nothing while demand ones move, and every projection made holds when no
    /// change follows it.
    #[test]
    fn random_schedules_respect_the_bandwidth_and_the_projections() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 11) as f64 / (1u64 << 53) as f64
        };
        let mut l = link();
        let mut live: Vec<FlowId> = Vec::new();
        let mut now = 0.0;
        for _ in 0..1000 {
            let before: f64 = l.flows.values().map(|f| f.delivered).sum();
            let dt = rnd() * 0.05;
            let projected: Vec<(FlowId, f64)> = live
                .iter()
                .filter_map(|&id| Some((id, l.finish_time(id)?)))
                .collect();
            // Strict priority: while demand transfers move throughout the step (no event in it),
            // no background byte moves.
            let held = l.active().demand > 0 && l.next_event().is_none_or(|e| e > now + dt);
            let background = |l: &LinkModel| -> f64 {
                l.flows
                    .values()
                    .filter(|f| f.class == B)
                    .map(|f| f.delivered)
                    .sum()
            };
            let bg_before = background(&l);
            now += dt;
            l.advance(now);
            if held {
                assert_eq!(background(&l), bg_before, "background moved behind demand");
            }
            let after: f64 = l.flows.values().map(|f| f.delivered).sum();
            assert!(
                after - before <= 1e9 * dt * (1.0 + 1e-9) + 1e-3,
                "over bandwidth"
            );
            for (id, at) in projected {
                let f = &l.flows[&id];
                assert!(f.delivered <= f.total);
                assert_eq!(f.done(), at <= now, "projection {at} vs now {now}: {f:?}");
            }
            // Starts and removals balance, so a few dozen transfers share the link at a time
            // (each projection simulates the rest: quadratic in their number).
            match (rnd() * 5.0) as u32 {
                0 if live.len() < 40 => {
                    let class = if rnd() < 0.5 { D } else { B };
                    live.push(l.start(now, rnd() * 2.0 * MB100, class));
                }
                3 if !live.is_empty() => {
                    let id = live[(rnd() * live.len() as f64) as usize % live.len()];
                    l.promote(now, id);
                }
                1 if !live.is_empty() => {
                    let id = live.swap_remove((rnd() * live.len() as f64) as usize % live.len());
                    l.remove(now, id);
                }
                2 if !live.is_empty() => {
                    let id = live[(rnd() * live.len() as f64) as usize % live.len()];
                    l.truncate(now, id, rnd() * MB100);
                }
                _ => {}
            }
        }
    }

    /// A synthetic ladder generated from a known link (100 Gb/s, 5 ms) is fitted back to that
    /// link exactly, and ladders that cannot define a link are refused. (The fit of llm-d's
    /// published gpt-oss-120b ladder, within 15 % of each point, is tested in
    /// `compute::sim_link`.)
    #[test]
    fn the_fit_reproduces_a_linear_ladder_exactly() {
        let p = LinkParams::from_gbps_ms(100.0, 5.0);
        let ladder: Vec<(f64, f64)> = [1000.0, 4000.0, 16000.0]
            .iter()
            .map(|&t| (t, 1000.0 * p.uncontended_s(t * 1000.0)))
            .collect();
        let fit = fit_ladder(&ladder, 1000.0).unwrap();
        assert!((fit.gbps() - 100.0).abs() < 1e-6, "{fit:?}");
        assert!((fit.setup_s - 0.005).abs() < 1e-9);
        assert!(fit_ladder(&[(1.0, 1.0)], 1.0).is_none());
        assert!(fit_ladder(&[(1.0, 2.0), (2.0, 1.0)], 1.0).is_none());
    }
}
