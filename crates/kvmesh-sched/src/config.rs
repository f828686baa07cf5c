//! Scheduling configuration: plugin instances, profiles, the default pipeline (llm-d's
//! `EndpointPickerConfig` shapes), and the duration format every kvmesh YAML uses.

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

/// The pipeline used when a config has no profiles: the lowest predicted time to first token
/// (`predicted-ttft-scorer` with pulls) and pulls priced by the same function. A pull source needs
/// a `p2p` address, so a fleet without P2P gets pure predicted-TTFT placement.
pub fn default_pipeline() -> (Vec<PluginSpec>, Vec<ProfileSpec>) {
    let p = |kind: &str, parameters: Option<serde_json::Value>| PluginSpec {
        kind: kind.to_owned(),
        name: None,
        parameters,
    };
    let r = |name: &str, weight: Option<f64>| PluginRef {
        plugin_ref: name.to_owned(),
        weight,
    };
    (
        vec![
            p(
                "predicted-ttft-scorer",
                Some(serde_json::json!({"p2p": true, "minPullTokens": 512})),
            ),
            p("max-score-picker", None),
            p(
                "p2p-source-producer",
                Some(
                    serde_json::json!({"mode": "predicted", "minCachedTokenDelta": 512, "marginMs": 5}),
                ),
            ),
        ],
        vec![ProfileSpec {
            name: "default".to_owned(),
            plugins: vec![
                r("predicted-ttft-scorer", Some(1.0)),
                r("max-score-picker", None),
                r("p2p-source-producer", None),
            ],
        }],
    )
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
