//! `max-score-picker`: the highest weighted score; ties broken *randomly* (with the injected rng), so
//! cold requests do not all land on the first endpoint (`docs/architecture.md#pitfalls-we-avoid`).

use crate::candidate::{Candidate, SchedulingContext};
use crate::plugin::{Picker, argmax_all, choose};

pub const TYPE: &str = "max-score-picker";

pub struct MaxScorePicker;

impl Picker for MaxScorePicker {
    fn type_name(&self) -> &'static str {
        TYPE
    }

    fn pick(
        &self,
        _ctx: &SchedulingContext<'_>,
        _candidates: &[&Candidate],
        scores: &[f64],
        rng: &mut dyn rand::RngCore,
    ) -> Option<usize> {
        choose(&argmax_all(scores), rng)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugins::test_util::{ctx, rng};

    #[test]
    fn picks_the_unique_maximum() {
        let c: Vec<Candidate> = (0..3).map(|i| Candidate::idle(i, "e")).collect();
        let refs: Vec<&Candidate> = c.iter().collect();
        let pick = MaxScorePicker.pick(&ctx(32, 16), &refs, &[0.2, 0.9, 0.5], &mut rng(1));
        assert_eq!(pick, Some(1));
    }

    #[test]
    fn ties_are_broken_randomly_over_all_tied() {
        let c: Vec<Candidate> = (0..4).map(|i| Candidate::idle(i, "e")).collect();
        let refs: Vec<&Candidate> = c.iter().collect();
        let mut counts = [0usize; 4];
        let mut r = rng(3);
        for _ in 0..3000 {
            let i = MaxScorePicker
                .pick(&ctx(32, 16), &refs, &[1.0, 1.0, 0.3, 1.0 - 1e-12], &mut r)
                .expect("pick");
            counts[i] += 1;
        }
        assert_eq!(counts[2], 0);
        for i in [0, 1, 3] {
            assert!((800..1200).contains(&counts[i]), "{counts:?}");
        }
    }

    #[test]
    fn empty_input_picks_nothing() {
        assert_eq!(
            MaxScorePicker.pick(&ctx(32, 16), &[], &[], &mut rng(1)),
            None
        );
    }
}
