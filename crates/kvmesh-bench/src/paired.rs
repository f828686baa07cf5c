//! Paired statistics for comparing two arms that served the same requests: exact percentiles,
//! the pairing of one arm's requests with the control's, a two-sided sign test and a percentile
//! bootstrap over sessions. Pure functions on plain data (no I/O); [`crate::repeat`] turns a
//! report's results into these inputs and renders them.
//!
//! Why paired: every arm of a workload sends the same sessions, so the same (run, session, step)
//! is the same request under two routers. Comparing request by request removes the variation
//! between requests (prompt length, arrival), which dominates a tail percentile of one run.

use std::collections::BTreeMap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::client::Outcome;
use crate::driver::RequestRecord;

/// Quantiles the report shows.
pub const QUANTILES: [f64; 3] = [0.5, 0.9, 0.99];

/// Relative TTFT change within which a pair counts as neither faster nor slower.
pub const WITHIN: f64 = 0.05;

/// Bootstrap resamples per comparison (fewer only for very large inputs, see [`resamples_for`]).
pub const RESAMPLES: usize = 1000;

/// Pair draws one bootstrap may make in all: bounds the work of a report write whatever the
/// number of pairs (≈ 3,000 pairs × 1,000 resamples fits; 100,000 pairs get 200 resamples).
const DRAW_BUDGET: usize = 4_000_000;

/// Index of the nearest-rank `q` quantile in a sorted slice of `n` values (the smallest value
/// with at least a fraction `q` of the values at or below it, as hdrhistogram reports it).
fn rank(n: usize, q: f64) -> usize {
    // The epsilon keeps 0.9 × 10 from rounding up to rank 10 through float error.
    let r = (q.clamp(0.0, 1.0) * n as f64 - 1e-9).ceil() as usize;
    r.clamp(1, n.max(1)) - 1
}

/// Nearest-rank `q` quantile of `values` (any order); None when empty.
pub fn percentile(values: &[f64], q: f64) -> Option<f64> {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(rank(v.len(), q)).copied()
}

/// Nearest-rank quantiles of `buf` for `qs` (ascending), reordering `buf` in place: linear
/// selections instead of a sort, since the bootstrap does this a thousand times per comparison.
fn select_quantiles(buf: &mut [f64], qs: &[f64]) -> Vec<f64> {
    let n = buf.len();
    if n == 0 {
        return Vec::new();
    }
    let mut out = vec![0.0; qs.len()];
    // From the highest rank down: after selecting rank k, everything left of k is ≤ it, so the
    // next (lower) rank is found in the left part alone.
    let mut end = n;
    for (i, &q) in qs.iter().enumerate().rev() {
        let k = rank(n, q).min(end.saturating_sub(1));
        let (_, v, _) = buf[..end].select_nth_unstable_by(k, f64::total_cmp);
        out[i] = *v;
        end = k + 1;
    }
    out
}

/// Median (the mean of the two middle values for an even count); None when empty.
pub fn median(values: &[f64]) -> Option<f64> {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => v.get(n / 2).copied(),
        _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

/// Two-sided exact sign test: the probability, if either arm were equally likely to be the
/// faster one, of a split at least as uneven as `faster` vs `slower` (ties are left out by the
/// caller). Exact binomial at any size: the terms are summed from their logarithms, so there is
/// no need for a normal approximation.
pub fn sign_test_p(faster: usize, slower: usize) -> f64 {
    let n = faster + slower;
    let k = faster.min(slower);
    if n == 0 {
        return 1.0;
    }
    // ln P(X = 0) = −n ln 2, then P(X = i + 1) = P(X = i) · (n − i) / (i + 1).
    let mut ln_term = -(n as f64) * std::f64::consts::LN_2;
    let mut tail = 0.0;
    for i in 0..=k {
        tail += ln_term.exp();
        ln_term += ((n - i) as f64).ln() - ((i + 1) as f64).ln();
    }
    (2.0 * tail).min(1.0)
}

/// Which request a TTFT belongs to, the same under every arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Key {
    /// Repeat index (0-based).
    pub run: u32,
    pub session: usize,
    pub step: usize,
}

impl Key {
    /// A request after its session's first (a returning turn in session workloads).
    pub fn returning(&self) -> bool {
        self.step > 0
    }
}

/// One request served by both the control and the arm (TTFTs in model seconds).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pair {
    pub key: Key,
    pub control_s: f64,
    pub arm_s: f64,
}

/// One run's records of an arm, with the time scale that converts them to model time.
#[derive(Debug, Clone, Copy)]
pub struct RunRecords<'a> {
    pub run: u32,
    pub time_scale: f64,
    pub records: &'a [RequestRecord],
}

/// The successful requests' TTFTs in model seconds (wall × time scale, as every report table).
pub fn ok_ttfts<'a>(runs: &'a [RunRecords<'a>]) -> impl Iterator<Item = (Key, f64)> + 'a {
    runs.iter().flat_map(|r| {
        let ts = crate::stats::usable_time_scale(r.time_scale);
        r.records
            .iter()
            .filter(|x| x.outcome == Outcome::Ok)
            .filter_map(move |x| {
                let t = x.ttft_s?;
                t.is_finite().then_some((
                    Key {
                        run: r.run,
                        session: x.session,
                        step: x.step,
                    },
                    t * ts,
                ))
            })
    })
}

/// Pairs the arm's requests with the control's by (run, session, step). Requests that failed
/// (or had no first token) on either side, and keys only one side has, are left out. A key seen
/// twice on one side is ambiguous and left out too.
pub fn pair(control: &[RunRecords<'_>], arm: &[RunRecords<'_>]) -> Vec<Pair> {
    fn by_key(it: impl Iterator<Item = (Key, f64)>) -> BTreeMap<Key, Option<f64>> {
        let mut m = BTreeMap::new();
        for (k, t) in it {
            m.entry(k).and_modify(|v| *v = None).or_insert(Some(t));
        }
        m
    }
    let c = by_key(ok_ttfts(control));
    let a = by_key(ok_ttfts(arm));
    c.iter()
        .filter_map(|(k, ct)| {
            let at = a.get(k).copied().flatten()?;
            Some(Pair {
                key: *k,
                control_s: (*ct)?,
                arm_s: at,
            })
        })
        .collect()
}

/// Resamples for `n` pairs: [`RESAMPLES`], fewer when that would exceed the draw budget.
fn resamples_for(n: usize) -> usize {
    (DRAW_BUDGET / n.max(1)).clamp(200, RESAMPLES)
}

/// Percentile-bootstrap 95 % intervals of (arm's `q` quantile − control's), one per quantile
/// in `qs` (ascending), over the pairs' sessions: a resample draws, within each run, as many
/// sessions as the run has, with replacement, and a drawn session brings all its pairs (a
/// session's turns share a history and a placement, so they are not independent). None with
/// fewer than two sessions.
fn bootstrap_diffs(
    pairs: &[Pair],
    qs: &[f64],
    resamples: usize,
    seed: u64,
) -> Vec<Option<(f64, f64)>> {
    // run → its sessions → their pairs (control, arm).
    let mut runs: BTreeMap<u32, BTreeMap<usize, Vec<(f64, f64)>>> = BTreeMap::new();
    for p in pairs {
        runs.entry(p.key.run)
            .or_default()
            .entry(p.key.session)
            .or_default()
            .push((p.control_s, p.arm_s));
    }
    let strata: Vec<Vec<Vec<(f64, f64)>>> = runs
        .into_values()
        .map(|sessions| sessions.into_values().collect())
        .collect();
    let clusters: usize = strata.iter().map(Vec::len).sum();
    if clusters < 2 || resamples == 0 {
        return vec![None; qs.len()];
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut diffs: Vec<Vec<f64>> = vec![Vec::with_capacity(resamples); qs.len()];
    let (mut c, mut a) = (Vec::with_capacity(pairs.len()), Vec::new());
    for _ in 0..resamples {
        c.clear();
        a.clear();
        for sessions in &strata {
            for _ in 0..sessions.len() {
                let s = &sessions[rng.random_range(0..sessions.len())];
                c.extend(s.iter().map(|p| p.0));
                a.extend(s.iter().map(|p| p.1));
            }
        }
        let (cq, aq) = (select_quantiles(&mut c, qs), select_quantiles(&mut a, qs));
        for (i, d) in diffs.iter_mut().enumerate() {
            if let (Some(x), Some(y)) = (aq.get(i), cq.get(i)) {
                d.push(x - y);
            }
        }
    }
    diffs
        .into_iter()
        .map(|d| Some((percentile(&d, 0.025)?, percentile(&d, 0.975)?)))
        .collect()
}

/// One pooled quantile of both sides of the pairs and its difference.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QuantileDiff {
    pub quantile: f64,
    pub control_ms: f64,
    pub arm_ms: f64,
    /// arm − control.
    pub diff_ms: f64,
    /// Bootstrap 95 % interval of `diff_ms` (None with fewer than two sessions).
    pub ci95_ms: Option<(f64, f64)>,
}

/// What the pairs of one comparison say (all times model milliseconds).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PairedStats {
    pub pairs: usize,
    /// Sessions (per run) the pairs come from: the bootstrap's unit.
    pub sessions: usize,
    /// Pairs where the arm's TTFT was more than [`WITHIN`] of the control's below it...
    pub faster: usize,
    /// ...above it...
    pub slower: usize,
    /// ...or neither.
    pub within: usize,
    /// Two-sided sign test of `faster` vs `slower`.
    pub sign_test_p: f64,
    /// Median of arm − control over the pairs.
    pub median_diff_ms: Option<f64>,
    /// Median of arm ÷ control (pairs with a positive control TTFT).
    pub median_ratio: Option<f64>,
    /// Pooled p50, p90, p99 of both sides and their differences.
    pub quantiles: Vec<QuantileDiff>,
    /// Bootstrap resamples behind the intervals.
    pub resamples: usize,
}

impl PairedStats {
    /// Summarises `pairs`; `seed` makes the bootstrap reproducible.
    pub fn from_pairs(pairs: &[Pair], seed: u64) -> Self {
        let (mut faster, mut slower) = (0, 0);
        for p in pairs {
            let margin = WITHIN * p.control_s;
            if p.control_s - p.arm_s > margin {
                faster += 1;
            } else if p.arm_s - p.control_s > margin {
                slower += 1;
            }
        }
        let diffs: Vec<f64> = pairs
            .iter()
            .map(|p| (p.arm_s - p.control_s) * 1e3)
            .collect();
        let ratios: Vec<f64> = pairs
            .iter()
            .filter(|p| p.control_s > 0.0)
            .map(|p| p.arm_s / p.control_s)
            .collect();
        let sessions = pairs
            .iter()
            .map(|p| (p.key.run, p.key.session))
            .collect::<std::collections::BTreeSet<_>>()
            .len();
        let resamples = resamples_for(pairs.len());
        let cis = bootstrap_diffs(pairs, &QUANTILES, resamples, seed);
        let control: Vec<f64> = pairs.iter().map(|p| p.control_s).collect();
        let arm: Vec<f64> = pairs.iter().map(|p| p.arm_s).collect();
        let quantiles = QUANTILES
            .iter()
            .zip(cis)
            .filter_map(|(&q, ci)| {
                let (c, a) = (percentile(&control, q)?, percentile(&arm, q)?);
                Some(QuantileDiff {
                    quantile: q,
                    control_ms: c * 1e3,
                    arm_ms: a * 1e3,
                    diff_ms: (a - c) * 1e3,
                    ci95_ms: ci.map(|(lo, hi)| (lo * 1e3, hi * 1e3)),
                })
            })
            .collect();
        Self {
            pairs: pairs.len(),
            sessions,
            faster,
            slower,
            within: pairs.len() - faster - slower,
            sign_test_p: sign_test_p(faster, slower),
            median_diff_ms: median(&diffs),
            median_ratio: median(&ratios),
            quantiles,
            resamples: if sessions >= 2 { resamples } else { 0 },
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::workload::StepKind;

    fn rec(session: usize, step: usize, ttft: Option<f64>, outcome: Outcome) -> RequestRecord {
        RequestRecord {
            session,
            step,
            kind: StepKind::Turn,
            prompt_tokens: 100,
            novel_tokens: None,
            sent_s: 0.0,
            ttft_s: ttft,
            e2e_s: 1.0,
            output_tokens: 4,
            cached_tokens: None,
            outcome,
        }
    }

    /// `sessions` sessions of `steps` pairs per run, control TTFTs spread 0.1–1.0 s, the arm's
    /// = f(control, index).
    fn pairs(runs: u32, sessions: usize, steps: usize, f: impl Fn(f64, usize) -> f64) -> Vec<Pair> {
        let mut out = Vec::new();
        let mut i = 0;
        for run in 0..runs {
            for session in 0..sessions {
                for step in 0..steps {
                    let c = 0.1 + 0.9 * ((i * 37) % 101) as f64 / 100.0;
                    out.push(Pair {
                        key: Key { run, session, step },
                        control_s: c,
                        arm_s: f(c, i),
                    });
                    i += 1;
                }
            }
        }
        out
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=1000).rev().map(|i| i as f64).collect();
        assert_eq!(percentile(&v, 0.5), Some(500.0));
        assert_eq!(percentile(&v, 0.9), Some(900.0));
        assert_eq!(percentile(&v, 0.99), Some(990.0));
        assert_eq!(percentile(&v, 1.0), Some(1000.0));
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        let ten: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile(&ten, 0.9), Some(9.0));
        assert_eq!(percentile(&[], 0.5), None);
        assert_eq!(percentile(&[3.0], 0.99), Some(3.0));
        // The selection the bootstrap uses agrees with the sort.
        let mut scrambled: Vec<f64> = (0..997).map(|i| ((i * 389) % 997) as f64).collect();
        let expect: Vec<f64> = QUANTILES
            .iter()
            .map(|&q| percentile(&scrambled, q).unwrap())
            .collect();
        assert_eq!(select_quantiles(&mut scrambled, &QUANTILES), expect);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[5.0, 1.0, 3.0]), Some(3.0));
        assert_eq!(median(&[]), None);
    }

    #[test]
    fn sign_test_matches_the_binomial() {
        // n = 10, 1 vs 9: 2 · (1 + 10) / 1024.
        assert!((sign_test_p(1, 9) - 22.0 / 1024.0).abs() < 1e-12);
        assert!((sign_test_p(9, 1) - 22.0 / 1024.0).abs() < 1e-12);
        // n = 20, 5 vs 15: 2 · (1 + 20 + 190 + 1140 + 4845 + 15504) / 2^20.
        assert!((sign_test_p(5, 15) - 2.0 * 21700.0 / 1_048_576.0).abs() < 1e-12);
        // n = 6, 0 vs 6: 2 / 64.
        assert!((sign_test_p(0, 6) - 2.0 / 64.0).abs() < 1e-12);
        assert_eq!(sign_test_p(5, 5), 1.0);
        assert_eq!(sign_test_p(0, 0), 1.0);
        assert_eq!(sign_test_p(0, 1), 1.0);
        // Large n: 450 vs 550 of 1000; the exact value is 0.00173 (normal approx. with
        // continuity correction: 0.00176).
        let p = sign_test_p(450, 550);
        assert!((p - 0.001731).abs() < 2e-5, "{p}");
        // Far tails do not underflow to nonsense.
        let tiny = sign_test_p(0, 3000);
        assert!((0.0..1e-300).contains(&tiny), "{tiny}");
        assert!(sign_test_p(1400, 1600) < sign_test_p(1450, 1550));
    }

    #[test]
    fn pairing_skips_failed_requests_and_unmatched_keys() {
        let control = [
            rec(0, 0, Some(1.0), Outcome::Ok),
            rec(0, 1, Some(2.0), Outcome::Ok),
            rec(1, 0, Some(3.0), Outcome::Error("500".into())),
            rec(1, 1, Some(4.0), Outcome::Ok),
            rec(2, 0, Some(5.0), Outcome::Ok), // the arm has no session 2
            rec(3, 0, None, Outcome::Ok),      // no first token
        ];
        let arm = [
            rec(0, 0, Some(0.5), Outcome::Ok),
            rec(0, 1, Some(2.5), Outcome::Timeout),
            rec(1, 0, Some(3.5), Outcome::Ok),
            rec(1, 1, Some(4.5), Outcome::Ok),
            rec(3, 0, Some(1.0), Outcome::Ok),
            rec(9, 0, Some(1.0), Outcome::Ok), // the control has no session 9
        ];
        // Run 1 holds the same requests again, the arm's at time scale 2 (model = wall × 2).
        let c = [
            RunRecords {
                run: 0,
                time_scale: 1.0,
                records: &control,
            },
            RunRecords {
                run: 1,
                time_scale: 1.0,
                records: &control[..1],
            },
        ];
        let a = [
            RunRecords {
                run: 0,
                time_scale: 1.0,
                records: &arm,
            },
            RunRecords {
                run: 1,
                time_scale: 2.0,
                records: &arm[..1],
            },
        ];
        let p = pair(&c, &a);
        let keys: Vec<(u32, usize, usize)> = p
            .iter()
            .map(|p| (p.key.run, p.key.session, p.key.step))
            .collect();
        assert_eq!(keys, vec![(0, 0, 0), (0, 1, 1), (1, 0, 0)]);
        assert_eq!((p[1].control_s, p[1].arm_s), (4.0, 4.5));
        assert_eq!(p[2].arm_s, 1.0);
        assert!(!p[0].key.returning() && p[1].key.returning());
        // A key twice on one side is ambiguous: dropped.
        let twice = [
            rec(0, 0, Some(1.0), Outcome::Ok),
            rec(0, 0, Some(1.1), Outcome::Ok),
        ];
        let t = [RunRecords {
            run: 0,
            time_scale: 1.0,
            records: &twice,
        }];
        assert!(pair(&t, &a[..1]).is_empty());
    }

    #[test]
    fn counts_faster_slower_and_within() {
        // Control 1 s each; the arm 0.5 (faster), 0.96 and 1.04 (within 5 %), 1.5 and 2 (slower).
        let p: Vec<Pair> = [0.5, 0.96, 1.04, 1.5, 2.0]
            .iter()
            .enumerate()
            .map(|(i, &a)| Pair {
                key: Key {
                    run: 0,
                    session: i,
                    step: 0,
                },
                control_s: 1.0,
                arm_s: a,
            })
            .collect();
        let s = PairedStats::from_pairs(&p, 1);
        assert_eq!((s.pairs, s.faster, s.within, s.slower), (5, 1, 2, 2));
        assert!((s.median_diff_ms.unwrap() - 40.0).abs() < 1e-9);
        assert!((s.median_ratio.unwrap() - 1.04).abs() < 1e-12);
        assert!((s.sign_test_p - 1.0).abs() < 1e-12);
        assert_eq!(s.sessions, 5);
        assert_eq!(s.quantiles.len(), 3);
        assert!((s.quantiles[0].diff_ms - 40.0).abs() < 1e-9);
    }

    #[test]
    fn a_clear_shift_excludes_zero_and_no_change_contains_it() {
        // 3 runs × 40 sessions × 8 steps; the arm is 200 ms slower on every request.
        let slower = pairs(3, 40, 8, |c, _| c + 0.2);
        let s = PairedStats::from_pairs(&slower, 7);
        assert_eq!((s.pairs, s.sessions, s.resamples), (960, 120, RESAMPLES));
        assert_eq!(s.slower, 960);
        assert!(s.sign_test_p < 1e-100);
        for q in &s.quantiles {
            let (lo, hi) = q.ci95_ms.unwrap();
            assert!(lo > 0.0 && lo <= q.diff_ms && q.diff_ms <= hi, "{q:?}");
            assert!((q.diff_ms - 200.0).abs() < 1e-6, "{q:?}");
        }
        // Identical samples: every resample's difference is 0.
        let same = pairs(3, 40, 8, |c, _| c);
        let s = PairedStats::from_pairs(&same, 7);
        assert_eq!((s.faster, s.slower, s.within), (0, 0, 960));
        for q in &s.quantiles {
            assert_eq!(q.ci95_ms, Some((0.0, 0.0)));
        }
        // Noise without a shift (the arm's TTFT is another draw from the same spread): the
        // intervals contain 0 and the sign test sees nothing.
        let noise = pairs(3, 40, 8, |_, i| {
            0.1 + 0.9 * ((i * 53 + 11) % 101) as f64 / 100.0
        });
        let s = PairedStats::from_pairs(&noise, 7);
        for q in &s.quantiles[..2] {
            let (lo, hi) = q.ci95_ms.unwrap();
            assert!(lo <= 0.0 && 0.0 <= hi, "{q:?}");
        }
        assert!(s.sign_test_p > 0.05, "{}", s.sign_test_p);
    }

    #[test]
    fn the_bootstrap_is_seeded_and_moves_whole_sessions() {
        let p = pairs(2, 10, 5, |c, i| c + if i % 3 == 0 { 0.3 } else { -0.1 });
        let a = bootstrap_diffs(&p, &QUANTILES, 300, 42);
        assert_eq!(a, bootstrap_diffs(&p, &QUANTILES, 300, 42));
        assert_ne!(a, bootstrap_diffs(&p, &QUANTILES, 300, 43));
        // One session (a single cluster) cannot be resampled into an interval.
        let one = pairs(1, 1, 20, |c, _| c + 0.1);
        assert_eq!(bootstrap_diffs(&one, &QUANTILES, 100, 1), vec![None; 3]);
        // Sessions that are each internally constant but differ between sessions: resampling
        // whole sessions gives a wider p50 interval than 50 single-request sessions would.
        let clustered: Vec<Pair> = (0..50)
            .map(|i| Pair {
                key: Key {
                    run: 0,
                    session: i / 10,
                    step: i % 10,
                },
                control_s: 1.0,
                arm_s: 1.0 + 0.1 * (i / 10) as f64,
            })
            .collect();
        let spread: Vec<Pair> = clustered
            .iter()
            .enumerate()
            .map(|(i, p)| Pair {
                key: Key {
                    run: 0,
                    session: i,
                    step: 0,
                },
                ..*p
            })
            .collect();
        let width = |p: &[Pair]| {
            let (lo, hi) = bootstrap_diffs(p, &[0.5], 500, 3)[0].unwrap();
            hi - lo
        };
        assert!(
            width(&clustered) > width(&spread),
            "{} vs {}",
            width(&clustered),
            width(&spread)
        );
    }

    #[test]
    fn work_is_bounded() {
        assert_eq!(resamples_for(3_000), RESAMPLES);
        assert_eq!(resamples_for(100_000), 200);
        assert_eq!(resamples_for(0), RESAMPLES);
    }
}
