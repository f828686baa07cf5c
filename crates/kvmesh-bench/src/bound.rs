//! The physical bound of a workload's TTFT, printed next to every router's numbers: each request
//! computes only the tokens no earlier request sent (its longest run of whole leading blocks sent
//! before counts as cached on its engine: an ideal fleet holds every earlier prefix where it is
//! needed and moves nothing), alone on an idle engine of the fleet's modelled GPU. No placement
//! can beat it on the same engines; TTFT ÷ bound is what placement still leaves on the table.

use crate::driver::RequestRecord;
use crate::stats::Latency;

/// The bound's TTFT percentiles (model seconds) for the requests `records` sent, on engines of
/// the sim profile `profile`; None for an unknown profile (a real model backend has no modelled
/// speed to compute it from).
pub fn bound_ttft(records: &[RequestRecord], profile: Option<&str>) -> Option<Latency> {
    let p = kvmesh_engine::compute::profiles::profile(profile?)?;
    Some(Latency::from_secs(records.iter().filter_map(|r| {
        let novel = r.novel_tokens?.min(r.prompt_tokens);
        Some(p.prefill_chunk_ms(r.prompt_tokens - novel, novel) / 1000.0)
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_prices_novel_tokens_after_their_cached_prefix() {
        let record = |prompt_tokens, novel| RequestRecord {
            session: 0,
            step: 0,
            kind: crate::workload::StepKind::Turn,
            prompt_tokens,
            novel_tokens: Some(novel),
            sent_s: 0.0,
            ttft_s: None,
            e2e_s: 0.0,
            output_tokens: 0,
            cached_tokens: None,
            outcome: crate::client::Outcome::Ok,
        };
        // gpt-oss-120b on H200: 8,192 tokens from scratch take 250 ms, 16,384 take 510 ms.
        let b = bound_ttft(&[record(8192, 8192)], Some("gpt-oss-120b-h200")).unwrap();
        assert!((b.p50 - 0.250).abs() < 0.001, "{b:?}");
        let b = bound_ttft(&[record(16_384, 8192)], Some("gpt-oss-120b-h200")).unwrap();
        assert!((b.p50 - 0.260).abs() < 0.001, "{b:?}");
        assert!(bound_ttft(&[record(1, 1)], Some("no-such-gpu")).is_none());
        assert!(bound_ttft(&[record(1, 1)], None).is_none());
    }
}
