//! `predicted-ttft-scorer`: prefers the endpoint with the lowest predicted time to first token.
//!
//! The prediction ([`crate::predict`]) adds the prefill work already queued on the endpoint, the
//! request's own uncached tokens there (CPU-tier hits at restore cost, and — with `p2p: true` — a
//! pull from a peer's CPU tier when that is cheaper), and a small per-request decode penalty.
//! Score = `best / cost` (1 for the best endpoint, in `(0, 1]`) where cost is the predicted TTFT
//! plus `work_weight − 1` times the prefill work the request adds there, so with a max-score picker
//! the request goes where it starts soon without throwing away a warm cache for a few ms; ties
//! are broken randomly by the picker.
//! Dynamo's router uses the same idea (predicted prefill tokens to compute plus decode load);
//! kvmesh adds tiers, in-flight accounting and priced pulls.

use std::sync::Arc;

use crate::candidate::{Candidate, SchedulingContext};
use crate::cost_model::CostModel;
use crate::plugin::Scorer;
use crate::predict::{Prediction, TtftParams, predict};

pub const TYPE: &str = "predicted-ttft-scorer";

pub struct PredictedTtftScorer {
    params: TtftParams,
    cost_model: Arc<CostModel>,
}

impl PredictedTtftScorer {
    pub fn new(params: TtftParams, cost_model: Arc<CostModel>) -> Self {
        PredictedTtftScorer { params, cost_model }
    }

    pub fn params(&self) -> &TtftParams {
        &self.params
    }
}

impl Scorer for PredictedTtftScorer {
    fn type_name(&self) -> &'static str {
        TYPE
    }

    fn score(&self, ctx: &SchedulingContext<'_>, candidates: &[&Candidate]) -> Vec<f64> {
        self.score_explained(ctx, candidates).0
    }

    fn score_explained(
        &self,
        ctx: &SchedulingContext<'_>,
        candidates: &[&Candidate],
    ) -> (Vec<f64>, Option<Vec<Prediction>>) {
        let predictions: Vec<Prediction> = (0..candidates.len())
            .map(|i| predict(ctx, candidates, i, &self.cost_model, &self.params))
            .collect();
        let best = predictions
            .iter()
            .map(|p| p.cost_ms)
            .fold(f64::INFINITY, f64::min);
        let scores = predictions
            .iter()
            .map(|p| {
                if p.cost_ms.is_finite() && p.cost_ms > 0.0 && best.is_finite() {
                    (best / p.cost_ms).clamp(0.0, 1.0)
                } else {
                    0.0
                }
            })
            .collect();
        (scores, Some(predictions))
    }

    fn prices_pulls(&self) -> bool {
        self.params.p2p
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost_model::CostModelParams;
    use crate::plugins::test_util::ctx;

    #[test]
    fn best_predicted_endpoint_scores_one_and_others_in_proportion() {
        let cm = Arc::new(CostModel::new(CostModelParams::default()));
        let s = PredictedTtftScorer::new(TtftParams::default(), cm);
        let mut busy = Candidate::idle(0, "busy");
        (busy.in_flight_requests, busy.in_flight_uncached_tokens) = (1, 25_000);
        let idle = Candidate::idle(1, "idle");
        let (scores, preds) = s.score_explained(&ctx(2048, 16), &[&busy, &idle]);
        let preds = preds.expect("explained");
        assert_eq!(scores[1], 1.0);
        assert!(scores[0] < 0.2, "{scores:?}");
        assert!((scores[0] - preds[1].cost_ms / preds[0].cost_ms).abs() < 1e-12);
    }
}
