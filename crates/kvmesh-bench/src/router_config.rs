//! Benchmark arms and the router config each one runs.
//!
//! An arm is a named router policy, and each kvmesh arm is a config file a user can run with
//! `kvmesh router --config`: `configs/arms/<arm>.yaml`, and for `ttft-p2p` the default placement
//! itself, `configs/router.yaml` (llm-d's reference arms: `docs/protocols.md#reference-arms`).
//! The files are embedded, so `kvmesh bench` works from any directory. [`arm_config`] loads an
//! arm's file into the typed [`RouterConfig`] and fills in what belongs to the fleet and the run
//! (endpoints, seed, the workload's pull threshold, the fleet's clock, the bench's operational
//! settings) by editing the struct: two arms of an A/B differ only in what their files say.

use std::path::Path;
use std::time::Duration;

use kvmesh_router::RouterConfig;
use kvmesh_router::config::{EndpointSpec, HealthCheckConfig, KvEventsSpec};
use serde::{Deserialize, Serialize};

use crate::launch::Role;
use crate::peers::PeerArm;

/// A router policy under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Arm {
    /// Baseline: rotate over endpoints.
    RoundRobin,
    /// Precise prefix affinity: prefix 3, queue 2, kv-util 2, max-score picker.
    Affinity,
    /// Load-aware placement: queue 3, kv-util 2, weighted-random picker.
    Load,
    /// `load` plus the P2P source producer.
    LoadP2p,
    /// `affinity` plus the P2P source producer.
    AffinityP2p,
    /// `load` plus P2P decided by the cost model (pull iff predicted recompute > pull + margin).
    CostP2p,
    /// kvmesh's default placement: the endpoint with the lowest predicted time to first token
    /// (queued prefill work, own uncached tokens by tier, decode penalty; `predicted-ttft-scorer`).
    Ttft,
    /// `ttft` with pulls in the prediction and the pull decision priced by the same function
    /// (`p2p-source-producer` mode `predicted`): the default profile a router ships with.
    TtftP2p,
    /// P/D disaggregation (`pd:` with prefill/decode profiles, decider `always`): the decoder
    /// pulls the prompt KV from the prefiller; each turn's prefill recomputes the history.
    Pd,
    /// `pd` plus bi-directional KV transfer: the router caches the decoder's returned params per
    /// conversation and the next turn's prefill reads the history from the decoder.
    PdBidir,
    /// P/D with the prefill leg placed by load (queue 3, kv-util 2, weighted-random picker; no
    /// prefix affinity), as in the published agentic P/D setup: a conversation's next turn
    /// usually lands on a prefiller that never saw it, so without history pulls it recomputes
    /// the whole conversation. The decode profile is `pd`'s.
    PdLoad,
    /// `pd-load` plus bi-directional KV transfer: the next turn's prefiller reads the whole
    /// history (prompt and generated tokens) from the decoder.
    PdLoadBidir,
    /// `affinity-p2p` plus prefetch ahead of arrival (`prefetch:`): when a session's turn ends,
    /// a second engine pulls its history during the client's gap.
    AffinityP2pPrefetch,
    /// `ttft-p2p` plus prefetch ahead of arrival.
    TtftP2pPrefetch,
    /// `affinity-p2p` plus hot-prefix replication (`replication:`): a prefix that keeps being
    /// asked for while its holders are busy is copied to a second engine ahead of demand.
    AffinityP2pReplicate,
    /// `ttft-p2p` plus hot-prefix replication.
    TtftP2pReplicate,
    /// `affinity` (no pulls on a request's path) plus hot-prefix replication: the only blocks
    /// that move are copies made ahead of demand, so a busy hot owner gains a second holder
    /// without any request waiting on a transfer.
    AffinityReplicate,
    /// `ttft` (no pulls on a request's path) plus hot-prefix replication.
    TtftReplicate,
    /// An external router (`vllm-router:<policy>`, `smg:<policy>`) in front of the same engines
    /// instead of `kvmesh router` (see [`crate::peers`]).
    Peer(PeerArm),
}

pub const ARM_NAMES: &[&str] = &[
    "round-robin",
    "affinity",
    "load",
    "load-p2p",
    "affinity-p2p",
    "cost-p2p",
    "ttft",
    "ttft-p2p",
    "pd",
    "pd-bidir",
    "pd-load",
    "pd-load-bidir",
    "affinity-p2p-prefetch",
    "ttft-p2p-prefetch",
    "affinity-p2p-replicate",
    "ttft-p2p-replicate",
    "affinity-replicate",
    "ttft-replicate",
];

impl Arm {
    pub fn name(self) -> &'static str {
        match self {
            Self::RoundRobin => "round-robin",
            Self::Affinity => "affinity",
            Self::Load => "load",
            Self::LoadP2p => "load-p2p",
            Self::AffinityP2p => "affinity-p2p",
            Self::CostP2p => "cost-p2p",
            Self::Ttft => "ttft",
            Self::TtftP2p => "ttft-p2p",
            Self::Pd => "pd",
            Self::PdBidir => "pd-bidir",
            Self::PdLoad => "pd-load",
            Self::PdLoadBidir => "pd-load-bidir",
            Self::AffinityP2pPrefetch => "affinity-p2p-prefetch",
            Self::TtftP2pPrefetch => "ttft-p2p-prefetch",
            Self::AffinityP2pReplicate => "affinity-p2p-replicate",
            Self::TtftP2pReplicate => "ttft-p2p-replicate",
            Self::AffinityReplicate => "affinity-replicate",
            Self::TtftReplicate => "ttft-replicate",
            Self::Peer(p) => p.name(),
        }
    }

    /// Whether this arm is meant to pull (a pull arm that moved nothing is misconfigured).
    /// P/D arms pull too: the P→D handoff travels over the P2P service.
    pub fn pulls(self) -> bool {
        matches!(
            self.base(),
            Self::LoadP2p
                | Self::AffinityP2p
                | Self::CostP2p
                | Self::TtftP2p
                | Self::Pd
                | Self::PdBidir
                | Self::PdLoad
                | Self::PdLoadBidir
        )
    }

    /// Whether this arm's pulls are priced against recompute (so pulling nothing can be right).
    pub fn prices_pulls(self) -> bool {
        matches!(self.base(), Self::CostP2p | Self::TtftP2p)
    }

    /// The placement policy under an arm that adds a mechanism to it (prefetch, replication).
    pub fn base(self) -> Arm {
        match self {
            Self::AffinityP2pPrefetch | Self::AffinityP2pReplicate => Self::AffinityP2p,
            Self::TtftP2pPrefetch | Self::TtftP2pReplicate => Self::TtftP2p,
            Self::AffinityReplicate => Self::Affinity,
            Self::TtftReplicate => Self::Ttft,
            other => other,
        }
    }

    /// Whether the router prefetches sessions' histories ahead of their next turn.
    pub fn prefetches(self) -> bool {
        matches!(self, Self::AffinityP2pPrefetch | Self::TtftP2pPrefetch)
    }

    /// Whether the router copies hot prefixes to a second holder ahead of demand.
    pub fn replicates(self) -> bool {
        matches!(
            self,
            Self::AffinityP2pReplicate
                | Self::TtftP2pReplicate
                | Self::AffinityReplicate
                | Self::TtftReplicate
        )
    }

    /// Whether the engines need their P2P service: the arm pulls, or copies hot prefixes.
    pub fn moves_blocks(self) -> bool {
        self.pulls() || self.replicates()
    }

    /// Whether this arm disaggregates prefill and decode (needs a fleet with both roles).
    pub fn is_pd(self) -> bool {
        matches!(
            self,
            Self::Pd | Self::PdBidir | Self::PdLoad | Self::PdLoadBidir
        )
    }

    /// Whether this arm is meant to move conversation history decoder → prefiller.
    pub fn moves_history(self) -> bool {
        matches!(self, Self::PdBidir | Self::PdLoadBidir)
    }
}

impl std::fmt::Display for Arm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Arm {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "round-robin" => Self::RoundRobin,
            "affinity" => Self::Affinity,
            "load" => Self::Load,
            "load-p2p" => Self::LoadP2p,
            "affinity-p2p" => Self::AffinityP2p,
            "cost-p2p" => Self::CostP2p,
            "ttft" => Self::Ttft,
            "ttft-p2p" => Self::TtftP2p,
            "pd" => Self::Pd,
            "pd-bidir" => Self::PdBidir,
            "pd-load" => Self::PdLoad,
            "pd-load-bidir" => Self::PdLoadBidir,
            "affinity-p2p-prefetch" => Self::AffinityP2pPrefetch,
            "ttft-p2p-prefetch" => Self::TtftP2pPrefetch,
            "affinity-p2p-replicate" => Self::AffinityP2pReplicate,
            "ttft-p2p-replicate" => Self::TtftP2pReplicate,
            "affinity-replicate" => Self::AffinityReplicate,
            "ttft-replicate" => Self::TtftReplicate,
            peer if peer.contains(':') => Self::Peer(PeerArm::parse(peer)?),
            other => {
                return Err(format!(
                    "unknown arm {other:?}; known: {}, or a peer router ({})",
                    ARM_NAMES.join(", "),
                    crate::peers::PEER_ARMS
                        .iter()
                        .map(|p| p.name())
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
        })
    }
}

/// What the router needs to know about one engine.
#[derive(Debug, Clone, PartialEq)]
pub struct EndpointInfo {
    pub name: String,
    pub url: String,
    /// ZMQ endpoint the router connects to.
    pub kv_events: String,
    /// `host:port` of the engine's P2P service.
    pub p2p: Option<String>,
    pub role: Role,
}

impl EndpointInfo {
    /// The router's endpoint entry.
    fn spec(&self) -> EndpointSpec {
        EndpointSpec {
            name: self.name.clone(),
            url: self.url.clone(),
            kv_events: Some(KvEventsSpec {
                endpoint: self.kv_events.clone(),
                bind: false,
                topic: crate::launch::KV_EVENTS_TOPIC.to_owned(),
                replay_endpoint: None,
                allowed_peers: None,
            }),
            p2p: self.p2p.clone(),
            role: match self.role {
                Role::Both => kvmesh_router::config::Role::Both,
                Role::Prefill => kvmesh_router::config::Role::Prefill,
                Role::Decode => kvmesh_router::config::Role::Decode,
            },
            kv_group: None,
        }
    }
}

/// Default P2P threshold (llm-d's reference `load + P2P` arm, and what every arm file says).
pub const DEFAULT_MIN_CACHED_TOKEN_DELTA: usize = 2048;

/// The arm's config file as shipped: `configs/arms/<arm>.yaml`, and for `ttft-p2p` the default
/// placement, `configs/router.yaml` (the very bytes the router falls back to). None for a peer
/// arm, which runs its own router (crate::peers).
pub fn arm_file(arm: Arm) -> Option<&'static str> {
    Some(match arm {
        Arm::RoundRobin => include_str!("../../../configs/arms/round-robin.yaml"),
        Arm::Affinity => include_str!("../../../configs/arms/affinity.yaml"),
        Arm::Load => include_str!("../../../configs/arms/load.yaml"),
        Arm::LoadP2p => include_str!("../../../configs/arms/load-p2p.yaml"),
        Arm::AffinityP2p => include_str!("../../../configs/arms/affinity-p2p.yaml"),
        Arm::CostP2p => include_str!("../../../configs/arms/cost-p2p.yaml"),
        Arm::Ttft => include_str!("../../../configs/arms/ttft.yaml"),
        Arm::TtftP2p => kvmesh_router::config::DEFAULT_CONFIG_YAML,
        Arm::Pd => include_str!("../../../configs/arms/pd.yaml"),
        Arm::PdBidir => include_str!("../../../configs/arms/pd-bidir.yaml"),
        Arm::PdLoad => include_str!("../../../configs/arms/pd-load.yaml"),
        Arm::PdLoadBidir => include_str!("../../../configs/arms/pd-load-bidir.yaml"),
        Arm::AffinityP2pPrefetch => {
            include_str!("../../../configs/arms/affinity-p2p-prefetch.yaml")
        }
        Arm::TtftP2pPrefetch => include_str!("../../../configs/arms/ttft-p2p-prefetch.yaml"),
        Arm::AffinityP2pReplicate => {
            include_str!("../../../configs/arms/affinity-p2p-replicate.yaml")
        }
        Arm::TtftP2pReplicate => include_str!("../../../configs/arms/ttft-p2p-replicate.yaml"),
        Arm::AffinityReplicate => include_str!("../../../configs/arms/affinity-replicate.yaml"),
        Arm::TtftReplicate => include_str!("../../../configs/arms/ttft-replicate.yaml"),
        Arm::Peer(_) => return None,
    })
}

/// Where an arm's file lives in the repository (for messages and generated files).
fn arm_path(arm: Arm) -> String {
    match arm {
        Arm::TtftP2p => "configs/router.yaml".to_owned(),
        other => format!("configs/arms/{}.yaml", other.name()),
    }
}

/// What the bench fills into an arm's file to run it in front of a fleet.
#[derive(Debug, Clone, Copy)]
pub struct FleetRouter<'a> {
    pub endpoints: &'a [EndpointInfo],
    /// Seed of the router's random tie-breaks and weighted picks, so arms are reproducible.
    pub seed: u64,
    /// The workload's P2P threshold (tokens); None keeps the file's.
    pub pull_threshold: Option<usize>,
    /// The fleet's `--time-scale` (the file holds model time).
    pub time_scale: f64,
}

/// How many recent decisions the bench's routers keep: every request of a full docqa or skew arm,
/// so `logs/router-decisions.json` can audit a warm-up.
const BENCH_DECISIONS: usize = 8192;

/// The bench's health checks: a saturated engine on an oversubscribed benchmark host answers
/// `/health` slowly; ejecting it would turn queueing into 503s and measure the health checker
/// instead of the policy.
fn bench_health_check() -> HealthCheckConfig {
    HealthCheckConfig {
        interval: Duration::from_secs(2),
        timeout: Duration::from_secs(10),
        unhealthy_threshold: 10,
        healthy_threshold: 1,
        ..HealthCheckConfig::default()
    }
}

/// The router config `arm` runs with in front of `fleet`: the arm's file with the fleet's
/// endpoints, the seed, the workload's pull threshold, the fleet's clock
/// ([`RouterConfig::scale_time`]) and the bench's operational settings (decision ring, health
/// checks). Err for a peer arm or a file that does not parse.
pub fn arm_config(arm: Arm, fleet: &FleetRouter<'_>) -> Result<RouterConfig, String> {
    let file = arm_file(arm).ok_or_else(|| format!("{arm} runs its own router, not kvmesh's"))?;
    let path = arm_path(arm);
    let mut cfg = RouterConfig::from_yaml(file, Path::new(&path)).map_err(|e| e.to_string())?;
    cfg.endpoints = fleet.endpoints.iter().map(EndpointInfo::spec).collect();
    cfg.seed = Some(fleet.seed);
    if let Some(tokens) = fleet.pull_threshold {
        cfg.set_pull_threshold(tokens.max(1) as u64);
    }
    cfg.scale_time(fleet.time_scale);
    cfg.decisions_capacity = BENCH_DECISIONS;
    cfg.health_check = bench_health_check();
    Ok(cfg)
}

/// [`arm_config`] as the YAML file the bench hands `kvmesh router --config`.
pub fn arm_yaml(arm: Arm, fleet: &FleetRouter<'_>) -> Result<String, String> {
    let cfg = arm_config(arm, fleet)?;
    let body = serde_norway::to_string(&cfg).map_err(|e| e.to_string())?;
    Ok(format!(
        "# Written by kvmesh for arm `{}`: {} with this fleet's endpoints, seed {}, pull \
         threshold and time scale {}.\n{body}",
        arm.name(),
        arm_path(arm),
        fleet.seed,
        fleet.time_scale
    ))
}

#[cfg(test)]
mod tests;
