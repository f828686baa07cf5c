//! Runs in two waves with the engines' counters scraped in between (issue 17).
//!
//! - **fork**: the parent, then the children. The counters scraped between the waves make the
//!   children's own deltas readable, so "children that recomputed the context" comes from what
//!   the engines counted (`vllm:prompt_tokens_by_source_total`), not from their TTFT.
//! - **docqa-warm**: one unmeasured warm-up request per document (placed by the arm under test),
//!   then the measured docqa conversations: the published docqa ran on a warm fleet.
//!
//! Pure: workloads in, workloads out; the runner drives the waves and scrapes.

use std::time::Duration;

use crate::tokens::Segment;
use crate::workload::{self, Scale, Session, Start, Step, StepKind, Workload, key};

/// The session of a fork's parent: the first session with a `Parent` step that another
/// session starts after. `None` for every other workload.
pub fn fork_parent(w: &Workload) -> Option<usize> {
    let parent = w
        .sessions
        .iter()
        .position(|s| s.steps.iter().any(|st| st.kind == StepKind::Parent))?;
    w.sessions
        .iter()
        .any(|s| matches!(s.start, Start::After { session, .. } if session == parent))
        .then_some(parent)
}

/// A session that sends nothing and ends at once. Emptied sessions keep every other session's
/// index, so request ids (`bench-<seed>-<session>-<step>`) stay those of the whole workload.
fn empty() -> Session {
    Session {
        start: Start::At(Duration::ZERO),
        steps: Vec::new(),
    }
}

/// The parent's wave: only the parent sends.
pub fn parent_wave(w: &Workload, parent: usize) -> Workload {
    let mut out = w.clone();
    for (i, s) in out.sessions.iter_mut().enumerate() {
        if i != parent {
            *s = empty();
        }
    }
    out
}

/// The children's wave, started right after the parent's wave ended and the counters were
/// scraped: the parent sends nothing (so its children start at once), and `spent` (model time
/// since the parent finished: scraping, wave hand-over) is taken off each child's delay so the
/// children arrive when they would have in one wave (unless `spent` exceeds a delay).
pub fn child_wave(w: &Workload, parent: usize, spent: Duration) -> Workload {
    let mut out = w.clone();
    for (i, s) in out.sessions.iter_mut().enumerate() {
        if i == parent {
            s.steps.clear();
        } else if let Start::After { session, delay } = &mut s.start
            && *session == parent
        {
            *delay = delay.saturating_sub(spent);
        }
    }
    out
}

/// Length of the context the fork's children share: the first segment of the parent's first
/// step (the children's first segment is the same seeded run).
pub fn shared_context_tokens(w: &Workload, parent: usize) -> usize {
    w.sessions
        .get(parent)
        .and_then(|s| s.steps.first())
        .and_then(|st| st.segments.first())
        .map(Segment::len)
        .unwrap_or(0)
}

/// Name of the warm-started docqa.
pub const DOCQA_WARM: &str = "docqa-warm";

/// docqa measured on a warm fleet (see [`warmup_for`]).
pub fn docqa_warm(scale: Scale, seed: u64) -> Workload {
    let mut w = workload::docqa(scale, seed);
    w.name = DOCQA_WARM.into();
    w.description.push_str(
        "; measured after an unmeasured warm-up placed each document once (one request each)",
    );
    w
}

/// The unmeasured wave to run before `w`, if it has one: for docqa-warm one request per
/// document (the document plus a question no measured turn asks, one token out), with docqa's
/// concurrency. The warm-up's sessions sit after as many empty ones, so their request ids
/// never collide with the measured turns' in the router's decision log.
pub fn warmup_for(w: &Workload) -> Option<Workload> {
    if w.name != DOCQA_WARM {
        return None;
    }
    let n = w.sessions.len();
    let mut sessions: Vec<Session> = (0..n).map(|_| empty()).collect();
    for (d, s) in w.sessions.iter().enumerate() {
        let doc = s.steps.first()?.segments.first()?.clone();
        sessions.push(Session {
            start: Start::At(Duration::ZERO),
            steps: vec![Step {
                gap: Duration::ZERO,
                history: false,
                segments: vec![doc, Segment::seeded(key(&[36, w.seed, d as u64]), 32)],
                max_tokens: 1,
                kind: StepKind::Seed,
            }],
        });
    }
    Some(Workload {
        name: format!("{} warm-up", w.name),
        description: format!("one request per document ({n})"),
        sessions,
        ..w.clone()
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::client::Outcome;
    use crate::driver::RequestRecord;
    use crate::metrics::{EngineEvidence, Evidence, WaveCounters, fmt_children};
    use crate::workload::fork;

    #[test]
    fn fork_splits_into_parent_and_children_keeping_session_numbers() {
        let w = fork(Scale::Quick, 1);
        let p = fork_parent(&w).unwrap();
        assert_eq!(p, 0);
        assert_eq!(fork_parent(&workload::docqa(Scale::Quick, 1)), None);
        let a = parent_wave(&w, p);
        let b = child_wave(&w, p, Duration::from_millis(50));
        assert_eq!(a.sessions.len(), w.sessions.len());
        assert_eq!(a.num_requests(), 1);
        assert_eq!(b.num_requests(), w.num_requests() - 1);
        assert_eq!(a.num_requests() + b.num_requests(), w.num_requests());
        // The time spent between the waves comes off the children's delays.
        match (&w.sessions[1].start, &b.sessions[1].start) {
            (Start::After { delay: d0, .. }, Start::After { delay: d1, .. }) => {
                assert_eq!(*d0 - *d1, Duration::from_millis(50))
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(shared_context_tokens(&w, p), 8192);
    }

    #[test]
    fn recomputed_children_come_from_computed_token_deltas() {
        let child = RequestRecord {
            session: 1,
            step: 0,
            kind: StepKind::Child,
            prompt_tokens: 8192 + 256,
            novel_tokens: None,
            sent_s: 0.0,
            ttft_s: Some(0.1),
            e2e_s: 0.2,
            output_tokens: 32,
            cached_tokens: None,
            outcome: Outcome::Ok,
        };
        let kids = [&child, &child, &child, &child];
        // 4 children: one recomputed the context, one pulled it, two hit it locally.
        let e = |computed: usize, hit: usize, pulled: usize| {
            EngineEvidence::from_exposition(
                "e",
                &format!(
                    "vllm:prompt_tokens_by_source_total{{source=\"local_compute\"}} {computed}\n\
                     vllm:prompt_tokens_by_source_total{{source=\"local_cache_hit\"}} {hit}\n\
                     vllm:prompt_tokens_by_source_total{{source=\"external_kv_transfer\"}} {pulled}\n"
                ),
            )
        };
        let delta = Evidence::from_engines(
            vec![e(8192 + 256, 0, 0), e(256, 0, 8192), e(512, 16384, 0)],
            vec![],
        );
        let c = WaveCounters::from_delta(&delta, &kids, 8192);
        assert_eq!(c.recomputed_children, 1.0);
        assert_eq!(c.pulled_tokens, 8192.0);
        assert_eq!(c.computed_per_engine, vec![8448.0, 256.0, 512.0]);
        assert!(c.explain().starts_with("1 = "), "{}", c.explain());
        assert_eq!(fmt_children(1.5), "1.5");
    }

    #[test]
    fn docqa_warm_up_places_every_document_once_under_fresh_ids() {
        let w = docqa_warm(Scale::Quick, 1);
        assert!(warmup_for(&workload::docqa(Scale::Quick, 1)).is_none());
        let up = warmup_for(&w).unwrap();
        let n = w.sessions.len();
        assert_eq!(up.num_requests(), n);
        assert!(up.sessions[..n].iter().all(|s| s.steps.is_empty()));
        for (d, s) in up.sessions[n..].iter().enumerate() {
            assert_eq!(s.steps[0].segments[0], w.sessions[d].steps[0].segments[0]);
            assert_ne!(s.steps[0].segments[1], w.sessions[d].steps[0].segments[1]);
        }
        assert_eq!(up.seed, w.seed);
        assert_eq!(up.max_active_sessions, w.max_active_sessions);
    }
}
