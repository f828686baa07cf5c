//! `kv-cache-utilization-scorer`: `1 − kv_cache_usage` (scraped `vllm:kv_cache_usage_perc`, 0..1).
//! An endpoint not yet scraped scores as empty (1.0) — the same for all of them, so it does not bias.

use crate::candidate::{Candidate, SchedulingContext};
use crate::plugin::Scorer;

pub const TYPE: &str = "kv-cache-utilization-scorer";

pub struct KvCacheUtilizationScorer;

impl Scorer for KvCacheUtilizationScorer {
    fn type_name(&self) -> &'static str {
        TYPE
    }

    fn score(&self, _ctx: &SchedulingContext<'_>, candidates: &[&Candidate]) -> Vec<f64> {
        candidates
            .iter()
            .map(|c| 1.0 - c.kv_usage.unwrap_or(0.0).clamp(0.0, 1.0))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugins::test_util::ctx;

    #[test]
    fn one_minus_usage_clamped() {
        let mk = |u: Option<f64>| Candidate {
            kv_usage: u,
            ..Candidate::idle(0, "e")
        };
        let (a, b, c, d) = (mk(Some(0.25)), mk(None), mk(Some(1.7)), mk(Some(0.0)));
        let s = KvCacheUtilizationScorer.score(&ctx(32, 16), &[&a, &b, &c, &d]);
        assert_eq!(s, vec![0.75, 1.0, 0.0, 1.0]);
    }
}
