//! Every router metric, described once and recorded through this module (`kvmesh_router_*`).
//! Label values come from config (endpoint, profile names) or fixed enums — never from clients.

use kvmesh_core::exposition::FloatGauge;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::fleet::endpoints::EndpointSet;
use kvmesh_sched::cost_model::CostModel;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProfileEndpoint {
    pub profile: String,
    pub endpoint: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Outcome {
    pub outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Reason {
    pub reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Kind {
    pub kind: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointLabel {
    pub endpoint: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointOutcome {
    pub endpoint: String,
    pub outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabel {
    pub source: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceReason {
    pub source: String,
    pub reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PairLabel {
    pub source: String,
    pub dest: String,
}

pub struct RouterMetrics {
    pub requests: Family<ProfileEndpoint, Counter>,
    pub decisions: Family<Outcome, Counter>,
    pub pull_skipped: Family<Reason, Counter>,
    pub errors: Family<Kind, Counter>,
    pub scheduling_seconds: Histogram,
    pub endpoint_changes: Family<Kind, Counter>,
    /// Requests sent to a second endpoint after the first failed before any response byte.
    pub retries: Counter,
    /// Client-sent `kv_transfer_params` removed before forwarding (the router owns them).
    pub client_params_dropped: Counter,
    /// Client requests the router holds now (parsing, queued, forwarding or streaming).
    pub in_flight: Gauge,
    in_flight_requests: Family<EndpointLabel, Gauge>,
    in_flight_uncached: Family<EndpointLabel, Gauge>,
    in_flight_decode: Family<EndpointLabel, Gauge>,
    in_flight_context_blocks: Family<EndpointLabel, Gauge>,
    /// Engine load reports received, by endpoint and outcome (accepted, malformed, flood).
    pub load_reports: Family<EndpointOutcome, Counter>,
    load_shared: Family<EndpointLabel, Gauge>,
    gpu_capacity: Family<EndpointLabel, FloatGauge>,
    decode_seconds: Family<EndpointLabel, FloatGauge>,
    waiting: Family<EndpointLabel, FloatGauge>,
    running: Family<EndpointLabel, FloatGauge>,
    kv_usage: Family<EndpointLabel, FloatGauge>,
    healthy: Family<EndpointLabel, Gauge>,
    events_silent: Family<EndpointLabel, Gauge>,
    block_size_mismatch: Family<EndpointLabel, Gauge>,
    prefill_rate: Family<EndpointLabel, FloatGauge>,
    pull_rate: Family<PairLabel, FloatGauge>,
    pull_rate_into: Family<EndpointLabel, FloatGauge>,
    /// Pulls that fell short of what their source advertised, by source and reason.
    pub p2p_source_penalties: Family<SourceReason, Counter>,
    /// Pulls that reached what their source advertised, by source.
    pub p2p_source_served: Family<SourceLabel, Counter>,
    p2p_source_failure_probability: Family<SourceLabel, FloatGauge>,
    p2p_source_excluded: Family<SourceLabel, Gauge>,
}

impl RouterMetrics {
    /// Counts one placement: the request (or P/D leg) routed by `profile` to `endpoint` with
    /// `outcome`, and why the profile named no P2P source, if it did not.
    pub fn placed(
        &self,
        profile: &str,
        endpoint: &str,
        outcome: &'static str,
        p2p: Option<&kvmesh_sched::plugins::p2p_source_producer::P2pDecision>,
    ) {
        self.requests
            .get_or_create(&ProfileEndpoint {
                profile: profile.to_owned(),
                endpoint: endpoint.to_owned(),
            })
            .inc();
        self.decisions.get_or_create(&Outcome { outcome }).inc();
        if let Some(reason) = p2p.and_then(|p| p.skipped) {
            self.pull_skipped
                .get_or_create(&Reason {
                    reason: reason.as_str(),
                })
                .inc();
        }
    }

    /// Creates and registers every router metric in `registry`.
    pub fn register(registry: &mut Registry) -> RouterMetrics {
        let m = RouterMetrics {
            requests: Family::default(),
            decisions: Family::default(),
            pull_skipped: Family::default(),
            errors: Family::default(),
            scheduling_seconds: Histogram::new(exponential_buckets(1e-5, 2.0, 20)),
            endpoint_changes: Family::default(),
            retries: Counter::default(),
            client_params_dropped: Counter::default(),
            in_flight: Gauge::default(),
            in_flight_requests: Family::default(),
            in_flight_uncached: Family::default(),
            in_flight_decode: Family::default(),
            in_flight_context_blocks: Family::default(),
            load_reports: Family::default(),
            load_shared: Family::default(),
            gpu_capacity: Family::default(),
            decode_seconds: Family::default(),
            waiting: Family::default(),
            running: Family::default(),
            kv_usage: Family::default(),
            healthy: Family::default(),
            events_silent: Family::default(),
            block_size_mismatch: Family::default(),
            prefill_rate: Family::default(),
            pull_rate: Family::default(),
            pull_rate_into: Family::default(),
            p2p_source_penalties: Family::default(),
            p2p_source_served: Family::default(),
            p2p_source_failure_probability: Family::default(),
            p2p_source_excluded: Family::default(),
        };
        let r = registry;
        r.register(
            "kvmesh_router_requests",
            "Requests routed, by profile and chosen endpoint (a P/D request counts each leg)",
            m.requests.clone(),
        );
        r.register(
            "kvmesh_router_decisions",
            "Placement outcomes per scheduled leg: local_hit (chosen endpoint holds part of the prefix, no pull), pull_named (told to read KV from a peer: a P2P source, a decoder's history, or a P/D decode leg's prefiller), cold",
            m.decisions.clone(),
        );
        r.register(
            "kvmesh_router_pull_skipped",
            "P2P source not named, by reason (below_threshold, self, no_source, cost)",
            m.pull_skipped.clone(),
        );
        r.register(
            "kvmesh_router_errors",
            "Requests the router answered with an error, by kind",
            m.errors.clone(),
        );
        r.register(
            "kvmesh_router_scheduling_duration_seconds",
            "Tokenize + block keys + index lookup + scheduling pipeline, per request",
            m.scheduling_seconds.clone(),
        );
        r.register(
            "kvmesh_router_endpoint_changes",
            "Endpoints added/removed/ejected/readmitted",
            m.endpoint_changes.clone(),
        );
        r.register(
            "kvmesh_router_retries",
            "Requests retried once on another endpoint because the first refused the connection or failed before any response byte",
            m.retries.clone(),
        );
        r.register(
            "kvmesh_router_client_kv_transfer_params_dropped",
            "Client-supplied kv_transfer_params removed before forwarding (trust_client_kv_transfer_params: false)",
            m.client_params_dropped.clone(),
        );
        r.register(
            "kvmesh_router_in_flight",
            "Client requests the router holds now (bounded by max_in_flight)",
            m.in_flight.clone(),
        );
        r.register(
            "kvmesh_router_endpoint_in_flight_requests",
            "Requests in flight per endpoint",
            m.in_flight_requests.clone(),
        );
        r.register(
            "kvmesh_router_endpoint_in_flight_uncached_tokens",
            "Prompt tokens in flight that the endpoint still computes",
            m.in_flight_uncached.clone(),
        );
        r.register(
            "kvmesh_router_endpoint_in_flight_decode_tokens",
            "Decode tokens (max_tokens) of in-flight requests",
            m.in_flight_decode.clone(),
        );
        r.register(
            "kvmesh_router_endpoint_in_flight_context_blocks",
            "Distinct prompt blocks of in-flight requests (what they need the GPU tier to hold; a shared prefix counts once)",
            m.in_flight_context_blocks.clone(),
        );
        r.register(
            "kvmesh_router_load_reports",
            "Engine load reports (kvmesh.load on the KV-event socket) by endpoint and outcome: accepted, malformed, flood (beyond 50 per 100 ms)",
            m.load_reports.clone(),
        );
        r.register(
            "kvmesh_router_endpoint_load_shared",
            "1 while the endpoint's in-flight figures include every router replica's work (a fresh engine load report), 0 when this replica falls back to its own view",
            m.load_shared.clone(),
        );
        r.register(
            "kvmesh_router_endpoint_gpu_capacity_tokens",
            "Scraped vllm:cache_config_info num_gpu_blocks x block_size",
            m.gpu_capacity.clone(),
        );
        r.register(
            "kvmesh_router_endpoint_decode_seconds_per_token",
            "Learned decode time per requested output token on the endpoint, first byte to end (prices the wait for GPU room)",
            m.decode_seconds.clone(),
        );
        r.register(
            "kvmesh_router_endpoint_waiting_requests",
            "Scraped vllm:num_requests_waiting",
            m.waiting.clone(),
        );
        r.register(
            "kvmesh_router_endpoint_running_requests",
            "Scraped vllm:num_requests_running",
            m.running.clone(),
        );
        r.register(
            "kvmesh_router_endpoint_kv_usage_ratio",
            "Scraped vllm:kv_cache_usage_perc",
            m.kv_usage.clone(),
        );
        r.register(
            "kvmesh_router_endpoint_healthy",
            "1 if the endpoint passes health checks",
            m.healthy.clone(),
        );
        r.register(
            "kvmesh_router_endpoint_events_silent",
            "1 if the endpoint is configured with KV events but none arrived while it served requests (the router routes it blind)",
            m.events_silent.clone(),
        );
        r.register(
            "kvmesh_router_endpoint_block_size_mismatch",
            "1 if the endpoint reports a block size (vllm:cache_config_info) that is not a multiple of the router's block_size: its KV events cannot match the router's block hashes",
            m.block_size_mismatch.clone(),
        );
        r.register(
            "kvmesh_router_prefill_rate_tokens_per_second",
            "Cost model: learned prefill rate per endpoint",
            m.prefill_rate.clone(),
        );
        r.register(
            "kvmesh_router_pull_rate_tokens_per_second",
            "Cost model: learned P2P pull rate per (source, dest)",
            m.pull_rate.clone(),
        );
        r.register(
            "kvmesh_router_pull_rate_into_tokens_per_second",
            "Cost model: learned P2P pull rate per destination, from the engine's own pull counters (used for pairs without their own rate)",
            m.pull_rate_into.clone(),
        );
        r.register(
            "kvmesh_router_p2p_source_penalties",
            "P2P pulls that fell short of the prefix their named source advertised, by source and reason (miss, stall, verify_failure, error), as the consuming engine reported them (x-kvmesh-pull)",
            m.p2p_source_penalties.clone(),
        );
        r.register(
            "kvmesh_router_p2p_source_served",
            "P2P pulls that reached the prefix their named source advertised, by source",
            m.p2p_source_served.clone(),
        );
        r.register(
            "kvmesh_router_p2p_source_failure_probability",
            "Estimated probability that a pull from the source fails (decaying reputation; placement discounts a pull's saving by it)",
            m.p2p_source_failure_probability.clone(),
        );
        r.register(
            "kvmesh_router_p2p_source_excluded",
            "1 while the source's failure probability is at or above p2p_reputation.exclude_at: it is not named as a P2P source",
            m.p2p_source_excluded.clone(),
        );
        m
    }

    /// Refreshes the source-reputation gauges: one series per endpoint (0 when nothing counts
    /// against it), so a recovered source reads 0 rather than vanishing.
    pub fn refresh_reputation(
        &self,
        endpoints: &EndpointSet,
        standings: &[(
            kvmesh_index::EndpointId,
            kvmesh_sched::reputation::SourceStanding,
        )],
    ) {
        self.p2p_source_failure_probability.clear();
        self.p2p_source_excluded.clear();
        for e in endpoints.list().iter().filter(|e| e.spec.p2p.is_some()) {
            let standing = standings
                .iter()
                .find(|(id, _)| *id == e.id)
                .map(|(_, s)| *s)
                .unwrap_or_default();
            let l = SourceLabel {
                source: e.name.to_string(),
            };
            self.p2p_source_failure_probability
                .get_or_create(&l)
                .set(standing.failure_probability);
            self.p2p_source_excluded
                .get_or_create(&l)
                .set(i64::from(standing.excluded));
        }
    }

    pub fn error(&self, kind: &'static str) {
        self.errors.get_or_create(&Kind { kind }).inc();
    }

    /// Refreshes the per-endpoint gauges from live state (called before each `/metrics` render), so
    /// removed endpoints disappear and the values are exact at scrape time.
    pub fn refresh(&self, endpoints: &EndpointSet, cost: &CostModel, block_size: usize) {
        let list = endpoints.list();
        for f in [
            &self.in_flight_requests,
            &self.in_flight_uncached,
            &self.in_flight_decode,
            &self.in_flight_context_blocks,
            &self.load_shared,
            &self.healthy,
            &self.events_silent,
            &self.block_size_mismatch,
        ] {
            f.clear();
        }
        for f in [
            &self.waiting,
            &self.running,
            &self.kv_usage,
            &self.prefill_rate,
            &self.gpu_capacity,
            &self.decode_seconds,
        ] {
            f.clear();
        }
        self.pull_rate.clear();
        self.pull_rate_into.clear();
        let clamp = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        for e in list.iter() {
            let l = EndpointLabel {
                endpoint: e.name.to_string(),
            };
            let load = e.load.snapshot();
            self.in_flight_requests
                .get_or_create(&l)
                .set(clamp(load.requests));
            self.in_flight_uncached
                .get_or_create(&l)
                .set(clamp(load.uncached_tokens));
            self.in_flight_decode
                .get_or_create(&l)
                .set(clamp(load.decode_tokens));
            self.in_flight_context_blocks
                .get_or_create(&l)
                .set(clamp(load.context_blocks));
            if e.spec.kv_events.is_some() {
                self.load_shared
                    .get_or_create(&l)
                    .set(i64::from(load.shared));
            }
            if let Some(ms) = e.load.decode_ms_per_token() {
                self.decode_seconds.get_or_create(&l).set(ms / 1000.0);
            }
            self.healthy
                .get_or_create(&l)
                .set(i64::from(e.is_healthy()));
            if e.spec.kv_events.is_some() {
                let silent = e.events_silent.load(std::sync::atomic::Ordering::Relaxed);
                self.events_silent.get_or_create(&l).set(i64::from(silent));
            }
            if let Some(m) = e.metrics() {
                self.waiting.get_or_create(&l).set(m.waiting);
                self.running.get_or_create(&l).set(m.running);
                self.kv_usage.get_or_create(&l).set(m.kv_usage);
                if let Some(cap) = m.gpu_capacity_tokens {
                    self.gpu_capacity.get_or_create(&l).set(cap as f64);
                }
                if let Some(agree) = m.block_size_agrees(block_size as u64) {
                    self.block_size_mismatch
                        .get_or_create(&l)
                        .set(i64::from(!agree));
                }
            }
            self.prefill_rate
                .get_or_create(&l)
                .set(cost.prefill_rate(e.id));
        }
        let name = |id| list.iter().find(|e| e.id == id).map(|e| e.name.to_string());
        for ((s, d), rate) in cost.pull_rates() {
            if let (Some(source), Some(dest)) = (name(s), name(d)) {
                self.pull_rate
                    .get_or_create(&PairLabel { source, dest })
                    .set(rate.tokens_per_second);
            }
        }
        for (d, rate) in cost.pull_into_rates() {
            if let Some(endpoint) = name(d) {
                self.pull_rate_into
                    .get_or_create(&EndpointLabel { endpoint })
                    .set(rate.tokens_per_second);
            }
        }
    }
}
