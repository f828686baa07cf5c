//! Per-arm statistics from request records: TTFT and end-to-end percentiles (hdrhistogram),
//! achieved vs offered rate, failures and timeouts. Reported in *model* seconds (wall × time scale).

use std::collections::BTreeMap;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use crate::client::Outcome;
use crate::driver::RequestRecord;
use crate::workload::StepKind;

/// Percentiles of one latency, in seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Latency {
    pub count: u64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
    pub max: f64,
}

impl Latency {
    /// Summarises seconds (µs resolution, 3 significant digits).
    pub fn from_secs(values: impl IntoIterator<Item = f64>) -> Self {
        let mut h = match Histogram::<u64>::new(3) {
            Ok(h) => h,
            Err(_) => return Self::default(),
        };
        for v in values {
            if v.is_finite() && v >= 0.0 {
                let _ = h.record((v * 1e6).round().max(1.0) as u64);
            }
        }
        if h.is_empty() {
            return Self::default();
        }
        let s = |q: f64| h.value_at_quantile(q) as f64 / 1e6;
        Self {
            count: h.len(),
            p50: s(0.5),
            p90: s(0.9),
            p99: s(0.99),
            mean: h.mean() / 1e6,
            max: h.max() as f64 / 1e6,
        }
    }
}

/// Everything the report shows for one arm.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ArmStats {
    pub requests: usize,
    pub succeeded: usize,
    pub failed: usize,
    pub timeouts: usize,
    /// TTFT over all successful requests (model seconds).
    pub ttft: Latency,
    /// End-to-end latency over all successful requests (model seconds).
    pub e2e: Latency,
    /// TTFT per step kind (e.g. fork `child` = branch starts).
    pub ttft_by_kind: BTreeMap<String, Latency>,
    /// Offered request rate (req/s, model time).
    pub offered_rate: f64,
    /// Completed requests per second from the first send to the last completion (model time).
    pub achieved_rate: f64,
    /// Wall seconds of the run.
    pub wall_s: f64,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    /// Sum of `cached_tokens` the servers reported.
    pub cached_tokens_reported: u64,
    /// Fork: children whose TTFT was at least half the parent's (they recomputed the context).
    pub slow_branches: Option<usize>,
    /// First error messages (up to 5), for diagnosis.
    pub sample_errors: Vec<String>,
}

/// A fleet's `--time-scale` as a usable divisor: anything but a positive finite number is 1.
pub fn usable_time_scale(time_scale: f64) -> f64 {
    if time_scale.is_finite() && time_scale > 0.0 {
        time_scale
    } else {
        1.0
    }
}

/// Seconds as whole milliseconds, for report tables.
pub fn fmt_ms(secs: f64) -> String {
    format!("{:.0} ms", secs * 1000.0)
}

/// Computes the statistics; `time_scale` converts wall seconds to model seconds.
pub fn summarize(
    records: &[RequestRecord],
    time_scale: f64,
    offered_rate: Option<f64>,
) -> ArmStats {
    let ts = usable_time_scale(time_scale);
    let ok: Vec<&RequestRecord> = records
        .iter()
        .filter(|r| r.outcome == Outcome::Ok)
        .collect();
    let mut by_kind: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for r in &ok {
        if let Some(t) = r.ttft_s {
            by_kind.entry(kind_name(r.kind)).or_default().push(t * ts);
        }
    }
    let first = records
        .iter()
        .map(|r| r.sent_s)
        .fold(f64::INFINITY, f64::min);
    let last_send = records.iter().map(|r| r.sent_s).fold(0.0f64, f64::max);
    let last_done = ok.iter().map(|r| r.sent_s + r.e2e_s).fold(0.0f64, f64::max);
    let span = (last_done - first).max(1e-9);
    let send_span = (last_send - first).max(1e-9);
    let parent_ttft = ok
        .iter()
        .find(|r| r.kind == StepKind::Parent)
        .and_then(|r| r.ttft_s);
    let slow_branches = parent_ttft.map(|p| {
        ok.iter()
            .filter(|r| r.kind == StepKind::Child && r.ttft_s.is_some_and(|t| t >= 0.5 * p))
            .count()
    });
    ArmStats {
        requests: records.len(),
        succeeded: ok.len(),
        failed: records
            .iter()
            .filter(|r| matches!(r.outcome, Outcome::Error(_)))
            .count(),
        timeouts: records
            .iter()
            .filter(|r| r.outcome == Outcome::Timeout)
            .count(),
        ttft: Latency::from_secs(ok.iter().filter_map(|r| r.ttft_s).map(|t| t * ts)),
        e2e: Latency::from_secs(ok.iter().map(|r| r.e2e_s * ts)),
        ttft_by_kind: by_kind
            .into_iter()
            .map(|(k, v)| (k, Latency::from_secs(v)))
            .collect(),
        offered_rate: offered_rate.unwrap_or(if records.len() > 1 {
            (records.len() - 1) as f64 / (send_span * ts)
        } else {
            0.0
        }),
        achieved_rate: if ok.is_empty() {
            0.0
        } else {
            ok.len() as f64 / (span * ts)
        },
        wall_s: if records.is_empty() { 0.0 } else { span },
        prompt_tokens: ok.iter().map(|r| r.prompt_tokens as u64).sum(),
        output_tokens: ok.iter().map(|r| r.output_tokens as u64).sum(),
        cached_tokens_reported: ok.iter().filter_map(|r| r.cached_tokens).sum(),
        slow_branches,
        sample_errors: records
            .iter()
            .filter_map(|r| match &r.outcome {
                Outcome::Error(e) => Some(e.clone()),
                Outcome::Timeout => Some("timeout".into()),
                Outcome::Ok => None,
            })
            .take(5)
            .collect(),
    }
}

fn kind_name(k: StepKind) -> String {
    serde_json::to_value(k)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(kind: StepKind, sent: f64, ttft: f64, e2e: f64, outcome: Outcome) -> RequestRecord {
        RequestRecord {
            session: 0,
            step: 0,
            kind,
            prompt_tokens: 100,
            novel_tokens: None,
            sent_s: sent,
            ttft_s: Some(ttft),
            e2e_s: e2e,
            output_tokens: 4,
            cached_tokens: Some(10),
            outcome,
        }
    }

    #[test]
    fn percentiles_are_close_to_exact() {
        let l = Latency::from_secs((1..=1000).map(|i| i as f64 / 1000.0));
        assert_eq!(l.count, 1000);
        assert!((l.p50 - 0.5).abs() < 0.001, "{}", l.p50);
        assert!((l.p90 - 0.9).abs() < 0.001);
        assert!((l.p99 - 0.99).abs() < 0.001);
        assert!((l.max - 1.0).abs() < 0.001);
        assert_eq!(Latency::from_secs([]), Latency::default());
    }

    #[test]
    fn summary_scales_to_model_time_and_counts_outcomes() {
        let recs = vec![
            rec(StepKind::Parent, 0.0, 1.0, 1.2, Outcome::Ok),
            rec(StepKind::Child, 1.5, 0.1, 0.2, Outcome::Ok),
            rec(StepKind::Child, 1.6, 0.8, 0.9, Outcome::Ok),
            rec(StepKind::Child, 1.7, 0.0, 9.0, Outcome::Timeout),
            rec(
                StepKind::Child,
                1.8,
                0.0,
                0.1,
                Outcome::Error("HTTP 500".into()),
            ),
        ];
        let s = summarize(&recs, 10.0, None);
        assert_eq!(
            (s.requests, s.succeeded, s.failed, s.timeouts),
            (5, 3, 1, 1)
        );
        assert!((s.ttft.max - 10.0).abs() < 0.01);
        assert_eq!(s.ttft_by_kind["child"].count, 2);
        assert_eq!(s.slow_branches, Some(1));
        // 3 completions over (2.5 - 0.0) wall s × 10.
        assert!(
            (s.achieved_rate - 3.0 / 25.0).abs() < 1e-6,
            "{}",
            s.achieved_rate
        );
        assert_eq!(s.cached_tokens_reported, 30);
        assert_eq!(s.sample_errors.len(), 2);
    }
}
