//! `p2p-source-producer`: names a peer the computing endpoint should pull the missing prefix from.
//!
//! Exactly llm-d's semantics (`docs/protocols.md#p2p-source-producer`): source tokens = CPU-tier blocks × block size (pulls are
//! served from the CPU tier); candidates are the endpoints whose CPU-tier prefix is within one block
//! of the best; weight `1/(1 + waiting)`; one is sampled at `fnv1a32(request_id) / 2^32 × Σw` along
//! the cumulative weights (deterministic per request id, in endpoint-id order). The computing
//! endpoint's cached tokens are counted tier-blind. No source when the sample is the computing
//! endpoint itself or when `source − computing < minCachedTokenDelta` (≥ 1).
//!
//! `mode: cost_model` samples only among the band's holders whose link serves the fewest pulls
//! this router has in flight (so a burst spreads over every holder, replicas that pulled
//! earlier included, before any link carries two), and adds a price check: pull only if the
//! predicted recompute time of the delta exceeds the predicted pull time, stretched by the
//! transfers already on the source's or the puller's link, plus the delay the pull adds to those
//! transfers, plus `marginMs` (rates from [`CostModel`]). `mode: predicted`
//! replaces sampling and threshold by the placement cost function ([`crate::predict`]): the source
//! is the peer with the cheapest pull path, priced with the transfers already in flight on both
//! ends, and it is named only when the pull beats recomputing the same tokens.
//! Endpoints without a configured P2P address are never sources, and in every mode neither are
//! endpoints outside the computing endpoint's KV group ([`Candidate::kv_group`]): their blocks
//! (another model, layout, dtype or block size) would be refused by the fingerprint and
//! recomputed, so naming them only wastes a round trip and counts a failure.

use std::sync::Arc;

use kvmesh_index::EndpointId;
use serde::{Deserialize, Serialize};

use crate::candidate::{Candidate, SchedulingContext};
use crate::cost_model::CostModel;
use crate::predict::{RateSource, TtftParams, contended_pull_ms, predict};

pub const TYPE: &str = "p2p-source-producer";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum P2pMode {
    /// llm-d: pull whenever the delta reaches `minCachedTokenDelta`.
    #[default]
    Threshold,
    /// Sample only among the holders whose link serves the fewest pulls, and additionally
    /// require predicted recompute > predicted (contended) pull + the delay it adds to the
    /// transfers it joins + margin.
    CostModel,
    /// The placement cost function ([`crate::predict`]): pull from the peer whose pull path gives
    /// the lowest predicted TTFT, and only when the pull (stretched by the transfers already on
    /// both ends' links) plus `marginMs` beats recomputing the same tokens on the destination.
    Predicted,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct P2pParams {
    #[serde(alias = "min_cached_token_delta", rename = "minCachedTokenDelta")]
    pub min_cached_token_delta: u64,
    /// Accepted for llm-d config compatibility (P/D profiles); the aggregated path computes on the
    /// primary target.
    #[serde(alias = "prefill_profile_name", rename = "prefillProfileName")]
    pub prefill_profile_name: String,
    pub mode: P2pMode,
    #[serde(alias = "margin_ms", rename = "marginMs")]
    pub margin_ms: f64,
    /// `mode: predicted`: CPU tier → GPU copy rate of the destination (tokens/s).
    #[serde(alias = "restore_tokens_per_second", rename = "restoreTokensPerSecond")]
    pub restore_tokens_per_second: f64,
    /// `mode: predicted`: configured or learned rates (see [`crate::predict::RateSource`]).
    pub rates: RateSource,
}

impl Default for P2pParams {
    fn default() -> Self {
        P2pParams {
            min_cached_token_delta: 1,
            prefill_profile_name: "prefill".to_owned(),
            mode: P2pMode::Threshold,
            margin_ms: 0.0,
            restore_tokens_per_second: TtftParams::default().restore_tokens_per_second,
            rates: RateSource::Configured,
        }
    }
}

/// Why no source was named.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SkipReason {
    /// No endpoint holds any of the prefix in its CPU tier (or none has a P2P address).
    NoSource,
    /// The sampled source is the computing endpoint.
    SelfSource,
    /// The source leads the computing endpoint by less than `minCachedTokenDelta`.
    BelowThreshold,
    /// Cost model: recomputing the delta is predicted to be no slower than pulling it.
    Cost,
}

impl SkipReason {
    pub fn as_str(self) -> &'static str {
        match self {
            SkipReason::NoSource => "no_source",
            SkipReason::SelfSource => "self",
            SkipReason::BelowThreshold => "below_threshold",
            SkipReason::Cost => "cost",
        }
    }
}

/// Outcome of source selection, with everything `/debug/decisions` shows.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct P2pDecision {
    /// The named source (what the router turns into `remote_kv_source`).
    #[serde(skip)]
    pub source: Option<EndpointId>,
    pub source_endpoint: Option<String>,
    pub skipped: Option<SkipReason>,
    /// CPU-tier tokens of the sampled source (0 if none).
    pub source_tokens: u64,
    /// Tier-blind cached tokens of the computing endpoint.
    pub computing_tokens: u64,
    pub delta_tokens: i64,
    /// Cost-model predictions (ms) when that mode ran.
    pub predicted_recompute_ms: Option<f64>,
    pub predicted_pull_ms: Option<f64>,
    /// Sources considered (names), in sampling order.
    pub band: Vec<String>,
    pub why: String,
}

/// 32-bit FNV-1a, as llm-d hashes the request id.
pub fn fnv1a32(bytes: &[u8]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in bytes {
        h ^= u32::from(*b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

pub struct P2pSourceProducer {
    params: P2pParams,
    cost_model: Arc<CostModel>,
}

impl P2pSourceProducer {
    pub fn new(params: P2pParams, cost_model: Arc<CostModel>) -> Result<Self, String> {
        if params.min_cached_token_delta < 1 {
            return Err("minCachedTokenDelta must be >= 1".to_owned());
        }
        if !params.margin_ms.is_finite() {
            return Err("marginMs must be finite".to_owned());
        }
        if !(params.restore_tokens_per_second.is_finite() && params.restore_tokens_per_second > 0.0)
        {
            return Err("restoreTokensPerSecond must be a finite number > 0".to_owned());
        }
        Ok(P2pSourceProducer { params, cost_model })
    }

    pub fn params(&self) -> &P2pParams {
        &self.params
    }

    /// Chooses a source for a request placed on `candidates[computing]`. `candidates` are all
    /// healthy endpoints (not only those the filters kept: any peer of the computing endpoint's
    /// KV group can serve a pull).
    pub fn select(
        &self,
        ctx: &SchedulingContext<'_>,
        candidates: &[&Candidate],
        computing: usize,
    ) -> P2pDecision {
        let bs = ctx.block_size as u64;
        let computing_tokens = candidates
            .get(computing)
            .map_or(0, |c| c.any_blocks as u64 * bs);
        let mut d = P2pDecision {
            source: None,
            source_endpoint: None,
            skipped: None,
            source_tokens: 0,
            computing_tokens,
            delta_tokens: 0,
            predicted_recompute_ms: None,
            predicted_pull_ms: None,
            band: Vec::new(),
            why: String::new(),
        };
        if self.params.mode == P2pMode::Predicted {
            return self.select_predicted(ctx, candidates, computing, d);
        }
        let cpu_tokens = |c: &Candidate| c.cpu_blocks as u64 * bs;
        // Without a computing candidate (callers always pass one) there is no group to keep to.
        let usable = |c: &Candidate| {
            candidates
                .get(computing)
                .map_or(c.has_p2p, |dest| c.can_source_for(dest))
        };
        let max_cached = candidates
            .iter()
            .filter(|c| usable(c))
            .map(|c| cpu_tokens(c))
            .max()
            .unwrap_or(0);
        if max_cached == 0 {
            d.skipped = Some(SkipReason::NoSource);
            d.why = no_source_why(candidates, computing, "holds the prefix in its CPU tier");
            return d;
        }
        let mut band: Vec<usize> = (0..candidates.len())
            .filter(|&i| usable(candidates[i]) && cpu_tokens(candidates[i]) + bs >= max_cached)
            .collect();
        band.sort_by_key(|&i| candidates[i].endpoint);
        if self.params.mode == P2pMode::CostModel {
            // Every holder in the band can serve the prefix, but one already serving pulls
            // splits its link with each new one (fan-out: N pullers of one holder each take
            // ~N× as long). Sampling by queue alone sends every puller of a burst to a
            // random holder, however busy its link; keeping only the holders whose link
            // carries the fewest pulls spreads a burst over every holder, replicas that
            // pulled earlier included, before any link carries two.
            let least = band
                .iter()
                .map(|&i| candidates[i].pulls_out)
                .min()
                .unwrap_or(0);
            band.retain(|&i| candidates[i].pulls_out == least);
        }
        d.band = band
            .iter()
            .map(|&i| candidates[i].name.to_string())
            .collect();
        let weights: Vec<f64> = band
            .iter()
            .map(|&i| 1.0 / (1.0 + candidates[i].waiting.unwrap_or(0.0).max(0.0)))
            .collect();
        let total: f64 = weights.iter().sum();
        let x = f64::from(fnv1a32(ctx.request_id.as_bytes())) / 4_294_967_296.0 * total;
        let mut acc = 0.0;
        let mut pos = band.len() - 1;
        for (k, w) in weights.iter().enumerate() {
            acc += w;
            if x < acc {
                pos = k;
                break;
            }
        }
        let src = band[pos];
        let source = candidates[src];
        d.source_tokens = cpu_tokens(source);
        d.source_endpoint = Some(source.name.to_string());
        d.delta_tokens = d.source_tokens as i64 - computing_tokens as i64;
        if src == computing {
            d.skipped = Some(SkipReason::SelfSource);
            d.why = "the computing endpoint is the best holder".to_owned();
            return d;
        }
        if d.delta_tokens < self.params.min_cached_token_delta as i64 {
            d.skipped = Some(SkipReason::BelowThreshold);
            d.why = format!(
                "source leads by {} tokens < minCachedTokenDelta {}",
                d.delta_tokens, self.params.min_cached_token_delta
            );
            return d;
        }
        if self.params.mode == P2pMode::CostModel {
            let dest = candidates.get(computing);
            let dest_id = dest.map(|c| c.endpoint).unwrap_or(source.endpoint);
            let delta = d.delta_tokens as u64;
            let recompute = self.cost_model.predict_recompute_ms(dest_id, delta);
            // Transfers already on the source's (or the puller's) link share it with this one:
            // a hot holder serving many pulls makes each slower, until recomputing wins.
            let sharing = source.pulls_out.max(dest.map_or(0, |c| c.pulls_in));
            let alone = self
                .cost_model
                .predict_pull_ms(source.endpoint, dest_id, delta);
            let floor = self.cost_model.params().pull_floor_ms;
            let pull = contended_pull_ms(alone, floor, sharing);
            // The pull also slows the transfers it joins: each of them gives up about this
            // pull's bytes' time (exactly that when they are at least as long). Priced by its
            // own time only, every puller of a burst accepts a pull until the pulls are as slow
            // as recomputing, and a fan-out ends no faster than recomputing everywhere
            // (measured: docs/benchmarks.md, hot prefixes). Recompute adds nothing to the link.
            let joined = sharing as f64 * (alone - floor.min(alone));
            d.predicted_recompute_ms = Some(recompute);
            d.predicted_pull_ms = Some(pull);
            if recompute <= pull + joined + self.params.margin_ms {
                d.skipped = Some(SkipReason::Cost);
                d.why = format!(
                    "recompute {recompute:.1} ms <= pull {pull:.1} ms ({sharing} transfers already on the link) + {joined:.1} ms it adds to them + margin {:.1} ms",
                    self.params.margin_ms
                );
                return d;
            }
        }
        d.source = Some(source.endpoint);
        d.why = format!("pull {} tokens from {}", d.delta_tokens, source.name);
        d
    }

    /// The TTFT parameters `mode: predicted` prices pulls with.
    pub fn ttft_params(&self) -> TtftParams {
        TtftParams {
            restore_tokens_per_second: self.params.restore_tokens_per_second,
            p2p: true,
            min_pull_tokens: self.params.min_cached_token_delta,
            margin_ms: self.params.margin_ms.max(0.0),
            rates: self.params.rates,
            ..TtftParams::default()
        }
    }

    fn select_predicted(
        &self,
        ctx: &SchedulingContext<'_>,
        candidates: &[&Candidate],
        computing: usize,
        mut d: P2pDecision,
    ) -> P2pDecision {
        let pred = predict(
            ctx,
            candidates,
            computing,
            &self.cost_model,
            &self.ttft_params(),
        );
        let Some(plan) = pred.best_pull else {
            d.skipped = Some(SkipReason::NoSource);
            d.why = no_source_why(
                candidates,
                computing,
                &format!(
                    "leads by >= {} tokens in its CPU tier",
                    self.params.min_cached_token_delta
                ),
            );
            return d;
        };
        d.band = vec![plan.source_endpoint.clone()];
        d.source_endpoint = Some(plan.source_endpoint.clone());
        d.source_tokens = plan.source_tokens;
        d.delta_tokens = plan.delta_tokens as i64;
        d.predicted_pull_ms = Some(plan.pull_ms);
        d.predicted_recompute_ms = Some(plan.recompute_ms);
        if !pred.pulls {
            d.skipped = Some(SkipReason::Cost);
            d.why = format!(
                "recompute {:.1} ms <= pull {:.1} ms ({} transfers sharing the link) + margin {:.1} ms",
                plan.recompute_ms, plan.pull_ms, plan.sharing, self.params.margin_ms
            );
            return d;
        }
        d.source = Some(plan.source);
        d.why = format!(
            "pull {} tokens from {}: {:.1} ms vs recompute {:.1} ms",
            plan.delta_tokens, plan.source_endpoint, plan.pull_ms, plan.recompute_ms
        );
        d
    }
}

/// Why no source was found: "no peer <what>", plus, when a holder exists only outside the
/// computing endpoint's KV group, that it was passed over for that reason (`/debug/decisions`
/// should not look like the prefix is nowhere).
fn no_source_why(candidates: &[&Candidate], computing: usize, what: &str) -> String {
    let mut why = format!("no peer {what}");
    let Some(dest) = candidates.get(computing) else {
        return why;
    };
    let other_group = candidates
        .iter()
        .filter(|c| c.has_p2p && c.cpu_blocks > 0 && !c.same_kv_group(dest))
        .count();
    if other_group > 0 {
        why.push_str(&format!(
            " in KV group {} ({other_group} holder(s) in other groups are never sources)",
            dest.kv_group.as_deref().unwrap_or("(default)")
        ));
    }
    why
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost_model::CostModelParams;

    fn producer(min: u64, mode: P2pMode) -> P2pSourceProducer {
        let p = P2pParams {
            min_cached_token_delta: min,
            mode,
            ..P2pParams::default()
        };
        P2pSourceProducer::new(p, Arc::new(CostModel::new(CostModelParams::default())))
            .expect("valid")
    }

    fn cand(id: u32, any: usize, cpu: usize, waiting: f64) -> Candidate {
        Candidate {
            name: Arc::from(format!("e{id}")),
            any_blocks: any,
            cpu_blocks: cpu,
            gpu_blocks: any,
            waiting: Some(waiting),
            ..Candidate::idle(id, "")
        }
    }

    fn ctx(id: &str) -> SchedulingContext<'_> {
        SchedulingContext {
            request_id: id,
            prompt_tokens: 4096,
            total_blocks: 256,
            block_size: 16,
            max_tokens: None,
            backlog: Default::default(),
        }
    }

    #[test]
    fn predicted_mode_names_the_cheapest_source_and_prices_link_sharing() {
        // e1 holds 200 blocks (3,200 tokens) in CPU, e2 the same but already serves 8 pulls.
        let mut c = [
            cand(0, 0, 0, 0.0),
            cand(1, 200, 200, 5.0),
            cand(2, 200, 200, 0.0),
        ];
        c[1].pulls_out = 0;
        c[2].pulls_out = 8;
        let refs: Vec<&Candidate> = c.iter().collect();
        let p = producer(512, P2pMode::Predicted);
        let d = p.select(&ctx("a"), &refs, 0);
        assert_eq!(d.source, Some(EndpointId(1)), "{d:?}");
        assert_eq!(d.delta_tokens, 3200);
        let (pull, rec) = (
            d.predicted_pull_ms.expect("priced"),
            d.predicted_recompute_ms.expect("priced"),
        );
        assert!(pull < rec, "{d:?}");
        // When both sources are saturated the pull loses to recompute and is skipped, with why.
        c[1].pulls_out = 12;
        c[2].pulls_out = 12;
        let refs: Vec<&Candidate> = c.iter().collect();
        let d = p.select(&ctx("a"), &refs, 0);
        assert_eq!(d.source, None);
        assert_eq!(d.skipped, Some(SkipReason::Cost));
        assert!(d.why.contains("12 transfers"), "{}", d.why);
        // Below minCachedTokenDelta nothing is priced.
        let d = producer(4096, P2pMode::Predicted).select(&ctx("a"), &refs, 0);
        assert_eq!(d.skipped, Some(SkipReason::NoSource));
    }

    #[test]
    fn fnv1a32_test_vectors() {
        assert_eq!(fnv1a32(b""), 0x811c_9dc5);
        assert_eq!(fnv1a32(b"a"), 0xe40c_292c);
        assert_eq!(fnv1a32(b"foobar"), 0xbf9c_f968);
    }

    #[test]
    fn samples_the_band_deterministically_by_request_id() {
        // e1: 100 CPU blocks, waiting 0 (w 1); e2: 99 blocks (within one block), waiting 1 (w 0.5);
        // e3: 98 blocks (out of band). Computing endpoint e0 holds nothing.
        let c = [
            cand(0, 0, 0, 0.0),
            cand(1, 100, 100, 0.0),
            cand(2, 99, 99, 1.0),
            cand(3, 98, 98, 0.0),
        ];
        let refs: Vec<&Candidate> = c.iter().collect();
        let p = producer(1, P2pMode::Threshold);
        // "a": 0xe40c292c / 2^32 = 0.8908 × 1.5 = 1.336 → past e1's 1.0 → e2.
        let d = p.select(&ctx("a"), &refs, 0);
        assert_eq!(d.band, vec!["e1", "e2"]);
        assert_eq!(d.source, Some(EndpointId(2)));
        assert_eq!(d.source_tokens, 99 * 16);
        assert_eq!(d.delta_tokens, 99 * 16);
        // "": 0x811c9dc5 / 2^32 = 0.5043 × 1.5 = 0.756 → e1.
        assert_eq!(p.select(&ctx(""), &refs, 0).source, Some(EndpointId(1)));
    }

    #[test]
    fn computing_endpoint_is_counted_tier_blind_and_threshold_applies() {
        // Computing e0 holds 90 blocks (GPU only); source e1 has 100 in CPU: delta 160 tokens.
        let c = [cand(0, 90, 0, 0.0), cand(1, 100, 100, 0.0)];
        let refs: Vec<&Candidate> = c.iter().collect();
        let d = producer(160, P2pMode::Threshold).select(&ctx("x"), &refs, 0);
        assert_eq!(
            (d.source, d.computing_tokens, d.delta_tokens),
            (Some(EndpointId(1)), 1440, 160)
        );
        let d = producer(161, P2pMode::Threshold).select(&ctx("x"), &refs, 0);
        assert_eq!(d.skipped, Some(SkipReason::BelowThreshold));
        assert_eq!(d.source, None);
    }

    #[test]
    fn self_and_no_source() {
        let c = [cand(0, 100, 100, 0.0), cand(1, 10, 10, 0.0)];
        let refs: Vec<&Candidate> = c.iter().collect();
        assert_eq!(
            producer(1, P2pMode::Threshold)
                .select(&ctx("x"), &refs, 0)
                .skipped,
            Some(SkipReason::SelfSource)
        );
        let c = [cand(0, 5, 0, 0.0), cand(1, 50, 0, 0.0)];
        let refs: Vec<&Candidate> = c.iter().collect();
        assert_eq!(
            producer(1, P2pMode::Threshold)
                .select(&ctx("x"), &refs, 0)
                .skipped,
            Some(SkipReason::NoSource)
        );
    }

    #[test]
    fn endpoints_without_p2p_are_not_sources() {
        let mut holder = cand(1, 100, 100, 0.0);
        holder.has_p2p = false;
        let c = [cand(0, 0, 0, 0.0), holder];
        let refs: Vec<&Candidate> = c.iter().collect();
        assert_eq!(
            producer(1, P2pMode::Threshold)
                .select(&ctx("x"), &refs, 0)
                .skipped,
            Some(SkipReason::NoSource)
        );
    }

    #[test]
    fn sources_outside_the_computing_kv_group_are_never_named_in_any_mode() {
        let group = |c: &mut Candidate, g: Option<&str>| c.kv_group = g.map(Arc::from);
        for mode in [P2pMode::Threshold, P2pMode::CostModel, P2pMode::Predicted] {
            let p = producer(16, mode);
            // e0 (kvmesh engines, implicit group) computes; e1 (vLLM group) holds 200 blocks,
            // far more than any cost check needs. Many request ids, so sampling cannot hide it.
            let mut c = [cand(0, 0, 0, 0.0), cand(1, 200, 200, 0.0)];
            group(&mut c[1], Some("vllm"));
            let refs: Vec<&Candidate> = c.iter().collect();
            for id in ["a", "b", "c", "", "x", "request-42"] {
                let d = p.select(&ctx(id), &refs, 0);
                assert_eq!(d.source, None, "{mode:?} {d:?}");
                assert_eq!(d.skipped, Some(SkipReason::NoSource), "{mode:?} {d:?}");
                assert!(d.band.is_empty(), "{mode:?} {d:?}");
                assert!(d.why.contains("other groups"), "{mode:?} {}", d.why);
            }
            // Named groups on both sides, different names: still never.
            group(&mut c[0], Some("sim"));
            let refs: Vec<&Candidate> = c.iter().collect();
            assert_eq!(p.select(&ctx("a"), &refs, 0).source, None, "{mode:?}");
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
                let d = p.select(&ctx(id), &refs, 0);
                assert_eq!(d.source, Some(EndpointId(1)), "{mode:?} {d:?}");
                assert_eq!(d.band, vec!["e1"], "{mode:?} {d:?}");
                assert_eq!(d.source_tokens, 200 * 16, "{mode:?} {d:?}");
            }
            // Same group (implicit on both sides) still pulls.
            let c = [cand(0, 0, 0, 0.0), cand(1, 200, 200, 0.0)];
            let refs: Vec<&Candidate> = c.iter().collect();
            assert_eq!(
                p.select(&ctx("a"), &refs, 0).source,
                Some(EndpointId(1)),
                "{mode:?}"
            );
        }
    }

    #[test]
    fn cost_model_prices_the_delta() {
        // Defaults: recompute 25K tok/s; pull 26 ms + 235K tok/s. Break-even ≈ 737 tokens.
        // 640 tokens: recompute 25.6 ms vs pull 28.7 ms → skip. 1600 tokens: 64 ms vs 32.8 ms → pull.
        let p = producer(1, P2pMode::CostModel);
        let c = [cand(0, 0, 0, 0.0), cand(1, 40, 40, 0.0)];
        let refs: Vec<&Candidate> = c.iter().collect();
        let d = p.select(&ctx("x"), &refs, 0);
        assert_eq!(d.skipped, Some(SkipReason::Cost));
        assert!((d.predicted_recompute_ms.expect("ran") - 25.6).abs() < 1e-9);
        let c = [cand(0, 0, 0, 0.0), cand(1, 100, 100, 0.0)];
        let refs: Vec<&Candidate> = c.iter().collect();
        assert_eq!(p.select(&ctx("x"), &refs, 0).source, Some(EndpointId(1)));
    }

    #[test]
    fn cost_model_recomputes_when_the_holder_link_is_shared() {
        // 1600 tokens: alone, pull 26 + 6.8 = 32.8 ms beats recompute 64 ms. With 8 pulls already
        // out of the holder the bandwidth part is split 9 ways: 26 + 9 x 6.8 = 87.3 ms > 64 ms
        // (and it would delay the 8 others by 6.8 ms each).
        let p = producer(1, P2pMode::CostModel);
        let mut c = [cand(0, 0, 0, 0.0), cand(1, 100, 100, 0.0)];
        let refs: Vec<&Candidate> = c.iter().collect();
        let alone = p.select(&ctx("x"), &refs, 0);
        assert_eq!(alone.source, Some(EndpointId(1)));
        c[1].pulls_out = 8;
        let refs: Vec<&Candidate> = c.iter().collect();
        let shared = p.select(&ctx("x"), &refs, 0);
        assert_eq!(shared.source, None, "{shared:?}");
        assert_eq!(shared.skipped, Some(SkipReason::Cost));
        let pull = shared.predicted_pull_ms.expect("priced");
        assert!(
            (pull - (26.0 + 9.0 * 1600.0 / 235.0)).abs() < 1e-6,
            "{pull}"
        );
        assert!(shared.why.contains("8 transfers"), "{}", shared.why);
        assert!(shared.why.contains("54.5 ms it adds"), "{}", shared.why);
        // The puller's own ingress counts the same way.
        c[1].pulls_out = 0;
        c[0].pulls_in = 8;
        let refs: Vec<&Candidate> = c.iter().collect();
        assert_eq!(p.select(&ctx("x"), &refs, 0).source, None);
    }

    /// Names sources for `ids` one after another, as a burst arriving at once: each named
    /// pull stays on its source's link (`pulls_out`) and the puller's (`pulls_in`), as the
    /// router's load counters keep them until the pull is over. Returns the sources named.
    fn burst(p: &P2pSourceProducer, c: &mut [Candidate], ids: &[&str]) -> Vec<Option<u32>> {
        let mut named = Vec::new();
        for (k, id) in ids.iter().enumerate() {
            // Each request computes on its own fresh engine (the last candidates).
            let dest = c.len() - ids.len() + k;
            let refs: Vec<&Candidate> = c.iter().collect();
            let d = p.select(&ctx(id), &refs, dest);
            if let Some(src) = d.source {
                c[src.0 as usize].pulls_out += 1;
                c[dest].pulls_in += 1;
            }
            named.push(d.source.map(|s| s.0));
        }
        named
    }

    const IDS: [&str; 12] = [
        "r0", "r1", "r2", "r3", "r4", "r5", "r6", "r7", "r8", "r9", "r10", "r11",
    ];

    #[test]
    fn cost_model_spreads_a_burst_over_every_holder() {
        // Three holders of the same 3,200 tokens (e.g. the original and two replicas that
        // pulled it earlier), six cold pullers arriving at once.
        let fleet = || {
            let mut c = vec![
                cand(0, 200, 200, 0.0),
                cand(1, 200, 200, 0.0),
                cand(2, 200, 200, 0.0),
            ];
            c.extend((3..9).map(|i| cand(i, 0, 0, 0.0)));
            c
        };
        let per_holder = |c: &[Candidate]| [c[0].pulls_out, c[1].pulls_out, c[2].pulls_out];
        let mut c = fleet();
        let named = burst(&producer(16, P2pMode::CostModel), &mut c, &IDS[..6]);
        assert!(named.iter().all(Option::is_some), "{named:?}");
        assert_eq!(per_holder(&c), [2, 2, 2], "{named:?}");
        // llm-d's sampling (threshold mode) ignores the links: the same burst piles up.
        let mut c = fleet();
        burst(&producer(16, P2pMode::Threshold), &mut c, &IDS[..6]);
        assert_ne!(per_holder(&c), [2, 2, 2]);
    }

    #[test]
    fn cost_model_prefers_a_replica_whose_link_is_idle() {
        // e1 computed the prefix and serves three pulls; e2 pulled it earlier and serves none.
        let mut c = [
            cand(0, 0, 0, 0.0),
            cand(1, 200, 200, 0.0),
            cand(2, 200, 200, 3.0),
        ];
        c[1].pulls_out = 3;
        let refs: Vec<&Candidate> = c.iter().collect();
        let p = producer(16, P2pMode::CostModel);
        for id in IDS {
            let d = p.select(&ctx(id), &refs, 0);
            assert_eq!(d.source, Some(EndpointId(2)), "{d:?}");
            assert_eq!(d.band, vec!["e2"]);
        }
        // Its queue is longer, so queue-weighted sampling alone sends most of them to e1.
        let to_e1 = IDS
            .iter()
            .filter(|id| {
                producer(16, P2pMode::Threshold)
                    .select(&ctx(id), &refs, 0)
                    .source
                    == Some(EndpointId(1))
            })
            .count();
        assert!(to_e1 > 0);
    }

    #[test]
    fn cost_model_recomputes_once_a_fan_out_makes_pulling_slower() {
        // One holder of 8,192 tokens, twelve cold pullers at once. Alone a pull is predicted at
        // 26 + 34.9 ms against 327.7 ms of recompute. With s pulls already out of the holder it
        // takes 26 + (1 + s) x 34.9 ms and delays each of the s by 34.9 ms: 26 + (1 + 2s) x
        // 34.9 ms, which passes recompute at s = 4 (339.7 ms). So four pull and eight
        // recompute; the threshold profile pulls all twelve.
        let fleet = || {
            let mut c = vec![cand(0, 512, 512, 0.0)];
            c.extend((1..13).map(|i| cand(i, 0, 0, 0.0)));
            c
        };
        let mut c = fleet();
        let named = burst(&producer(16, P2pMode::CostModel), &mut c, &IDS);
        let pulls = named.iter().filter(|s| s.is_some()).count();
        assert_eq!(pulls, 4, "{named:?}");
        assert!(named[4..].iter().all(Option::is_none), "{named:?}");
        let mut c = fleet();
        let named = burst(&producer(16, P2pMode::Threshold), &mut c, &IDS);
        assert_eq!(named.iter().filter(|s| s.is_some()).count(), 12);
    }

    #[test]
    fn zero_threshold_is_rejected() {
        let p = P2pParams {
            min_cached_token_delta: 0,
            ..P2pParams::default()
        };
        assert!(
            P2pSourceProducer::new(p, Arc::new(CostModel::new(CostModelParams::default())))
                .is_err()
        );
    }
}
