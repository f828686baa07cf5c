//! Workloads by name: what `kvmesh bench --workload` accepts, built from the generators in
//! [`crate::workload`] and the trace replay in [`crate::trace`].

use crate::hot_prefix::{
    FANOUT_WAVES, SKEW_HEAVY, fanout, fanout_pullers, fanout_waves, skew, skew_exponents,
    skew_heavy,
};
use crate::trace;
use crate::workload::{
    Scale, Workload, WorkloadError, WorkloadOptions, agentic_pd, docqa, fork, ladder, pool,
};

/// Names accepted by [`build`].
pub const WORKLOAD_NAMES: &[&str] = &[
    "ladder",
    "fork",
    "pool",
    "docqa",
    "docqa-warm",
    "agentic",
    "agentic-nogap",
    "agentic-paced",
    "agentic-pd",
    "restart",
    "restart-agg",
    "fanout",
    "fanout@<pullers>",
    "fanout-waves@<pullers>",
    "skew",
    "skew@<zipf exponent>",
    "skew-heavy",
    "skew-heavy@<zipf exponent>",
    "scaleout",
    "trace:<file>",
];

/// Builds the workload(s) named by `spec`. `pool` yields one workload per offered rate.
pub fn build(
    spec: &str,
    scale: Scale,
    seed: u64,
    opts: &WorkloadOptions,
) -> Result<Vec<Workload>, WorkloadError> {
    let space = opts.token_space.unwrap_or_default();
    let mut out = match spec {
        "ladder" => vec![ladder(scale, seed)],
        "fork" => vec![fork(scale, seed)],
        "pool" => {
            let rates = opts.rates.clone().unwrap_or_else(|| match scale {
                Scale::Quick => vec![4.0, 12.0],
                Scale::Full => vec![4.0, 8.0, 12.0, 16.0],
            });
            rates.into_iter().map(|r| pool(scale, seed, r)).collect()
        }
        "docqa" => vec![docqa(scale, seed)],
        crate::waves::DOCQA_WARM => vec![crate::waves::docqa_warm(scale, seed)],
        crate::scale_out::NAME => vec![crate::scale_out::scaleout(scale, seed)],
        // The experiment and its negative control (same sessions, no gap) in one run.
        "agentic" => vec![
            crate::agentic::agentic(scale, seed, crate::agentic::gaps(scale)),
            crate::agentic::agentic(scale, seed, (0.0, 0.0)),
        ],
        "agentic-nogap" => vec![crate::agentic::agentic(scale, seed, (0.0, 0.0))],
        crate::agentic::PACED => vec![crate::agentic::agentic_paced(scale, seed)],
        "agentic-pd" => vec![agentic_pd(scale, seed)],
        crate::restart::NAME => vec![crate::restart::restart(scale, seed)],
        crate::restart::NAME_AGG => vec![crate::restart::restart_agg(scale, seed)],
        "fanout" => fanout_pullers(scale)
            .into_iter()
            .map(|n| fanout(scale, seed, n))
            .collect(),
        "skew" => skew_exponents(scale)
            .into_iter()
            .map(|s| skew(scale, seed, s))
            .collect(),
        SKEW_HEAVY => skew_exponents(scale)
            .into_iter()
            .map(|s| skew_heavy(scale, seed, s))
            .collect(),
        other => {
            if let Some(path) = other.strip_prefix("trace:") {
                vec![trace::workload(path, scale, seed, opts)?]
            } else if let Some(rate) = other.strip_prefix("pool@") {
                let r: f64 = rate
                    .parse()
                    .map_err(|_| WorkloadError::Unknown(format!("pool rate {rate:?}")))?;
                vec![pool(scale, seed, r)]
            } else if let Some(n) = other.strip_prefix("fanout@") {
                vec![fanout(scale, seed, fanout_count(n)?)]
            } else if let Some(n) = other
                .strip_prefix(FANOUT_WAVES)
                .and_then(|rest| rest.strip_prefix('@'))
            {
                vec![fanout_waves(scale, seed, fanout_count(n)?)]
            } else if let Some(e) = other.strip_prefix("skew@") {
                vec![skew(scale, seed, zipf_exponent(e)?)]
            } else if let Some(e) = other
                .strip_prefix(SKEW_HEAVY)
                .and_then(|rest| rest.strip_prefix('@'))
            {
                vec![skew_heavy(scale, seed, zipf_exponent(e)?)]
            } else {
                return Err(WorkloadError::Unknown(format!(
                    "workload {other:?}; known: {}",
                    WORKLOAD_NAMES.join(", ")
                )));
            }
        }
    };
    for w in &mut out {
        w.token_space = space;
    }
    Ok(out)
}

/// A fan-out's puller count from a workload name: 1..=64 (each gets an engine of its own).
fn fanout_count(text: &str) -> Result<usize, WorkloadError> {
    text.parse()
        .ok()
        .filter(|n| (1..=64).contains(n))
        .ok_or_else(|| WorkloadError::Unknown(format!("fanout pullers {text:?} (1..=64)")))
}

/// A `skew` exponent from a workload name: finite, 0..=4.
fn zipf_exponent(text: &str) -> Result<f64, WorkloadError> {
    text.parse()
        .ok()
        .filter(|e: &f64| e.is_finite() && (0.0..=4.0).contains(e))
        .ok_or_else(|| WorkloadError::Unknown(format!("skew exponent {text:?} (0..=4)")))
}
