//! One (workload, arm, run) result of a benchmark, on its own so that both the report and the
//! repeated-run statistics ([`crate::repeat`]) can read it without importing each other.

use serde::{Deserialize, Serialize};

use crate::driver::RequestRecord;
use crate::fleet::FleetSpec;
use crate::metrics::Evidence;
use crate::stats::ArmStats;

/// One (workload, arm) cell.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ArmResult {
    pub workload: String,
    pub workload_description: String,
    pub arm: String,
    /// Which of `kvmesh bench --repeat N`'s runs this is (0-based; each run on a fresh fleet).
    #[serde(default)]
    pub run: u32,
    /// Whether the arm was meant to pull.
    pub pulls: bool,
    pub time_scale: f64,
    pub fleet: FleetSpec,
    pub stats: ArmStats,
    /// TTFT of the physical bound for the requests this arm sent ([`crate::bound`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bound_ttft: Option<crate::stats::Latency>,
    pub evidence: Evidence,
    /// Tokens pulled into prefill engines (P/D: session history moved).
    pub prefill_external_hit_tokens: f64,
    /// Problems that make the arm's numbers untrustworthy (shown in the table).
    pub flags: Vec<String>,
    pub records: Vec<RequestRecord>,
    /// The external router's name and version for a peer arm (e.g. `vllm-router 0.1.17`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router_version: Option<String>,
    /// The router's decisions joined with what the client and engines saw (kvmesh arms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audit: Option<crate::audit::Audit>,
    /// Restart workloads: TTFT around the prefill fleet's replacement.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart: Option<crate::restart::RestartResult>,
    /// What the router's prefetch counters say (arms with `prefetch:` in their config).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefetch: Option<crate::agentic::PrefetchStats>,
    /// Scale-out workloads: the engine that joined mid-run, window by window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_out: Option<crate::scale_out::ScaleOutResult>,
    /// Hot-prefix copies by outcome, from the router's counters (arms with `replication:`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replication: Option<std::collections::BTreeMap<String, f64>>,
}
