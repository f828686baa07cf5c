//! `prefix-cache-affinity-filter`: keep only the endpoints that already hold most of the prefix.
//!
//! llm-d semantics (`docs/protocols.md#filters`): keep candidates whose prefix score (same formula and parameters
//! as `prefix-cache-scorer`) is ≥ `threshold` (0.80); keep all when none qualifies. With probability
//! `exploration_probability` keep all (so new holders get a chance). Affinity is broken — all kept —
//! when the best sticky endpoint's predicted TTFT exceeds the best other's by more than
//! `max_ttft_penalty_ms` (18,000). Predicted TTFT = (in-flight uncached tokens + this request's uncached
//! tokens on that endpoint) / `peak_prefill_tokens_per_second`. kvmesh adds the request's own uncached
//! tokens (llm-d counts in-flight only) so that the cold endpoints pay for the prefill they would do.

use serde::{Deserialize, Serialize};

use super::prefix_cache_scorer::PrefixParams;
use crate::candidate::{Candidate, SchedulingContext};
use crate::plugin::{Filter, FilterOutcome};

pub const TYPE: &str = "prefix-cache-affinity-filter";

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct AffinityParams {
    pub threshold: f64,
    pub exploration_probability: f64,
    pub max_ttft_penalty_ms: f64,
    pub peak_prefill_tokens_per_second: f64,
    pub absolute_weight: f64,
    pub scale_tokens: f64,
    pub gpu_weight: f64,
    pub cpu_weight: f64,
}

impl Default for AffinityParams {
    fn default() -> Self {
        let p = PrefixParams::default();
        AffinityParams {
            threshold: 0.80,
            exploration_probability: 0.0,
            max_ttft_penalty_ms: 18_000.0,
            peak_prefill_tokens_per_second: 25_000.0,
            absolute_weight: p.absolute_weight,
            scale_tokens: p.scale_tokens,
            gpu_weight: p.gpu_weight,
            cpu_weight: p.cpu_weight,
        }
    }
}

impl AffinityParams {
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.exploration_probability) {
            return Err(format!(
                "exploration_probability {} not in [0, 1]",
                self.exploration_probability
            ));
        }
        if self.peak_prefill_tokens_per_second <= 0.0 {
            return Err("peak_prefill_tokens_per_second must be > 0".to_owned());
        }
        Ok(())
    }

    fn prefix(&self) -> PrefixParams {
        PrefixParams {
            absolute_weight: self.absolute_weight,
            scale_tokens: self.scale_tokens,
            gpu_weight: self.gpu_weight,
            cpu_weight: self.cpu_weight,
        }
    }
}

pub struct PrefixCacheAffinityFilter {
    params: AffinityParams,
}

impl PrefixCacheAffinityFilter {
    pub fn new(params: AffinityParams) -> Self {
        PrefixCacheAffinityFilter { params }
    }

    /// Predicted time to first token on `c`, in ms.
    fn predicted_ttft_ms(&self, ctx: &SchedulingContext<'_>, c: &Candidate) -> f64 {
        let tokens = c.in_flight_uncached_tokens + ctx.uncached_tokens(c);
        tokens as f64 / self.params.peak_prefill_tokens_per_second * 1000.0
    }
}

impl Filter for PrefixCacheAffinityFilter {
    fn type_name(&self) -> &'static str {
        TYPE
    }

    fn filter(
        &self,
        ctx: &SchedulingContext<'_>,
        candidates: &[&Candidate],
        rng: &mut dyn rand::RngCore,
    ) -> FilterOutcome {
        use rand::Rng;
        let all = || (0..candidates.len()).collect::<Vec<_>>();
        let prefix = self.params.prefix();
        let sticky: Vec<usize> = (0..candidates.len())
            .filter(|&i| prefix.score(ctx, candidates[i]) >= self.params.threshold)
            .collect();
        if sticky.is_empty() {
            return FilterOutcome {
                kept: all(),
                note: "no endpoint above threshold; kept all".to_owned(),
            };
        }
        if sticky.len() == candidates.len() {
            return FilterOutcome {
                kept: all(),
                note: "all endpoints above threshold".to_owned(),
            };
        }
        if self.params.exploration_probability > 0.0
            && rng.random::<f64>() < self.params.exploration_probability
        {
            return FilterOutcome {
                kept: all(),
                note: "exploring; kept all".to_owned(),
            };
        }
        let ttft = |set: &mut dyn Iterator<Item = usize>| {
            set.map(|i| self.predicted_ttft_ms(ctx, candidates[i]))
                .fold(f64::INFINITY, f64::min)
        };
        let best_sticky = ttft(&mut sticky.iter().copied());
        let best_other = ttft(&mut (0..candidates.len()).filter(|i| !sticky.contains(i)));
        if best_sticky - best_other > self.params.max_ttft_penalty_ms {
            return FilterOutcome {
                kept: all(),
                note: format!(
                    "affinity broken: sticky TTFT {best_sticky:.0} ms > best other {best_other:.0} ms + {:.0} ms",
                    self.params.max_ttft_penalty_ms
                ),
            };
        }
        FilterOutcome {
            note: format!("kept {} sticky of {}", sticky.len(), candidates.len()),
            kept: sticky,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugins::test_util::{ctx, rng};

    fn cand(id: u32, gpu: usize, inflight_uncached: u64) -> Candidate {
        Candidate {
            gpu_blocks: gpu,
            any_blocks: gpu,
            in_flight_uncached_tokens: inflight_uncached,
            ..Candidate::idle(id, "e")
        }
    }

    #[test]
    fn keeps_holders_above_threshold() {
        // 10 blocks: A holds 9 (0.9), B 8 (0.8, kept: ≥), C 7 (0.7, dropped).
        let f = PrefixCacheAffinityFilter::new(AffinityParams::default());
        let (a, b, c) = (cand(0, 9, 0), cand(1, 8, 0), cand(2, 7, 0));
        let out = f.filter(&ctx(160, 16), &[&a, &b, &c], &mut rng(1));
        assert_eq!(out.kept, vec![0, 1]);
    }

    #[test]
    fn keeps_all_when_no_holder() {
        let f = PrefixCacheAffinityFilter::new(AffinityParams::default());
        let (a, b) = (cand(0, 1, 0), cand(1, 0, 0));
        assert_eq!(
            f.filter(&ctx(160, 16), &[&a, &b], &mut rng(1)).kept,
            vec![0, 1]
        );
    }

    #[test]
    fn ttft_penalty_breaks_affinity() {
        // Rate 1000 tok/s. Sticky A: 30,000 in-flight + 0 own = 30,000 ms. Cold B: 160 own tokens = 160 ms.
        // Penalty 18,000: 30,000 − 160 > 18,000 → keep all.
        let p = AffinityParams {
            peak_prefill_tokens_per_second: 1000.0,
            ..AffinityParams::default()
        };
        let f = PrefixCacheAffinityFilter::new(p.clone());
        let (a, b) = (cand(0, 10, 30_000), cand(1, 0, 0));
        let out = f.filter(&ctx(160, 16), &[&a, &b], &mut rng(1));
        assert_eq!(out.kept, vec![0, 1]);
        assert!(out.note.contains("broken"), "{}", out.note);
        // 18,000 in flight: 18,000 − 160 < 18,000 → stays sticky.
        let a = cand(0, 10, 18_000);
        let out = PrefixCacheAffinityFilter::new(p).filter(&ctx(160, 16), &[&a, &b], &mut rng(1));
        assert_eq!(out.kept, vec![0]);
    }

    #[test]
    fn exploration_keeps_all_at_about_the_configured_rate() {
        let p = AffinityParams {
            exploration_probability: 0.25,
            ..AffinityParams::default()
        };
        let f = PrefixCacheAffinityFilter::new(p);
        let (a, b) = (cand(0, 10, 0), cand(1, 0, 0));
        let mut r = rng(7);
        let explored = (0..4000)
            .filter(|_| f.filter(&ctx(160, 16), &[&a, &b], &mut r).kept.len() == 2)
            .count();
        assert!(
            (800..1200).contains(&explored),
            "explored {explored} of 4000"
        );
    }

    #[test]
    fn rejects_bad_probability() {
        let p = AffinityParams {
            exploration_probability: 1.5,
            ..AffinityParams::default()
        };
        assert!(p.validate().is_err());
    }
}
