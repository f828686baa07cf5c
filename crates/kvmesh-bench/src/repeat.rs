//! Report sections for `kvmesh bench --repeat N` and for the paired comparison of every arm
//! with the control (the first arm of `--arms`): "Repeated runs" pools each arm's requests over
//! its runs and shows how far single runs strayed; "Paired against the control" matches each
//! arm's requests with the control's ([`crate::paired`]) so that a difference in the tail can be
//! told from the noise between fresh fleets.
//!
//! Arms are told apart by their position in `--arms` (a result's position among its workload's
//! results of the same run), not by name, so an arm listed twice (`--arms ttft,ttft`, an A/A
//! test) is compared with itself rather than merged.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::arm_result::ArmResult;
use crate::paired::{PairedStats, QUANTILES, RunRecords, ok_ttfts, pair, percentile};
use crate::stats::fmt_ms;

/// One arm of `--arms` on one workload, with its runs in run order.
pub struct Slot<'a> {
    /// The arm's name, with `#k` when the same arm is listed more than once.
    pub label: String,
    pub runs: Vec<&'a ArmResult>,
}

impl Slot<'_> {
    fn run_records(&self) -> Vec<RunRecords<'_>> {
        self.runs
            .iter()
            .map(|r| RunRecords {
                run: r.run,
                time_scale: r.time_scale,
                records: &r.records,
            })
            .collect()
    }
}

/// Per workload (in first-seen order), its arms in `--arms` order.
pub fn slots(results: &[ArmResult]) -> Vec<(String, Vec<Slot<'_>>)> {
    // Per workload, (arm name, its runs) in `--arms` order.
    type Arms<'a> = Vec<(&'a str, Vec<&'a ArmResult>)>;
    let mut out: Vec<(String, Arms<'_>)> = Vec::new();
    for r in results {
        let i = match out.iter().position(|(w, _)| *w == r.workload) {
            Some(i) => i,
            None => {
                out.push((r.workload.clone(), Vec::new()));
                out.len() - 1
            }
        };
        let Some((_, arms)) = out.get_mut(i) else {
            continue;
        };
        // The runner runs every arm of a round in `--arms` order, so a result's position
        // among the results of its workload and run is its arm's position.
        let position = arms
            .iter()
            .filter(|(_, runs)| runs.iter().any(|x| x.run == r.run))
            .count();
        let at_position =
            arms.len() == position || arms.get(position).is_some_and(|(name, _)| *name == r.arm);
        if at_position {
            match arms.get_mut(position) {
                Some((_, runs)) => runs.push(r),
                None => arms.push((&r.arm, vec![r])),
            }
        } else {
            // Not in round order (a hand-edited report): the first slot of the same name
            // without this run, else a slot of its own.
            match arms
                .iter_mut()
                .find(|(name, runs)| *name == r.arm && runs.iter().all(|x| x.run != r.run))
            {
                Some((_, runs)) => runs.push(r),
                None => arms.push((&r.arm, vec![r])),
            }
        }
    }
    out.into_iter()
        .map(|(w, arms)| {
            let names: Vec<&str> = arms.iter().map(|a| a.0).collect();
            let slots = arms
                .iter()
                .enumerate()
                .map(|(i, (name, runs))| {
                    let seen = names[..i].iter().filter(|n| *n == name).count();
                    let twice = names.iter().filter(|n| *n == name).count() > 1;
                    Slot {
                        label: if twice {
                            format!("{name} #{}", seen + 1)
                        } else {
                            (*name).to_owned()
                        },
                        runs: runs.clone(),
                    }
                })
                .collect();
            (w, slots)
        })
        .collect()
}

/// One arm against the control on one workload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PairedComparison {
    pub workload: String,
    /// The control arm (the first of `--arms`).
    pub control: String,
    pub arm: String,
    /// Runs that contributed pairs.
    pub runs: usize,
    /// Every pair.
    pub all: PairedStats,
    /// Pairs after a session's first request (returning turns); None when there are none.
    pub returning: Option<PairedStats>,
}

/// Every arm of every workload with at least two arms, against its control.
pub fn paired_comparisons(results: &[ArmResult], seed: u64) -> Vec<PairedComparison> {
    let mut out = Vec::new();
    for (workload, slots) in slots(results) {
        let Some((control, rest)) = slots.split_first() else {
            continue;
        };
        let c = control.run_records();
        for (i, slot) in rest.iter().enumerate() {
            let pairs = pair(&c, &slot.run_records());
            let returning: Vec<_> = pairs
                .iter()
                .copied()
                .filter(|p| p.key.returning())
                .collect();
            // Each comparison its own reproducible stream.
            let s = crate::workload::key(&[70, seed, out.len() as u64, i as u64]);
            out.push(PairedComparison {
                workload: workload.clone(),
                control: control.label.clone(),
                arm: slot.label.clone(),
                runs: pairs
                    .iter()
                    .map(|p| p.key.run)
                    .collect::<BTreeSet<_>>()
                    .len(),
                all: PairedStats::from_pairs(&pairs, s),
                returning: (!returning.is_empty())
                    .then(|| PairedStats::from_pairs(&returning, s ^ 1)),
            });
        }
    }
    out
}

/// Pooled quantiles over every run and each run's own, for one set of TTFTs.
struct Pooled {
    count: usize,
    pooled: Vec<f64>,
    /// Per quantile, (min, max) over the runs that had values; None unless two runs had.
    range: Vec<Option<(f64, f64)>>,
}

fn pooled(per_run: &[Vec<f64>]) -> Pooled {
    let all: Vec<f64> = per_run.iter().flatten().copied().collect();
    let pooled = QUANTILES
        .iter()
        .filter_map(|&q| percentile(&all, q))
        .collect();
    let with_values = per_run.iter().filter(|v| !v.is_empty()).count();
    let range = QUANTILES
        .iter()
        .map(|&q| {
            if with_values < 2 {
                return None;
            }
            per_run.iter().filter_map(|v| percentile(v, q)).fold(
                None,
                |acc: Option<(f64, f64)>, x| {
                    Some(acc.map_or((x, x), |(lo, hi)| (lo.min(x), hi.max(x))))
                },
            )
        })
        .collect();
    Pooled {
        count: all.len(),
        pooled,
        range,
    }
}

/// Successful requests' TTFTs of one run in model seconds, all or only returning ones.
fn ttfts(r: &ArmResult, returning_only: bool) -> Vec<f64> {
    let run = [RunRecords {
        run: r.run,
        time_scale: r.time_scale,
        records: &r.records,
    }];
    ok_ttfts(&run)
        .filter(|(key, _)| !returning_only || key.returning())
        .map(|(_, t)| t)
        .collect()
}

fn cells(p: &Pooled) -> String {
    if p.count == 0 {
        return " — | — | — |".into();
    }
    let mut s = String::new();
    for (v, range) in p.pooled.iter().zip(&p.range) {
        // The range even when the runs agreed: "(69–69 ms)" says they did.
        match range {
            Some((lo, hi)) => {
                let _ = write!(s, " {} ({:.0}–{}) |", fmt_ms(*v), lo * 1e3, fmt_ms(*hi));
            }
            _ => {
                let _ = write!(s, " {} |", fmt_ms(*v));
            }
        }
    }
    s
}

/// The "Repeated runs" section; empty unless some arm ran more than once.
pub fn repeated_markdown(results: &[ArmResult]) -> String {
    let workloads = slots(results);
    if !workloads
        .iter()
        .any(|(_, slots)| slots.iter().any(|s| s.runs.len() > 1))
    {
        return String::new();
    }
    let mut s = String::from(
        "\n### Repeated runs\n\nEach arm's successful requests pooled over its runs (each run on a \
         fresh fleet, arms interleaved round by round); TTFT in model time, nearest-rank \
         percentiles, in brackets the lowest and highest value of single runs. Returning: \
         requests after their session's first (an agent's or a conversation's later turns).\n",
    );
    for (workload, slots) in &workloads {
        let _ = writeln!(s, "\n**{workload}: repeated runs**\n");
        s.push_str("| arm | runs | requests pooled (ok / sent) | TTFT p50 | TTFT p90 | TTFT p99 | returning pooled | returning p50 | returning p90 | returning p99 |\n");
        s.push_str("|---|---|---|---|---|---|---|---|---|---|\n");
        for slot in slots {
            let all: Vec<Vec<f64>> = slot.runs.iter().map(|r| ttfts(r, false)).collect();
            let ret: Vec<Vec<f64>> = slot.runs.iter().map(|r| ttfts(r, true)).collect();
            let (all, ret) = (pooled(&all), pooled(&ret));
            let sent: usize = slot.runs.iter().map(|r| r.records.len()).sum();
            let _ = writeln!(
                s,
                "| `{}` | {} | {} / {} |{} {} |{}",
                slot.label,
                slot.runs.len(),
                all.count,
                sent,
                cells(&all),
                ret.count,
                cells(&ret),
            );
        }
    }
    s
}

fn signed_ms(v: f64) -> String {
    // A true minus sign, as elsewhere in the docs; "+0" for a zero difference.
    if v < -0.5 {
        format!("−{:.0}", -v)
    } else {
        format!("+{:.0}", v.max(0.0))
    }
}

fn p_value(p: f64) -> String {
    if p < 0.001 {
        "< 0.001".into()
    } else {
        format!("{p:.3}")
    }
}

fn stats_row(s: &mut String, arm: &str, which: &str, st: &PairedStats) {
    let _ = write!(
        s,
        "| `{arm}` | {which} | {} ({}) | {} / {} / {} | {} | {} | {} |",
        st.pairs,
        st.sessions,
        st.faster,
        st.within,
        st.slower,
        p_value(st.sign_test_p),
        st.median_diff_ms
            .map_or("—".into(), |d| format!("{} ms", signed_ms(d))),
        st.median_ratio.map_or("—".into(), |r| format!("{r:.2}")),
    );
    for i in 0..QUANTILES.len() {
        match st.quantiles.get(i) {
            Some(q) => {
                let ci = q.ci95_ms.map_or(String::new(), |(lo, hi)| {
                    format!(" [{}, {}]", signed_ms(lo), signed_ms(hi))
                });
                let _ = write!(
                    s,
                    " {} ms{ci} ({:.0} → {:.0}) |",
                    signed_ms(q.diff_ms),
                    q.control_ms,
                    q.arm_ms
                );
            }
            None => s.push_str(" — |"),
        }
    }
    s.push('\n');
}

/// The "Paired against the control" section; empty when no workload has two arms.
pub fn paired_markdown(comparisons: &[PairedComparison]) -> String {
    if comparisons.is_empty() {
        return String::new();
    }
    let resamples = comparisons
        .iter()
        .map(|c| c.all.resamples)
        .max()
        .unwrap_or(0);
    let mut s = format!(
        "\n### Paired against the control\n\nThe control is the first arm of `--arms`. A pair is \
         one request — the same run, session and step — that succeeded under both the control \
         and the arm. Faster / slower: the arm's TTFT more than {:.0} % of the control's below / \
         above it; p: two-sided exact sign test of faster against slower. Δ = arm − control in \
         model ms: the median of the pairs' differences, and the difference of the pairs' pooled \
         percentiles with a 95 % bootstrap interval (sessions resampled within each run, a \
         session's requests together; {resamples} resamples, seeded) and, in brackets, the \
         control's and the arm's pooled value. The bootstrap resamples sessions, not fleets: \
         with few runs, check the per-run ranges of *Repeated runs* too.\n",
        crate::paired::WITHIN * 100.0
    );
    let mut workloads: Vec<&str> = comparisons.iter().map(|c| c.workload.as_str()).collect();
    workloads.dedup();
    for w in workloads {
        let here: Vec<&PairedComparison> = comparisons.iter().filter(|c| c.workload == w).collect();
        let control = here.first().map_or("", |c| c.control.as_str());
        let _ = writeln!(s, "\n**{w}: paired against the control `{control}`**\n");
        s.push_str("| arm | requests | pairs (sessions) | faster / within / slower | sign test p | median Δ | median ratio | Δ p50 [95 % CI] (control → arm) | Δ p90 [95 % CI] | Δ p99 [95 % CI] |\n");
        s.push_str("|---|---|---|---|---|---|---|---|---|---|\n");
        for c in here {
            stats_row(&mut s, &c.arm, "all", &c.all);
            if let Some(r) = &c.returning {
                stats_row(&mut s, &c.arm, "returning", r);
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::client::Outcome;
    use crate::driver::RequestRecord;
    use crate::fleet::FleetSpec;
    use crate::workload::StepKind;

    /// 20 sessions × 3 steps; TTFT (wall) = base + per-session offset, time scale 2.
    fn result(arm: &str, run: u32, base: f64) -> ArmResult {
        let mut records = Vec::new();
        for session in 0..20 {
            for step in 0..3 {
                records.push(RequestRecord {
                    session,
                    step,
                    kind: StepKind::Turn,
                    prompt_tokens: 100,
                    novel_tokens: None,
                    sent_s: session as f64,
                    ttft_s: Some(base + 0.01 * session as f64 + 0.001 * step as f64),
                    e2e_s: 1.0,
                    output_tokens: 4,
                    cached_tokens: None,
                    outcome: if session == 0 && step == 1 {
                        Outcome::Timeout
                    } else {
                        Outcome::Ok
                    },
                });
            }
        }
        ArmResult {
            workload: "agentic".into(),
            workload_description: "test".into(),
            arm: arm.into(),
            run,
            pulls: false,
            time_scale: 2.0,
            fleet: FleetSpec::from_yaml("engines:\n  - count: 4\n").unwrap(),
            bound_ttft: None,
            stats: Default::default(),
            evidence: Default::default(),
            prefill_external_hit_tokens: 0.0,
            flags: Vec::new(),
            records,
            router_version: None,
            audit: None,
            prefetch: None,
            restart: None,
            scale_out: None,
            replication: None,
        }
    }

    #[test]
    fn interleaved_runs_are_grouped_by_arm_position() {
        // Round 1 then round 2, the same arm listed twice (A/A) next to another.
        let results = vec![
            result("ttft", 0, 0.1),
            result("ttft", 0, 0.1),
            result("ttft-p2p", 0, 0.05),
            result("ttft", 1, 0.2),
            result("ttft", 1, 0.2),
            result("ttft-p2p", 1, 0.1),
        ];
        let w = slots(&results);
        assert_eq!(w.len(), 1);
        let labels: Vec<&str> = w[0].1.iter().map(|s| s.label.as_str()).collect();
        assert_eq!(labels, vec!["ttft #1", "ttft #2", "ttft-p2p"]);
        assert!(w[0].1.iter().all(|s| s.runs.len() == 2));
        assert_eq!(w[0].1[2].runs[1].run, 1);

        let c = paired_comparisons(&results, 1);
        assert_eq!(c.len(), 2);
        // A/A: all within, zero difference.
        assert_eq!((c[0].arm.as_str(), c[0].all.within), ("ttft #2", 118));
        assert_eq!(c[0].all.median_diff_ms, Some(0.0));
        // The p2p arm is 50 ms (wall) faster in round 1 and 100 ms in round 2: × time scale 2.
        let p = &c[1];
        assert_eq!((p.runs, p.all.pairs, p.all.faster), (2, 118, 118));
        assert!((p.all.median_diff_ms.unwrap() - -150.0).abs() < 1e-6);
        let r = p.returning.as_ref().unwrap();
        assert_eq!(r.pairs, 78);
        for q in &p.all.quantiles {
            assert!(q.ci95_ms.unwrap().1 < 0.0, "{q:?}");
        }
        let md = paired_markdown(&c);
        assert!(md.contains("paired against the control `ttft #1`"), "{md}");
        assert!(
            md.contains("| `ttft-p2p` | returning | 78 (40) | 78 / 0 / 0 |"),
            "{md}"
        );
        assert!(md.contains("| −150 ms |"), "{md}");
    }

    #[test]
    fn repeated_section_pools_runs_and_shows_their_range() {
        let one = vec![result("ttft", 0, 0.1), result("ttft-p2p", 0, 0.05)];
        assert_eq!(repeated_markdown(&one), "");
        let two = vec![
            result("ttft", 0, 0.1),
            result("ttft-p2p", 0, 0.05),
            result("ttft", 1, 0.2),
            result("ttft-p2p", 1, 0.1),
        ];
        let md = repeated_markdown(&two);
        // 59 ok of 60 per run (model ms = 2 × wall). Run 1's p50 is rank 30 of 59, session
        // 10's first turn: 2 × (0.1 + 0.1) = 400; run 2's is 600; pooled, rank 59 of 118 falls
        // between them at 500 (checked against an independent computation).
        assert!(
            md.contains(
                "| `ttft` | 2 | 118 / 120 | 500 ms (400–600 ms) | 720 ms (560–760 ms) | 782 ms (584–784 ms) | 78 | 502 ms (402–602 ms) |"
            ),
            "{md}"
        );
        // An arm with one run (an interrupted round) has no range to show.
        let partial = vec![
            result("ttft", 0, 0.1),
            result("ttft-p2p", 0, 0.05),
            result("ttft", 1, 0.2),
        ];
        let md = repeated_markdown(&partial);
        assert!(
            md.contains("| `ttft-p2p` | 1 | 59 / 60 | 300 ms | 460 ms | 484 ms | 39 |"),
            "{md}"
        );
    }
}
