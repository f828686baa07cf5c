//! SIGTERM drains the real binaries: `kvmesh router` and `kvmesh engine`, each with a slow
//! streamed request in flight, stop accepting connections, let the stream finish, and exit 0
//! within the drain bound; a stream longer than `--drain-timeout` is cut and the process still
//! exits 0 at the bound.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{BIN, spawn_engine};
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::Child;
use tokio::time::timeout;

/// Sends SIGTERM with the system's `kill` (no libc binding needed for one signal).
fn sigterm(child: &Child) {
    let pid = child.id().expect("child still running");
    let status = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// Starts `kvmesh router --port 0` in front of `engine_url`; returns the child and its base URL.
async fn spawn_router(dir: &std::path::Path, engine_url: &str, extra: &[&str]) -> (Child, String) {
    let config = dir.join("router.yaml");
    std::fs::write(
        &config,
        format!("endpoints:\n  - {{name: e0, url: \"{engine_url}\"}}\n"),
    )
    .unwrap();
    let mut child = tokio::process::Command::new(BIN)
        .args(["router", "--port", "0", "--config"])
        .arg(&config)
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let base = loop {
        let line = lines
            .next_line()
            .await
            .unwrap()
            .expect("router exited before listening");
        if let Some(rest) = line.strip_prefix("listening on ") {
            break rest.trim().to_owned();
        }
    };
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, base)
}

/// Opens a streamed completion of `tokens` tokens (4.5 ms each on the sim at scale 1) and
/// returns once its first bytes arrived, with a task reading the rest.
async fn open_stream(base: &str, tokens: usize) -> tokio::task::JoinHandle<Result<String, String>> {
    let mut r = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .json(
            &json!({"model": "sim", "prompt": "a slow stream", "max_tokens": tokens,
                      "ignore_eos": true, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let first = r.chunk().await.unwrap().expect("stream ended at once");
    tokio::spawn(async move {
        let mut text = String::from_utf8_lossy(&first).into_owned();
        loop {
            match r.chunk().await {
                Ok(Some(c)) => text.push_str(&String::from_utf8_lossy(&c)),
                Ok(None) => return Ok(text),
                Err(e) => return Err(format!("{e} after {text:?}")),
            }
        }
    })
}

/// A connection to `base`'s port is refused within a second of the signal.
async fn refuses_connections(base: &str) {
    let addr = base.trim_start_matches("http://").to_owned();
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        match TcpStream::connect(&addr).await {
            Err(_) => return,
            Ok(_) => {
                assert!(
                    Instant::now() < deadline,
                    "{addr} still accepts connections after SIGTERM"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

async fn exits_zero_within(child: &mut Child, bound: Duration) -> Duration {
    let started = Instant::now();
    let status = timeout(bound, child.wait())
        .await
        .unwrap_or_else(|_| panic!("still running {bound:?} after SIGTERM"))
        .unwrap();
    assert!(status.success(), "exit status {status:?}");
    started.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_router_and_engine_streams_then_exits_zero() {
    timeout(Duration::from_secs(90), async {
        let mut engine = spawn_engine([
            "--time-scale",
            "1",
            "--num-gpu-blocks",
            "512",
            "--drain-timeout",
            "20s",
        ])
        .await;
        let dir = tempfile::tempdir().unwrap();
        let (mut router, router_base) =
            spawn_router(dir.path(), &engine.http, &["--drain-timeout", "20s"]).await;

        // Router: a ~1.8 s stream through it survives its SIGTERM.
        let stream = open_stream(&router_base, 400).await;
        sigterm(&router);
        refuses_connections(&router_base).await;
        let text = stream
            .await
            .unwrap()
            .expect("the stream through the router was cut");
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        assert!(text.contains("\"finish_reason\":\"length\""), "{text}");
        exits_zero_within(&mut router, Duration::from_secs(10)).await;

        // Engine: the same, straight to it.
        let stream = open_stream(&engine.http, 400).await;
        sigterm(&engine.child);
        refuses_connections(&engine.http).await;
        let text = stream
            .await
            .unwrap()
            .expect("the stream from the engine was cut");
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        exits_zero_within(&mut engine.child, Duration::from_secs(15)).await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_longer_than_the_drain_timeout_is_cut_at_the_bound() {
    timeout(Duration::from_secs(60), async {
        let mut engine = spawn_engine([
            "--time-scale",
            "1",
            "--num-gpu-blocks",
            "1024",
            "--drain-timeout",
            "500ms",
        ])
        .await;
        // ~20 s of tokens: far beyond the bound.
        let stream = open_stream(&engine.http, 4000).await;
        sigterm(&engine.child);
        let took = exits_zero_within(&mut engine.child, Duration::from_secs(8)).await;
        assert!(
            took >= Duration::from_millis(400),
            "exited before the drain bound: {took:?}"
        );
        let cut = stream.await.unwrap();
        assert!(
            cut.as_ref().map_or(true, |t| !t.contains("[DONE]")),
            "not cut: {cut:?}"
        );
    })
    .await
    .expect("test timed out");
}
