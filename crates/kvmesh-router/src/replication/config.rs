//! `replication:` — its config: when a prefix is hot, when its holders are busy, how often a
//! copy may be made.

use serde::{Deserialize, Serialize};

use crate::config::error::ConfigError;

/// `replication:` — hot-prefix replication ahead of demand.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicationConfig {
    /// Prefixes shorter than this are never copied (default 2048).
    #[serde(default = "default_replication_min_tokens")]
    pub min_tokens: usize,
    /// Requests for one prefix within `window_s` that make it hot (default 4).
    #[serde(default = "default_hot_requests")]
    pub hot_requests: usize,
    #[serde(default = "default_hot_window")]
    pub window_s: f64,
    /// Copy only when every holder has at least this much prefill queued by this router (tokens
    /// not cached there; default 8192): an idle holder serves the next request sooner than a copy.
    #[serde(default = "default_busy_tokens")]
    pub busy_tokens: u64,
    /// A prefix held by this many endpoints is not copied again (default 2).
    #[serde(default = "default_max_holders")]
    pub max_holders: usize,
    /// At most one copy of a prefix per this many seconds (default 30).
    #[serde(default = "default_replication_cooldown")]
    pub cooldown_s: f64,
    /// Copies in flight towards one endpoint; beyond it a copy is skipped, never queued (default 1).
    #[serde(default = "default_one")]
    pub max_inflight_per_endpoint: usize,
    /// Prefixes remembered (default 4096; the least recently asked-for is forgotten).
    #[serde(default = "default_hot_entries")]
    pub max_prefixes: usize,
    /// Longest a copy may run before the router stops waiting for its report.
    #[serde(default = "default_copy_timeout")]
    pub timeout_s: f64,
}

fn default_replication_min_tokens() -> usize {
    2048
}
fn default_hot_requests() -> usize {
    4
}
fn default_hot_window() -> f64 {
    10.0
}
fn default_busy_tokens() -> u64 {
    8192
}
fn default_max_holders() -> usize {
    2
}
fn default_replication_cooldown() -> f64 {
    30.0
}
fn default_one() -> usize {
    1
}
fn default_hot_entries() -> usize {
    4096
}

impl ReplicationConfig {
    /// On a fleet sped up by `ts` (see `RouterConfig::scale_time`): the hot window and the
    /// cooldown are `ts` times shorter.
    pub fn scale_time(&mut self, ts: f64) {
        self.window_s /= ts;
        self.cooldown_s /= ts;
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: &str| Err(ConfigError::Invalid(format!("replication: {m}")));
        if self.hot_requests == 0 || self.max_inflight_per_endpoint == 0 || self.max_prefixes == 0 {
            return bad("hot_requests, max_inflight_per_endpoint and max_prefixes must be > 0");
        }
        if self.max_holders < 2 {
            return bad("max_holders must be >= 2 (1 would never copy)");
        }
        for (name, v) in [
            ("window_s", self.window_s),
            ("cooldown_s", self.cooldown_s),
            ("timeout_s", self.timeout_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return bad(&format!("{name} must be a positive number of seconds"));
            }
        }
        Ok(())
    }
}
fn default_copy_timeout() -> f64 {
    30.0
}
