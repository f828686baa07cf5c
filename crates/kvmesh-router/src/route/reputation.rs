//! The router's side of P2P source reputation (issue 37, finding 6): the one
//! [`kvmesh_sched::reputation::Reputation`] behind a mutex, the clock it is read with, and the
//! verdict on each pull from the engine's `x-kvmesh-pull` header (read by
//! `route::remote_source::judge_pull`).
//!
//! The engine reports what its read reached ([`PullFeedback`]); the router alone knows what the
//! source advertised (the decision's source tokens), so the verdict is made here: a pull that
//! reached the advertised prefix (within a block) served it, whatever stopped it afterwards (a
//! peer that holds the document but not the question's blocks misses past it, which is normal);
//! one that fell short is a failure of the reason the engine gave. A read that did not need the
//! source, or a header that is missing or unreadable (a vLLM engine, a proxy in between), says
//! nothing about it. The mutex is held only for a lookup or an update, never across `.await`.

use std::time::Instant;

use kvmesh_core::{PullFeedback, PullFeedbackOutcome};
use kvmesh_index::EndpointId;
use kvmesh_sched::Candidate;
use kvmesh_sched::reputation::{PenaltyReason, Reputation, ReputationParams, SourceStanding};
use parking_lot::Mutex;

/// What one pull says about its source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    Served,
    Failed(PenaltyReason),
}

/// The verdict on a pull that was to bring the prompt's prefix up to `advertised_tokens` (the
/// source's advertised CPU-tier prefix), given what the engine reported; `block_tokens` is the
/// router's block size. None: the report says nothing about the source.
pub(crate) fn verdict(
    fb: &PullFeedback,
    advertised_tokens: u64,
    block_tokens: u64,
) -> Option<Verdict> {
    if fb.outcome == PullFeedbackOutcome::NotNeeded {
        return None;
    }
    // Our own full tier is not the source's doing.
    if fb.reason.as_deref() == Some("sink_full") {
        return None;
    }
    // The engine reads whole blocks of its own size and never the block holding the last
    // prompt token: expect no more than it could read, and allow one block of either size.
    let expected = advertised_tokens.min(fb.readable_tokens);
    let slack = fb.block_size.max(block_tokens);
    if fb.reached_tokens.saturating_add(slack) >= expected {
        return Some(Verdict::Served);
    }
    let reason = match fb.reason.as_deref() {
        Some("miss") => PenaltyReason::Miss,
        Some("timeout" | "pending_deadline") => PenaltyReason::Stall,
        Some("checksum" | "sink_rejected" | "mac_failed" | "protocol" | "bad_layout") => {
            PenaltyReason::VerifyFailure
        }
        _ if fb.outcome == PullFeedbackOutcome::WaitedOut => PenaltyReason::Stall,
        _ => PenaltyReason::Error,
    };
    Some(Verdict::Failed(reason))
}

/// Every source's reputation and the monotonic clock it is kept in (seconds since the router
/// started).
pub struct SourceReputations {
    inner: Mutex<Reputation>,
    origin: Instant,
}

impl SourceReputations {
    pub fn new(params: ReputationParams) -> Self {
        SourceReputations {
            inner: Mutex::new(Reputation::new(params)),
            origin: Instant::now(),
        }
    }

    fn now(&self) -> f64 {
        self.origin.elapsed().as_secs_f64()
    }

    /// Fills every candidate's [`Candidate::source_standing`] as of now.
    pub(crate) fn fill(&self, candidates: &mut [Candidate]) {
        let now = self.now();
        let rep = self.inner.lock();
        for c in candidates {
            c.source_standing = rep.standing(c.endpoint, now);
        }
    }

    /// `source`'s standing now.
    pub(crate) fn standing(&self, source: EndpointId) -> SourceStanding {
        let now = self.now();
        self.inner.lock().standing(source, now)
    }

    /// Records `verdict` against `source`; returns the standing it leaves.
    pub(crate) fn record(&self, source: EndpointId, verdict: Verdict) -> SourceStanding {
        let now = self.now();
        let mut rep = self.inner.lock();
        match verdict {
            Verdict::Served => rep.record_success(source, now),
            Verdict::Failed(reason) => rep.record_failure(source, reason, now),
        }
        rep.standing(source, now)
    }

    /// Every remembered source's standing now.
    pub fn standings(&self) -> Vec<(EndpointId, SourceStanding)> {
        let now = self.now();
        self.inner.lock().standings(now)
    }

    /// Forgets sources that are no longer endpoints.
    pub(crate) fn retain(&self, keep: impl FnMut(EndpointId) -> bool) {
        self.inner.lock().retain(keep);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fb(outcome: PullFeedbackOutcome, reason: Option<&str>, reached: u64) -> PullFeedback {
        PullFeedback {
            outcome,
            reason: reason.map(str::to_owned),
            reached_tokens: reached,
            readable_tokens: 4080,
            block_size: 16,
            elapsed_ms: 1.0,
            deadline_ms: 200.0,
        }
    }

    #[test]
    fn a_pull_that_reached_the_advertised_prefix_served_it_whatever_stopped_it_after() {
        use PullFeedbackOutcome::*;
        // Advertised 2,048 tokens; the peer had them and missed on the question's blocks.
        let partial = fb(Partial, Some("miss"), 2048);
        assert_eq!(verdict(&partial, 2048, 16), Some(Verdict::Served));
        assert_eq!(
            verdict(&fb(Complete, None, 4080), 4096, 16),
            Some(Verdict::Served),
            "the block holding the last token is never read"
        );
        // Within a block of the engine's (64-token) blocks.
        let coarse = PullFeedback {
            block_size: 64,
            ..fb(Partial, Some("miss"), 1984)
        };
        assert_eq!(verdict(&coarse, 2048, 16), Some(Verdict::Served));
    }

    #[test]
    fn a_pull_short_of_the_advertised_prefix_fails_for_the_engines_reason() {
        use PullFeedbackOutcome::*;
        let cases = [
            (fb(Failed, Some("miss"), 0), PenaltyReason::Miss),
            (fb(Partial, Some("miss"), 512), PenaltyReason::Miss),
            (fb(Failed, Some("timeout"), 0), PenaltyReason::Stall),
            (
                fb(Partial, Some("pending_deadline"), 16),
                PenaltyReason::Stall,
            ),
            (fb(WaitedOut, Some("timeout"), 0), PenaltyReason::Stall),
            (fb(WaitedOut, None, 0), PenaltyReason::Stall),
            (
                fb(Failed, Some("checksum"), 0),
                PenaltyReason::VerifyFailure,
            ),
            (
                fb(Failed, Some("sink_rejected"), 0),
                PenaltyReason::VerifyFailure,
            ),
            (
                fb(Failed, Some("mac_failed"), 0),
                PenaltyReason::VerifyFailure,
            ),
            (fb(Failed, Some("connect"), 0), PenaltyReason::Error),
            (fb(Failed, Some("peer_closed"), 0), PenaltyReason::Error),
            (fb(Failed, None, 0), PenaltyReason::Error),
        ];
        for (f, want) in cases {
            assert_eq!(verdict(&f, 2048, 16), Some(Verdict::Failed(want)), "{f}");
        }
    }

    #[test]
    fn reads_that_did_not_need_the_source_or_hit_our_full_tier_say_nothing() {
        use PullFeedbackOutcome::*;
        assert_eq!(verdict(&fb(NotNeeded, None, 4080), 2048, 16), None);
        assert_eq!(verdict(&fb(NotNeeded, Some("expired"), 0), 2048, 16), None);
        assert_eq!(verdict(&fb(Partial, Some("sink_full"), 16), 2048, 16), None);
    }

    #[test]
    fn standings_follow_the_records() {
        let r = SourceReputations::new(ReputationParams::default());
        let id = EndpointId(3);
        r.record(id, Verdict::Failed(PenaltyReason::Miss));
        let st = r.record(id, Verdict::Failed(PenaltyReason::Stall));
        assert!(st.excluded, "{st:?}");
        let mut c = [Candidate::idle(3, "e3"), Candidate::idle(4, "e4")];
        r.fill(&mut c);
        assert!(c[0].source_standing.excluded);
        assert!(!c[1].source_standing.is_penalised());
        r.retain(|e| e != id);
        assert!(r.standings().is_empty());
    }
}
