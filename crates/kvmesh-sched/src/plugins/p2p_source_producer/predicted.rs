//! `mode: predicted`: carries out the placement's own prediction.
//!
//! The profile's `predicted-ttft-scorer` (with `p2p: true`) already priced, for every candidate,
//! the cheapest pull from a peer's CPU tier against recomputing the same tokens
//! ([`crate::predict`]: the pull stretched by the transfers on both ends' links, the admission
//! queue's overtaking, `margin_ms`), and placement chose with that price. This step names the
//! chosen candidate's best pull option when the prediction says pulling wins, and says why not
//! otherwise. It has no parameters of its own: one set of pricing parameters (the scorer's) owns
//! the decision, so what placement assumed is what the engine is told.

use super::policy::{P2pDecision, P2pMode, SkipReason, SourcePolicy, SourceQuery, no_source_why};

/// The placement's pull, named.
pub struct Predicted;

impl SourcePolicy for Predicted {
    fn mode(&self) -> P2pMode {
        P2pMode::Predicted
    }

    fn select(&self, q: &SourceQuery<'_>, mut d: P2pDecision) -> P2pDecision {
        let Some(pred) = q.placement else {
            let why = "no prediction for the computing endpoint (the profile's \
                       predicted-ttft-scorer did not score it)";
            return d.skip(SkipReason::NoSource, why.to_owned());
        };
        let Some(plan) = &pred.best_pull else {
            let what = "leads it in its CPU tier by the scorer's min_pull_tokens";
            let why = no_source_why(q.candidates, q.computing, what);
            return d.skip(SkipReason::NoSource, why);
        };
        d.band = vec![plan.source_endpoint.clone()];
        d.source_endpoint = Some(plan.source_endpoint.clone());
        d.source_tokens = plan.source_tokens;
        d.delta_tokens = plan.delta_tokens as i64;
        d.predicted_pull_ms = Some(plan.pull_ms);
        d.predicted_recompute_ms = Some(plan.recompute_ms);
        if !pred.pulls {
            let expected = plan.expected_recompute_ms();
            let why = if plan.pull_ms + expected + plan.margin_ms >= plan.recompute_ms {
                let failing = if expected > 0.0 {
                    format!(
                        " + {expected:.1} ms expected recompute ({} fails {:.0} % of pulls lately)",
                        plan.source_endpoint,
                        plan.failure_probability * 100.0
                    )
                } else {
                    String::new()
                };
                format!(
                    "recompute {:.1} ms <= pull {:.1} ms ({} transfers sharing the link){failing} + \
                     margin {:.1} ms",
                    plan.recompute_ms, plan.pull_ms, plan.sharing, plan.margin_ms
                )
            } else {
                format!(
                    "the pull ({:.1} ms) beats recomputing its tokens ({:.1} ms), but pulling, \
                     computing the rest and waiting for what the admission queue places ahead \
                     meanwhile, plus margin {:.1} ms, is not faster than computing here \
                     ({:.1} ms)",
                    plan.pull_ms, plan.recompute_ms, plan.margin_ms, pred.own_ms
                )
            };
            return d.skip(SkipReason::Cost, why);
        }
        d.source = Some(plan.source);
        d.why = format!(
            "pull {} tokens from {}: {:.1} ms vs recompute {:.1} ms",
            plan.delta_tokens, plan.source_endpoint, plan.pull_ms, plan.recompute_ms
        );
        if plan.failure_probability > 0.0 {
            d.why.push_str(&format!(
                " (its pulls fail {:.0} % lately: {:.1} ms of recompute expected)",
                plan.failure_probability * 100.0,
                plan.expected_recompute_ms()
            ));
        }
        d
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kvmesh_index::EndpointId;

    use super::super::test_util::{cand, ctx, producer};
    use super::super::{P2pMode, P2pParams, P2pSourceProducer, SkipReason};
    use crate::candidate::{Candidate, SchedulingContext};
    use crate::cost_model::{CostModel, CostModelParams};
    use crate::predict::{Prediction, TtftParams, predict};

    fn predicted() -> P2pSourceProducer {
        let p = P2pParams {
            mode: P2pMode::Predicted,
            ..P2pParams::default()
        };
        P2pSourceProducer::new(p, Arc::new(CostModel::new(CostModelParams::default())))
            .expect("valid")
    }

    /// What `predicted-ttft-scorer` with `p2p: true` and `min_pull_tokens: min` predicts for
    /// `candidates[at]`.
    fn placement(ctx: &SchedulingContext<'_>, c: &[&Candidate], at: usize, min: u64) -> Prediction {
        let p = TtftParams {
            p2p: true,
            min_pull_tokens: min,
            ..TtftParams::default()
        };
        predict(ctx, c, at, &CostModel::new(CostModelParams::default()), &p)
    }

    #[test]
    fn names_the_placements_cheapest_source_and_says_why_a_shared_link_loses() {
        // e1 holds 200 blocks (3,200 tokens) in CPU, e2 the same but already serves 8 pulls.
        let mut c = [
            cand(0, 0, 0, 0.0),
            cand(1, 200, 200, 5.0),
            cand(2, 200, 200, 0.0),
        ];
        c[2].pulls_out = 8;
        let refs: Vec<&Candidate> = c.iter().collect();
        let p = predicted();
        let pred = placement(&ctx("a"), &refs, 0, 512);
        let d = p.select(&ctx("a"), &refs, 0, Some(&pred));
        assert_eq!(d.source, Some(EndpointId(1)), "{d:?}");
        assert_eq!(d.delta_tokens, 3200);
        let plan = pred.best_pull.as_ref().expect("priced");
        assert_eq!(
            (d.predicted_pull_ms, d.predicted_recompute_ms),
            (Some(plan.pull_ms), Some(plan.recompute_ms)),
            "the placement's numbers, not a second prediction"
        );
        // When both sources are saturated the pull loses to recompute and is skipped, with why.
        c[1].pulls_out = 12;
        c[2].pulls_out = 12;
        let refs: Vec<&Candidate> = c.iter().collect();
        let pred = placement(&ctx("a"), &refs, 0, 512);
        let d = p.select(&ctx("a"), &refs, 0, Some(&pred));
        assert_eq!(d.source, None);
        assert_eq!(d.skipped, Some(SkipReason::Cost));
        assert!(d.why.contains("12 transfers"), "{}", d.why);
        // Below the scorer's min_pull_tokens there is no pull option, so no source.
        let pred = placement(&ctx("a"), &refs, 0, 4096);
        let d = p.select(&ctx("a"), &refs, 0, Some(&pred));
        assert_eq!(d.skipped, Some(SkipReason::NoSource));
    }

    #[test]
    fn sources_outside_the_computing_kv_group_are_never_named_in_any_mode() {
        let group = |c: &mut Candidate, g: Option<&str>| c.kv_group = g.map(Arc::from);
        let modes = [
            producer(16, P2pMode::Threshold),
            producer(16, P2pMode::CostModel),
            predicted(),
        ];
        let select = |p: &P2pSourceProducer, id: &str, refs: &[&Candidate]| {
            let pred = placement(&ctx(id), refs, 0, 16);
            p.select(&ctx(id), refs, 0, Some(&pred))
        };
        for p in &modes {
            // e0 (kvmesh engines, implicit group) computes; e1 (vLLM group) holds 200 blocks,
            // far more than any cost check needs. Many request ids, so sampling cannot hide it.
            let mut c = [cand(0, 0, 0, 0.0), cand(1, 200, 200, 0.0)];
            group(&mut c[1], Some("vllm"));
            let refs: Vec<&Candidate> = c.iter().collect();
            for id in ["a", "b", "c", "", "x", "request-42"] {
                let d = select(p, id, &refs);
                assert_eq!(d.source, None, "{d:?}");
                assert_eq!(d.skipped, Some(SkipReason::NoSource), "{d:?}");
                assert!(d.band.is_empty(), "{d:?}");
                assert!(d.why.contains("other groups"), "{}", d.why);
            }
            // Named groups on both sides, different names: still never.
            group(&mut c[0], Some("sim"));
            let refs: Vec<&Candidate> = c.iter().collect();
            assert_eq!(select(p, "a", &refs).source, None);
            // The vLLM endpoint computing: the kvmesh holder e2 is not its source, the vLLM
            // holder e1 is, though e2 holds more (and in threshold mode would take the band).
            let mut c = [
                cand(0, 0, 0, 0.0),
                cand(1, 200, 200, 0.0),
                cand(2, 250, 250, 0.0),
            ];
            group(&mut c[0], Some("vllm"));
            group(&mut c[1], Some("vllm"));
            let refs: Vec<&Candidate> = c.iter().collect();
            for id in ["a", "b", "c", "", "x", "request-42"] {
                let d = select(p, id, &refs);
                assert_eq!(d.source, Some(EndpointId(1)), "{d:?}");
                assert_eq!(d.band, vec!["e1"], "{d:?}");
                assert_eq!(d.source_tokens, 200 * 16, "{d:?}");
            }
            // Same group (implicit on both sides) still pulls.
            let c = [cand(0, 0, 0, 0.0), cand(1, 200, 200, 0.0)];
            let refs: Vec<&Candidate> = c.iter().collect();
            assert_eq!(select(p, "a", &refs).source, Some(EndpointId(1)));
        }
    }
}
