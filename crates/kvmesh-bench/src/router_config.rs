//! Router configurations for benchmark arms.
//!
//! An arm is a named router policy (llm-d reference configurations, `docs/protocols.md#reference-arms`): the YAML is
//! generated per arm with the fleet's endpoints, so the only difference between two arms of an A/B
//! is the scheduling profile (and whether a P2P source may be named).

use std::fmt::Write as _;

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

    /// Whether the P/D prefill leg is placed by load alone (no prefix affinity).
    pub fn prefill_by_load(self) -> bool {
        matches!(self, Self::PdLoad | Self::PdLoadBidir)
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

/// Default P2P threshold (llm-d's reference `load + P2P` arm).
pub const DEFAULT_MIN_CACHED_TOKEN_DELTA: usize = 2048;

/// Renders the router YAML (`kvmesh router --config`) for `arm` over `endpoints`. `seed` fixes
/// the router's random tie-breaks and weighted picks so arms are reproducible.
pub fn render(arm: Arm, endpoints: &[EndpointInfo], min_delta: Option<usize>, seed: u64) -> String {
    render_scaled(arm, endpoints, min_delta, seed, 1.0)
}

/// [`render`] for engines sped up by `time_scale`. The `ttft` arms get the cost model's rates in
/// the engines' wall time (prefill and pull rates × time scale, pull floor ÷ time scale): their
/// admission queue weighs predicted work against time actually waited, so both must be in the
/// same clock. They also get the admission queue (`dispatch:`).
pub fn render_scaled(
    arm: Arm,
    endpoints: &[EndpointInfo],
    min_delta: Option<usize>,
    seed: u64,
    time_scale: f64,
) -> String {
    let ts = crate::stats::usable_time_scale(time_scale);
    let delta = min_delta.unwrap_or(DEFAULT_MIN_CACHED_TOKEN_DELTA).max(1);
    let mut y = String::new();
    let _ = writeln!(y, "# Generated by `kvmesh bench` for arm `{}`.", arm.name());
    y.push_str(
        "block_size: 16
tokenizer: byte
metrics_scrape_interval: 200ms
# Kept for logs/router-decisions.json: every request of a full docqa or skew arm, so a
# warm-up can be audited.
decisions_capacity: 8192
",
    );
    // A saturated engine on an oversubscribed benchmark host answers /health slowly; ejecting it
    // would turn queueing into 503s and measure the health checker instead of the policy.
    y.push_str(
        "health_check: {interval: 2s, timeout: 10s, unhealthy_threshold: 10, healthy_threshold: 1}\n",
    );
    let _ = writeln!(y, "seed: {seed}");
    let default_profile = if arm.is_pd() { "decode" } else { arm.name() };
    let _ = writeln!(y, "default_profile: {default_profile}");
    y.push_str("endpoints:\n");
    for e in endpoints {
        let _ = writeln!(y, "  - name: {}", e.name);
        let _ = writeln!(y, "    url: \"{}\"", e.url);
        let _ = writeln!(
            y,
            "    kv_events: {{endpoint: \"{}\", topic: \"{}\"}}",
            e.kv_events,
            crate::launch::KV_EVENTS_TOPIC
        );
        if let Some(p) = &e.p2p {
            let _ = writeln!(y, "    p2p: \"{p}\"");
        }
        let _ = writeln!(y, "    role: {}", e.role.as_str());
    }
    // (type, name, parameters, weight in the profile; None = filter/picker/producer).
    if arm.prefetches() {
        // Sessions are the bench client's `X-Session-ID`; the budgets let two 32K-token
        // histories (gpt-oss: 73,728 B/token) be in flight towards one engine and about a
        // quarter of a bench engine's CPU tier (2x its GPU tier) hold unused copies; the
        // decision waits 500 ms of model time after a turn ends (wall time on a sped-up fleet),
        // or for a session with a regular pace until 0.5 s of model time before its next turn
        // (a restore of a 60K-token history takes ~90 ms of model time; the 1 s default also
        // covers slower pulls).
        let _ = writeln!(
            y,
            "prefetch: {{session_id: \"header:x-session-id\", min_tokens: 2048, kv_bytes_per_token: 73728, max_inflight_bytes_per_endpoint: 4831838208, max_unused_bytes_per_endpoint: 3221225472, restore: true, delay_ms: {}, lead_ms: {}}}",
            500.0 / ts,
            500.0 / ts
        );
    }
    if arm.replicates() {
        // A prefix asked for 4 times in 10 s (model time) while every holder has 8K tokens of
        // prefill queued gets a second holder; one copy per prefix per 30 s.
        let _ = writeln!(
            y,
            "replication: {{min_tokens: 2048, hot_requests: 4, window_s: {}, busy_tokens: 8192, max_holders: 2, cooldown_s: {}}}",
            10.0 / ts,
            30.0 / ts
        );
    }
    let mut plugins: Vec<(&str, &str, String, Option<u32>)> = Vec::new();
    match arm.base() {
        Arm::Pd | Arm::PdBidir | Arm::PdLoad | Arm::PdLoadBidir => {
            render_pd(&mut y, arm);
            return y;
        }
        // A peer arm runs its own router (crate::peers); its kvmesh config is never started.
        // (`base()` never returns these; listed so a new arm is a compile error here.)
        Arm::RoundRobin
        | Arm::Peer(_)
        | Arm::AffinityP2pPrefetch
        | Arm::TtftP2pPrefetch
        | Arm::AffinityP2pReplicate
        | Arm::TtftP2pReplicate
        | Arm::AffinityReplicate
        | Arm::TtftReplicate => plugins.push(("round-robin-picker", "picker", String::new(), None)),
        Arm::Affinity | Arm::AffinityP2p => {
            plugins.push(("prefix-cache-scorer", "prefix", String::new(), Some(3)));
            plugins.push(("queue-scorer", "queue", String::new(), Some(2)));
            plugins.push((
                "kv-cache-utilization-scorer",
                "kv-util",
                String::new(),
                Some(2),
            ));
            plugins.push(("max-score-picker", "picker", String::new(), None));
        }
        Arm::Load | Arm::LoadP2p | Arm::CostP2p => {
            if arm.base() == Arm::CostP2p {
                // The price check uses rates the router learns in wall time: on a sped-up
                // fleet the defaults (and the per-pull floor) must be sped up the same way,
                // or learned and default rates disagree by the time scale. As ttft arms do.
                write_cost_model(&mut y, ts);
            }
            plugins.push(("queue-scorer", "queue", String::new(), Some(3)));
            plugins.push((
                "kv-cache-utilization-scorer",
                "kv-util",
                String::new(),
                Some(2),
            ));
            plugins.push(("weighted-random-picker", "picker", String::new(), None));
        }
        Arm::Ttft | Arm::TtftP2p => {
            let p2p = arm.base() == Arm::TtftP2p;
            write_cost_model(&mut y, ts);
            y.push_str("dispatch: {max_queued_prefill_tokens: 8192, aging: 2.0, max_hold: 10s}\n");
            plugins.push((
                "predicted-ttft-scorer",
                "ttft",
                format!("{{p2p: {p2p}, minPullTokens: {delta}}}"),
                Some(1),
            ));
            plugins.push(("max-score-picker", "picker", String::new(), None));
        }
    }
    if arm.pulls() {
        let params = if arm.base() == Arm::CostP2p {
            format!("{{minCachedTokenDelta: {delta}, mode: cost_model, marginMs: 5}}")
        } else if arm.base() == Arm::TtftP2p {
            format!("{{minCachedTokenDelta: {delta}, mode: predicted, marginMs: 5}}")
        } else {
            format!("{{minCachedTokenDelta: {delta}}}")
        };
        plugins.push(("p2p-source-producer", "p2p", params, None));
    }
    y.push_str("plugins:\n");
    for (ty, name, params, _) in &plugins {
        if params.is_empty() {
            let _ = writeln!(y, "  - {{type: {ty}, name: {name}}}");
        } else {
            let _ = writeln!(y, "  - {{type: {ty}, name: {name}, parameters: {params}}}");
        }
    }
    let _ = writeln!(
        y,
        "schedulingProfiles:\n  - name: {}\n    plugins:",
        arm.name()
    );
    for (_, name, _, w) in &plugins {
        match w {
            Some(w) => {
                let _ = writeln!(y, "      - {{pluginRef: {name}, weight: {w}}}");
            }
            None => {
                let _ = writeln!(y, "      - {{pluginRef: {name}}}");
            }
        }
    }
    y
}

/// The default cost-model rates, sped up by the fleet's time scale `ts` (wall time = model time
/// / `ts`).
fn write_cost_model(y: &mut String, ts: f64) {
    let cm = kvmesh_sched::cost_model::CostModelParams::default();
    let _ = writeln!(
        y,
        "cost_model: {{prefill_tokens_per_second: {}, pull_tokens_per_second: {}, pull_floor_ms: {}}}",
        cm.prefill_tokens_per_second * ts,
        cm.pull_tokens_per_second * ts,
        cm.pull_floor_ms / ts
    );
}

/// Name of the prefill / decode scheduling profiles of the P/D arms.
pub const PD_PREFILL_PROFILE: &str = "prefill";
pub const PD_DECODE_PROFILE: &str = "decode";

/// P/D arms: a `prefill` and a `decode` profile (the router restricts each leg to endpoints of its
/// role) and a `pd:` section that disaggregates every request. `pd`/`pd-bidir` use the same
/// affinity scoring in both profiles; `pd-load`/`pd-load-bidir` place the prefill leg by load
/// (queue 3, kv-util 2, weighted-random picker) with the same decode profile. Each pair differs
/// only in `bidirectional` (and the engines' `--bidirectional-kv-xfer`), so an A/B isolates the
/// history pull. No `p2p-source-producer`: a prefill leg that reads history does so only through
/// the conversation's cached decoder params.
fn render_pd(y: &mut String, arm: Arm) {
    y.push_str(
        "plugins:
  - {type: prefix-cache-scorer, name: prefix}
  - {type: queue-scorer, name: queue}
  - {type: kv-cache-utilization-scorer, name: kv-util}
  - {type: max-score-picker, name: picker}
",
    );
    if arm.prefill_by_load() {
        y.push_str("  - {type: weighted-random-picker, name: random-picker}\n");
    }
    y.push_str("schedulingProfiles:\n");
    let affinity = "      - {pluginRef: prefix, weight: 3}
      - {pluginRef: queue, weight: 2}
      - {pluginRef: kv-util, weight: 2}
      - {pluginRef: picker}";
    let by_load = "      - {pluginRef: queue, weight: 3}
      - {pluginRef: kv-util, weight: 2}
      - {pluginRef: random-picker}";
    let prefill = if arm.prefill_by_load() {
        by_load
    } else {
        affinity
    };
    for (profile, plugins) in [(PD_PREFILL_PROFILE, prefill), (PD_DECODE_PROFILE, affinity)] {
        let _ = writeln!(y, "  - name: {profile}\n    plugins:\n{plugins}");
    }
    // TTL below the engines' default --decoder-kv-blocks-ttl (480 s), like vLLM's proxy.
    let _ = writeln!(
        y,
        "pd:
  prefill_profile: {PD_PREFILL_PROFILE}
  decode_profile: {PD_DECODE_PROFILE}
  decider: always
  bidirectional: {}
  conversation_ttl_s: 450",
        arm.moves_history()
    );
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn eps(roles: &[Role]) -> Vec<EndpointInfo> {
        roles
            .iter()
            .enumerate()
            .map(|(i, r)| EndpointInfo {
                name: format!("e{i}"),
                url: format!("http://127.0.0.1:{}", 8000 + i),
                kv_events: format!("tcp://127.0.0.1:{}", 9000 + i),
                p2p: Some(format!("127.0.0.1:{}", 7000 + i)),
                role: *r,
            })
            .collect()
    }

    /// P/D arms run on a prefill + decode pair, the others on aggregated engines.
    fn eps_for(arm: Arm) -> Vec<EndpointInfo> {
        if arm.is_pd() {
            eps(&[Role::Prefill, Role::Decode])
        } else {
            eps(&[Role::Both, Role::Both])
        }
    }

    #[test]
    fn pd_arms_render_profiles_and_differ_only_in_bidirectional() {
        let e = eps(&[Role::Prefill, Role::Decode]);
        let path = tempfile::NamedTempFile::new().unwrap();
        for (arm, bidir) in [(Arm::Pd, false), (Arm::PdBidir, true)] {
            std::fs::write(path.path(), render(arm, &e, None, 1)).unwrap();
            let cfg = kvmesh_router::RouterConfig::load(path.path()).unwrap();
            let pd = cfg.pd.unwrap();
            assert_eq!(
                (pd.prefill_profile.as_str(), pd.decode_profile.as_str()),
                (PD_PREFILL_PROFILE, PD_DECODE_PROFILE)
            );
            assert_eq!(pd.bidirectional, bidir);
            assert_eq!(pd.decider, kvmesh_router::config::Decider::default());
            assert!(pd.conversation_ttl_s < 480.0);
        }
        let a: serde_json::Value = serde_norway::from_str(&render(Arm::Pd, &e, None, 1)).unwrap();
        let mut b: serde_json::Value =
            serde_norway::from_str(&render(Arm::PdBidir, &e, None, 1)).unwrap();
        b["pd"]["bidirectional"] = false.into();
        assert_eq!(a["pd"], b["pd"]);
        assert_eq!(a["schedulingProfiles"], b["schedulingProfiles"]);
        assert_eq!(a["endpoints"], b["endpoints"]);
    }

    /// `pd-load`/`pd-load-bidir`: the prefill leg is placed by load (queue 3, kv-util 2,
    /// weighted-random picker, no prefix scorer), the decode leg as in `pd`; the two differ
    /// only in `bidirectional`.
    #[test]
    fn pd_load_arms_place_the_prefill_leg_by_load_and_differ_only_in_bidirectional() {
        let e = eps(&[Role::Prefill, Role::Prefill, Role::Decode]);
        let path = tempfile::NamedTempFile::new().unwrap();
        for (arm, bidir) in [(Arm::PdLoad, false), (Arm::PdLoadBidir, true)] {
            assert!(arm.is_pd() && arm.pulls() && arm.prefill_by_load());
            assert_eq!(arm.moves_history(), bidir);
            std::fs::write(path.path(), render(arm, &e, None, 1)).unwrap();
            let cfg = kvmesh_router::RouterConfig::load(path.path()).unwrap();
            let pd = cfg.pd.unwrap();
            assert_eq!(pd.bidirectional, bidir);
            assert_eq!(pd.decider, kvmesh_router::config::Decider::default());
            assert_eq!(cfg.default_profile.as_deref(), Some(PD_DECODE_PROFILE));
        }
        let v = |arm| -> serde_json::Value {
            serde_norway::from_str(&render(arm, &e, None, 1)).unwrap()
        };
        let (load, mut load_bidir, aff) = (v(Arm::PdLoad), v(Arm::PdLoadBidir), v(Arm::Pd));
        let profile = |y: &serde_json::Value, name: &str| -> serde_json::Value {
            y["schedulingProfiles"]
                .as_array()
                .unwrap()
                .iter()
                .find(|p| p["name"] == name)
                .unwrap()["plugins"]
                .clone()
        };
        let refs = |plugins: serde_json::Value| -> Vec<(String, Option<u64>)> {
            plugins
                .as_array()
                .unwrap()
                .iter()
                .map(|p| {
                    (
                        p["pluginRef"].as_str().unwrap().to_owned(),
                        p["weight"].as_u64(),
                    )
                })
                .collect()
        };
        let prefill = refs(profile(&load, PD_PREFILL_PROFILE));
        assert_eq!(
            prefill,
            vec![
                ("queue".to_owned(), Some(3)),
                ("kv-util".to_owned(), Some(2)),
                ("random-picker".to_owned(), None)
            ]
        );
        let plugin_type = |name: &str| {
            load["plugins"]
                .as_array()
                .unwrap()
                .iter()
                .find(|p| p["name"] == name)
                .unwrap()["type"]
                .clone()
        };
        assert_eq!(plugin_type("random-picker"), "weighted-random-picker");
        assert_eq!(
            profile(&load, PD_DECODE_PROFILE),
            profile(&aff, PD_DECODE_PROFILE),
            "decode leg unchanged"
        );
        assert_eq!(
            refs(profile(&aff, PD_PREFILL_PROFILE))[0],
            ("prefix".to_owned(), Some(3)),
            "pd keeps prefix affinity on the prefill leg"
        );
        load_bidir["pd"]["bidirectional"] = false.into();
        assert_eq!(load, load_bidir, "only `bidirectional` differs");
    }

    #[test]
    fn arms_round_trip_and_only_p2p_arms_pull() {
        for n in ARM_NAMES {
            let a: Arm = n.parse().unwrap();
            assert_eq!(a.name(), *n);
            assert_eq!(
                a.pulls(),
                n.ends_with("-p2p")
                    || n.ends_with("-p2p-prefetch")
                    || n.ends_with("-p2p-replicate")
                    || n.starts_with("pd")
            );
            assert_eq!(a.prefetches(), n.ends_with("-prefetch"));
            assert_eq!(a.replicates(), n.ends_with("-replicate"));
            assert_eq!(a.moves_blocks(), a.pulls() || n.ends_with("-replicate"));
            assert_eq!(a.is_pd(), n.starts_with("pd"));
        }
        assert!("nope".parse::<Arm>().is_err());
    }

    #[test]
    fn rendered_yaml_is_a_valid_router_config_and_arms_differ_only_by_policy() {
        let path = tempfile::NamedTempFile::new().unwrap();
        for arm in ARM_NAMES {
            let arm: Arm = arm.parse().unwrap();
            let e = eps_for(arm);
            std::fs::write(path.path(), render(arm, &e, None, 1)).unwrap();
            let cfg = kvmesh_router::RouterConfig::load(path.path())
                .unwrap_or_else(|err| panic!("{arm}: {err}\n{}", render(arm, &e, None, 1)));
            assert_eq!(cfg.endpoints.len(), 2);
            assert_eq!(cfg.pd.is_some(), arm.is_pd());
            if !arm.is_pd() {
                assert_eq!(cfg.default_profile.as_deref(), Some(arm.name()));
            }
            assert_eq!(
                cfg.plugins.iter().any(|p| p.kind == "p2p-source-producer"),
                arm.pulls() && !arm.is_pd()
            );
        }
        let e = eps(&[Role::Both, Role::Both]);
        let load: serde_json::Value =
            serde_norway::from_str(&render(Arm::Load, &e, None, 1)).unwrap();
        let p2p: serde_json::Value =
            serde_norway::from_str(&render(Arm::LoadP2p, &e, Some(4096), 1)).unwrap();
        assert_eq!(load["endpoints"], p2p["endpoints"]);
        assert_eq!(load["endpoints"][1]["p2p"], "127.0.0.1:7001");
        let plugins = p2p["plugins"].as_array().unwrap();
        let src = plugins
            .iter()
            .find(|p| p["type"] == "p2p-source-producer")
            .unwrap();
        assert_eq!(src["parameters"]["minCachedTokenDelta"], 4096);
        let aff: serde_json::Value =
            serde_norway::from_str(&render(Arm::Affinity, &e, None, 1)).unwrap();
        let w = &aff["schedulingProfiles"][0]["plugins"][0];
        assert_eq!(
            (w["pluginRef"].as_str(), w["weight"].as_u64()),
            (Some("prefix"), Some(3))
        );
    }

    /// The router accepts every arm's plugins and parameters (not just the YAML shape).
    #[tokio::test]
    async fn the_router_starts_with_every_arm() {
        let path = tempfile::NamedTempFile::new().unwrap();
        for arm in ARM_NAMES {
            let arm: Arm = arm.parse().unwrap();
            let e = eps_for(arm);
            std::fs::write(path.path(), render(arm, &e, Some(1024), 3)).unwrap();
            let cfg = kvmesh_router::RouterConfig::load(path.path()).unwrap();
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let handle = tokio::time::timeout(
                std::time::Duration::from_secs(10),
                kvmesh_router::start(cfg, listener, kvmesh_router::RouterOptions::default()),
            )
            .await
            .unwrap_or_else(|_| panic!("{arm}: router start timed out"))
            .unwrap_or_else(|err| panic!("{arm}: {err}"));
            tokio::time::timeout(std::time::Duration::from_secs(10), handle.shutdown())
                .await
                .unwrap()
                .unwrap();
        }
    }

    #[test]
    fn roles_are_passed_to_the_router() {
        let y: serde_json::Value = serde_norway::from_str(&render(
            Arm::LoadP2p,
            &eps(&[Role::Prefill, Role::Decode]),
            None,
            1,
        ))
        .unwrap();
        assert_eq!(y["endpoints"][0]["role"], "prefill");
        assert_eq!(y["endpoints"][1]["role"], "decode");
    }
}
