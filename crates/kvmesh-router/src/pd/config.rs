//! `pd:` — its config: the prefill and decode profiles, when to disaggregate, and the
//! conversation cache of bi-directional transfer.

use kvmesh_sched::Scheduler;
use serde::{Deserialize, Serialize};

use crate::config::error::ConfigError;

/// When to disaggregate.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Decider {
    /// `always`.
    Named(String),
    /// Disaggregate only when at least this many prompt tokens are uncached on the prefill side;
    /// otherwise the decoder serves the whole request.
    MinUncached { min_uncached_tokens: u64 },
}

impl Default for Decider {
    fn default() -> Self {
        Decider::Named("always".to_owned())
    }
}

fn default_ttl() -> f64 {
    450.0
}

/// The `pd:` section of the router config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PdConfig {
    pub prefill_profile: String,
    pub decode_profile: String,
    #[serde(default)]
    pub decider: Decider,
    /// Cache decoders' returned params per conversation and attach them to the next prefill leg.
    #[serde(default)]
    pub bidirectional: bool,
    /// Lifetime of a cached conversation entry (keep it below the engines' 480 s TTL).
    #[serde(default = "default_ttl")]
    pub conversation_ttl_s: f64,
}

impl PdConfig {
    pub fn validate(&self, scheduler: &Scheduler) -> Result<(), ConfigError> {
        for p in [&self.prefill_profile, &self.decode_profile] {
            if scheduler.profile(Some(p)).is_none() {
                return Err(ConfigError::Invalid(format!(
                    "pd: unknown scheduling profile {p:?}"
                )));
            }
        }
        if let Decider::Named(n) = &self.decider
            && n != "always"
        {
            return Err(ConfigError::Invalid(format!(
                "pd.decider: `always` or {{min_uncached_tokens: N}}, not {n:?}"
            )));
        }
        if !(self.conversation_ttl_s.is_finite() && self.conversation_ttl_s > 0.0) {
            return Err(ConfigError::Invalid(
                "pd.conversation_ttl_s must be > 0".into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RouterConfig;

    #[test]
    fn example_pd_config_is_valid() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../configs/router-pd.yaml");
        let cfg = RouterConfig::load(std::path::Path::new(path)).unwrap();
        let pd = cfg.pd.clone().unwrap();
        assert!(pd.bidirectional);
        assert_eq!(
            pd.decider,
            Decider::MinUncached {
                min_uncached_tokens: 512
            }
        );
        let cm = std::sync::Arc::new(kvmesh_sched::cost_model::CostModel::new(
            cfg.cost_model.clone(),
        ));
        let s = Scheduler::build(
            &cfg.plugins,
            &cfg.scheduling_profiles,
            cfg.default_profile.as_deref(),
            cfg.seed,
            &cm,
        )
        .unwrap();
        pd.validate(&s).unwrap();
        let mut bad = pd.clone();
        bad.decode_profile = "nope".into();
        assert!(bad.validate(&s).is_err());
        bad = pd;
        bad.decider = Decider::Named("sometimes".into());
        assert!(bad.validate(&s).is_err());
    }

    #[test]
    fn decider_parses_both_forms() {
        let d: Decider = serde_norway::from_str("always").unwrap();
        assert_eq!(d, Decider::Named("always".into()));
        let d: Decider = serde_norway::from_str("{min_uncached_tokens: 256}").unwrap();
        assert_eq!(
            d,
            Decider::MinUncached {
                min_uncached_tokens: 256
            }
        );
    }
}
