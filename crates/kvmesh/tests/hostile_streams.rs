//! A stream to a frozen engine (issue 37, finding 3), against real `kvmesh router` and `kvmesh
//! engine` processes on loopback: one of two sim engines is stopped (SIGSTOP) while a client
//! streams from it. The router must end that client's stream within `stream_idle_timeout` with
//! an SSE error event the OpenAI client raises (`data: {"error": {...}}`), count it, and keep
//! serving everyone else. Before the fix the stream received no byte and was never cut.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod hostile_common;

use std::time::{Duration, Instant};

use hostile_common::{Proc, metric, router, sim_engine_args, spawn};
use serde_json::json;

/// The router's idle timeout between upstream chunks in this test.
const IDLE: Duration = Duration::from_secs(2);
/// The stream must end within this after the engine froze (the timeout plus room for a loaded
/// 2-core machine).
const CUT_WITHIN: Duration = Duration::from_secs(8);

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

fn signal(pid: u32, sig: &str) {
    let ok = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig} {pid}");
}

/// A streamed completion of `max_tokens` from `base`: the endpoint that serves it and its body.
async fn open_stream(base: &str, prompt: &str, max_tokens: u32) -> (String, reqwest::Response) {
    let r = client()
        .post(format!("{base}/v1/completions"))
        .json(
            &json!({"model": "sim", "prompt": prompt, "max_tokens": max_tokens,
                      "stream": true}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let ep = r
        .headers()
        .get("x-kvmesh-endpoint")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    (ep, r)
}

/// A sim engine at the modelled speed (time scale 1): a long completion streams for tens of
/// seconds. Returns it and its HTTP base URL.
async fn slow_sim_engine(dir: &std::path::Path) -> (Proc, String) {
    let args = sim_engine_args("1");
    let (proc, found) = spawn("engine", &args, &["kvmesh engine listening on "], dir).await;
    (proc, found[0].clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stream_from_a_frozen_engine_ends_with_an_error_event() {
    let dir = tempfile::tempdir().unwrap();
    let (mut frozen_candidate_a, url_a) = slow_sim_engine(dir.path()).await;
    let (mut frozen_candidate_b, url_b) = slow_sim_engine(dir.path()).await;
    let yaml = format!(
        "block_size: 16\ntokenizer: byte\nstream_idle_timeout: 2s\n\
         health_check: {{interval: 500ms, timeout: 300ms}}\n\
         endpoints:\n  - {{name: a, url: \"{url_a}\"}}\n  - {{name: b, url: \"{url_b}\"}}\n"
    );
    let (mut router_proc, base) = router(&yaml, dir.path()).await;

    // One long stream on each engine (placement spreads load; try a few prompts).
    let mut streams: Vec<(String, reqwest::Response)> = Vec::new();
    for i in 0..20 {
        let (ep, r) = open_stream(&base, &format!("stream {i}: a long story please"), 3000).await;
        if streams.iter().any(|(e, _)| *e == ep) {
            drop(r);
            continue;
        }
        streams.push((ep, r));
        if streams.len() == 2 {
            break;
        }
    }
    assert_eq!(streams.len(), 2, "could not place a stream on each engine");
    let (frozen_ep, mut frozen) = streams.remove(0);
    let (_, mut healthy) = streams.remove(0);
    // Both are streaming.
    let mut frozen_body = Vec::new();
    for r in [&mut frozen, &mut healthy] {
        let chunk = tokio::time::timeout(Duration::from_secs(20), r.chunk())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert!(!chunk.is_empty());
    }
    let frozen_proc = if frozen_ep == "a" {
        &mut frozen_candidate_a
    } else {
        &mut frozen_candidate_b
    };
    signal(frozen_proc.pid, "-STOP");
    let stopped = Instant::now();

    // The frozen stream ends, with an error event, within the timeout.
    let ended = tokio::time::timeout(CUT_WITHIN, async {
        while let Ok(Some(b)) = frozen.chunk().await {
            frozen_body.extend_from_slice(&b);
        }
    })
    .await;
    let took = stopped.elapsed();
    signal(frozen_proc.pid, "-CONT");
    assert!(
        ended.is_ok(),
        "the stream from the frozen engine was not cut within {CUT_WITHIN:?}"
    );
    println!("frozen stream cut after {:.2} s", took.as_secs_f64());
    assert!(
        took >= IDLE - Duration::from_millis(300),
        "cut too early: {took:?}"
    );
    let text = String::from_utf8_lossy(&frozen_body);
    let last = text
        .lines()
        .rfind(|l| l.starts_with("data: "))
        .unwrap_or_default();
    let event: serde_json::Value =
        serde_json::from_str(last.trim_start_matches("data: ")).unwrap_or_default();
    let error = &event["error"];
    assert!(
        error["message"]
            .as_str()
            .is_some_and(|m| m.contains("stalled")),
        "last event is not an error: {last:?}"
    );
    assert_eq!(error["code"], 504, "{last}");
    assert!(
        !text.contains("[DONE]"),
        "a cut stream must not look finished"
    );

    // The stream on the other engine was unaffected: it keeps streaming.
    let more = tokio::time::timeout(Duration::from_secs(5), healthy.chunk())
        .await
        .unwrap()
        .unwrap();
    assert!(more.is_some_and(|c| !c.is_empty()));
    drop(healthy);

    // New requests are served (the frozen engine is ejected by its health checks).
    tokio::time::sleep(Duration::from_secs(2)).await;
    for i in 0..4 {
        let r = client()
            .post(format!("{base}/v1/completions"))
            .json(&json!({"model": "sim", "prompt": format!("after {i}"), "max_tokens": 4}))
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }

    let metrics = client()
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(
        metric(&metrics, "kvmesh_router_errors_total", "upstream_stalled"),
        1.0,
        "the cut stream is counted"
    );
    router_proc.assert_running("the frozen stream");
}
