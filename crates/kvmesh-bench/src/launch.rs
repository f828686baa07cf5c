//! What launching the bench's processes (kvmesh engines, routers, peer routers) shares: engine
//! roles, the KV-event topic, launch errors and log tails for their messages.

use std::path::Path;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Engine role (`docs/architecture.md#pd-disaggregation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    #[default]
    Both,
    Prefill,
    Decode,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Both => "both",
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }
}

/// The topic the fleet's engines publish KV events under (and routers subscribe to).
pub const KV_EVENTS_TOPIC: &str = "";

#[derive(Debug, Error)]
pub enum FleetError {
    #[error("fleet spec: {0}")]
    Spec(String),
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    #[error("{what} did not become ready within {secs:.0} s (log: {log})\n{tail}")]
    NotReady {
        what: String,
        secs: f64,
        log: String,
        tail: String,
    },
    #[error("{what} exited during start-up with {status} (log: {log})\n{tail}")]
    Exited {
        what: String,
        status: String,
        log: String,
        tail: String,
    },
}

/// The last `n` lines of a log file (for error messages).
pub fn log_tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
