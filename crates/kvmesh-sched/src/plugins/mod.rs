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

use crate::cost_model::CostModel;
use crate::plugin::{Filter, Picker, Scorer};

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

/// A plugin built from config, with the parameters it runs with (defaults filled in).
pub struct BuiltPlugin {
    pub plugin: Plugin,
    /// The typed parameters serialized back: what two configs are compared by.
    pub parameters: serde_json::Value,
}

/// Reads `parameters` as `T` (absent = `T::default()`), and `T` serialized back.
fn params<T: serde::de::DeserializeOwned + serde::Serialize + Default>(
    name: &str,
    kind: &'static str,
    parameters: &Option<serde_json::Value>,
) -> Result<(T, serde_json::Value), PluginError> {
    let bad = |source| PluginError::BadParameters {
        name: name.to_owned(),
        kind,
        source,
    };
    let typed: T = match parameters {
        None | Some(serde_json::Value::Null) => T::default(),
        Some(v) => serde_json::from_value(v.clone()).map_err(bad)?,
    };
    let effective = serde_json::to_value(&typed).map_err(bad)?;
    Ok((typed, effective))
}

/// Builds one plugin from its config entry. `cost_model` is shared by every plugin that prices
/// with it, so rates learned from one request serve them all.
pub fn build_plugin(
    kind: &str,
    name: &str,
    parameters: &Option<serde_json::Value>,
    cost_model: &Arc<CostModel>,
) -> Result<BuiltPlugin, PluginError> {
    use self::{
        kv_cache_utilization_scorer as kvu, least_loaded_picker as ll, max_score_picker as ms,
        p2p_source_producer as p2p, predicted_ttft_scorer as pts,
        prefix_cache_affinity_filter as paf, prefix_cache_scorer as pcs, queue_scorer as qs,
        round_robin_picker as rr, token_load_scorer as tls, weighted_random_picker as wr,
    };
    let invalid = |kind: &'static str| {
        move |message: String| PluginError::Invalid {
            name: name.to_owned(),
            kind,
            message,
        }
    };
    let none = serde_json::Value::Null;
    let (plugin, parameters) = match kind {
        pcs::TYPE => {
            let (p, v) = params(name, pcs::TYPE, parameters)?;
            (Plugin::Scorer(Arc::new(pcs::PrefixCacheScorer::new(p))), v)
        }
        qs::TYPE => {
            let (p, v) = params(name, qs::TYPE, parameters)?;
            (Plugin::Scorer(Arc::new(qs::QueueScorer::new(p))), v)
        }
        kvu::TYPE => (
            Plugin::Scorer(Arc::new(kvu::KvCacheUtilizationScorer)),
            none,
        ),
        tls::TYPE => {
            let (p, v) = params(name, tls::TYPE, parameters)?;
            (Plugin::Scorer(Arc::new(tls::TokenLoadScorer::new(p))), v)
        }
        pts::TYPE => {
            let (p, v): (crate::predict::TtftParams, _) = params(name, pts::TYPE, parameters)?;
            p.validate().map_err(invalid(pts::TYPE))?;
            let scorer = pts::PredictedTtftScorer::new(p, Arc::clone(cost_model));
            (Plugin::Scorer(Arc::new(scorer)), v)
        }
        paf::TYPE => {
            let (p, v): (paf::AffinityParams, _) = params(name, paf::TYPE, parameters)?;
            p.validate().map_err(invalid(paf::TYPE))?;
            (
                Plugin::Filter(Arc::new(paf::PrefixCacheAffinityFilter::new(p))),
                v,
            )
        }
        ms::TYPE => (Plugin::Picker(Arc::new(ms::MaxScorePicker)), none),
        wr::TYPE => (Plugin::Picker(Arc::new(wr::WeightedRandomPicker)), none),
        rr::TYPE => (
            Plugin::Picker(Arc::new(rr::RoundRobinPicker::default())),
            none,
        ),
        ll::TYPE => (Plugin::Picker(Arc::new(ll::LeastLoadedPicker)), none),
        p2p::TYPE => {
            let (p, v) = params(name, p2p::TYPE, parameters)?;
            let producer = p2p::P2pSourceProducer::new(p, Arc::clone(cost_model))
                .map_err(invalid(p2p::TYPE))?;
            (Plugin::P2pSource(Arc::new(producer)), v)
        }
        other => return Err(PluginError::UnknownType(other.to_owned())),
    };
    Ok(BuiltPlugin { plugin, parameters })
}

#[cfg(test)]
pub(crate) mod test_util {
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    pub fn rng(seed: u64) -> ChaCha8Rng {
        ChaCha8Rng::seed_from_u64(seed)
    }

    pub fn ctx(
        prompt_tokens: usize,
        block_size: usize,
    ) -> crate::candidate::SchedulingContext<'static> {
        crate::candidate::SchedulingContext {
            request_id: "req-1",
            prompt_tokens,
            total_blocks: prompt_tokens / block_size,
            block_size,
            max_tokens: Some(16),
            backlog: Default::default(),
            may_pull: true,
        }
    }
}
