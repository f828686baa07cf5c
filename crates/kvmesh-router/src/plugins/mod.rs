//! Scheduling plugins: filters, scorers, pickers and the P2P source producer.
//!
//! One plugin per file, each behind one of three small traits ([`Filter`], [`Scorer`],
//! [`Picker`]) whose `type_name()` is the config string (llm-d's `EndpointPickerConfig` names where
//! kvmesh offers the same plugin). Inputs come in borrowed structs ([`SchedulingContext`] for the
//! request, [`Candidate`] per endpoint) whose optional fields are `Option`s, so adding an input never
//! breaks an existing plugin. Plugins are pure: no I/O, no clocks; randomness is injected.
//! [`build_plugin`] is the one factory from config to plugin and matches every type exhaustively.

pub mod kv_cache_utilization_scorer;
pub mod least_loaded_picker;
pub mod max_score_picker;
pub mod p2p_source_producer;
pub mod predicted_ttft_scorer;
pub mod prefix_cache_affinity_filter;
pub mod prefix_cache_scorer;
pub mod queue_scorer;
pub mod round_robin_picker;
pub mod token_load_scorer;
pub mod weighted_random_picker;

use std::sync::Arc;

use kvmesh_index::EndpointId;
use rand::RngCore;

use crate::cost_model::CostModel;

/// Scores closer than this are treated as equal by pickers (float sums of weights are inexact).
pub const SCORE_EPSILON: f64 = 1e-9;

/// What the scheduler knows about one endpoint for one request.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub endpoint: EndpointId,
    pub name: Arc<str>,
    /// Longest consecutive prefix of the request held in the GPU tier, in blocks.
    pub gpu_blocks: usize,
    /// Longest consecutive prefix held in the CPU tier, in blocks (what a P2P producer can serve).
    pub cpu_blocks: usize,
    /// Longest consecutive prefix held in either tier, in blocks.
    pub any_blocks: usize,
    /// Requests this router has in flight to the endpoint.
    pub in_flight_requests: u64,
    /// Prompt tokens of in-flight requests the endpoint still has to compute (not cached, not pulled).
    pub in_flight_uncached_tokens: u64,
    /// Decode tokens (max_tokens) of in-flight requests.
    pub in_flight_decode_tokens: u64,
    /// Scraped `vllm:num_requests_waiting` (None until the first successful scrape).
    pub waiting: Option<f64>,
    /// Scraped `vllm:num_requests_running`.
    pub running: Option<f64>,
    /// Scraped `vllm:kv_cache_usage_perc` (0..1).
    pub kv_usage: Option<f64>,
    /// Whether the endpoint has a P2P producer address (can be named as a pull source).
    pub has_p2p: bool,
    /// Pulls this router named into the endpoint that have not finished yet.
    pub pulls_in: u64,
    /// Pulls this router named with the endpoint as source that have not finished yet.
    pub pulls_out: u64,
}

impl Candidate {
    /// A candidate with no prefix, no load and no scraped metrics (tests and cold starts).
    pub fn idle(endpoint: u32, name: &str) -> Candidate {
        Candidate {
            endpoint: EndpointId(endpoint),
            name: Arc::from(name),
            gpu_blocks: 0,
            cpu_blocks: 0,
            any_blocks: 0,
            in_flight_requests: 0,
            in_flight_uncached_tokens: 0,
            in_flight_decode_tokens: 0,
            waiting: None,
            running: None,
            kv_usage: None,
            has_p2p: true,
            pulls_in: 0,
            pulls_out: 0,
        }
    }
}

/// What the scheduler knows about the request.
#[derive(Debug, Clone, Copy)]
pub struct SchedulingContext<'a> {
    /// The id forwarded to the engine and used for deterministic P2P sampling.
    pub request_id: &'a str,
    pub prompt_tokens: usize,
    /// Full blocks of the prompt (`prompt_tokens / block_size`).
    pub total_blocks: usize,
    pub block_size: usize,
    /// Requested decode length, if the request said.
    pub max_tokens: Option<u64>,
}

impl SchedulingContext<'_> {
    /// Prompt tokens `c` would still compute if it got the request (tier-blind local prefix).
    pub fn uncached_tokens(&self, c: &Candidate) -> u64 {
        let cached = c.any_blocks.saturating_mul(self.block_size);
        self.prompt_tokens.saturating_sub(cached) as u64
    }
}

/// The result of one filter: indices (into its input) to keep, and why, for `/debug/decisions`.
#[derive(Debug, Clone, PartialEq)]
pub struct FilterOutcome {
    pub kept: Vec<usize>,
    pub note: String,
}

/// Drops candidates. Must keep at least one if given any (a filter that would drop all keeps all).
pub trait Filter: Send + Sync {
    /// The config `type` string.
    fn type_name(&self) -> &'static str;
    fn filter(
        &self,
        ctx: &SchedulingContext<'_>,
        candidates: &[&Candidate],
        rng: &mut dyn RngCore,
    ) -> FilterOutcome;
}

/// Scores all candidates in one call; each score in `[0, 1]`, higher is better.
pub trait Scorer: Send + Sync {
    fn type_name(&self) -> &'static str;
    fn score(&self, ctx: &SchedulingContext<'_>, candidates: &[&Candidate]) -> Vec<f64>;

    /// Scores plus, for scorers that predict a time to first token, the prediction per candidate
    /// (`/debug/decisions` shows it; the P2P decision reuses it).
    fn score_explained(
        &self,
        ctx: &SchedulingContext<'_>,
        candidates: &[&Candidate],
    ) -> (Vec<f64>, Option<Vec<crate::predict::Prediction>>) {
        (self.score(ctx, candidates), None)
    }
}

/// Chooses one candidate given the weighted total scores (`scores[i]` belongs to `candidates[i]`).
pub trait Picker: Send + Sync {
    fn type_name(&self) -> &'static str;
    fn pick(
        &self,
        ctx: &SchedulingContext<'_>,
        candidates: &[&Candidate],
        scores: &[f64],
        rng: &mut dyn RngCore,
    ) -> Option<usize>;
}

/// A plugin built from config.
#[derive(Clone)]
pub enum Plugin {
    Filter(Arc<dyn Filter>),
    Scorer(Arc<dyn Scorer>),
    Picker(Arc<dyn Picker>),
    P2pSource(Arc<p2p_source_producer::P2pSourceProducer>),
}

impl Plugin {
    pub fn type_name(&self) -> &'static str {
        match self {
            Plugin::Filter(p) => p.type_name(),
            Plugin::Scorer(p) => p.type_name(),
            Plugin::Picker(p) => p.type_name(),
            Plugin::P2pSource(_) => p2p_source_producer::TYPE,
        }
    }
}

/// Why a plugin could not be built.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error("unknown plugin type {0:?} (known: {known})", known = PLUGIN_TYPES.join(", "))]
    UnknownType(String),
    #[error("plugin {name:?} ({kind}): bad parameters: {source}")]
    BadParameters {
        name: String,
        kind: &'static str,
        source: serde_json::Error,
    },
    #[error("plugin {name:?} ({kind}): {message}")]
    Invalid {
        name: String,
        kind: &'static str,
        message: String,
    },
}

/// Every plugin type the factory knows.
pub const PLUGIN_TYPES: &[&str] = &[
    prefix_cache_scorer::TYPE,
    queue_scorer::TYPE,
    kv_cache_utilization_scorer::TYPE,
    token_load_scorer::TYPE,
    predicted_ttft_scorer::TYPE,
    prefix_cache_affinity_filter::TYPE,
    max_score_picker::TYPE,
    weighted_random_picker::TYPE,
    round_robin_picker::TYPE,
    least_loaded_picker::TYPE,
    p2p_source_producer::TYPE,
];

fn params<T: serde::de::DeserializeOwned + Default>(
    name: &str,
    kind: &'static str,
    parameters: &Option<serde_json::Value>,
) -> Result<T, PluginError> {
    match parameters {
        None | Some(serde_json::Value::Null) => Ok(T::default()),
        Some(v) => serde_json::from_value(v.clone()).map_err(|source| PluginError::BadParameters {
            name: name.to_owned(),
            kind,
            source,
        }),
    }
}

/// Builds one plugin from its config entry. `cost_model` is shared by every P2P plugin so rates
/// learned from one request serve them all.
pub fn build_plugin(
    kind: &str,
    name: &str,
    parameters: &Option<serde_json::Value>,
    cost_model: &Arc<CostModel>,
) -> Result<Plugin, PluginError> {
    use self::{
        kv_cache_utilization_scorer as kvu, least_loaded_picker as ll, max_score_picker as ms,
        p2p_source_producer as p2p, predicted_ttft_scorer as pts,
        prefix_cache_affinity_filter as paf, prefix_cache_scorer as pcs, queue_scorer as qs,
        round_robin_picker as rr, token_load_scorer as tls, weighted_random_picker as wr,
    };
    Ok(match kind {
        pcs::TYPE => Plugin::Scorer(Arc::new(pcs::PrefixCacheScorer::new(params(
            name,
            pcs::TYPE,
            parameters,
        )?))),
        qs::TYPE => Plugin::Scorer(Arc::new(qs::QueueScorer::new(params(
            name,
            qs::TYPE,
            parameters,
        )?))),
        kvu::TYPE => Plugin::Scorer(Arc::new(kvu::KvCacheUtilizationScorer)),
        tls::TYPE => Plugin::Scorer(Arc::new(tls::TokenLoadScorer::new(params(
            name,
            tls::TYPE,
            parameters,
        )?))),
        pts::TYPE => {
            let p: crate::predict::TtftParams = params(name, pts::TYPE, parameters)?;
            p.validate().map_err(|message| PluginError::Invalid {
                name: name.to_owned(),
                kind: pts::TYPE,
                message,
            })?;
            Plugin::Scorer(Arc::new(pts::PredictedTtftScorer::new(
                p,
                Arc::clone(cost_model),
            )))
        }
        paf::TYPE => {
            let p: paf::AffinityParams = params(name, paf::TYPE, parameters)?;
            p.validate().map_err(|message| PluginError::Invalid {
                name: name.to_owned(),
                kind: paf::TYPE,
                message,
            })?;
            Plugin::Filter(Arc::new(paf::PrefixCacheAffinityFilter::new(p)))
        }
        ms::TYPE => Plugin::Picker(Arc::new(ms::MaxScorePicker)),
        wr::TYPE => Plugin::Picker(Arc::new(wr::WeightedRandomPicker)),
        rr::TYPE => Plugin::Picker(Arc::new(rr::RoundRobinPicker::default())),
        ll::TYPE => Plugin::Picker(Arc::new(ll::LeastLoadedPicker)),
        p2p::TYPE => {
            let p: p2p::P2pParams = params(name, p2p::TYPE, parameters)?;
            let producer =
                p2p::P2pSourceProducer::new(p, Arc::clone(cost_model)).map_err(|message| {
                    PluginError::Invalid {
                        name: name.to_owned(),
                        kind: p2p::TYPE,
                        message,
                    }
                })?;
            Plugin::P2pSource(Arc::new(producer))
        }
        other => return Err(PluginError::UnknownType(other.to_owned())),
    })
}

/// Indices of the candidates whose score equals the maximum (within [`SCORE_EPSILON`]).
pub(crate) fn argmax_all(scores: &[f64]) -> Vec<usize> {
    let best = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    scores
        .iter()
        .enumerate()
        .filter(|(_, s)| (best - **s).abs() <= SCORE_EPSILON)
        .map(|(i, _)| i)
        .collect()
}

/// A uniformly random element of `items` (None when empty).
pub(crate) fn choose(items: &[usize], rng: &mut dyn RngCore) -> Option<usize> {
    use rand::Rng;
    if items.is_empty() {
        return None;
    }
    Some(items[rng.random_range(0..items.len())])
}

#[cfg(test)]
pub(crate) mod test_util {
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    pub fn rng(seed: u64) -> ChaCha8Rng {
        ChaCha8Rng::seed_from_u64(seed)
    }

    pub fn ctx(prompt_tokens: usize, block_size: usize) -> super::SchedulingContext<'static> {
        super::SchedulingContext {
            request_id: "req-1",
            prompt_tokens,
            total_blocks: prompt_tokens / block_size,
            block_size,
            max_tokens: Some(16),
        }
    }
}
