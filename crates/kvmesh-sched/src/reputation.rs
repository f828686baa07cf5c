//! Source reputation: how far the router trusts a P2P source to serve the pull it is named for
//! (issue 37, finding 6: a source that advertised blocks it did not serve was named 19 times out
//! of 19, and a stalling one cost every request the flat pull timeout).
//!
//! Per source, per reason ([`PenaltyReason`]: miss, stall, verification failure, other error),
//! failed pulls add weight and served pulls add credit; both halve every `half_life_s`, so an old
//! lie is forgiven and old good service does not shield a new lie. The estimated probability that
//! the next pull from a source fails is
//!
//! ```text
//! p = F / (F + S + prior_successes)      F = Σ reason weight × decayed failures, S = decayed successes
//! ```
//!
//! The prior is a pseudo-count of served pulls that never decays: a source nobody has pulled
//! from is trusted (p = 0), and one failure among no successes does not condemn it (p = 1/3 with
//! the default prior of 2). Placement discounts a pull's saving by `p` (the pull is paid, and
//! with probability `p` the tokens are recomputed after it: [`crate::predict`]); at
//! `p ≥ exclude_at` (0.45: two failures with nothing served) the source is not named at all
//! until decay brings `p` back under it, when a pull or two probe it again. A verification failure weighs `verify_failure_weight` (2): a miss
//! or a stall can be the weather, a block that fails its checksum or content check cannot.
//!
//! A plain data structure: time is an argument (seconds on any monotonic clock the caller
//! keeps), nothing here reads a clock, so every case is a unit test.

use std::collections::HashMap;

use kvmesh_index::EndpointId;
use serde::{Deserialize, Serialize};

/// Why a pull counted against its source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PenaltyReason {
    /// The source did not hold blocks it advertised.
    Miss,
    /// The pull ran into its deadline (timeout, blocks pending past their deadline, or waiting on
    /// another request's pull from it).
    Stall,
    /// A block failed verification (transport checksum, MAC, content, protocol violation).
    VerifyFailure,
    /// Anything else: connect refused, peer closed, busy, refused handshake.
    Error,
}

impl PenaltyReason {
    pub const ALL: [PenaltyReason; 4] = [
        PenaltyReason::Miss,
        PenaltyReason::Stall,
        PenaltyReason::VerifyFailure,
        PenaltyReason::Error,
    ];

    /// Metric label and `/debug/decisions` key.
    pub fn label(self) -> &'static str {
        match self {
            PenaltyReason::Miss => "miss",
            PenaltyReason::Stall => "stall",
            PenaltyReason::VerifyFailure => "verify_failure",
            PenaltyReason::Error => "error",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// `p2p_reputation:` in the router's config.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReputationParams {
    /// Failures and successes halve every this many seconds (default 30).
    pub half_life_s: f64,
    /// Served pulls every source is credited with and never loses (default 2).
    pub prior_successes: f64,
    /// A source whose estimated failure probability reaches this is not named (default 0.45:
    /// two failures in a row with nothing served, a little under the 0.5 they give so that the
    /// decay between them does not matter; above 1 never excludes, the discount alone applies).
    pub exclude_at: f64,
    /// Weight of a verification failure relative to the other reasons (default 2).
    pub verify_failure_weight: f64,
}

impl Default for ReputationParams {
    fn default() -> Self {
        ReputationParams {
            half_life_s: 30.0,
            prior_successes: 2.0,
            exclude_at: 0.45,
            verify_failure_weight: 2.0,
        }
    }
}

impl ReputationParams {
    pub fn validate(&self) -> Result<(), String> {
        let pos = |v: f64| v.is_finite() && v > 0.0;
        if !pos(self.half_life_s) {
            return Err("p2p_reputation.half_life_s must be a finite number > 0".to_owned());
        }
        if !pos(self.prior_successes) {
            return Err("p2p_reputation.prior_successes must be a finite number > 0".to_owned());
        }
        if !pos(self.exclude_at) {
            return Err("p2p_reputation.exclude_at must be a finite number > 0".to_owned());
        }
        if !(self.verify_failure_weight.is_finite() && self.verify_failure_weight >= 0.0) {
            return Err("p2p_reputation.verify_failure_weight must be finite and >= 0".to_owned());
        }
        Ok(())
    }

    fn weight(&self, reason: PenaltyReason) -> f64 {
        match reason {
            PenaltyReason::VerifyFailure => self.verify_failure_weight,
            _ => 1.0,
        }
    }
}

/// A source's standing at one moment: what placement and `/debug/decisions` see.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct SourceStanding {
    /// Estimated probability that a pull from it fails (0 for a source with no failures).
    pub failure_probability: f64,
    /// Whether it is not named at all (`failure_probability ≥ exclude_at`).
    pub excluded: bool,
    /// Decayed failures per reason, in [`PenaltyReason::ALL`] order (unweighted).
    pub failures: [f64; 4],
    /// Decayed served pulls (the prior not included).
    pub successes: f64,
}

impl SourceStanding {
    /// Whether anything counts against it.
    pub fn is_penalised(&self) -> bool {
        self.failure_probability > 0.0
    }

    /// The decayed failures for `reason`.
    pub fn failures_of(&self, reason: PenaltyReason) -> f64 {
        self.failures[reason.index()]
    }
}

/// One source's record, as of `at`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
struct Record {
    failures: [f64; 4],
    successes: f64,
    at: f64,
}

/// Below this a decayed record is forgotten (it no longer changes any decision measurably).
const FORGET_BELOW: f64 = 1e-3;

/// Every source's record (see the module docs).
#[derive(Debug, Clone, Default)]
pub struct Reputation {
    params: ReputationParams,
    sources: HashMap<EndpointId, Record>,
}

impl Reputation {
    pub fn new(params: ReputationParams) -> Self {
        Reputation {
            params,
            sources: HashMap::new(),
        }
    }

    pub fn params(&self) -> &ReputationParams {
        &self.params
    }

    /// A pull from `source` served what it was named for, at `now` (seconds).
    pub fn record_success(&mut self, source: EndpointId, now: f64) {
        let r = self.decayed_entry(source, now);
        r.successes += 1.0;
    }

    /// A pull from `source` failed for `reason`, at `now` (seconds).
    pub fn record_failure(&mut self, source: EndpointId, reason: PenaltyReason, now: f64) {
        let r = self.decayed_entry(source, now);
        r.failures[reason.index()] += 1.0;
    }

    /// `source`'s standing at `now`.
    pub fn standing(&self, source: EndpointId, now: f64) -> SourceStanding {
        match self.sources.get(&source) {
            Some(r) => self.standing_of(&decay(r, now, self.params.half_life_s)),
            None => SourceStanding::default(),
        }
    }

    /// Every remembered source's standing at `now`, by endpoint id.
    pub fn standings(&self, now: f64) -> Vec<(EndpointId, SourceStanding)> {
        let mut all: Vec<_> = self
            .sources
            .iter()
            .map(|(&id, r)| {
                (
                    id,
                    self.standing_of(&decay(r, now, self.params.half_life_s)),
                )
            })
            .collect();
        all.sort_by_key(|(id, _)| *id);
        all
    }

    /// Forgets the sources `keep` says no (endpoints that left the list).
    pub fn retain(&mut self, mut keep: impl FnMut(EndpointId) -> bool) {
        self.sources.retain(|id, _| keep(*id));
    }

    /// The record of `source` decayed to `now` (created empty), forgetting records that decayed
    /// to nothing so memory stays bounded by the sources recently pulled from.
    fn decayed_entry(&mut self, source: EndpointId, now: f64) -> &mut Record {
        let half_life = self.params.half_life_s;
        self.sources
            .retain(|_, r| weight_of(&decay(r, now, half_life)) >= FORGET_BELOW);
        let r = self.sources.entry(source).or_default();
        *r = decay(r, now, half_life);
        r
    }

    fn standing_of(&self, r: &Record) -> SourceStanding {
        let p = &self.params;
        let failed: f64 = PenaltyReason::ALL
            .iter()
            .map(|&reason| p.weight(reason) * r.failures[reason.index()])
            .sum();
        let failure_probability = if failed > 0.0 {
            failed / (failed + r.successes + p.prior_successes)
        } else {
            0.0
        };
        SourceStanding {
            failure_probability,
            excluded: failure_probability >= p.exclude_at,
            failures: r.failures,
            successes: r.successes,
        }
    }
}

/// `r` halved once per `half_life` seconds from its time to `now` (a `now` before it, another
/// clock's, decays nothing).
fn decay(r: &Record, now: f64, half_life: f64) -> Record {
    let dt = now - r.at;
    // NaN (a caller's broken clock) decays nothing either.
    if dt.is_nan() || dt <= 0.0 {
        return Record {
            at: r.at.max(now),
            ..*r
        };
    }
    let k = 0.5f64.powf(dt / half_life);
    Record {
        failures: r.failures.map(|f| f * k),
        successes: r.successes * k,
        at: now,
    }
}

fn weight_of(r: &Record) -> f64 {
    r.failures.iter().sum::<f64>() + r.successes
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: EndpointId = EndpointId(1);
    const B: EndpointId = EndpointId(2);

    fn rep() -> Reputation {
        Reputation::new(ReputationParams::default())
    }

    #[test]
    fn an_unknown_or_honest_source_is_trusted() {
        let mut r = rep();
        assert_eq!(r.standing(A, 0.0), SourceStanding::default());
        for t in 0..10 {
            r.record_success(A, f64::from(t));
        }
        let s = r.standing(A, 10.0);
        assert_eq!(s.failure_probability, 0.0);
        assert!(!s.excluded && !s.is_penalised());
        assert!(s.successes > 5.0, "{s:?}");
    }

    #[test]
    fn a_source_that_keeps_missing_is_excluded_after_two_failures() {
        let mut r = rep();
        r.record_failure(A, PenaltyReason::Miss, 0.0);
        let one = r.standing(A, 0.0);
        assert!(
            (one.failure_probability - 1.0 / 3.0).abs() < 1e-12,
            "{one:?}"
        );
        assert!(
            !one.excluded,
            "one miss is not enough: it may be the weather"
        );
        r.record_failure(A, PenaltyReason::Miss, 0.1);
        let two = r.standing(A, 0.1);
        assert!(two.excluded, "{two:?}");
        assert!((two.failures_of(PenaltyReason::Miss) - 2.0).abs() < 0.01);
        // Another source is untouched.
        assert!(!r.standing(B, 0.1).is_penalised());
    }

    #[test]
    fn one_verification_failure_weighs_two() {
        let mut r = rep();
        r.record_failure(A, PenaltyReason::VerifyFailure, 0.0);
        let s = r.standing(A, 0.0);
        assert!(s.excluded, "{s:?}");
        assert_eq!(s.failures_of(PenaltyReason::VerifyFailure), 1.0);
        assert_eq!(s.failures_of(PenaltyReason::Stall), 0.0);
    }

    #[test]
    fn penalties_decay_and_the_source_is_named_again() {
        let mut r = rep();
        for t in 0..4 {
            r.record_failure(A, PenaltyReason::Stall, f64::from(t) * 0.1);
        }
        assert!(r.standing(A, 0.5).excluded);
        // F = 4 → p = 4/6. Under exclude_at (0.45) once F < 1.64: after 1.3 half-lives.
        assert!(r.standing(A, 38.0).excluded);
        let later = r.standing(A, 40.0);
        assert!(!later.excluded, "{later:?}");
        assert!(later.failure_probability > 0.4, "{later:?}");
        // Long after, it is all but forgotten.
        let much_later = r.standing(A, 300.0);
        assert!(much_later.failure_probability < 0.005, "{much_later:?}");
    }

    #[test]
    fn served_pulls_offset_failures_and_a_new_lie_still_counts() {
        let mut r = rep();
        for t in 0..8 {
            r.record_success(A, f64::from(t));
        }
        r.record_failure(A, PenaltyReason::Miss, 8.0);
        let s = r.standing(A, 8.0);
        assert!(!s.excluded && s.failure_probability < 0.15, "{s:?}");
        // Old credit decays: a source that starts lying is excluded within a few failures.
        let mut t = 100.0;
        let mut failures = 0;
        while !r.standing(A, t).excluded {
            r.record_failure(A, PenaltyReason::Miss, t);
            failures += 1;
            t += 0.1;
        }
        assert!(failures <= 3, "{failures}");
    }

    #[test]
    fn memory_is_bounded_by_recent_sources_and_retain_forgets() {
        let mut r = rep();
        for id in 0..100 {
            r.record_failure(EndpointId(id), PenaltyReason::Error, 0.0);
        }
        assert_eq!(r.standings(0.0).len(), 100);
        // An hour later every old record has decayed away once something is written.
        r.record_failure(A, PenaltyReason::Error, 3600.0);
        assert_eq!(r.standings(3600.0).len(), 1);
        r.retain(|id| id != A);
        assert!(r.standings(3600.0).is_empty());
    }

    #[test]
    fn a_clock_that_goes_backwards_decays_nothing() {
        let mut r = rep();
        r.record_failure(A, PenaltyReason::Miss, 10.0);
        r.record_failure(A, PenaltyReason::Miss, 5.0);
        assert!((r.standing(A, 0.0).failures_of(PenaltyReason::Miss) - 2.0).abs() < 1e-12);
    }

    #[test]
    fn bad_parameters_are_refused() {
        let ok = ReputationParams::default();
        assert!(ok.validate().is_ok());
        for bad in [
            ReputationParams {
                half_life_s: 0.0,
                ..ok.clone()
            },
            ReputationParams {
                prior_successes: f64::NAN,
                ..ok.clone()
            },
            ReputationParams {
                exclude_at: -1.0,
                ..ok.clone()
            },
            ReputationParams {
                verify_failure_weight: f64::INFINITY,
                ..ok.clone()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}
