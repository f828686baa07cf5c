//! Engine scraping and health checks: `GET /metrics` at `metrics_scrape_interval` for the queue
//! and KV-usage gauges, `GET /health` at the health-check interval to eject and readmit.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

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

/// Scrapes every endpoint's `/metrics` each `interval` until cancelled.
pub async fn scrape_loop(
    endpoints: Arc<EndpointSet>,
    client: reqwest::Client,
    interval: Duration,
    cancel: CancellationToken,
) {
    let mut tick = tokio::time::interval(interval.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        let list = endpoints.list();
        let scrapes = list.iter().map(|e| {
            let client = client.clone();
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
                if let Ok(Ok(text)) =
                    tokio::time::timeout(interval.max(Duration::from_millis(200)), fut).await
                    && let Some(m) = parse_engine_metrics(&text, Instant::now())
                {
                    e.set_metrics(m);
                }
            }
        });
        futures::future::join_all(scrapes).await;
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
