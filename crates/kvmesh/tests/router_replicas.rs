//! Several router replicas in front of one fleet (issue 35), as real `kvmesh` processes on
//! loopback: engines publish their load on the KV-event socket, so a replica sees the prefill
//! work another replica sent; a replica killed mid-run fails only the requests it held (a client
//! retries them on the other, as a Kubernetes Service would) and, restarted, catches up from the
//! engines' replay rings until its index answers like the survivor's.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod hostile_common;

use std::path::Path;
use std::time::{Duration, Instant};

use hostile_common::{Proc, metric, router, sim_engine_with_events_at};
use serde_json::{Value, json};

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

/// A sim engine at `time_scale` publishing KV events (bound PUB and replay sockets on loopback);
/// returns it, its HTTP URL, and the router's `kv_events` entry for it.
async fn engine(time_scale: &str, dir: &Path) -> (Proc, String, String) {
    let (proc, url, events, replay) = sim_engine_with_events_at(time_scale, json!({}), dir).await;
    let kv_events =
        format!("{{endpoint: \"{events}\", replay_endpoint: \"{replay}\", topic: kv-events}}");
    (proc, url, kv_events)
}

/// Two engines and the router YAML in front of them (the embedded default placement).
async fn fleet(time_scale: &str, dir: &Path) -> (Vec<Proc>, String) {
    let mut procs = Vec::new();
    let mut yaml = String::from("block_size: 16\ntokenizer: byte\nendpoints:\n");
    for i in 0..2 {
        let sub = dir.join(format!("engine{i}"));
        std::fs::create_dir_all(&sub).unwrap();
        let (p, url, events) = engine(time_scale, &sub).await;
        yaml.push_str(&format!(
            "  - {{name: e{i}, url: \"{url}\", kv_events: {events}}}\n"
        ));
        procs.push(p);
    }
    (procs, yaml)
}

/// Replica `name` of the router (its own folder: config and stderr).
async fn replica(yaml: &str, dir: &Path, name: &str) -> (Proc, String) {
    let sub = dir.join(name);
    std::fs::create_dir_all(&sub).unwrap();
    router(yaml, &sub).await
}

/// Two engines at `time_scale` and two ready replicas of the router in front of them: the
/// engines, the router YAML, and each replica with its URL.
async fn two_replicas(
    time_scale: &str,
    dir: &Path,
) -> (Vec<Proc>, String, (Proc, String), (Proc, String)) {
    let (engines, yaml) = fleet(time_scale, dir).await;
    let first = replica(&yaml, dir, "r1").await;
    let second = replica(&yaml, dir, "r2").await;
    ready(&first.1).await;
    ready(&second.1).await;
    (engines, yaml, first, second)
}

/// Waits until `router`'s `/health` says ready (healthy endpoints, caught up).
async fn ready(router: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(r) = client().get(format!("{router}/health")).send().await
            && r.status() == 200
        {
            return;
        }
        assert!(Instant::now() < deadline, "{router} never became ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn metrics(router: &str) -> String {
    client()
        .get(format!("{router}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The endpoint of `router`'s most recent decision.
async fn last_endpoint(router: &str) -> String {
    let v: Value = client()
        .get(format!("{router}/debug/decisions?last=1"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let last = v.as_array().and_then(|a| a.last()).cloned().unwrap_or(v);
    last["endpoint"].as_str().unwrap_or_default().to_owned()
}

fn prompt_ids(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) % 250 + 1)
        .collect()
}

async fn complete(router: &str, prompt: &[u32], max_tokens: u32) -> Result<(), String> {
    let r = client()
        .post(format!("{router}/v1/completions"))
        .json(&json!({"model": "sim", "prompt": prompt, "max_tokens": max_tokens}))
        .send()
        .await
        .map_err(|e| e.to_string())?;
    match r.status().as_u16() {
        200 => Ok(()),
        s => Err(format!(
            "status {s}: {}",
            r.text().await.unwrap_or_default()
        )),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_sees_and_avoids_the_prefill_work_another_replica_sent() {
    let dir = tempfile::tempdir().unwrap();
    // The modelled speed: a 60K-token prefill takes long enough to be seen.
    let (mut engines, _, (mut first, first_url), (mut second, second_url)) =
        two_replicas("1", dir.path()).await;
    let long = prompt_ids(1, 60_000);
    let busy = {
        let url = first_url.clone();
        tokio::spawn(async move { complete(&url, &long, 1).await })
    };
    // The second replica learns of the first one's work from the engine's report.
    let deadline = Instant::now() + Duration::from_secs(5);
    let busy_endpoint = loop {
        let text = metrics(&second_url).await;
        let queued: Vec<f64> = ["e0", "e1"]
            .iter()
            .map(|e| {
                metric(
                    &text,
                    "kvmesh_router_endpoint_in_flight_uncached_tokens",
                    &format!("endpoint=\"{e}\""),
                )
            })
            .collect();
        if let Some(i) = queued.iter().position(|q| *q >= 20_000.0) {
            let shared = metric(
                &text,
                "kvmesh_router_endpoint_load_shared",
                &format!("endpoint=\"e{i}\""),
            );
            assert_eq!(shared, 1.0, "{text}");
            break format!("e{i}");
        }
        assert!(
            Instant::now() < deadline,
            "the second replica never saw the first one's prefill: {queued:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(last_endpoint(&first_url).await, busy_endpoint);
    // While it computes, every cold request through the second replica goes to the other
    // engine (alone, each replica's view would make it a coin toss).
    let started = Instant::now();
    for i in 0..4 {
        complete(&second_url, &prompt_ids(100 + i, 512), 1)
            .await
            .unwrap();
        assert_ne!(
            last_endpoint(&second_url).await,
            busy_endpoint,
            "request {i} joined the busy engine's queue"
        );
    }
    assert!(
        !busy.is_finished(),
        "the long prefill ended before the check ({:?}): the test proves nothing",
        started.elapsed()
    );
    busy.await.unwrap().unwrap();
    let text = metrics(&second_url).await;
    assert!(
        metric(
            &text,
            "kvmesh_router_load_reports",
            &format!("endpoint=\"{busy_endpoint}\",outcome=\"accepted\"")
        ) > 0.0
    );
    for e in &mut engines {
        e.assert_running("shared load");
    }
    first.assert_running("shared load");
    second.assert_running("shared load");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replica_fails_only_its_own_requests_and_a_restarted_one_converges() {
    let dir = tempfile::tempdir().unwrap();
    let (mut engines, yaml, (mut doomed, doomed_url), (mut survivor, survivor_url)) =
        two_replicas("20", dir.path()).await;
    // 8 conversations sharing a 1,024-token system prompt each, 6 turns, 4 clients in
    // parallel taking the replicas in turn; the first replica is killed a third of the way in.
    let prompts: Vec<Vec<u32>> = (0..48u32)
        .map(|i| {
            let mut p = prompt_ids(1000 + i % 8, 1024);
            p.extend(prompt_ids(2000 + i, 256 + 64 * (i / 8) as usize));
            p
        })
        .collect();
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let urls = [doomed_url.clone(), survivor_url.clone()];
    let mut clients = Vec::new();
    for _ in 0..4 {
        let (next, urls, prompts) = (next.clone(), urls.clone(), prompts.clone());
        clients.push(tokio::spawn(async move {
            // (sent to the doomed replica and failed, retried and failed, sent to the survivor
            // and failed)
            let mut counts = (0u32, 0u32, 0u32, 0u32);
            loop {
                let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(p) = prompts.get(k) else {
                    return counts;
                };
                let target = &urls[k % 2];
                counts.0 += 1;
                if let Err(e) = complete(target, p, 8).await {
                    if k % 2 == 0 {
                        counts.1 += 1;
                        // Retried elsewhere, as a Service would.
                        if complete(&urls[1], p, 8).await.is_err() {
                            counts.2 += 1;
                        }
                    } else {
                        eprintln!("survivor failed request {k}: {e}");
                        counts.3 += 1;
                    }
                }
            }
        }));
    }
    while next.load(std::sync::atomic::Ordering::Relaxed) < 16 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    doomed.child.start_kill().unwrap();
    let _ = doomed.child.wait().await;
    let mut totals = (0, 0, 0, 0);
    for c in clients {
        let (sent, failed, retry_failed, survivor_failed) = c.await.unwrap();
        totals = (
            totals.0 + sent,
            totals.1 + failed,
            totals.2 + retry_failed,
            totals.3 + survivor_failed,
        );
    }
    eprintln!(
        "requests {}, failed on the killed replica {} (retried, {} of them failed again), failed on the survivor {}",
        totals.0, totals.1, totals.2, totals.3
    );
    assert_eq!(totals.0, 48);
    assert!(
        totals.1 > 0,
        "the kill happened after every request: {totals:?}"
    );
    assert_eq!(totals.2, 0, "a retried request failed on the survivor");
    assert_eq!(totals.3, 0, "a request sent to the survivor failed");
    // The replacement joins while the engines are idle: it must catch up from their replay
    // rings, not wait for them to publish again.
    let (mut restarted, restarted_url) = replica(&yaml, dir.path(), "r1-restarted").await;
    ready(&restarted_url).await;
    let http = client();
    let mut compared = 0;
    for (i, p) in prompts.iter().enumerate().step_by(5) {
        let query = json!({"token_ids": p});
        let ask = |url: String| {
            let (http, query) = (http.clone(), query.clone());
            async move {
                let v: Value = http
                    .post(format!("{url}/debug/prefix"))
                    .json(&query)
                    .send()
                    .await
                    .unwrap()
                    .json()
                    .await
                    .unwrap();
                ["e0", "e1"].map(|e| v["endpoints"][e]["any_tokens"].as_u64().unwrap_or(0))
            }
        };
        let (mine, theirs) = (
            ask(restarted_url.clone()).await,
            ask(survivor_url.clone()).await,
        );
        assert_eq!(mine, theirs, "prompt {i}: the restarted index differs");
        compared += u32::from(theirs.iter().any(|t| *t > 0));
    }
    eprintln!("prompts whose cached prefix both indexes agree on: {compared}");
    assert!(
        compared >= 5,
        "too few cached prompts to compare: {compared}"
    );
    for e in &mut engines {
        e.assert_running("replica kill");
    }
    survivor.assert_running("replica kill");
    restarted.assert_running("replica kill");
}
