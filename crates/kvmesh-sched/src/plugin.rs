//! The three plugin traits ([`Filter`], [`Scorer`], [`Picker`]) and the helpers pickers share.
//!
//! Plugins are pure: no I/O, no clocks, no locks; randomness is injected as `&mut dyn RngCore`, so
//! a decision is a function of its inputs and the seed (`README.md` lists the invariants).

use rand::RngCore;

use crate::candidate::{Candidate, SchedulingContext};
use crate::predict::Prediction;

/// Scores closer than this are treated as equal by pickers (float sums of weights are inexact).
pub const SCORE_EPSILON: f64 = 1e-9;
/// The result of one filter: indices (into its input) to keep, and why, for `/debug/decisions`.
#[derive(Debug, Clone, PartialEq)]
pub struct FilterOutcome {
    pub kept: Vec<usize>,
    pub note: String,
}

/// Drops candidates. Must keep at least one if given any (a filter that would drop all keeps all).
pub trait Filter: Send + Sync {
    /// The config `type` string.
    fn type_name(&self) -> &'static str;
    fn filter(
        &self,
        ctx: &SchedulingContext<'_>,
        candidates: &[&Candidate],
        rng: &mut dyn RngCore,
    ) -> FilterOutcome;
}

/// Scores all candidates in one call; each score in `[0, 1]`, higher is better.
pub trait Scorer: Send + Sync {
    fn type_name(&self) -> &'static str;
    fn score(&self, ctx: &SchedulingContext<'_>, candidates: &[&Candidate]) -> Vec<f64>;

    /// Scores plus, for scorers that predict a time to first token, the prediction per candidate
    /// (`/debug/decisions` shows it; the P2P decision reuses it).
    fn score_explained(
        &self,
        ctx: &SchedulingContext<'_>,
        candidates: &[&Candidate],
    ) -> (Vec<f64>, Option<Vec<Prediction>>) {
        (self.score(ctx, candidates), None)
    }

    /// Whether its predictions price a pull option (`best_pull`, `pulls`): the P2P step of
    /// `mode: predicted` carries out that price instead of pricing again.
    fn prices_pulls(&self) -> bool {
        false
    }
}

/// Chooses one candidate given the weighted total scores (`scores[i]` belongs to `candidates[i]`).
pub trait Picker: Send + Sync {
    fn type_name(&self) -> &'static str;
    fn pick(
        &self,
        ctx: &SchedulingContext<'_>,
        candidates: &[&Candidate],
        scores: &[f64],
        rng: &mut dyn RngCore,
    ) -> Option<usize>;
}

/// Indices of the candidates whose score equals the maximum (within [`SCORE_EPSILON`]).
pub fn argmax_all(scores: &[f64]) -> Vec<usize> {
    let best = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    scores
        .iter()
        .enumerate()
        .filter(|(_, s)| (best - **s).abs() <= SCORE_EPSILON)
        .map(|(i, _)| i)
        .collect()
}

/// A uniformly random element of `items` (None when empty).
pub fn choose(items: &[usize], rng: &mut dyn RngCore) -> Option<usize> {
    use rand::Rng;
    if items.is_empty() {
        return None;
    }
    Some(items[rng.random_range(0..items.len())])
}
