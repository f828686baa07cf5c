//! `least-loaded-picker` (baseline): ignores scores; the fewest requests at the engine
//! (`max(scraped waiting + running, router in-flight)`), then the fewest in-flight uncached tokens;
//! remaining ties broken randomly.

use crate::candidate::{Candidate, SchedulingContext};
use crate::plugin::{Picker, choose};

pub const TYPE: &str = "least-loaded-picker";

pub struct LeastLoadedPicker;

fn load(c: &Candidate) -> (f64, u64) {
    let scraped = c.waiting.unwrap_or(0.0).max(0.0) + c.running.unwrap_or(0.0).max(0.0);
    (
        scraped.max(c.in_flight_requests as f64),
        c.in_flight_uncached_tokens,
    )
}

impl Picker for LeastLoadedPicker {
    fn type_name(&self) -> &'static str {
        TYPE
    }

    fn pick(
        &self,
        _ctx: &SchedulingContext<'_>,
        candidates: &[&Candidate],
        _scores: &[f64],
        rng: &mut dyn rand::RngCore,
    ) -> Option<usize> {
        let best = candidates
            .iter()
            .map(|c| load(c))
            .min_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal))?;
        let tied: Vec<usize> = (0..candidates.len())
            .filter(|&i| load(candidates[i]) == best)
            .collect();
        choose(&tied, rng)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugins::test_util::{ctx, rng};

    #[test]
    fn fewest_requests_then_fewest_tokens() {
        let mk = |id, reqs, toks, waiting| Candidate {
            in_flight_requests: reqs,
            in_flight_uncached_tokens: toks,
            waiting,
            ..Candidate::idle(id, "e")
        };
        // B: 1 request but scrape says 3 waiting → 3. A and C: 1 request; C has fewer tokens.
        let (a, b, c) = (
            mk(0, 1, 500, None),
            mk(1, 1, 0, Some(3.0)),
            mk(2, 1, 100, Some(0.0)),
        );
        let pick =
            LeastLoadedPicker.pick(&ctx(32, 16), &[&a, &b, &c], &[1.0, 1.0, 0.0], &mut rng(1));
        assert_eq!(pick, Some(2));
    }

    #[test]
    fn ties_spread() {
        let c: Vec<Candidate> = (0..3).map(|i| Candidate::idle(i, "e")).collect();
        let refs: Vec<&Candidate> = c.iter().collect();
        let mut r = rng(2);
        let mut seen = [false; 3];
        for _ in 0..100 {
            seen[LeastLoadedPicker
                .pick(&ctx(32, 16), &refs, &[0.0; 3], &mut r)
                .expect("pick")] = true;
        }
        assert_eq!(seen, [true; 3]);
    }
}
