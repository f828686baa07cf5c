//! `mode: threshold` (the default): llm-d's source selection, and the sampling `cost_model`
//! shares.
//!
//! Source tokens = CPU-tier blocks × block size (pulls are served from the CPU tier); the band is
//! the endpoints whose CPU-tier prefix is within one block of the best; weight `1/(1 + waiting)`;
//! one is sampled at `fnv1a32(request_id) / 2^32 × Σw` along the cumulative weights
//! (deterministic per request id, in endpoint-id order), each weight times `1 − p` for a holder
//! whose pulls fail with estimated probability `p` ([`crate::reputation`]; an excluded holder is
//! not in the band). The computing endpoint's cached tokens
//! are counted tier-blind. No source when the sample is the computing endpoint itself or when
//! `source − computing < min_cached_token_delta` (≥ 1).

use crate::candidate::Candidate;

use super::policy::{P2pDecision, P2pMode, SkipReason, SourcePolicy, SourceQuery, no_source_why};

/// llm-d's threshold policy.
pub struct Threshold {
    /// `min_cached_token_delta`.
    pub min_delta: u64,
}

impl SourcePolicy for Threshold {
    fn mode(&self) -> P2pMode {
        P2pMode::Threshold
    }

    fn select(&self, q: &SourceQuery<'_>, d: P2pDecision) -> P2pDecision {
        match sample(q, d, self.min_delta, false) {
            (d, Some(source)) => named(d, source),
            (d, None) => d,
        }
    }
}

/// Names `source` (sampled by [`sample`]) in `d`.
pub(super) fn named(mut d: P2pDecision, source: &Candidate) -> P2pDecision {
    d.source = Some(source.endpoint);
    d.why = format!("pull {} tokens from {}", d.delta_tokens, source.name);
    d
}

/// Samples the band (see the module header); with `least_busy`, only among the band's holders
/// whose link serves the fewest pulls. The source comes back only when it is past `min_delta`
/// (not yet named); otherwise the decision says why it was skipped (no source, self, below the
/// threshold).
pub(super) fn sample<'a>(
    q: &SourceQuery<'a>,
    mut d: P2pDecision,
    min_delta: u64,
    least_busy: bool,
) -> (P2pDecision, Option<&'a Candidate>) {
    let (candidates, computing) = (q.candidates, q.computing);
    let bs = q.ctx.block_size as u64;
    let cpu_tokens = |c: &Candidate| c.cpu_blocks as u64 * bs;
    // Without a computing candidate (callers always pass one) there is no group to keep to.
    let usable = |c: &Candidate| {
        candidates
            .get(computing)
            .map_or(c.has_p2p && !c.source_standing.excluded, |dest| {
                c.can_source_for(dest)
            })
    };
    let max_cached = candidates
        .iter()
        .filter(|c| usable(c))
        .map(|c| cpu_tokens(c))
        .max()
        .unwrap_or(0);
    if max_cached == 0 {
        let why = no_source_why(candidates, computing, "holds the prefix in its CPU tier");
        return (d.skip(SkipReason::NoSource, why), None);
    }
    let mut band: Vec<usize> = (0..candidates.len())
        .filter(|&i| usable(candidates[i]) && cpu_tokens(candidates[i]) + bs >= max_cached)
        .collect();
    band.sort_by_key(|&i| candidates[i].endpoint);
    if least_busy {
        // Every holder in the band can serve the prefix, but one already serving pulls splits
        // its link with each new one (fan-out: N pullers of one holder each take ~N× as long).
        // Sampling by queue alone sends every puller of a burst to a random holder, however
        // busy its link; keeping only the holders whose link carries the fewest pulls spreads a
        // burst over every holder, replicas that pulled earlier included, before any link
        // carries two.
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
    // A holder that failed pulls lately (not yet excluded) is sampled as much less often as it
    // is likely to fail: its expected share of served pulls.
    let weights: Vec<f64> = band
        .iter()
        .map(|&i| {
            let c = candidates[i];
            let serves = 1.0 - c.source_standing.failure_probability.clamp(0.0, 0.99);
            serves / (1.0 + c.waiting.unwrap_or(0.0).max(0.0))
        })
        .collect();
    let total: f64 = weights.iter().sum();
    let x = f64::from(fnv1a32(q.ctx.request_id.as_bytes())) / 4_294_967_296.0 * total;
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
    d.delta_tokens = d.source_tokens as i64 - d.computing_tokens as i64;
    if src == computing {
        let why = "the computing endpoint is the best holder".to_owned();
        return (d.skip(SkipReason::SelfSource, why), None);
    }
    if d.delta_tokens < min_delta as i64 {
        let why = format!(
            "source leads by {} tokens < min_cached_token_delta {min_delta}",
            d.delta_tokens
        );
        return (d.skip(SkipReason::BelowThreshold, why), None);
    }
    (d, Some(source))
}

/// 32-bit FNV-1a, as llm-d hashes the request id.
fn fnv1a32(bytes: &[u8]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in bytes {
        h ^= u32::from(*b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

#[cfg(test)]
mod tests {
    use kvmesh_index::EndpointId;

    use super::super::test_util::{cand, ctx, producer};
    use super::*;

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
        let d = p.select(&ctx("a"), &refs, 0, None);
        assert_eq!(d.band, vec!["e1", "e2"]);
        assert_eq!(d.source, Some(EndpointId(2)));
        assert_eq!(d.source_tokens, 99 * 16);
        assert_eq!(d.delta_tokens, 99 * 16);
        // "": 0x811c9dc5 / 2^32 = 0.5043 × 1.5 = 0.756 → e1.
        assert_eq!(
            p.select(&ctx(""), &refs, 0, None).source,
            Some(EndpointId(1))
        );
    }

    #[test]
    fn computing_endpoint_is_counted_tier_blind_and_threshold_applies() {
        // Computing e0 holds 90 blocks (GPU only); source e1 has 100 in CPU: delta 160 tokens.
        let c = [cand(0, 90, 0, 0.0), cand(1, 100, 100, 0.0)];
        let refs: Vec<&Candidate> = c.iter().collect();
        let d = producer(160, P2pMode::Threshold).select(&ctx("x"), &refs, 0, None);
        assert_eq!(
            (d.source, d.computing_tokens, d.delta_tokens),
            (Some(EndpointId(1)), 1440, 160)
        );
        let d = producer(161, P2pMode::Threshold).select(&ctx("x"), &refs, 0, None);
        assert_eq!(d.skipped, Some(SkipReason::BelowThreshold));
        assert_eq!(d.source, None);
    }

    #[test]
    fn self_and_no_source() {
        let skipped = |c: &[Candidate]| {
            let refs: Vec<&Candidate> = c.iter().collect();
            producer(1, P2pMode::Threshold)
                .select(&ctx("x"), &refs, 0, None)
                .skipped
        };
        let c = [cand(0, 100, 100, 0.0), cand(1, 10, 10, 0.0)];
        assert_eq!(skipped(&c), Some(SkipReason::SelfSource));
        let c = [cand(0, 5, 0, 0.0), cand(1, 50, 0, 0.0)];
        assert_eq!(skipped(&c), Some(SkipReason::NoSource));
        // A holder without a P2P address is no source.
        let mut holder = cand(1, 100, 100, 0.0);
        holder.has_p2p = false;
        assert_eq!(
            skipped(&[cand(0, 0, 0, 0.0), holder]),
            Some(SkipReason::NoSource)
        );
    }
}
