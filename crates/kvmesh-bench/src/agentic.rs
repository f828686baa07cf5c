//! The `agentic` experiment (issue 19: prefetch ahead of arrival): aggregated engines serving
//! agent sessions whose turns are separated by tool calls, each turn carrying a session id.
//!
//! Arms: `affinity` (no P2P), `affinity-p2p` (pull on demand when the next turn lands away from
//! its history), `affinity-p2p-prefetch` (the router also has a second engine pull the history
//! during the tool gap); likewise `ttft`, `ttft-p2p`, `ttft-p2p-prefetch`. The measure is the TTFT
//! of *returning* turns (every turn after a session's first), and from the router's counters the
//! prefetch hit rate and the bytes prefetched for nothing. `agentic-nogap` is the negative
//! control: turns follow each other at once, so there is no gap to hide a transfer in.
//! `agentic-paced` has the same sessions with each keeping its own pace (an agent calling the
//! same kind of tool again): the case where the router can tell when the next turn comes.

use std::fmt::Write as _;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::driver::RequestRecord;
use crate::metrics::{Sample, parse_exposition};
use crate::stats::{Latency, fmt_ms};
use crate::tokens::{Segment, TokenSpace};
use crate::workload::{
    FleetShape, GPU_BLOCK_TOKENS, Scale, Session, Start, Step, StepKind, Workload, key, secs_f,
};

/// Agent sessions with tool gaps drawn uniformly from `gap_s` (model seconds); `(0, 0)` is the
/// no-gap control. Same sessions (system prompts, tool outputs, arrivals) for any gap range.
pub fn agentic(scale: Scale, seed: u64, gap_s: (f64, f64)) -> Workload {
    struct Shape {
        sessions: usize,
        engines: usize,
        sys: (usize, usize),
        turns: (usize, usize),
        tool_output: (usize, usize),
        output: u32,
        arrivals_s: f64,
    }
    let s = match scale {
        // Busy enough that a returning turn often finds its owner decoding for others.
        Scale::Quick => Shape {
            sessions: 32,
            engines: 4,
            sys: (8_192, 24_576),
            turns: (3, 5),
            tool_output: (256, 1024),
            output: 128,
            arrivals_s: 8.0,
        },
        Scale::Full => Shape {
            sessions: 128,
            engines: 8,
            sys: (10_000, 60_000),
            turns: (4, 12),
            tool_output: (500, 3000),
            output: 200,
            arrivals_s: 30.0,
        },
    };
    // The gaps come from their own stream so every gap range sees the same sessions.
    let mut rng = ChaCha8Rng::seed_from_u64(key(&[60, seed]));
    let mut gaps = ChaCha8Rng::seed_from_u64(key(&[61, seed]));
    let mut sessions = Vec::new();
    let mut longest = 0usize;
    for c in 0..s.sessions {
        let sys = rng.random_range(s.sys.0..=s.sys.1);
        let turns = rng.random_range(s.turns.0..=s.turns.1);
        let start = rng.random_range(0.0..s.arrivals_s);
        let mut total = sys;
        let mut steps = Vec::new();
        for t in 0..turns {
            let new = rng.random_range(s.tool_output.0..=s.tool_output.1);
            let mut segments = Vec::new();
            if t == 0 {
                segments.push(Segment::seeded(key(&[62, seed, c as u64]), sys));
            }
            segments.push(Segment::seeded(key(&[63, seed, c as u64, t as u64]), new));
            total += new + s.output as usize;
            let gap = if t == 0 || gap_s.1 <= 0.0 {
                Duration::ZERO
            } else {
                secs_f(gaps.random_range(gap_s.0..=gap_s.1))
            };
            steps.push(Step {
                gap,
                history: t > 0,
                segments,
                max_tokens: s.output,
                kind: StepKind::Turn,
            });
        }
        longest = longest.max(total);
        sessions.push(Session {
            start: Start::At(secs_f(start)),
            steps,
        });
    }
    let nogap = gap_s.1 <= 0.0;
    Workload {
        name: if nogap { "agentic-nogap" } else { "agentic" }.into(),
        description: format!(
            "{} agent sessions over {} engines, system prompts {}–{} tokens, {}–{} turns of {}–{} \
             tool-output tokens / {} out, {}",
            s.sessions,
            s.engines,
            s.sys.0,
            s.sys.1,
            s.turns.0,
            s.turns.1,
            s.tool_output.0,
            s.tool_output.1,
            s.output,
            if nogap {
                "no gap between turns (negative control)".to_owned()
            } else {
                format!("tool gaps {}–{} s", gap_s.0, gap_s.1)
            }
        ),
        seed,
        token_space: TokenSpace::default(),
        sessions,
        max_active_sessions: None,
        offered_rate: None,
        request_timeout: Duration::from_secs(600),
        fleet: FleetShape {
            engines: s.engines,
            prefill: 0,
            decode: 0,
            // Room for about three sessions' histories per engine: with a session per engine
            // busy and more arriving, histories leave the GPU tier during their gaps...
            num_gpu_blocks: (longest * 3).div_ceil(GPU_BLOCK_TOKENS),
            max_model_len: longest + 2048,
            // ...for the host tier, which holds every live session (the premise of restoring or
            // pulling a history rather than recomputing it; 8x also leaves room for copies).
            cpu_tier_ratio: 8,
        },
        min_cached_token_delta: 1024,
    }
}

/// The tool-gap range of `agentic` at each scale (model seconds; the issue asks for 1–20 s).
pub fn gaps(scale: Scale) -> (f64, f64) {
    match scale {
        Scale::Quick => (1.0, 8.0),
        Scale::Full => (1.0, 20.0),
    }
}

/// Name of [`agentic_paced`].
pub const PACED: &str = "agentic-paced";

/// How far one gap of a paced session may stray from its pace (relative).
pub const PACE_JITTER: f64 = 0.1;

/// The `agentic` sessions, each at its own pace: a session draws its pace once from the same
/// 1–20 s range, and each of its gaps is that pace ± [`PACE_JITTER`]. Everything else (system
/// prompts, tool outputs, arrivals) is `agentic`'s, so the two compare gap timing alone.
pub fn agentic_paced(scale: Scale, seed: u64) -> Workload {
    let (lo, hi) = gaps(scale);
    let mut w = agentic(scale, seed, (lo, hi));
    let mut rng = ChaCha8Rng::seed_from_u64(key(&[64, seed]));
    for session in &mut w.sessions {
        let pace = rng.random_range(lo..=hi);
        for step in session.steps.iter_mut().skip(1) {
            let jitter = rng.random_range(1.0 - PACE_JITTER..=1.0 + PACE_JITTER);
            step.gap = secs_f(pace * jitter);
        }
    }
    w.name = PACED.into();
    w.description = w.description.replace(
        &format!("tool gaps {lo}–{hi} s"),
        &format!(
            "each session at its own pace: gaps within ±{:.0} % of a pace drawn from {lo}–{hi} s",
            PACE_JITTER * 100.0
        ),
    );
    w
}

/// What the router's counters say prefetch did in one arm.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PrefetchStats {
    pub issued: f64,
    pub landed: f64,
    pub failed: f64,
    /// Next turn placed where the history had landed (or was still landing).
    pub used: f64,
    pub wasted: f64,
    pub expired: f64,
    pub skipped: f64,
    pub bytes_issued: f64,
    pub bytes_used: f64,
    pub bytes_wasted: f64,
    /// Restores ahead on the owner (its CPU tier into its GPU tier): issued, restored (blocks
    /// moved), next turn placed on the owner (used) or elsewhere (wasted), and those that found
    /// nothing to move or failed.
    #[serde(default)]
    pub restore_issued: f64,
    #[serde(default)]
    pub restored: f64,
    #[serde(default)]
    pub restore_used: f64,
    #[serde(default)]
    pub restore_wasted: f64,
    #[serde(default)]
    pub restore_nothing_missing: f64,
    #[serde(default)]
    pub restore_failed: f64,
    /// Modelled KV bytes restores moved up (at the router's `kv_bytes_per_token`).
    #[serde(default)]
    pub bytes_restored: f64,
    /// Decisions timed by the session's gap estimate, and restores skipped for want of one.
    #[serde(default)]
    pub timed_by_gap: f64,
    #[serde(default)]
    pub restore_skipped_unpredictable: f64,
}

impl PrefetchStats {
    /// From the router's `/metrics` text; None when it has no prefetch counters (prefetch off).
    pub fn from_router_metrics(text: &str) -> Option<Self> {
        let samples = parse_exposition(text);
        let by = |name: &str, label: &str, values: &[&str]| -> f64 {
            samples
                .iter()
                .filter(|s: &&Sample| s.name == name)
                .filter(|s| {
                    s.labels
                        .iter()
                        .any(|(k, v)| k == label && values.contains(&v.as_str()))
                })
                // From 0.0: an empty `f64` sum is -0.0, which tables print as "-0".
                .fold(0.0, |acc, s| acc + s.value)
        };
        let outcomes = "kvmesh_router_prefetches_total";
        if !samples.iter().any(|s| s.name == outcomes) {
            return None;
        }
        let bytes = "kvmesh_router_prefetch_bytes_total";
        Some(Self {
            issued: by(outcomes, "outcome", &["issued"]),
            landed: by(outcomes, "outcome", &["landed"]),
            failed: by(outcomes, "outcome", &["failed"]),
            used: by(outcomes, "outcome", &["used", "used_in_flight"]),
            wasted: by(outcomes, "outcome", &["wasted"]),
            expired: by(outcomes, "outcome", &["expired"]),
            skipped: by(
                outcomes,
                "outcome",
                &[
                    "skipped_short",
                    "skipped_held",
                    "skipped_no_target",
                    "skipped_budget",
                    "skipped_room",
                    "skipped_owner",
                    "skipped_arrived",
                    "restore_skipped_budget",
                    "restore_skipped_unpredictable",
                ],
            ),
            bytes_issued: by(bytes, "kind", &["issued"]),
            bytes_used: by(bytes, "kind", &["used"]),
            bytes_wasted: by(bytes, "kind", &["wasted"]),
            restore_issued: by(outcomes, "outcome", &["restore_issued"]),
            restored: by(outcomes, "outcome", &["restored"]),
            restore_used: by(outcomes, "outcome", &["restore_used"]),
            restore_wasted: by(outcomes, "outcome", &["restore_wasted", "restore_expired"]),
            restore_nothing_missing: by(outcomes, "outcome", &["restore_nothing_missing"]),
            restore_failed: by(outcomes, "outcome", &["restore_failed"]),
            bytes_restored: by(bytes, "kind", &["restored"]),
            timed_by_gap: by(outcomes, "outcome", &["timed_by_gap"]),
            restore_skipped_unpredictable: by(
                outcomes,
                "outcome",
                &["restore_skipped_unpredictable"],
            ),
        })
    }

    /// Prefetches whose next turn went where they pulled, of those issued.
    fn hit_rate(&self) -> Option<f64> {
        (self.issued > 0.0).then(|| self.used / self.issued)
    }
}

/// TTFT (model seconds) of every turn after a session's first.
pub fn returning_turns(records: &[RequestRecord], time_scale: f64) -> Latency {
    let ts = crate::stats::usable_time_scale(time_scale);
    Latency::from_secs(
        records
            .iter()
            .filter(|r| r.kind == StepKind::Turn && r.step > 0)
            .filter_map(|r| r.ttft_s.map(|t| t * ts)),
    )
}

/// One arm's row of the agentic table.
pub struct Row<'a> {
    pub workload: &'a str,
    pub arm: &'a str,
    /// TTFT of returning turns ([`returning_turns`]).
    pub returning: Latency,
    /// Tokens the engines counted as external hits (pulled from a peer, on demand or ahead).
    pub pulled_tokens: f64,
    pub prefetch: Option<&'a PrefetchStats>,
    /// The engines' own tier movements.
    pub tiers: TierStats,
}

/// What the engines' counters say about restores from their CPU tiers (summed over the fleet).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TierStats {
    /// Blocks restored CPU→GPU when a request needed them (on its critical path).
    pub restored_on_path: f64,
    /// Blocks restored ahead of a request (restore prefetch).
    pub restored_ahead: f64,
    /// Wall seconds admitted requests waited for their host-to-device copies to land.
    pub copy_wait_s: f64,
    /// Blocks evicted from GPU tiers.
    pub gpu_evicted: f64,
}

impl TierStats {
    pub fn from_evidence(e: &crate::metrics::Evidence) -> Self {
        let restored = e.tier_total("kvmesh_engine_cpu_restored_blocks_total");
        let ahead = e.tier_total("kvmesh_engine_prefetch_restored_blocks_total");
        Self {
            restored_on_path: (restored - ahead).max(0.0),
            restored_ahead: ahead,
            copy_wait_s: e.tier_total("kvmesh_engine_cpu_restore_wait_seconds_total"),
            gpu_evicted: e.tier_total("kvmesh_engine_gpu_evicted_blocks_total"),
        }
    }
}

/// Whether `workload` is one of this module's (they get the table below).
pub fn is_agentic(workload: &str) -> bool {
    workload == "agentic" || workload == "agentic-nogap" || workload == PACED
}

/// The agentic tables (returning-turn TTFT, prefetch hit rate, wasted bytes), one per workload.
pub fn markdown(rows: &[Row<'_>]) -> String {
    let mut s = String::new();
    let mut workloads: Vec<&str> = rows.iter().map(|r| r.workload).collect();
    workloads.dedup();
    for w in workloads {
        let _ = writeln!(s, "\n**{w}: returning turns and prefetch**\n");
        s.push_str("| arm | returning turns | TTFT p50 | TTFT p90 | TTFT p99 | external-hit tokens | prefetches issued / used / wasted | hit rate | prefetched GB used / wasted (modelled) | restores issued / restored / used / nothing missing | restored GB (modelled) | decisions timed by gap / restores skipped (pace unknown) | CPU→GPU restores on requests' paths / ahead (blocks) | wait for copies (wall s) | GPU evictions (blocks) |\n");
        s.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
        for r in rows.iter().filter(|r| r.workload == w) {
            let (l, p) = (&r.returning, r.prefetch);
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {:.0} | {} | {} | {} | {} | {} | {} | {:.0} / {:.0} | {:.1} | {:.0} |",
                r.arm,
                l.count,
                fmt_ms(l.p50),
                fmt_ms(l.p90),
                fmt_ms(l.p99),
                r.pulled_tokens,
                p.map_or("—".into(), |p| format!(
                    "{:.0} / {:.0} / {:.0}",
                    p.issued, p.used, p.wasted
                )),
                p.and_then(PrefetchStats::hit_rate)
                    .map_or("—".into(), |h| format!("{:.0}%", h * 100.0)),
                p.map_or("—".into(), |p| format!(
                    "{:.1} / {:.1}",
                    p.bytes_used / 1e9,
                    p.bytes_wasted / 1e9
                )),
                p.map_or("—".into(), |p| format!(
                    "{:.0} / {:.0} / {:.0} / {:.0}",
                    p.restore_issued, p.restored, p.restore_used, p.restore_nothing_missing
                )),
                p.map_or("—".into(), |p| format!("{:.1}", p.bytes_restored / 1e9)),
                p.map_or("—".into(), |p| format!(
                    "{:.0} / {:.0}",
                    p.timed_by_gap, p.restore_skipped_unpredictable
                )),
                r.tiers.restored_on_path,
                r.tiers.restored_ahead,
                r.tiers.copy_wait_s,
                r.tiers.gpu_evicted,
            );
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_control_has_the_same_sessions_without_gaps() {
        let with = agentic(Scale::Quick, 7, gaps(Scale::Quick));
        let without = agentic(Scale::Quick, 7, (0.0, 0.0));
        assert_eq!(with.name, "agentic");
        assert_eq!(without.name, "agentic-nogap");
        assert_eq!(with.sessions.len(), without.sessions.len());
        for (a, b) in with.sessions.iter().zip(&without.sessions) {
            assert_eq!(a.start, b.start);
            assert_eq!(a.steps.len(), b.steps.len());
            for (sa, sb) in a.steps.iter().zip(&b.steps) {
                assert_eq!(sa.segments, sb.segments);
                assert_eq!(sb.gap, Duration::ZERO);
            }
            // Every later turn of the gapped run waits 1–8 s.
            for st in &a.steps[1..] {
                assert!(st.gap >= Duration::from_secs(1) && st.gap <= Duration::from_secs(8));
                assert!(st.history);
            }
        }
    }

    #[test]
    fn a_paced_session_keeps_its_pace_and_agentics_prompts() {
        let paced = agentic_paced(Scale::Full, 7);
        let plain = agentic(Scale::Full, 7, gaps(Scale::Full));
        assert_eq!(paced.name, PACED);
        assert!(
            paced.description.contains("own pace"),
            "{}",
            paced.description
        );
        let mut paces = Vec::new();
        for (a, b) in paced.sessions.iter().zip(&plain.sessions) {
            assert_eq!(a.start, b.start);
            for (sa, sb) in a.steps.iter().zip(&b.steps) {
                assert_eq!(sa.segments, sb.segments);
            }
            assert_eq!(a.steps[0].gap, Duration::ZERO);
            let g: Vec<f64> = a.steps[1..].iter().map(|s| s.gap.as_secs_f64()).collect();
            let (min, max) = g
                .iter()
                .fold((f64::MAX, 0.0f64), |(lo, hi), &x| (lo.min(x), hi.max(x)));
            // Any two gaps of a session are within the jitter of one pace.
            assert!(
                max <= min * (1.0 + PACE_JITTER) / (1.0 - PACE_JITTER) + 1e-9,
                "{g:?}"
            );
            paces.push(min);
        }
        // ...while the paces themselves span the range.
        let (lo, hi) = paces
            .iter()
            .fold((f64::MAX, 0.0f64), |(lo, hi), &x| (lo.min(x), hi.max(x)));
        assert!(lo < 3.0 && hi > 15.0, "{lo}..{hi}");
    }

    #[test]
    fn prefetch_counters_are_read_from_the_router() {
        let text = "\
# TYPE kvmesh_router_prefetches counter
kvmesh_router_prefetches_total{outcome=\"issued\"} 10
kvmesh_router_prefetches_total{outcome=\"landed\"} 9
kvmesh_router_prefetches_total{outcome=\"used\"} 5
kvmesh_router_prefetches_total{outcome=\"used_in_flight\"} 1
kvmesh_router_prefetches_total{outcome=\"wasted\"} 3
kvmesh_router_prefetches_total{outcome=\"skipped_short\"} 2
kvmesh_router_prefetches_total{outcome=\"restore_issued\"} 7
kvmesh_router_prefetches_total{outcome=\"restored\"} 6
kvmesh_router_prefetches_total{outcome=\"restore_used\"} 5
kvmesh_router_prefetches_total{outcome=\"restore_nothing_missing\"} 1
kvmesh_router_prefetch_bytes_total{kind=\"wasted\"} 3000000000
kvmesh_router_prefetch_bytes_total{kind=\"restored\"} 2000000000
";
        let p = PrefetchStats::from_router_metrics(text).unwrap();
        assert_eq!(
            (p.issued, p.used, p.wasted, p.skipped),
            (10.0, 6.0, 3.0, 2.0)
        );
        assert_eq!(
            (
                p.restore_issued,
                p.restored,
                p.restore_used,
                p.restore_nothing_missing
            ),
            (7.0, 6.0, 5.0, 1.0)
        );
        assert_eq!(p.bytes_restored, 2e9);
        assert_eq!(p.hit_rate(), Some(0.6));
        assert_eq!(p.bytes_wasted, 3e9);
        assert!(PrefetchStats::from_router_metrics("kvmesh_router_requests_total 3\n").is_none());
    }

    /// The engines' restore counters reach the agentic table: restores on requests' paths are
    /// all restores minus those made ahead, summed over the fleet.
    #[test]
    fn restores_on_the_path_and_ahead_come_from_the_engines() {
        let engine = |url: &str, restored: u32, ahead: u32, wait: f64| {
            crate::metrics::EngineEvidence::from_exposition(
                url,
                &format!(
                    "kvmesh_engine_cpu_restored_blocks_total{{engine=\"0\"}} {restored}\n\
                     kvmesh_engine_prefetch_restored_blocks_total{{engine=\"0\"}} {ahead}\n\
                     kvmesh_engine_cpu_restore_wait_seconds_total{{engine=\"0\"}} {wait}\n\
                     kvmesh_engine_gpu_evicted_blocks_total{{engine=\"0\"}} 40\n"
                ),
            )
        };
        let ev = crate::metrics::Evidence::from_engines(
            vec![engine("a", 100, 30, 1.5), engine("b", 50, 0, 0.5)],
            Vec::new(),
        );
        let t = TierStats::from_evidence(&ev);
        assert_eq!(
            t,
            TierStats {
                restored_on_path: 120.0,
                restored_ahead: 30.0,
                copy_wait_s: 2.0,
                gpu_evicted: 80.0,
            }
        );
        let row = Row {
            workload: "agentic",
            arm: "ttft-p2p",
            returning: Latency::from_secs([0.1, 0.2]),
            pulled_tokens: 0.0,
            prefetch: None,
            tiers: t,
        };
        let md = markdown(&[row]);
        assert!(md.contains("| 120 / 30 | 2.0 | 80 |"), "{md}");
    }
}
