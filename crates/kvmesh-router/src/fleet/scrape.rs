//! Engine scraping and health checks: `GET /metrics` at `metrics_scrape_interval` for the queue
//! and KV-usage gauges, `GET /health` at the health-check interval to eject and readmit.

use std::sync::Arc;
use std::time::{Duration, Instant};

use std::collections::HashMap;

use kvmesh_core::exposition::{Sample, parse_exposition};
use kvmesh_index::EndpointId;
use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;

use kvmesh_sched::cost_model::{CostModel, uncontended_time};

use crate::config::HealthCheckConfig;
use crate::fleet::endpoints::{EndpointSet, EngineMetrics};
use crate::fleet::prefix::PrefixLookup;
use crate::metrics::{Kind, RouterMetrics};

/// Reads `vllm:num_requests_waiting`, `vllm:num_requests_running` (summed over series, e.g.
/// data-parallel ranks), `vllm:kv_cache_usage_perc` (mean) and the GPU tier's size from
/// `vllm:cache_config_info`'s `num_gpu_blocks` and `block_size` labels (summed over ranks) from
/// Prometheus text. `None` if the text has none of the gauges.
fn parse_engine_metrics(text: &str, now: Instant) -> Option<EngineMetrics> {
    let (mut waiting, mut running, mut kv_sum, mut kv_n, mut seen) = (0.0, 0.0, 0.0, 0u32, false);
    let mut capacity: Option<u64> = None;
    let mut block_size: Option<u64> = None;
    for s in samples(text) {
        match s.name.as_str() {
            "vllm:num_requests_waiting" => waiting += s.value,
            "vllm:num_requests_running" => running += s.value,
            "vllm:kv_cache_usage_perc" => {
                kv_sum += s.value;
                kv_n += 1;
            }
            "vllm:cache_config_info" => {
                let label = |k| s.label(k).and_then(|v| v.parse::<u64>().ok());
                block_size = block_size.or(label("block_size").filter(|&bs| bs > 0));
                if let (Some(blocks), Some(bs)) = (label("num_gpu_blocks"), label("block_size")) {
                    let tokens = blocks.saturating_mul(bs);
                    capacity = Some(capacity.unwrap_or(0).saturating_add(tokens));
                }
                continue;
            }
            _ => continue,
        }
        seen = true;
    }
    seen.then(|| EngineMetrics {
        waiting,
        running,
        kv_usage: if kv_n > 0 {
            kv_sum / f64::from(kv_n)
        } else {
            0.0
        },
        gpu_capacity_tokens: capacity.filter(|&c| c > 0),
        block_size,
        scraped_at: now,
    })
}

/// The id in `kvmesh_p2p_fingerprint_info{fingerprint="…"}` (kvmesh engines and the vLLM
/// connector export it): endpoints with equal ids can use each other's KV blocks. Ids longer
/// than 64 bytes are ignored (an id is 16 hex digits).
fn parse_fingerprint(text: &str) -> Option<String> {
    samples(text)
        .filter(|s| s.name == "kvmesh_p2p_fingerprint_info")
        .find_map(|s| {
            s.label("fingerprint")
                .filter(|id| !id.is_empty() && id.len() <= 64)
                .map(str::to_owned)
        })
}

/// Counters an engine reports about its own prefill work (vLLM names), summed over series.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PrefillCounters {
    /// `vllm:time_to_first_token_seconds_sum`.
    pub ttft_seconds: f64,
    /// `vllm:request_queue_time_seconds_sum`.
    pub queue_seconds: f64,
    /// `vllm:prompt_tokens_by_source_total{source="local_compute"}`.
    pub computed_tokens: f64,
    /// `vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`.
    pub external_tokens: f64,
}

/// The finite samples of an exposition page; comments and lines that do not parse are skipped.
fn samples(text: &str) -> impl Iterator<Item = Sample> {
    parse_exposition(text)
        .into_iter()
        .filter(|s| s.value.is_finite())
}

/// Reads [`PrefillCounters`]; absent series count as 0 (an engine that has served nothing yet
/// exports no labelled counters), so call it on pages that are engine metrics.
fn parse_prefill_counters(text: &str) -> PrefillCounters {
    let mut c = PrefillCounters::default();
    for s in samples(text) {
        let v = s.value;
        match (s.name.as_str(), s.label("source")) {
            ("vllm:time_to_first_token_seconds_sum", _) => c.ttft_seconds += v,
            ("vllm:request_queue_time_seconds_sum", _) => c.queue_seconds += v,
            ("vllm:prompt_tokens_by_source_total", Some("local_compute")) => {
                c.computed_tokens += v;
            }
            ("vllm:prompt_tokens_by_source_total", Some("external_kv_transfer")) => {
                c.external_tokens += v;
            }
            _ => {}
        }
    }
    c
}

/// A prefill-rate sample from two scrapes: tokens the engine computed per second of (TTFT − queue
/// time) it reported in between. Only intervals without external (pulled) tokens count, so pull
/// time is not mistaken for compute; counter resets are skipped.
fn prefill_sample(prev: &PrefillCounters, now: &PrefillCounters) -> Option<(u64, Duration)> {
    let tokens = now.computed_tokens - prev.computed_tokens;
    let secs = (now.ttft_seconds - prev.ttft_seconds) - (now.queue_seconds - prev.queue_seconds);
    if tokens <= 0.0 || secs <= 0.0 || now.external_tokens != prev.external_tokens {
        return None;
    }
    Some((tokens as u64, Duration::from_secs_f64(secs)))
}

/// Counters an engine reports about the KV it pulled from peers (kvmesh-transfer consumer side),
/// summed over series, plus the engine's block size if it reports one.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PullCounters {
    /// `kvmesh_p2p_pull_duration_seconds_sum`: wall time of pulls, connect to last block.
    pub duration_seconds: f64,
    /// `kvmesh_p2p_pull_duration_seconds_count`: pulls (any outcome).
    pub pulls: f64,
    /// `kvmesh_p2p_blocks_total{direction="in"}`: blocks pulled.
    pub blocks_in: f64,
    /// Tokens per block, from vLLM's `vllm:cache_config_info{block_size="…"}` if exported.
    pub block_size: Option<u64>,
}

/// Reads [`PullCounters`]; absent series count as 0 (an engine without P2P exports none).
fn parse_pull_counters(text: &str) -> PullCounters {
    let mut c = PullCounters::default();
    for s in samples(text) {
        let v = s.value;
        match s.name.as_str() {
            "kvmesh_p2p_pull_duration_seconds_sum" => c.duration_seconds += v,
            "kvmesh_p2p_pull_duration_seconds_count" => c.pulls += v,
            "kvmesh_p2p_blocks_total" if s.label("direction") == Some("in") => c.blocks_in += v,
            "vllm:cache_config_info" => {
                if let Some(bs) = s.label("block_size").and_then(|v| v.parse().ok())
                    && bs > 0
                {
                    c.block_size = Some(bs);
                }
            }
            _ => {}
        }
    }
    c
}

/// A destination-level pull-rate sample from two scrapes of the engine that pulled: `(tokens,
/// time)` with tokens = Δblocks in × tokens per block and time = Δpull seconds − `floor` × Δpulls
/// (the fixed per-pull cost the cost model adds separately), clamped at 1 ms. Tokens per block
/// are the engine's reported block size if it reports one, else `default_block_tokens` (the
/// router's `block_size`, which must match the fleet's for its KV-event hashes to line up anyway).
/// `None` without new blocks or time, or if a counter went back (engine restart).
fn pull_sample(
    prev: &PullCounters,
    now: &PullCounters,
    default_block_tokens: u64,
    floor: Duration,
) -> Option<(u64, Duration)> {
    let blocks = now.blocks_in - prev.blocks_in;
    let secs = now.duration_seconds - prev.duration_seconds;
    let pulls = now.pulls - prev.pulls;
    if blocks <= 0.0 || secs <= 0.0 || pulls < 0.0 {
        return None;
    }
    let block_tokens = now.block_size.unwrap_or(default_block_tokens) as f64;
    let time = (secs - floor.as_secs_f64() * pulls).max(MIN_PULL_SAMPLE_SECS);
    Some((
        (blocks * block_tokens) as u64,
        Duration::from_secs_f64(time),
    ))
}

/// Floor of a pull sample's time, so a pull that seemingly took no time beyond the floor yields a
/// large (and then 10×-bounded) rate instead of a division by zero.
const MIN_PULL_SAMPLE_SECS: f64 = 0.001;

/// Scrapes every endpoint's `/metrics` each `interval` until cancelled: queue and KV-usage gauges
/// for the scorers, and the engines' own prefill and pull timings for the cost model.
/// `block_size` (the router config's) converts pulled blocks to tokens for engines that do not
/// report their own block size.
pub async fn scrape_loop(
    endpoints: Arc<EndpointSet>,
    client: reqwest::Client,
    interval: Duration,
    cost_model: Arc<CostModel>,
    block_size: usize,
    cancel: CancellationToken,
) {
    let mut tick = tokio::time::interval(interval.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Per endpoint: its counters at the last scrape, and this router's (pulls named into it,
    // sum of their 1 + sharing) at the same moment.
    type Seen = (PrefillCounters, PullCounters, (u64, u64));
    let previous: Mutex<HashMap<EndpointId, Seen>> = Mutex::new(HashMap::new());
    let block_tokens = block_size as u64;
    let floor = Duration::from_secs_f64(cost_model.params().pull_floor_ms.max(0.0) / 1000.0);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        let list = endpoints.list();
        let scrapes = list.iter().map(|e| {
            let client = client.clone();
            let (previous, cost_model) = (&previous, &cost_model);
            async move {
                let fut = async {
                    client
                        .get(e.url("/metrics"))
                        .send()
                        .await?
                        .error_for_status()?
                        .text()
                        .await
                };
                let Ok(Ok(text)) =
                    tokio::time::timeout(interval.max(Duration::from_millis(200)), fut).await
                else {
                    return;
                };
                let Some(m) = parse_engine_metrics(&text, Instant::now()) else {
                    return;
                };
                let before = e.metrics().and_then(|m| m.block_size);
                if let Some(bs) = m.block_size
                    && before != Some(bs)
                    && m.block_size_agrees(block_tokens) == Some(false)
                {
                    tracing::warn!(
                        endpoint = %e.name,
                        engine_block_size = bs,
                        router_block_size = block_tokens,
                        "the engine's block size is not a multiple of the router's block_size: its \
                         KV events cannot match the router's block hashes, so its cached prefixes \
                         are never found (kvmesh_router_endpoint_block_size_mismatch)"
                    );
                }
                e.set_metrics(m);
                if let Some(id) = parse_fingerprint(&text) {
                    e.learn_fingerprint(&id);
                }
                {
                    let now = (
                        parse_prefill_counters(&text),
                        parse_pull_counters(&text),
                        e.load.pull_share_totals(),
                    );
                    let prev = previous.lock().insert(e.id, now);
                    if let Some((tokens, time)) = prev.and_then(|p| prefill_sample(&p.0, &now.0)) {
                        cost_model.observe_prefill_rate(e.id, tokens, time);
                    }
                    if let Some((tokens, time)) =
                        prev.and_then(|p| pull_sample(&p.1, &now.1, block_tokens, floor))
                    {
                        // The engine's pull times include the transfers that shared its links;
                        // the predictions add the sharing of the moment, so learn the link's own.
                        let (named, shares) = prev.map_or((0, 0), |p| {
                            (now.2.0.saturating_sub(p.2.0), now.2.1.saturating_sub(p.2.1))
                        });
                        let time = uncontended_time(time, named, shares);
                        cost_model.observe_pull_rate_into(e.id, tokens, time);
                    }
                }
            }
        });
        futures::future::join_all(scrapes).await;
        endpoints.note_fingerprints();
        let live: std::collections::HashSet<EndpointId> = list.iter().map(|e| e.id).collect();
        previous.lock().retain(|id, _| live.contains(id));
    }
}

/// Health-checks every endpoint each `cfg.interval`; ejects after `unhealthy_threshold` failures in
/// a row and readmits after `healthy_threshold` successes. An endpoint ejected because its
/// connections are refused also loses its index entries (its process, and cache, are gone; a
/// restarted one announces what it stores anew), as when a request finds it refusing.
pub async fn health_loop(
    endpoints: Arc<EndpointSet>,
    client: reqwest::Client,
    cfg: HealthCheckConfig,
    metrics: Arc<RouterMetrics>,
    prefix: Arc<dyn PrefixLookup>,
    cancel: CancellationToken,
) {
    let mut tick = tokio::time::interval(cfg.interval.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        let list = endpoints.list();
        let checks = list.iter().map(|e| {
            let client = client.clone();
            let cfg = &cfg;
            let metrics = &metrics;
            let prefix = &prefix;
            async move {
                let check =
                    tokio::time::timeout(cfg.timeout, client.get(e.url(&cfg.path)).send()).await;
                let ok = matches!(&check, Ok(Ok(r)) if r.status().is_success());
                // Nothing listens there: the process is gone, and its cache with it.
                let refused = matches!(&check, Ok(Err(err)) if err.is_connect());
                match e.record_health(ok, cfg.unhealthy_threshold, cfg.healthy_threshold) {
                    Some(false) => {
                        tracing::warn!(endpoint = %e.name, refused, "endpoint failed health checks; ejected");
                        metrics.endpoint_changes.get_or_create(&Kind { kind: "ejected" }).inc();
                        if refused {
                            prefix.remove_endpoint(e.id);
                        }
                    }
                    Some(true) => {
                        tracing::info!(endpoint = %e.name, "endpoint healthy again; readmitted");
                        metrics.endpoint_changes.get_or_create(&Kind { kind: "readmitted" }).inc();
                    }
                    None => {}
                }
            }
        });
        futures::future::join_all(checks).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_fingerprint_id_and_ignores_what_is_not_one() {
        let kvmesh = "kvmesh_p2p_fingerprint_info{fingerprint=\"0123456789abcdef\",model_name=\"m\",engine=\"0\"} 1\n";
        assert_eq!(
            parse_fingerprint(kvmesh).as_deref(),
            Some("0123456789abcdef")
        );
        assert_eq!(parse_fingerprint("vllm:num_requests_waiting 0\n"), None);
        let empty = "kvmesh_p2p_fingerprint_info{fingerprint=\"\"} 1\n";
        assert_eq!(parse_fingerprint(empty), None);
        let huge = format!(
            "kvmesh_p2p_fingerprint_info{{fingerprint=\"{}\"}} 1\n",
            "a".repeat(65)
        );
        assert_eq!(parse_fingerprint(&huge), None);
    }

    #[test]
    fn parses_the_vllm_fixture() {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/vllm/metrics.txt"
        ))
        .expect("fixture");
        let m = parse_engine_metrics(&text, Instant::now()).expect("has gauges");
        assert_eq!((m.waiting, m.running, m.kv_usage), (0.0, 0.0, 0.0));
        // 16,384 blocks of 32 tokens: vLLM's own `kv_cache_size_tokens` label says 524,288.
        assert!(text.contains("kv_cache_size_tokens=\"524288\""));
        assert_eq!(m.gpu_capacity_tokens, Some(524_288));
    }

    #[test]
    fn gpu_capacity_sums_ranks_and_needs_both_labels() {
        let text = "vllm:num_requests_waiting 0\n\
            vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"100\"} 1.0\n\
            vllm:cache_config_info{block_size=\"16\",engine=\"1\",num_gpu_blocks=\"50\"} 1.0\n";
        let m = parse_engine_metrics(text, Instant::now()).expect("gauges");
        assert_eq!(m.gpu_capacity_tokens, Some(2_400));
        let partial = "vllm:num_requests_waiting 0\n\
            vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"None\"} 1.0\n";
        let m = parse_engine_metrics(partial, Instant::now()).expect("gauges");
        assert_eq!(m.gpu_capacity_tokens, None);
        // The info series alone is not a scrape of the gauges.
        assert!(
            parse_engine_metrics(
                "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"1\"} 1\n",
                Instant::now()
            )
            .is_none()
        );
    }

    #[test]
    fn an_engine_block_size_that_is_not_a_multiple_of_the_routers_is_seen() {
        let text = "vllm:num_requests_waiting 0\n\
            vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"100\"} 1.0\n";
        let m = parse_engine_metrics(text, Instant::now()).unwrap();
        assert_eq!(m.block_size, Some(16));
        assert_eq!(m.block_size_agrees(16), Some(true));
        assert_eq!(m.block_size_agrees(8), Some(true));
        // Issue 37: a router at 7 in front of engines at 16 never matches their events.
        assert_eq!(m.block_size_agrees(7), Some(false));
        assert_eq!(m.block_size_agrees(32), Some(false));
        let silent = parse_engine_metrics("vllm:num_requests_waiting 0\n", Instant::now()).unwrap();
        assert_eq!(
            silent.block_size_agrees(7),
            None,
            "not reported, not judged"
        );
    }

    #[test]
    fn prefill_rate_from_engine_counters() {
        let text = |ttft: f64, queue: f64, computed: f64, external: f64| {
            format!(
                "vllm:time_to_first_token_seconds_sum{{engine=\"0\"}} {ttft}\n\
                 vllm:request_queue_time_seconds_sum{{engine=\"0\"}} {queue}\n\
                 vllm:prompt_tokens_by_source_total{{engine=\"0\",source=\"local_compute\"}} {computed}\n\
                 vllm:prompt_tokens_by_source_total{{engine=\"0\",source=\"external_kv_transfer\"}} {external}\n"
            )
        };
        let a = parse_prefill_counters(&text(1.0, 0.5, 1000.0, 0.0));
        // 20,000 more tokens in 1.5 s of TTFT, 0.5 s of which queueing → 20,000 tok / 1 s.
        let b = parse_prefill_counters(&text(2.5, 1.0, 21_000.0, 0.0));
        assert_eq!(
            prefill_sample(&a, &b),
            Some((20_000, Duration::from_secs(1)))
        );
        // An interval with pulled tokens, no new work, or a counter reset gives no sample.
        let c = parse_prefill_counters(&text(3.5, 1.0, 22_000.0, 512.0));
        assert_eq!(prefill_sample(&b, &c), None);
        assert_eq!(prefill_sample(&b, &b), None);
        assert_eq!(prefill_sample(&b, &a), None);
        assert_eq!(
            parse_prefill_counters("vllm:num_requests_waiting 1\n"),
            PrefillCounters::default()
        );
    }

    #[test]
    fn parses_pull_counters_from_engine_exposition() {
        // As kvmesh-engine renders them (registry labels, histogram buckets, both directions).
        let text = "# HELP kvmesh_p2p_blocks KV blocks moved over P2P\n\
            # TYPE kvmesh_p2p_blocks counter\n\
            kvmesh_p2p_blocks_total{model_name=\"m\",engine=\"0\",direction=\"in\"} 40\n\
            kvmesh_p2p_blocks_total{model_name=\"m\",engine=\"0\",direction=\"out\"} 7\n\
            # TYPE kvmesh_p2p_pull_duration_seconds histogram\n\
            kvmesh_p2p_pull_duration_seconds_sum{model_name=\"m\",engine=\"0\"} 0.25\n\
            kvmesh_p2p_pull_duration_seconds_count{model_name=\"m\",engine=\"0\"} 3\n\
            kvmesh_p2p_pull_duration_seconds_bucket{le=\"0.001\",model_name=\"m\",engine=\"0\"} 0\n\
            # EOF\n";
        assert_eq!(
            parse_pull_counters(text),
            PullCounters {
                duration_seconds: 0.25,
                pulls: 3.0,
                blocks_in: 40.0,
                block_size: None,
            }
        );
        // vLLM reports its block size; `mamba_block_size` and friends are other labels.
        let vllm = "vllm:cache_config_info{_block_size_resolved=\"True\",block_size=\"32\",engine=\"0\",mamba_block_size=\"None\"} 1.0\n";
        assert_eq!(parse_pull_counters(vllm).block_size, Some(32));
        let fixture = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/vllm/metrics.txt"
        ))
        .expect("fixture");
        assert_eq!(parse_pull_counters(&fixture).block_size, Some(32));
        assert_eq!(
            parse_pull_counters("vllm:num_requests_waiting 1\n"),
            PullCounters::default()
        );
    }

    #[test]
    fn pull_rate_sample_from_engine_counters() {
        let c = |secs: f64, pulls: f64, blocks: f64, bs: Option<u64>| PullCounters {
            duration_seconds: secs,
            pulls,
            blocks_in: blocks,
            block_size: bs,
        };
        let floor = Duration::from_millis(26);
        let a = c(1.0, 10.0, 1000.0, None);
        // 2 pulls, 640 blocks × 16 tokens in 0.152 s − 2 × 26 ms floor = 0.1 s.
        let b = c(1.152, 12.0, 1640.0, None);
        let (tokens, time) = pull_sample(&a, &b, 16, floor).expect("sample");
        assert_eq!(tokens, 10_240);
        assert!((time.as_secs_f64() - 0.1).abs() < 1e-9, "{time:?}");
        // The engine's reported block size wins over the router's.
        let b32 = c(1.152, 12.0, 1640.0, Some(32));
        assert_eq!(pull_sample(&a, &b32, 16, floor).map(|s| s.0), Some(20_480));
        // All time within the floor: clamped to 1 ms, not zero or negative.
        let fast = c(1.01, 11.0, 1100.0, None);
        assert_eq!(
            pull_sample(&a, &fast, 16, floor).map(|s| s.1),
            Some(Duration::from_millis(1))
        );
        // No new blocks, no time, or a counter reset (engine restarted): no sample.
        assert_eq!(pull_sample(&a, &a, 16, floor), None);
        assert_eq!(
            pull_sample(&a, &c(1.0, 11.0, 1100.0, None), 16, floor),
            None
        );
        assert_eq!(pull_sample(&b, &a, 16, floor), None);
        assert_eq!(pull_sample(&b, &c(0.05, 1.0, 64.0, None), 16, floor), None);
        // Wired into the cost model: below `min_sample_tokens` is skipped.
        let m = CostModel::new(kvmesh_sched::cost_model::CostModelParams::default());
        let id = EndpointId(3);
        let small = pull_sample(&a, &c(1.1, 11.0, 1010.0, None), 16, floor).expect("sample");
        assert!(!m.observe_pull_rate_into(id, small.0, small.1));
        assert!(m.observe_pull_rate_into(id, tokens, time));
        assert!((m.pull_rate_into(id) - 102_400.0).abs() < 1e-3);
    }

    #[test]
    fn sums_ranks_and_averages_usage() {
        let text = "# HELP x\nvllm:num_requests_waiting{engine=\"0\",model_name=\"a b\"} 3.0\n\
                    vllm:num_requests_waiting{engine=\"1\"} 2\nvllm:num_requests_running 1\n\
                    vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\nvllm:kv_cache_usage_perc{engine=\"1\"} 0.25\n\
                    vllm:num_requests_waiting_by_reason{reason=\"capacity\"} 9\n";
        let m = parse_engine_metrics(text, Instant::now()).expect("gauges");
        assert_eq!((m.waiting, m.running, m.kv_usage), (5.0, 1.0, 0.375));
        assert!(parse_engine_metrics("other_metric 1\n", Instant::now()).is_none());
    }
}
