//! What a source policy sees ([`SourceQuery`]) and returns ([`P2pDecision`]), and the trait the
//! three policies implement ([`SourcePolicy`]).

use std::collections::BTreeMap;

use kvmesh_index::EndpointId;
use serde::{Deserialize, Serialize};

use crate::candidate::{Candidate, SchedulingContext};
use crate::predict::Prediction;
use crate::reputation::PenaltyReason;

/// The source policy (`mode:`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum P2pMode {
    /// llm-d: pull whenever the delta reaches `min_cached_token_delta` (`threshold`).
    #[default]
    Threshold,
    /// Sample only among the holders whose link serves the fewest pulls, and additionally
    /// require predicted recompute > predicted (contended) pull + the delay it adds to the
    /// transfers it joins + margin (`cost_model`).
    CostModel,
    /// Carry out the placement's prediction (`predicted`).
    Predicted,
}

/// Why no source was named.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SkipReason {
    /// No endpoint holds any of the prefix in its CPU tier (or none has a P2P address).
    NoSource,
    /// The sampled source is the computing endpoint.
    SelfSource,
    /// The source leads the computing endpoint by less than `min_cached_token_delta`.
    BelowThreshold,
    /// Recomputing is predicted to be no slower than pulling.
    Cost,
    /// The request may not pull (held by the admission queue with `pulls_when_held: false`).
    PullsOff,
}

impl SkipReason {
    pub fn as_str(self) -> &'static str {
        match self {
            SkipReason::NoSource => "no_source",
            SkipReason::SelfSource => "self",
            SkipReason::BelowThreshold => "below_threshold",
            SkipReason::Cost => "cost",
            SkipReason::PullsOff => "pulls_off",
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
    /// Predictions (ms) when the mode prices pulls.
    pub predicted_recompute_ms: Option<f64>,
    pub predicted_pull_ms: Option<f64>,
    /// Sources considered (names), in sampling order.
    pub band: Vec<String>,
    pub why: String,
    /// Every possible source with pulls held against it at decision time
    /// ([`crate::reputation`]): its failure probability, whether it was excluded, and the
    /// decayed failures per reason. Empty when no source is penalised.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub penalised_sources: Vec<PenalisedSource>,
}

/// A source's reputation as one decision saw it (`/debug/decisions`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PenalisedSource {
    pub endpoint: String,
    pub failure_probability: f64,
    pub excluded: bool,
    /// Decayed failures by reason (`miss`, `stall`, `verify_failure`, `error`), non-zero only.
    pub failures: BTreeMap<&'static str, f64>,
    /// Decayed served pulls.
    pub successes: f64,
}

impl PenalisedSource {
    pub fn of(c: &Candidate) -> PenalisedSource {
        let st = &c.source_standing;
        // Rounded: the record is for reading, and decayed values have no meaningful 15th digit.
        let round = |v: f64| (v * 1000.0).round() / 1000.0;
        PenalisedSource {
            endpoint: c.name.to_string(),
            failure_probability: round(st.failure_probability),
            excluded: st.excluded,
            failures: PenaltyReason::ALL
                .iter()
                .filter(|r| st.failures_of(**r) > 0.0)
                .map(|&r| (r.label(), round(st.failures_of(r))))
                .collect(),
            successes: round(st.successes),
        }
    }
}

impl P2pDecision {
    /// A decision about to be made for a computing endpoint holding `computing_tokens`.
    pub(super) fn new(computing_tokens: u64) -> P2pDecision {
        P2pDecision {
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
            penalised_sources: Vec::new(),
        }
    }

    /// Skipped, with why.
    pub(super) fn skip(mut self, reason: SkipReason, why: String) -> P2pDecision {
        self.skipped = Some(reason);
        self.why = why;
        self
    }
}

/// What a source policy decides over.
pub struct SourceQuery<'a> {
    pub ctx: &'a SchedulingContext<'a>,
    /// Every healthy endpoint (not only those the filters kept: any peer of the computing
    /// endpoint's KV group can serve a pull).
    pub candidates: &'a [&'a Candidate],
    /// Position of the computing endpoint in `candidates`.
    pub computing: usize,
    /// The placement's prediction for the computing endpoint, when the profile's scorer priced
    /// the pull (`predicted` needs it).
    pub placement: Option<&'a Prediction>,
}

/// One source policy (`mode:`).
pub trait SourcePolicy: Send + Sync {
    /// The mode it implements.
    fn mode(&self) -> P2pMode;
    /// Names a source or says why not. `d` arrives with `computing_tokens` filled in.
    fn select(&self, q: &SourceQuery<'_>, d: P2pDecision) -> P2pDecision;
}

/// Why no source was found: "no peer <what>", plus, when a holder exists only outside the
/// computing endpoint's KV group, that it was passed over for that reason (`/debug/decisions`
/// should not look like the prefix is nowhere).
pub(super) fn no_source_why(candidates: &[&Candidate], computing: usize, what: &str) -> String {
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
    let excluded: Vec<&str> = candidates
        .iter()
        .filter(|c| c.has_p2p && c.cpu_blocks > 0 && c.same_kv_group(dest))
        .filter(|c| c.source_standing.excluded)
        .map(|c| c.name.as_ref())
        .collect();
    if !excluded.is_empty() {
        why.push_str(&format!(
            " that its reputation allows ({} excluded: its pulls missed, stalled or failed lately)",
            excluded.join(", ")
        ));
    }
    why
}
