//! Every engine metric, described once. vLLM's names (`vllm:*`, labels `model_name`, `engine`)
//! so routers and dashboards built for vLLM read kvmesh unchanged; kvmesh-only ones are
//! `kvmesh_engine_*`.

use std::sync::atomic::AtomicU64;

use kvmesh_core::exposition::FloatGauge;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::cpu_tier::CpuTierStats;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabel {
    pub source: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub finished_reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabel {
    pub reason: &'static str,
}

/// vLLM's `vllm:cache_config_info` labels that say how much KV the GPU tier holds (routers read
/// `num_gpu_blocks × block_size` as its capacity in tokens).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CacheConfigLabels {
    pub block_size: String,
    pub num_gpu_blocks: String,
    pub enable_prefix_caching: &'static str,
}

/// `kvmesh_p2p_fingerprint_info`'s label: [`kvmesh_core::Fingerprint::id`] of this engine's KV.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FingerprintLabel {
    pub fingerprint: String,
}

/// The engine's metrics; shared (`Arc`) by the compute thread and the HTTP handlers.
pub struct EngineMetrics {
    registry: Registry,
    /// `vllm:cache_config_info` (value 1, the facts are labels), set by [`Self::describe_cache`].
    cache_config_info: Family<CacheConfigLabels, FloatGauge>,
    /// `kvmesh_p2p_fingerprint_info` (value 1), set by [`Self::describe_fingerprint`].
    fingerprint_info: Family<FingerprintLabel, FloatGauge>,
    pub num_requests_running: FloatGauge,
    pub num_requests_waiting: FloatGauge,
    pub kv_cache_usage_perc: FloatGauge,
    pub prefix_cache_queries: Counter,
    pub prefix_cache_hits: Counter,
    pub external_prefix_cache_queries: Counter,
    pub external_prefix_cache_hits: Counter,
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
    pub prompt_tokens_by_source: Family<SourceLabel, Counter>,
    pub num_preemptions: Counter,
    pub request_success: Family<ReasonLabel, Counter>,
    pub time_to_first_token: Histogram,
    pub request_queue_time: Histogram,
    pub e2e_request_latency: Histogram,
    pub errors: Family<ErrorLabel, Counter>,
    pub gpu_evicted_blocks: Counter,
    pub cpu_capacity_bytes: FloatGauge,
    pub cpu_used_bytes: FloatGauge,
    pub cpu_blocks: FloatGauge,
    pub cpu_stored_blocks: FloatGauge,
    pub cpu_evicted_blocks: FloatGauge,
    pub cpu_rejected_blocks: FloatGauge,
    pub cpu_restored_blocks: Counter,
    /// Layer-wise pulls that ended short after their request's step began: the blocks that
    /// did not arrive on every layer were recomputed.
    pub p2p_layerwise_short: Counter,
    /// Layer-wise pulls dropped at admission because the local prefix had changed meanwhile.
    pub p2p_layerwise_unused: Counter,
    /// Layer-wise pulls that could not stage (the staging budget was full): pulled whole.
    pub p2p_layerwise_no_staging: Counter,
    /// Modelled host-to-device time of every CPU-tier restore (unscaled; time-modelled backends).
    pub cpu_restore_modelled_seconds: Counter<f64, AtomicU64>,
    /// Wall seconds requests spent admitted but waiting for their restored blocks to land
    /// (`--sim-h2d overlap`).
    pub cpu_restore_wait_seconds: Counter<f64, AtomicU64>,
    pub cpu_retained_evicted_blocks: FloatGauge,
    pub cpu_pull_pin_capped_blocks: FloatGauge,
    /// Pulls stopped because our own sink refused a block, by sink reason.
    pub p2p_sink_rejected: Family<ErrorLabel, Counter>,
    pub step_seconds: Histogram,
    /// P2P transfer counters (`kvmesh_p2p_*`), shared by this engine's producer and pull client.
    pub p2p: kvmesh_transfer::TransferMetrics,
    /// P/D counters (`vllm:nixl_num_kv_expired_reqs`, `kvmesh_engine_pd_*`).
    pub pd: PdMetrics,
    /// Prefetch counters (`kvmesh_engine_prefetches_total`, `kvmesh_engine_prefetch_blocks_total`).
    pub prefetch: PrefetchMetrics,
}

const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const QUEUE_BUCKETS: &[f64] = &[
    0.001, 0.01, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
];

impl EngineMetrics {
    pub fn new(model_name: &str, engine: &str) -> Self {
        let mut registry = Registry::with_labels(
            [
                ("model_name".into(), model_name.to_owned().into()),
                ("engine".into(), engine.to_owned().into()),
            ]
            .into_iter(),
        );
        let m = Self {
            cache_config_info: Family::default(),
            fingerprint_info: Family::default(),
            num_requests_running: FloatGauge::default(),
            num_requests_waiting: FloatGauge::default(),
            kv_cache_usage_perc: FloatGauge::default(),
            prefix_cache_queries: Counter::default(),
            prefix_cache_hits: Counter::default(),
            external_prefix_cache_queries: Counter::default(),
            external_prefix_cache_hits: Counter::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            prompt_tokens_by_source: Family::default(),
            num_preemptions: Counter::default(),
            request_success: Family::default(),
            time_to_first_token: Histogram::new(TTFT_BUCKETS.iter().copied()),
            request_queue_time: Histogram::new(QUEUE_BUCKETS.iter().copied()),
            e2e_request_latency: Histogram::new(TTFT_BUCKETS.iter().copied()),
            errors: Family::default(),
            gpu_evicted_blocks: Counter::default(),
            cpu_capacity_bytes: FloatGauge::default(),
            cpu_used_bytes: FloatGauge::default(),
            cpu_blocks: FloatGauge::default(),
            cpu_stored_blocks: FloatGauge::default(),
            cpu_evicted_blocks: FloatGauge::default(),
            cpu_rejected_blocks: FloatGauge::default(),
            cpu_restored_blocks: Counter::default(),
            p2p_layerwise_short: Counter::default(),
            p2p_layerwise_unused: Counter::default(),
            p2p_layerwise_no_staging: Counter::default(),
            cpu_restore_modelled_seconds: Counter::default(),
            cpu_restore_wait_seconds: Counter::default(),
            cpu_retained_evicted_blocks: FloatGauge::default(),
            cpu_pull_pin_capped_blocks: FloatGauge::default(),
            p2p_sink_rejected: Family::default(),
            step_seconds: Histogram::new(TTFT_BUCKETS.iter().copied()),
            p2p: kvmesh_transfer::TransferMetrics::new(),
            pd: PdMetrics::default(),
            prefetch: PrefetchMetrics::default(),
            registry: Registry::default(),
        };
        let r = &mut registry;
        r.register(
            "vllm:cache_config_info",
            "Information of the LLMEngine's CacheConfig",
            m.cache_config_info.clone(),
        );
        r.register(
            "kvmesh_p2p_fingerprint_info",
            "Id of the fingerprint a peer's KV must match to be used here (SHA-256 prefix of the \
             encoded fingerprint); endpoints with equal ids can exchange blocks",
            m.fingerprint_info.clone(),
        );
        r.register(
            "vllm:num_requests_running",
            "Requests in the running batch",
            m.num_requests_running.clone(),
        );
        r.register(
            "vllm:num_requests_waiting",
            "Requests waiting to be scheduled",
            m.num_requests_waiting.clone(),
        );
        r.register(
            "vllm:kv_cache_usage_perc",
            "GPU KV-cache usage (1 = full)",
            m.kv_cache_usage_perc.clone(),
        );
        r.register(
            "vllm:prefix_cache_queries",
            "Prompt tokens queried against the prefix cache",
            m.prefix_cache_queries.clone(),
        );
        r.register(
            "vllm:prefix_cache_hits",
            "Prompt tokens found in the local prefix cache (GPU or CPU tier)",
            m.prefix_cache_hits.clone(),
        );
        r.register(
            "vllm:external_prefix_cache_queries",
            "Prompt tokens queried against an external source (P2P)",
            m.external_prefix_cache_queries.clone(),
        );
        r.register(
            "vllm:external_prefix_cache_hits",
            "Prompt tokens loaded from an external source (P2P)",
            m.external_prefix_cache_hits.clone(),
        );
        r.register(
            "vllm:prompt_tokens",
            "Prompt tokens processed",
            m.prompt_tokens.clone(),
        );
        r.register(
            "vllm:generation_tokens",
            "Generated tokens",
            m.generation_tokens.clone(),
        );
        r.register(
            "vllm:prompt_tokens_by_source",
            "Prompt tokens by where their KV came from",
            m.prompt_tokens_by_source.clone(),
        );
        r.register(
            "vllm:num_preemptions",
            "Preemptions (requests sent back to the queue)",
            m.num_preemptions.clone(),
        );
        r.register(
            "vllm:request_success",
            "Finished requests by reason",
            m.request_success.clone(),
        );
        r.register(
            "vllm:time_to_first_token_seconds",
            "Time to first token",
            m.time_to_first_token.clone(),
        );
        r.register(
            "vllm:request_queue_time_seconds",
            "Time from arrival to first scheduling",
            m.request_queue_time.clone(),
        );
        r.register(
            "vllm:e2e_request_latency_seconds",
            "Arrival to finish",
            m.e2e_request_latency.clone(),
        );
        r.register(
            "kvmesh_engine_request_errors",
            "Rejected or failed requests by reason (malformed_remote_kv_source: the P2P hint was ignored, the request served)",
            m.errors.clone(),
        );
        r.register(
            "kvmesh_engine_gpu_evicted_blocks",
            "GPU-tier cached blocks evicted",
            m.gpu_evicted_blocks.clone(),
        );
        r.register(
            "kvmesh_engine_cpu_capacity_bytes",
            "CPU tier capacity",
            m.cpu_capacity_bytes.clone(),
        );
        r.register(
            "kvmesh_engine_cpu_used_bytes",
            "CPU tier bytes held",
            m.cpu_used_bytes.clone(),
        );
        r.register(
            "kvmesh_engine_cpu_blocks",
            "CPU tier blocks held",
            m.cpu_blocks.clone(),
        );
        r.register(
            "kvmesh_engine_cpu_stored_blocks",
            "Blocks stored into the CPU tier (cumulative)",
            m.cpu_stored_blocks.clone(),
        );
        r.register(
            "kvmesh_engine_cpu_evicted_blocks",
            "Blocks evicted from the CPU tier (cumulative)",
            m.cpu_evicted_blocks.clone(),
        );
        r.register(
            "kvmesh_engine_cpu_rejected_blocks",
            "Blocks the CPU tier refused (pinned blocks filled it; cumulative)",
            m.cpu_rejected_blocks.clone(),
        );
        r.register(
            "kvmesh_engine_cpu_restored_blocks",
            "Blocks restored from the CPU tier into the GPU tier",
            m.cpu_restored_blocks.clone(),
        );
        r.register(
            "kvmesh_engine_p2p_layerwise_short",
            "Layer-wise pulls that ended short during their request's step (the rest recomputed)",
            m.p2p_layerwise_short.clone(),
        );
        r.register(
            "kvmesh_engine_p2p_layerwise_unused",
            "Layer-wise pulls dropped at admission (the local prefix had changed)",
            m.p2p_layerwise_unused.clone(),
        );
        r.register(
            "kvmesh_engine_p2p_layerwise_no_staging",
            "Layer-wise pulls taken whole because the staging budget was full",
            m.p2p_layerwise_no_staging.clone(),
        );
        r.register(
            "kvmesh_engine_cpu_restore_modelled_seconds",
            "Modelled host-to-device copy time of CPU-tier restores (unscaled)",
            m.cpu_restore_modelled_seconds.clone(),
        );
        r.register(
            "kvmesh_engine_cpu_restore_wait_seconds",
            "Seconds admitted requests waited for restored blocks to land (copy engine)",
            m.cpu_restore_wait_seconds.clone(),
        );
        r.register(
            "kvmesh_engine_cpu_retained_evicted_blocks",
            "Blocks retained for a P/D reader evicted under pressure before their retention expired",
            m.cpu_retained_evicted_blocks.clone(),
        );
        r.register(
            "kvmesh_engine_cpu_pull_pin_capped_blocks",
            "Pulled blocks stored unpinned because pull pins held their share of the CPU tier",
            m.cpu_pull_pin_capped_blocks.clone(),
        );
        r.register(
            "kvmesh_engine_p2p_sink_rejected",
            "P2P pulls stopped because this engine's sink refused a block, by reason",
            m.p2p_sink_rejected.clone(),
        );
        r.register(
            "kvmesh_engine_step_seconds",
            "Wall time of one engine step",
            m.step_seconds.clone(),
        );
        m.p2p.register(r);
        m.pd.register(r);
        m.prefetch.register(r);
        Self { registry, ..m }
    }

    /// Copies CPU-tier counters into their gauges (called before each scrape).
    pub fn set_cpu_stats(&self, s: &CpuTierStats) {
        self.cpu_capacity_bytes.set(s.capacity_bytes as f64);
        self.cpu_used_bytes.set(s.used_bytes as f64);
        self.cpu_blocks.set(s.blocks as f64);
        self.cpu_stored_blocks.set(s.stored_blocks as f64);
        self.cpu_evicted_blocks.set(s.evicted_blocks as f64);
        self.cpu_rejected_blocks.set(s.rejected_blocks as f64);
        self.cpu_retained_evicted_blocks
            .set(s.retained_evicted_blocks as f64);
        self.cpu_pull_pin_capped_blocks
            .set(s.pull_pin_capped_blocks as f64);
    }

    /// Counts a pull our sink stopped (`reason` is the sink's label).
    pub fn p2p_sink_rejected(&self, reason: &'static str) {
        self.p2p_sink_rejected
            .get_or_create(&ErrorLabel { reason })
            .inc();
    }

    pub fn error(&self, reason: &'static str) {
        self.errors.get_or_create(&ErrorLabel { reason }).inc();
    }

    /// Prometheus text exposition.
    /// Publishes the GPU tier's shape as vLLM does (`vllm:cache_config_info`): routers size
    /// what a busy engine can admit from it. Prefix caching is always on in a kvmesh engine.
    pub fn describe_cache(&self, block_size: usize, num_gpu_blocks: usize) {
        self.cache_config_info
            .get_or_create(&CacheConfigLabels {
                block_size: block_size.to_string(),
                num_gpu_blocks: num_gpu_blocks.to_string(),
                enable_prefix_caching: "True",
            })
            .set(1.0);
    }

    /// Exports the id of the engine's fingerprint (routers group endpoints by it).
    pub fn describe_fingerprint(&self, fingerprint: &kvmesh_core::Fingerprint) {
        self.fingerprint_info
            .get_or_create(&FingerprintLabel {
                fingerprint: fingerprint.id(),
            })
            .set(1.0);
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// Labels of `kvmesh_engine_pd_remote_reads_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PdReadLabel {
    /// `decode` (P→D prompt pull) or `history` (D→P bi-directional read).
    pub leg: &'static str,
    pub outcome: &'static str,
}

/// Labels of `kvmesh_engine_pd_retained_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PdRetainLabel {
    /// `prefill` (prompt kept for a decoder) or `decode` (history kept for the next turn).
    pub role: &'static str,
}

/// P/D counters on the engine registry.
#[derive(Debug, Clone, Default)]
pub struct PdMetrics {
    /// vLLM's `vllm:nixl_num_kv_expired_reqs`: remote reads declined because the entry expired.
    pub expired_reqs: Counter,
    pub remote_reads: Family<PdReadLabel, Counter>,
    pub remote_read_tokens: Family<PdReadLabel, Counter>,
    pub retained: Family<PdRetainLabel, Counter>,
    pub retained_blocks: Family<PdRetainLabel, Counter>,
}

impl PdMetrics {
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "vllm:nixl_num_kv_expired_reqs",
            "Remote KV reads declined because the remote blocks had expired",
            self.expired_reqs.clone(),
        );
        r.register(
            "kvmesh_engine_pd_remote_reads",
            "P/D remote KV reads by leg (decode: prompt from the prefiller; history: from a decoder) and outcome",
            self.remote_reads.clone(),
        );
        r.register(
            "kvmesh_engine_pd_remote_read_tokens",
            "Tokens landed by P/D remote reads, by leg",
            self.remote_read_tokens.clone(),
        );
        r.register(
            "kvmesh_engine_pd_retained",
            "Requests whose blocks were pinned for a remote reader, by role",
            self.retained.clone(),
        );
        r.register(
            "kvmesh_engine_pd_retained_blocks",
            "Blocks pinned for remote readers, by role",
            self.retained_blocks.clone(),
        );
    }

    pub(crate) fn read(&self, leg: &'static str, outcome: &'static str) {
        self.remote_reads
            .get_or_create(&PdReadLabel { leg, outcome })
            .inc();
    }
}

/// Labels of `kvmesh_engine_prefetches_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PrefetchLabel {
    pub outcome: String,
}

/// Prefetch counters on the engine registry ([`crate::prefetch`]).
#[derive(Debug, Clone, Default)]
pub struct PrefetchMetrics {
    pub prefetches: Family<PrefetchLabel, Counter>,
    pub blocks: Counter,
    /// Blocks restores ahead copied from this engine's CPU tier into its GPU tier.
    pub restored_blocks: Counter,
    /// Modelled host-to-device time those copies were charged (unscaled seconds).
    pub restore_modelled_seconds: Counter<f64, AtomicU64>,
}

impl PrefetchMetrics {
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "kvmesh_engine_prefetches",
            "Prefetches a router asked this engine to run ahead of a request, by outcome",
            self.prefetches.clone(),
        );
        r.register(
            "kvmesh_engine_prefetch_blocks",
            "Blocks prefetches landed in the CPU tier",
            self.blocks.clone(),
        );
        r.register(
            "kvmesh_engine_prefetch_restored_blocks",
            "Blocks restore-ahead prefetches copied from the CPU tier into the GPU tier",
            self.restored_blocks.clone(),
        );
        r.register(
            "kvmesh_engine_prefetch_restore_modelled_seconds",
            "Modelled host-to-device time charged for restore-ahead copies (unscaled)",
            self.restore_modelled_seconds.clone(),
        );
    }

    pub(crate) fn finished(&self, outcome: &str, blocks: usize) {
        self.prefetches
            .get_or_create(&PrefetchLabel {
                outcome: outcome.to_owned(),
            })
            .inc();
        self.blocks.inc_by(blocks as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_config_info_names_the_gpu_tier_as_vllm_does() {
        let m = EngineMetrics::new("sim-model", "0");
        m.describe_cache(16, 15_071);
        let text = m.encode();
        assert!(
            text.contains("vllm:cache_config_info{model_name=\"sim-model\",engine=\"0\",block_size=\"16\",num_gpu_blocks=\"15071\",enable_prefix_caching=\"True\"} 1"),
            "{text}"
        );
    }

    #[test]
    fn the_fingerprint_id_is_exported_for_routers_to_group_by() {
        let m = EngineMetrics::new("sim-model", "0");
        let hasher = kvmesh_core::BlockHasher::new(kvmesh_core::HashAlgo::Sha256Cbor, None, 16);
        let fp = kvmesh_core::Fingerprint::new("sim-model", "sim", 36, 8, 64, &hasher);
        m.describe_fingerprint(&fp);
        let text = m.encode();
        let want = format!(
            "kvmesh_p2p_fingerprint_info{{model_name=\"sim-model\",engine=\"0\",fingerprint=\"{}\"}} 1",
            fp.id()
        );
        assert!(text.contains(&want), "{text}");
    }

    #[test]
    fn exposes_vllm_names_with_labels() {
        let m = EngineMetrics::new("sim-model", "0");
        m.prefix_cache_hits.inc_by(16);
        m.prompt_tokens_by_source
            .get_or_create(&SourceLabel {
                source: "local_cache_hit",
            })
            .inc_by(16);
        let text = m.encode();
        assert!(
            text.contains("vllm:prefix_cache_hits_total{model_name=\"sim-model\",engine=\"0\"} 16"),
            "{text}"
        );
        assert!(text.contains("vllm:prompt_tokens_by_source_total{model_name=\"sim-model\",engine=\"0\",source=\"local_cache_hit\"} 16"), "{text}");
        assert!(text.contains("vllm:time_to_first_token_seconds_bucket"));
        assert!(text.contains("vllm:num_requests_waiting{"));
    }
}
