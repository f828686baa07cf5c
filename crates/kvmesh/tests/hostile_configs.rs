//! Configs that should be refused (issue 37, finding 8), against the built `kvmesh router`: a
//! zero interval is a startup error naming its key (exit 2), and a router whose `block_size`
//! does not divide its engine's says so at run time (a warning and a gauge) — it cannot know the
//! engine's block size before scraping it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod hostile_common;

use std::time::{Duration, Instant};

use hostile_common::{metric, router, sim_engine};

#[test]
fn zero_intervals_stop_the_router_at_startup_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    for (yaml, key) in [
        ("health_check: {interval: 0s}\n", "health_check.interval"),
        ("metrics_scrape_interval: 0s\n", "metrics_scrape_interval"),
        (
            "cost_model: {prefill_tokens_per_second: -1}\n",
            "cost_model.prefill_tokens_per_second",
        ),
        (
            "endpoints: [{name: e0, url: \"http://127.0.0.1:1\", kv_events: {endpoint: \"udp://127.0.0.1:5557\"}}]\n",
            "kv_events.endpoint",
        ),
    ] {
        let path = dir.path().join("router.yaml");
        std::fs::write(&path, yaml).unwrap();
        let out = std::process::Command::new(hostile_common::BIN)
            .args(["router", "--port", "0", "--config"])
            .arg(&path)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{yaml}: {stderr}");
        assert!(stderr.contains(key), "{yaml}: {stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_block_size_that_does_not_divide_the_engines_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let (_engine, url) = sim_engine(&[], dir.path()).await;
    let yaml = format!(
        "block_size: 7\ntokenizer: byte\nmetrics_scrape_interval: 100ms\n\
         endpoints:\n  - {{name: e0, url: \"{url}\"}}\n"
    );
    let (router_proc, base) = router(&yaml, dir.path()).await;
    let client = reqwest::Client::new();
    let start = Instant::now();
    loop {
        let text = client
            .get(format!("{base}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let gauge = "kvmesh_router_endpoint_block_size_mismatch";
        if metric(&text, gauge, "e0") == 1.0 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{gauge} never became 1"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log = router_proc.log();
    assert!(
        log.contains("not a multiple of the router's block_size"),
        "no warning in the router's log:\n{log}"
    );
}
