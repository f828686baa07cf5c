//! `p2p-source-producer`: names a peer the computing endpoint should pull the missing prefix from.
//!
//! The step after the picker. Three source policies (`mode:`), one file each behind
//! [`SourcePolicy`]:
//!
//! - [`threshold`] (the default): llm-d's semantics (`docs/protocols.md#p2p-source-producer`) —
//!   sample a holder of the best CPU-tier prefix, name it if it leads by `min_cached_token_delta`;
//! - [`cost_model`]: the same sampling among the holders whose link is least busy, plus a price
//!   check against recomputing the delta ([`CostModel`] rates);
//! - [`predicted`]: no pricing of its own — it carries out the placement's prediction
//!   ([`crate::predict`], priced by the profile's `predicted-ttft-scorer`): the chosen
//!   candidate's best pull option, named when the prediction says pulling wins. One owner per
//!   decision: the scorer's parameters price the pull, nothing here prices it again.
//!
//! What a policy sees and returns is in [`policy`]. In every mode: endpoints without a configured P2P address are never sources, nor are
//! endpoints outside the computing endpoint's KV group ([`Candidate::kv_group`]: their blocks,
//! another model, layout, dtype or block size, would be refused by the fingerprint and
//! recomputed), and a request the router may not let pull ([`SchedulingContext::may_pull`]) gets
//! no source.

pub mod cost_model;
pub mod policy;
pub mod predicted;
pub mod threshold;

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::candidate::{Candidate, SchedulingContext};
use crate::cost_model::CostModel;
use crate::predict::Prediction;

pub use self::policy::{
    P2pDecision, P2pMode, PenalisedSource, SkipReason, SourcePolicy, SourceQuery,
};

pub const TYPE: &str = "p2p-source-producer";

/// `parameters:` of a `p2p-source-producer`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct P2pParams {
    /// `threshold` and `cost_model`: the source must lead the computing endpoint by at least this
    /// many tokens (default 1, must be >= 1). Not in `predicted` mode: there the profile's
    /// `predicted-ttft-scorer` owns the threshold (`min_pull_tokens`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_cached_token_delta: Option<u64>,
    /// Accepted for llm-d config compatibility (P/D profiles); the aggregated path computes on the
    /// primary target.
    pub prefill_profile_name: String,
    pub mode: P2pMode,
    /// `cost_model`: a pull must beat recomputing by at least this much (ms, default 0). Not in
    /// `predicted` mode (the scorer's `margin_ms` prices the pull).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub margin_ms: Option<f64>,
}

impl Default for P2pParams {
    fn default() -> Self {
        P2pParams {
            min_cached_token_delta: None,
            prefill_profile_name: "prefill".to_owned(),
            mode: P2pMode::Threshold,
            margin_ms: None,
        }
    }
}

/// The plugin: its parameters and the policy they chose.
pub struct P2pSourceProducer {
    params: P2pParams,
    policy: Box<dyn SourcePolicy>,
}

impl P2pSourceProducer {
    pub fn new(params: P2pParams, cost_model: Arc<CostModel>) -> Result<Self, String> {
        let min_delta = params.min_cached_token_delta.unwrap_or(1);
        if min_delta < 1 {
            return Err("min_cached_token_delta must be >= 1".to_owned());
        }
        let margin_ms = params.margin_ms.unwrap_or(0.0);
        if !margin_ms.is_finite() {
            return Err("margin_ms must be finite".to_owned());
        }
        let policy: Box<dyn SourcePolicy> = match params.mode {
            P2pMode::Threshold => Box::new(threshold::Threshold { min_delta }),
            P2pMode::CostModel => Box::new(cost_model::PricedByCostModel {
                min_delta,
                margin_ms,
                cost_model,
            }),
            P2pMode::Predicted => {
                if params.min_cached_token_delta.is_some() || params.margin_ms.is_some() {
                    return Err(
                        "mode: predicted carries out the placement's own prediction: \
                         set the threshold and margin on the profile's predicted-ttft-scorer \
                         (min_pull_tokens, margin_ms), not here"
                            .to_owned(),
                    );
                }
                Box::new(predicted::Predicted)
            }
        };
        Ok(P2pSourceProducer { params, policy })
    }

    pub fn params(&self) -> &P2pParams {
        &self.params
    }

    /// Whether the policy carries out the placement's prediction (the profile must have a
    /// scorer that prices pulls).
    pub fn needs_prediction(&self) -> bool {
        self.policy.mode() == P2pMode::Predicted
    }

    /// Chooses a source for a request placed on `candidates[computing]` (see [`SourceQuery`]).
    pub fn select(
        &self,
        ctx: &SchedulingContext<'_>,
        candidates: &[&Candidate],
        computing: usize,
        placement: Option<&Prediction>,
    ) -> P2pDecision {
        let bs = ctx.block_size as u64;
        let computing_tokens = candidates
            .get(computing)
            .map_or(0, |c| c.any_blocks as u64 * bs);
        let d = P2pDecision::new(computing_tokens);
        if !ctx.may_pull {
            let why = "this request may not pull (held by the admission queue, \
                       pulls_when_held: false)";
            return d.skip(SkipReason::PullsOff, why.to_owned());
        }
        let q = SourceQuery {
            ctx,
            candidates,
            computing,
            placement,
        };
        let mut d = self.policy.select(&q, d);
        d.penalised_sources = penalised(candidates, computing);
        d
    }
}

/// The possible sources of a pull into `candidates[computing]` that have failed pulls lately,
/// as the decision record shows them.
fn penalised(candidates: &[&Candidate], computing: usize) -> Vec<PenalisedSource> {
    let dest = candidates.get(computing);
    candidates
        .iter()
        .enumerate()
        .filter(|&(i, c)| i != computing && c.has_p2p && c.source_standing.is_penalised())
        .filter(|(_, c)| dest.is_none_or(|d| c.same_kv_group(d)))
        .map(|(_, c)| PenalisedSource::of(c))
        .collect()
}

#[cfg(test)]
pub(crate) mod test_util {
    use super::*;
    use crate::cost_model::CostModelParams;

    pub fn producer(min: u64, mode: P2pMode) -> P2pSourceProducer {
        let p = P2pParams {
            min_cached_token_delta: Some(min),
            mode,
            ..P2pParams::default()
        };
        P2pSourceProducer::new(p, Arc::new(CostModel::new(CostModelParams::default())))
            .expect("valid")
    }

    pub fn cand(id: u32, any: usize, cpu: usize, waiting: f64) -> Candidate {
        Candidate {
            name: Arc::from(format!("e{id}")),
            any_blocks: any,
            cpu_blocks: cpu,
            gpu_blocks: any,
            waiting: Some(waiting),
            ..Candidate::idle(id, "")
        }
    }

    pub fn ctx(id: &str) -> SchedulingContext<'_> {
        SchedulingContext {
            request_id: id,
            prompt_tokens: 4096,
            total_blocks: 256,
            block_size: 16,
            max_tokens: None,
            backlog: Default::default(),
            may_pull: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use kvmesh_index::EndpointId;

    use super::test_util::*;
    use super::*;
    use crate::cost_model::CostModelParams;
    use crate::reputation::{PenaltyReason, Reputation, ReputationParams};

    #[test]
    fn no_source_is_named_for_a_request_that_may_not_pull_in_any_mode() {
        let c = [cand(0, 0, 0, 0.0), cand(1, 200, 200, 0.0)];
        let refs: Vec<&Candidate> = c.iter().collect();
        let held = SchedulingContext {
            may_pull: false,
            ..ctx("a")
        };
        for mode in [P2pMode::Threshold, P2pMode::CostModel] {
            let p = producer(16, mode);
            assert_eq!(
                p.select(&ctx("a"), &refs, 0, None).source,
                Some(EndpointId(1))
            );
            let d = p.select(&held, &refs, 0, None);
            assert_eq!((d.source, d.skipped), (None, Some(SkipReason::PullsOff)));
        }
    }

    /// Each mode, 19 requests in a row whose named pull from e1 misses (e1 advertises 3,200
    /// tokens it does not serve), its failures fed back as the router does. Returns the times
    /// e1 was named and the last decision.
    fn lying_source_run(mode: P2pMode, rep: &mut Reputation, t0: f64) -> (usize, P2pDecision) {
        use crate::predict::{TtftParams, predict};
        let cm = CostModel::new(CostModelParams::default());
        let p = if mode == P2pMode::Predicted {
            let params = P2pParams {
                mode,
                ..P2pParams::default()
            };
            P2pSourceProducer::new(params, Arc::new(CostModel::new(CostModelParams::default())))
                .expect("valid")
        } else {
            producer(16, mode)
        };
        let ttft = TtftParams {
            p2p: true,
            min_pull_tokens: 16,
            ..TtftParams::default()
        };
        let mut named = 0;
        let mut last = None;
        for k in 0..19 {
            let now = t0 + f64::from(k) * 0.1;
            let mut c = [cand(0, 0, 0, 0.0), cand(1, 200, 200, 0.0)];
            c[1].source_standing = rep.standing(EndpointId(1), now);
            let refs: Vec<&Candidate> = c.iter().collect();
            let id = format!("req-{k}");
            let ctx = ctx(&id);
            let pred = predict(&ctx, &refs, 0, &cm, &ttft);
            let d = p.select(&ctx, &refs, 0, Some(&pred));
            if d.source == Some(EndpointId(1)) {
                named += 1;
                rep.record_failure(EndpointId(1), PenaltyReason::Miss, now);
            }
            last = Some(d);
        }
        (named, last.expect("ran"))
    }

    #[test]
    fn a_lying_source_stops_being_named_in_every_mode_and_is_tried_again_after_decay() {
        for mode in [P2pMode::Threshold, P2pMode::CostModel, P2pMode::Predicted] {
            let mut rep = Reputation::new(ReputationParams::default());
            let (named, last) = lying_source_run(mode, &mut rep, 0.0);
            assert!((1..=3).contains(&named), "{mode:?}: named {named} of 19");
            // The record says who was passed over and why.
            assert_eq!(last.source, None, "{mode:?}: {last:?}");
            let pen = &last.penalised_sources;
            assert_eq!(pen.len(), 1, "{last:?}");
            assert_eq!(pen[0].endpoint, "e1");
            assert!(
                pen[0].excluded && pen[0].failure_probability >= 0.45,
                "{pen:?}"
            );
            assert!(
                pen[0].failures.get("miss").is_some_and(|m| *m > 1.9),
                "{pen:?}"
            );
            assert!(last.why.contains("e1 excluded"), "{mode:?}: {}", last.why);
            // Two half-lives later its failures weigh a quarter: it is probed again, and
            // excluded again once those pulls miss too.
            let (again, _) = lying_source_run(mode, &mut rep, 62.0);
            assert!((1..=2).contains(&again), "{mode:?}: {again}");
        }
    }

    #[test]
    fn bad_parameters_are_rejected() {
        let cm = || Arc::new(CostModel::new(CostModelParams::default()));
        let zero = P2pParams {
            min_cached_token_delta: Some(0),
            ..P2pParams::default()
        };
        assert!(P2pSourceProducer::new(zero, cm()).is_err());
        let nan = P2pParams {
            margin_ms: Some(f64::NAN),
            mode: P2pMode::CostModel,
            ..P2pParams::default()
        };
        assert!(P2pSourceProducer::new(nan, cm()).is_err());
        // In predicted mode the scorer owns the threshold and the margin: a second copy here
        // would be a second owner of the same decision.
        let twice = P2pParams {
            min_cached_token_delta: Some(512),
            mode: P2pMode::Predicted,
            ..P2pParams::default()
        };
        let err = P2pSourceProducer::new(twice, cm()).err().expect("refused");
        assert!(err.contains("min_pull_tokens"), "{err}");
        let ok = P2pParams {
            mode: P2pMode::Predicted,
            ..P2pParams::default()
        };
        assert!(P2pSourceProducer::new(ok, cm()).is_ok_and(|p| p.needs_prediction()));
    }
}
