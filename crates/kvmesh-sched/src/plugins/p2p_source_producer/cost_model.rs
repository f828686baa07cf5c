//! `mode: cost_model`: llm-d's sampling among the band's holders whose link serves the fewest
//! pulls this router has in flight (so a burst spreads over every holder, replicas that pulled
//! earlier included, before any link carries two), then a price check: pull only if the
//! predicted recompute time of the delta exceeds the predicted pull time, stretched by the
//! transfers already on the source's or the puller's link, plus the delay the pull adds to those
//! transfers, plus `margin_ms` (rates from [`CostModel`]).

use std::sync::Arc;

use crate::cost_model::CostModel;
use crate::predict::contended_pull_ms;

use super::policy::{P2pDecision, P2pMode, SkipReason, SourcePolicy, SourceQuery};
use super::threshold::{named, sample};

/// Threshold sampling over the least busy links, priced against recompute.
pub struct PricedByCostModel {
    /// `min_cached_token_delta`.
    pub min_delta: u64,
    /// `margin_ms`.
    pub margin_ms: f64,
    pub cost_model: Arc<CostModel>,
}

impl SourcePolicy for PricedByCostModel {
    fn mode(&self) -> P2pMode {
        P2pMode::CostModel
    }

    fn select(&self, q: &SourceQuery<'_>, d: P2pDecision) -> P2pDecision {
        let (mut d, source) = match sample(q, d, self.min_delta, true) {
            (d, Some(source)) => (d, source),
            (skipped, None) => return skipped,
        };
        let dest = q.candidates.get(q.computing);
        let dest_id = dest.map(|c| c.endpoint).unwrap_or(source.endpoint);
        let delta = d.delta_tokens.max(0) as u64;
        let recompute = self.cost_model.predict_recompute_ms(dest_id, delta);
        // Transfers already on the source's (or the puller's) link share it with this one: a hot
        // holder serving many pulls makes each slower, until recomputing wins.
        let sharing = source.pulls_out.max(dest.map_or(0, |c| c.pulls_in));
        let alone = self
            .cost_model
            .predict_pull_ms(source.endpoint, dest_id, delta);
        let floor = self.cost_model.params().pull_floor_ms;
        let pull = contended_pull_ms(alone, floor, sharing);
        // The pull also slows the transfers it joins: each of them gives up about this pull's
        // bytes' time (exactly that when they are at least as long). Priced by its own time
        // only, every puller of a burst accepts a pull until the pulls are as slow as
        // recomputing, and a fan-out ends no faster than recomputing everywhere (measured:
        // docs/benchmarks.md, hot prefixes). Recompute adds nothing to the link.
        let joined = sharing as f64 * (alone - floor.min(alone));
        // A source that failed pulls lately leaves its tokens to recompute after the pull with
        // its failure probability: that much of the saving is not expected.
        let p_fail = source.source_standing.failure_probability.clamp(0.0, 1.0);
        let expected = p_fail * recompute;
        d.predicted_recompute_ms = Some(recompute);
        d.predicted_pull_ms = Some(pull);
        if recompute <= pull + joined + expected + self.margin_ms {
            let why = format!(
                "recompute {recompute:.1} ms <= pull {pull:.1} ms ({sharing} transfers already on \
                 the link) + {joined:.1} ms it adds to them + {expected:.1} ms expected recompute \
                 (source fails {:.0} %) + margin {:.1} ms",
                p_fail * 100.0,
                self.margin_ms
            );
            return d.skip(SkipReason::Cost, why);
        }
        named(d, source)
    }
}

#[cfg(test)]
mod tests {
    use kvmesh_index::EndpointId;

    use super::super::test_util::{cand, ctx, producer};
    use super::super::{P2pMode, P2pSourceProducer, SkipReason};
    use crate::candidate::Candidate;

    #[test]
    fn cost_model_prices_the_delta() {
        // Defaults: recompute 25K tok/s; pull 26 ms + 235K tok/s. Break-even ≈ 737 tokens.
        // 640 tokens: recompute 25.6 ms vs pull 28.7 ms → skip. 1600 tokens: 64 ms vs 32.8 ms → pull.
        let p = producer(1, P2pMode::CostModel);
        let c = [cand(0, 0, 0, 0.0), cand(1, 40, 40, 0.0)];
        let refs: Vec<&Candidate> = c.iter().collect();
        let d = p.select(&ctx("x"), &refs, 0, None);
        assert_eq!(d.skipped, Some(SkipReason::Cost));
        assert!((d.predicted_recompute_ms.expect("ran") - 25.6).abs() < 1e-9);
        let c = [cand(0, 0, 0, 0.0), cand(1, 100, 100, 0.0)];
        let refs: Vec<&Candidate> = c.iter().collect();
        assert_eq!(
            p.select(&ctx("x"), &refs, 0, None).source,
            Some(EndpointId(1))
        );
    }

    #[test]
    fn cost_model_recomputes_when_the_holder_link_is_shared() {
        // 1600 tokens: alone, pull 26 + 6.8 = 32.8 ms beats recompute 64 ms. With 8 pulls already
        // out of the holder the bandwidth part is split 9 ways: 26 + 9 x 6.8 = 87.3 ms > 64 ms
        // (and it would delay the 8 others by 6.8 ms each).
        let p = producer(1, P2pMode::CostModel);
        let mut c = [cand(0, 0, 0, 0.0), cand(1, 100, 100, 0.0)];
        let refs: Vec<&Candidate> = c.iter().collect();
        let alone = p.select(&ctx("x"), &refs, 0, None);
        assert_eq!(alone.source, Some(EndpointId(1)));
        c[1].pulls_out = 8;
        let refs: Vec<&Candidate> = c.iter().collect();
        let shared = p.select(&ctx("x"), &refs, 0, None);
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
        assert_eq!(p.select(&ctx("x"), &refs, 0, None).source, None);
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
            let d = p.select(&ctx(id), &refs, dest, None);
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
            let d = p.select(&ctx(id), &refs, 0, None);
            assert_eq!(d.source, Some(EndpointId(2)), "{d:?}");
            assert_eq!(d.band, vec!["e2"]);
        }
        // Its queue is longer, so queue-weighted sampling alone sends most of them to e1.
        let to_e1 = IDS
            .iter()
            .filter(|id| {
                producer(16, P2pMode::Threshold)
                    .select(&ctx(id), &refs, 0, None)
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
}
