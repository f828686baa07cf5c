//! Workloads by name: what `kvmesh bench --workload` accepts, built from the generators in
//! [`crate::workload`] and the trace replay in [`crate::trace`].

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
    "agentic-pd",
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
        "agentic-pd" => vec![agentic_pd(scale, seed)],
        other => {
            if let Some(path) = other.strip_prefix("trace:") {
                vec![trace::workload(path, scale, seed, opts)?]
            } else if let Some(rate) = other.strip_prefix("pool@") {
                let r: f64 = rate
                    .parse()
                    .map_err(|_| WorkloadError::Unknown(format!("pool rate {rate:?}")))?;
                vec![pool(scale, seed, r)]
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
