//! `weighted-random-picker`: candidate `i` with probability `score_i / Σ score`; uniform when every
//! score is zero. Spreads load while still preferring better endpoints.

use rand::Rng;

use crate::candidate::{Candidate, SchedulingContext};
use crate::plugin::Picker;

pub const TYPE: &str = "weighted-random-picker";

pub struct WeightedRandomPicker;

impl Picker for WeightedRandomPicker {
    fn type_name(&self) -> &'static str {
        TYPE
    }

    fn pick(
        &self,
        _ctx: &SchedulingContext<'_>,
        candidates: &[&Candidate],
        scores: &[f64],
        rng: &mut dyn rand::RngCore,
    ) -> Option<usize> {
        let n = candidates.len().min(scores.len());
        if n == 0 {
            return None;
        }
        let weights: Vec<f64> = scores[..n]
            .iter()
            .map(|s| if s.is_finite() { s.max(0.0) } else { 0.0 })
            .collect();
        let total: f64 = weights.iter().sum();
        if total <= 0.0 {
            return Some(rng.random_range(0..n));
        }
        let x = rng.random::<f64>() * total;
        let mut acc = 0.0;
        for (i, w) in weights.iter().enumerate() {
            acc += w;
            if x < acc {
                return Some(i);
            }
        }
        // Float rounding can leave x == total: the last positive weight.
        weights.iter().rposition(|w| *w > 0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugins::test_util::{ctx, rng};

    #[test]
    fn frequencies_follow_scores() {
        let c: Vec<Candidate> = (0..3).map(|i| Candidate::idle(i, "e")).collect();
        let refs: Vec<&Candidate> = c.iter().collect();
        let mut counts = [0usize; 3];
        let mut r = rng(11);
        for _ in 0..10_000 {
            counts[WeightedRandomPicker
                .pick(&ctx(32, 16), &refs, &[3.0, 1.0, 0.0], &mut r)
                .expect("pick")] += 1;
        }
        assert_eq!(counts[2], 0);
        assert!((7300..7700).contains(&counts[0]), "{counts:?}");
    }

    #[test]
    fn all_zero_is_uniform() {
        let c: Vec<Candidate> = (0..2).map(|i| Candidate::idle(i, "e")).collect();
        let refs: Vec<&Candidate> = c.iter().collect();
        let mut r = rng(5);
        let ones = (0..2000)
            .filter(|_| {
                WeightedRandomPicker.pick(&ctx(32, 16), &refs, &[0.0, 0.0], &mut r) == Some(1)
            })
            .count();
        assert!((850..1150).contains(&ones), "{ones}");
    }
}
