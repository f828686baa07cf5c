//! Engine scraping and health checks: `GET /metrics` at `metrics_scrape_interval` for the queue
//! and KV-usage gauges, `GET /health` at the health-check interval to eject and readmit.

use std::sync::Arc;
use std::time::{Duration, Instant};

use std::collections::HashMap;

use kvmesh_index::EndpointId;
use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;

use crate::cost_model::CostModel;

use crate::config::HealthCheckConfig;
use crate::endpoints::{EndpointSet, EngineMetrics};
use crate::metrics::{Kind, RouterMetrics};

/// Reads `vllm:num_requests_waiting`, `vllm:num_requests_running` (summed over series, e.g.
/// data-parallel ranks) and `vllm:kv_cache_usage_perc` (mean) from Prometheus text. `None` if the
/// text has none of them.
pub fn parse_engine_metrics(text: &str, now: Instant) -> Option<EngineMetrics> {
    let (mut waiting, mut running, mut kv_sum, mut kv_n, mut seen) = (0.0, 0.0, 0.0, 0u32, false);
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let name = &line[..name_end];
        if !matches!(
            name,
            "vllm:num_requests_waiting" | "vllm:num_requests_running" | "vllm:kv_cache_usage_perc"
        ) {
            continue;
        }
        // The value follows the label set (which may contain spaces inside quotes).
        let rest = match line[name_end..].rfind('}') {
            Some(i) => &line[name_end + i + 1..],
            None => &line[name_end..],
        };
        let Some(value) = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        else {
            continue;
        };
        if !value.is_finite() {
            continue;
        }
        seen = true;
        match name {
            "vllm:num_requests_waiting" => waiting += value,
            "vllm:num_requests_running" => running += value,
            _ => {
                kv_sum += value;
                kv_n += 1;
            }
        }
    }
    seen.then(|| EngineMetrics {
        waiting,
        running,
        kv_usage: if kv_n > 0 {
            kv_sum / f64::from(kv_n)
        } else {
            0.0
        },
        scraped_at: now,
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

/// Reads [`PrefillCounters`]; absent series count as 0 (an engine that has served nothing yet
/// exports no labelled counters), so call it on pages that are engine metrics.
pub fn parse_prefill_counters(text: &str) -> PrefillCounters {
    let mut c = PrefillCounters::default();
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let name = &line[..name_end];
        let (labels, rest) = match line[name_end..].rfind('}') {
            Some(i) => (&line[name_end..name_end + i + 1], &line[name_end + i + 1..]),
            None => ("", &line[name_end..]),
        };
        let Some(v) = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        else {
            continue;
        };
        if !v.is_finite() {
            continue;
        }
        match name {
            "vllm:time_to_first_token_seconds_sum" => c.ttft_seconds += v,
            "vllm:request_queue_time_seconds_sum" => c.queue_seconds += v,
            "vllm:prompt_tokens_by_source_total" if labels.contains("source=\"local_compute\"") => {
                c.computed_tokens += v;
            }
            "vllm:prompt_tokens_by_source_total"
                if labels.contains("source=\"external_kv_transfer\"") =>
            {
                c.external_tokens += v
            }
            _ => {}
        }
    }
    c
}

/// A prefill-rate sample from two scrapes: tokens the engine computed per second of (TTFT − queue
/// time) it reported in between. Only intervals without external (pulled) tokens count, so pull
/// time is not mistaken for compute; counter resets are skipped.
pub fn prefill_sample(prev: &PrefillCounters, now: &PrefillCounters) -> Option<(u64, Duration)> {
    let tokens = now.computed_tokens - prev.computed_tokens;
    let secs = (now.ttft_seconds - prev.ttft_seconds) - (now.queue_seconds - prev.queue_seconds);
    if tokens <= 0.0 || secs <= 0.0 || now.external_tokens != prev.external_tokens {
        return None;
    }
    Some((tokens as u64, Duration::from_secs_f64(secs)))
}

/// Scrapes every endpoint's `/metrics` each `interval` until cancelled: queue and KV-usage gauges
/// for the scorers, and the engines' own prefill timings for the cost model.
pub async fn scrape_loop(
    endpoints: Arc<EndpointSet>,
    client: reqwest::Client,
    interval: Duration,
    cost_model: Arc<CostModel>,
    cancel: CancellationToken,
) {
    let mut tick = tokio::time::interval(interval.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let previous: Mutex<HashMap<EndpointId, PrefillCounters>> = Mutex::new(HashMap::new());
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
                e.set_metrics(m);
                {
                    let now = parse_prefill_counters(&text);
                    let prev = previous.lock().insert(e.id, now);
                    if let Some((tokens, time)) = prev.and_then(|p| prefill_sample(&p, &now)) {
                        cost_model.observe_prefill_rate(e.id, tokens, time);
                    }
                }
            }
        });
        futures::future::join_all(scrapes).await;
        let live: std::collections::HashSet<EndpointId> = list.iter().map(|e| e.id).collect();
        previous.lock().retain(|id, _| live.contains(id));
    }
}

/// Health-checks every endpoint each `cfg.interval`; ejects after `unhealthy_threshold` failures in
/// a row and readmits after `healthy_threshold` successes.
pub async fn health_loop(
    endpoints: Arc<EndpointSet>,
    client: reqwest::Client,
    cfg: HealthCheckConfig,
    metrics: Arc<RouterMetrics>,
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
            async move {
                let ok = matches!(
                    tokio::time::timeout(cfg.timeout, client.get(e.url(&cfg.path)).send()).await,
                    Ok(Ok(r)) if r.status().is_success()
                );
                match e.record_health(ok, cfg.unhealthy_threshold, cfg.healthy_threshold) {
                    Some(false) => {
                        tracing::warn!(endpoint = %e.name, "endpoint failed health checks; ejected");
                        metrics.endpoint_changes.get_or_create(&Kind { kind: "ejected" }).inc();
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
    fn parses_the_vllm_fixture() {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../../shared/vllm-fixtures/metrics.txt"
        ))
        .expect("fixture");
        let m = parse_engine_metrics(&text, Instant::now()).expect("has gauges");
        assert_eq!((m.waiting, m.running, m.kv_usage), (0.0, 0.0, 0.0));
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
