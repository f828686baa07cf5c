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
    /// Sets the P2P pull threshold (tokens) if this plugin owns one: `minPullTokens` of a
    /// `predicted-ttft-scorer`, `minCachedTokenDelta` of a `p2p-source-producer` outside
    /// `mode: predicted` (there the scorer owns it). Returns whether it did. The bench's
    /// workloads set their own threshold this way.
    pub fn set_pull_threshold(&mut self, tokens: u64) -> bool {
        let mode = |p: &Option<serde_json::Value>| {
            p.as_ref()
                .and_then(|v| v.get("mode"))
                .and_then(|m| m.as_str())
                .map(str::to_owned)
        };
        let spellings: &[&str] = match self.kind.as_str() {
            crate::plugins::predicted_ttft_scorer::TYPE => &["minPullTokens", "min_pull_tokens"],
            crate::plugins::p2p_source_producer::TYPE
                if mode(&self.parameters).as_deref() != Some("predicted") =>
            {
                &["minCachedTokenDelta", "min_cached_token_delta"]
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
        for key in spellings {
            map.remove(*key);
        }
        map.insert(spellings[0].to_owned(), tokens.into());
        true
    }
}

/// A plugin used by a profile; `weight` applies to scorers (default 1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PluginRef {
    #[serde(rename = "pluginRef", alias = "plugin_ref")]
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
