//! `prefix-cache-scorer`: how much of the request's prefix an endpoint already holds.
//!
//! llm-d semantics (`docs/protocols.md#scorers`): `w·min(1, matched_tokens/scale)² + (1−w)·matched_blocks/total_blocks`
//! with `w = 0` and `scale = 8192` tokens by default; only the longest *consecutive* prefix counts.
//! Tiers are weighted: the GPU-resident part of the prefix counts `gpu_weight` (1.0) per block, the
//! rest of the consecutive prefix that is only in the CPU tier counts `cpu_weight` (0.8) — a CPU hit
//! still saves compute but costs a restore.

use serde::{Deserialize, Serialize};

use crate::candidate::{Candidate, SchedulingContext};
use crate::plugin::Scorer;

pub const TYPE: &str = "prefix-cache-scorer";

/// Parameters (llm-d's, in snake_case like every kvmesh YAML key).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrefixParams {
    /// Weight of the absolute-length term (`w`); 0 = purely the matched fraction of the prompt.
    pub absolute_weight: f64,
    /// Tokens at which the absolute term saturates.
    pub scale_tokens: f64,
    pub gpu_weight: f64,
    pub cpu_weight: f64,
}

impl Default for PrefixParams {
    fn default() -> Self {
        PrefixParams {
            absolute_weight: 0.0,
            scale_tokens: 8192.0,
            gpu_weight: 1.0,
            cpu_weight: 0.8,
        }
    }
}

impl PrefixParams {
    /// Tier-weighted matched blocks of one candidate.
    fn weighted_blocks(&self, c: &Candidate) -> f64 {
        // `any` covers the GPU run by definition; `max` guards a lookup that says otherwise.
        let gpu = c.gpu_blocks;
        let total = c.any_blocks.max(gpu);
        self.gpu_weight * gpu as f64 + self.cpu_weight * (total - gpu) as f64
    }

    /// The prefix score of one candidate in `[0, 1]`.
    pub fn score(&self, ctx: &SchedulingContext<'_>, c: &Candidate) -> f64 {
        if ctx.total_blocks == 0 {
            return 0.0;
        }
        let blocks = self.weighted_blocks(c);
        let tokens = blocks * ctx.block_size as f64;
        let absolute = if self.scale_tokens > 0.0 {
            (tokens / self.scale_tokens).min(1.0).powi(2)
        } else {
            0.0
        };
        let fraction = (blocks / ctx.total_blocks as f64).min(1.0);
        let w = self.absolute_weight.clamp(0.0, 1.0);
        (w * absolute + (1.0 - w) * fraction).clamp(0.0, 1.0)
    }
}

pub struct PrefixCacheScorer {
    params: PrefixParams,
}

impl PrefixCacheScorer {
    pub fn new(params: PrefixParams) -> Self {
        PrefixCacheScorer { params }
    }
}

impl Scorer for PrefixCacheScorer {
    fn type_name(&self) -> &'static str {
        TYPE
    }

    fn score(&self, ctx: &SchedulingContext<'_>, candidates: &[&Candidate]) -> Vec<f64> {
        candidates
            .iter()
            .map(|c| self.params.score(ctx, c))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugins::test_util::ctx;

    fn cand(gpu: usize, cpu: usize, any: usize) -> Candidate {
        Candidate {
            gpu_blocks: gpu,
            cpu_blocks: cpu,
            any_blocks: any,
            ..Candidate::idle(0, "e")
        }
    }

    #[test]
    fn fraction_of_prompt_with_tier_weights() {
        // 10 blocks of 16; A: 5 GPU; B: 2 GPU then 4 more only in CPU (any = 6); C: nothing.
        let ctx = ctx(160, 16);
        let (a, b, c) = (cand(5, 0, 5), cand(2, 6, 6), cand(0, 0, 0));
        let s = PrefixCacheScorer::new(PrefixParams::default()).score(&ctx, &[&a, &b, &c]);
        assert!((s[0] - 0.5).abs() < 1e-12);
        // (2·1.0 + 4·0.8) / 10 = 0.52
        assert!((s[1] - 0.52).abs() < 1e-12);
        assert_eq!(s[2], 0.0);
    }

    #[test]
    fn cpu_only_prefix_is_discounted() {
        let ctx = ctx(160, 16);
        let cpu_only = cand(0, 10, 10);
        let s = PrefixCacheScorer::new(PrefixParams::default()).score(&ctx, &[&cpu_only]);
        assert!((s[0] - 0.8).abs() < 1e-12);
    }

    #[test]
    fn absolute_term_saturates_at_scale() {
        // w = 1: score = min(1, tokens/scale)². 4096 GPU tokens of 8192 → 0.25.
        let p = PrefixParams {
            absolute_weight: 1.0,
            ..PrefixParams::default()
        };
        let ctx = ctx(16384, 16);
        let half = cand(256, 0, 256);
        let full = cand(1024, 0, 1024);
        let s = PrefixCacheScorer::new(p).score(&ctx, &[&half, &full]);
        assert!((s[0] - 0.25).abs() < 1e-12);
        assert!((s[1] - 1.0).abs() < 1e-12);
    }

    #[test]
    fn prompt_shorter_than_a_block_scores_zero() {
        let ctx = ctx(10, 16);
        let s = PrefixCacheScorer::new(PrefixParams::default()).score(&ctx, &[&cand(0, 0, 0)]);
        assert_eq!(s, vec![0.0]);
    }

    #[test]
    fn parameters_parse_in_snake_case() {
        let p: PrefixParams =
            serde_json::from_value(serde_json::json!({"scale_tokens": 4096, "cpu_weight": 0.5}))
                .expect("parse");
        assert_eq!(p.scale_tokens, 4096.0);
        assert_eq!(p.cpu_weight, 0.5);
    }
}
