//! Token sampling: greedy at temperature 0, otherwise temperature + nucleus (top-p), driven by a
//! counter-based random stream so the same (seed, step) always draws the same number — a request
//! replays identically whether its prefix was computed, restored, or pulled.

use kvmesh_core::TokenId;
use kvmesh_engine::compute::SamplingParams;

use crate::load::splitmix64;

/// Temperatures at or below this are greedy.
const GREEDY_BELOW: f32 = 1e-5;

/// Index of the largest logit (lowest index on ties; NaN never wins).
pub fn argmax(logits: &[f32]) -> TokenId {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best_v = v;
            best = i;
        }
    }
    best as TokenId
}

/// A uniform draw in `[0, 1)` for step `step` of stream `seed`.
fn uniform(seed: u64, step: u64) -> f64 {
    let bits = splitmix64(seed ^ splitmix64(step.wrapping_add(0xA5A5)));
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

/// Samples one token from `logits` per `params`; `seed`/`step` select the random draw.
pub fn sample(logits: &[f32], params: &SamplingParams, seed: u64, step: u64) -> TokenId {
    if params.temperature.is_nan() || params.temperature <= GREEDY_BELOW || logits.is_empty() {
        return argmax(logits);
    }
    let inv_t = 1.0 / f64::from(params.temperature);
    let max = logits
        .iter()
        .copied()
        .filter(|v| v.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return argmax(logits);
    }
    let mut probs: Vec<(f64, u32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            (
                if v.is_finite() {
                    (f64::from(v - max) * inv_t).exp()
                } else {
                    0.0
                },
                i as u32,
            )
        })
        .collect();
    let total: f64 = probs.iter().map(|p| p.0).sum();
    let top_p = f64::from(params.top_p);
    let kept: &[(f64, u32)] = if top_p > 0.0 && top_p < 1.0 {
        probs.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut cum = 0.0;
        let mut n = 0;
        for p in &probs {
            n += 1;
            cum += p.0 / total;
            if cum >= top_p {
                break;
            }
        }
        &probs[..n]
    } else {
        &probs
    };
    let mass: f64 = kept.iter().map(|p| p.0).sum();
    let mut u = uniform(seed, step) * mass;
    for p in kept {
        if u < p.0 {
            return p.1;
        }
        u -= p.0;
    }
    kept.last().map_or_else(|| argmax(logits), |p| p.1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_p,
            seed: None,
        }
    }

    #[test]
    fn greedy_picks_the_argmax() {
        assert_eq!(sample(&[0.1, 3.0, -1.0, 3.0], &params(0.0, 1.0), 1, 0), 1);
    }

    #[test]
    fn same_seed_same_draws_and_seeds_differ() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let p = params(1.0, 1.0);
        let a: Vec<_> = (0..20).map(|s| sample(&logits, &p, 42, s)).collect();
        let b: Vec<_> = (0..20).map(|s| sample(&logits, &p, 42, s)).collect();
        let c: Vec<_> = (0..20).map(|s| sample(&logits, &p, 43, s)).collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn top_p_excludes_the_tail() {
        // One token holds ~88% of the mass; top_p 0.5 must always choose it.
        let logits = [5.0, 3.0, 0.0, 0.0];
        let p = params(1.0, 0.5);
        assert!((0..200).all(|s| sample(&logits, &p, 7, s) == 0));
        // Without top-p the tail shows up.
        assert!((0..200).any(|s| sample(&logits, &params(1.0, 1.0), 7, s) != 0));
    }
}
