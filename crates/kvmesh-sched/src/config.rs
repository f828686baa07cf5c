//! Scheduling configuration: plugin instances and profiles (llm-d's `EndpointPickerConfig`
//! shapes), and the duration format every kvmesh YAML uses. The default placement is a file,
//! `configs/router.yaml`, which the router loads for a config without profiles.

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};

/// A plugin instance (`plugins:` entry).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PluginSpec {
    #[serde(rename = "type")]
    pub kind: String,
    /// Reference name; defaults to the type.
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub parameters: Option<serde_json::Value>,
}

impl PluginSpec {
    /// Sets the P2P pull threshold (tokens) if this plugin owns one: `min_pull_tokens` of a
    /// `predicted-ttft-scorer`, `min_cached_token_delta` of a `p2p-source-producer` outside
    /// `mode: predicted` (there the scorer owns it). Returns whether it did. The bench's
    /// workloads set their own threshold this way.
    pub fn set_pull_threshold(&mut self, tokens: u64) -> bool {
        let mode = |p: &Option<serde_json::Value>| {
            p.as_ref()
                .and_then(|v| v.get("mode"))
                .and_then(|m| m.as_str())
                .map(str::to_owned)
        };
        let key = match self.kind.as_str() {
            crate::plugins::predicted_ttft_scorer::TYPE => "min_pull_tokens",
            crate::plugins::p2p_source_producer::TYPE
                if mode(&self.parameters).as_deref() != Some("predicted") =>
            {
                "min_cached_token_delta"
            }
            _ => return false,
        };
        let params = self
            .parameters
            .get_or_insert_with(|| serde_json::Value::Object(Default::default()));
        if params.is_null() {
            *params = serde_json::Value::Object(Default::default());
        }
        let Some(map) = params.as_object_mut() else {
            return false;
        };
        map.insert(key.to_owned(), tokens.into());
        true
    }
}

/// Plugin parameter keys in the spelling kvmesh accepted before every YAML key was snake_case
/// (llm-d's camelCase), and their names now. The router renames them before reading a config
/// and warns once per key; they stay accepted for one release.
pub const DEPRECATED_PARAMETER_KEYS: &[(&str, &str)] = &[
    ("absoluteWeight", "absolute_weight"),
    ("cpuWeight", "cpu_weight"),
    ("decodePenaltyMs", "decode_penalty_ms"),
    ("explorationProbability", "exploration_probability"),
    ("gpuWeight", "gpu_weight"),
    ("marginMs", "margin_ms"),
    ("maxTTFTPenaltyMs", "max_ttft_penalty_ms"),
    ("maxTokens", "max_tokens"),
    ("minCachedTokenDelta", "min_cached_token_delta"),
    ("minPullTokens", "min_pull_tokens"),
    (
        "peakPrefillTokensPerSecond",
        "peak_prefill_tokens_per_second",
    ),
    ("prefillProfileName", "prefill_profile_name"),
    ("pullingDelayWeight", "pulling_delay_weight"),
    ("queueSource", "queue_source"),
    ("restoreTokensPerSecond", "restore_tokens_per_second"),
    ("scaleTokens", "scale_tokens"),
    ("stepOverheadMs", "step_overhead_ms"),
    ("workWeight", "work_weight"),
];

/// A plugin used by a profile; `weight` applies to scorers (default 1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PluginRef {
    pub plugin_ref: String,
    #[serde(default)]
    pub weight: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileSpec {
    pub name: String,
    #[serde(default)]
    pub plugins: Vec<PluginRef>,
}

/// Durations as humantime strings (`"500ms"`, `"2s"`) or plain numbers of seconds.
pub mod duration_str {
    use super::*;

    pub fn serialize<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(*d).to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Secs(f64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Secs(s) if s.is_finite() && s >= 0.0 => Ok(Duration::from_secs_f64(s)),
            Raw::Secs(s) => Err(serde::de::Error::custom(format!("invalid duration {s}"))),
            Raw::Text(t) => humantime::parse_duration(&t).map_err(serde::de::Error::custom),
        }
    }
}
