//! Time to first byte through the router's streaming path: a streamed completion reaches the
//! client as soon as the engine sends its first chunk, not when the engine's stream ends (issue
//! 13: "first-byte latency through the router's streaming path vs direct").
//!
//! The fake engine sends one SSE chunk and then holds the stream for 2 s; the first chunk must
//! arrive through the router within 200 ms of the request (it takes a few ms on an idle machine),
//! for one stream and for several concurrent ones.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{FakeEngine, Mode, client, endpoints_yaml, start_router};
use futures::StreamExt;
use serde_json::json;
use tokio::sync::Notify;

/// The engine holds the rest of its stream this long after the first chunk.
const HOLD: Duration = Duration::from_secs(2);
/// The bound on the first chunk's arrival through the router.
const FIRST_CHUNK_WITHIN: Duration = Duration::from_millis(200);

/// Sends one streamed completion to `base` and returns (time to the first chunk, time to the end
/// of the stream), checking the first chunk is the engine's first (`t0`) and the stream ends with
/// `[DONE]`.
async fn first_chunk_and_end(base: &str, prompt: &str) -> (Duration, Duration) {
    let start = Instant::now();
    let resp = client()
        .post(format!("{base}/v1/completions"))
        .json(&json!({"prompt": prompt, "stream": true, "max_tokens": 3}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.bytes_stream();
    let first = body.next().await.unwrap().unwrap();
    let first_at = start.elapsed();
    assert!(
        std::str::from_utf8(&first).unwrap().contains("t0"),
        "the first bytes are the engine's first chunk: {first:?}"
    );
    let mut rest = Vec::new();
    while let Some(c) = body.next().await {
        rest.extend_from_slice(&c.unwrap());
    }
    assert!(
        String::from_utf8(rest)
            .unwrap()
            .ends_with("data: [DONE]\n\n")
    );
    (first_at, start.elapsed())
}

/// Opens the engine's gate `HOLD` after now (the engine has sent its first chunk by then).
fn release_after_hold(gate: &Arc<Notify>) {
    let gate = Arc::clone(gate);
    tokio::spawn(async move {
        tokio::time::sleep(HOLD).await;
        gate.notify_waiters();
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_chunk_reaches_the_client_while_the_engine_holds_the_stream() {
    tokio::time::timeout(Duration::from_secs(30), async {
        let e0 = FakeEngine::start("e0").await;
        let gate = Arc::new(Notify::new());
        e0.set_mode(Mode::Gated(Arc::clone(&gate)));
        let r = start_router(&endpoints_yaml(&[&e0]), None).await;
        let router = format!("http://{}", r.addr);
        // A prompt of a realistic size, so tokenizing and placing it is part of the path.
        let prompt = common::doc(7, 8192);

        // Direct to the engine: the baseline.
        release_after_hold(&gate);
        let (direct, direct_end) = first_chunk_and_end(&e0.url, &prompt).await;
        // Through the router.
        release_after_hold(&gate);
        let (routed, routed_end) = first_chunk_and_end(&router, &prompt).await;
        println!(
            "first chunk: direct {:.1} ms, through the router {:.1} ms (stream end {:.0} / {:.0} ms)",
            direct.as_secs_f64() * 1e3,
            routed.as_secs_f64() * 1e3,
            direct_end.as_secs_f64() * 1e3,
            routed_end.as_secs_f64() * 1e3,
        );
        assert!(
            routed < FIRST_CHUNK_WITHIN,
            "first chunk through the router after {routed:?} (direct {direct:?})"
        );
        assert!(
            routed_end >= HOLD - Duration::from_millis(300),
            "the engine held its stream, so the end came later: {routed_end:?}"
        );
        r.shutdown().await.unwrap();
    })
    .await
    .unwrap();
}

/// Several streams at once: none waits for another's engine stream to end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_streams_each_get_their_first_chunk_promptly() {
    tokio::time::timeout(Duration::from_secs(30), async {
        let engines = [FakeEngine::start("e0").await, FakeEngine::start("e1").await];
        let gate = Arc::new(Notify::new());
        for e in &engines {
            e.set_mode(Mode::Gated(Arc::clone(&gate)));
        }
        let r = start_router(&endpoints_yaml(&[&engines[0], &engines[1]]), None).await;
        let router = format!("http://{}", r.addr);
        release_after_hold(&gate);
        let streams: Vec<_> = (0..8u32)
            .map(|i| {
                let router = router.clone();
                tokio::spawn(async move {
                    first_chunk_and_end(&router, &common::doc(100 + i, 4096)).await
                })
            })
            .collect();
        let mut firsts = Vec::new();
        for s in streams {
            firsts.push(s.await.unwrap().0);
        }
        let worst = firsts.iter().max().copied().unwrap_or_default();
        println!("8 concurrent streams: slowest first chunk {worst:?}");
        assert!(
            worst < FIRST_CHUNK_WITHIN,
            "a first chunk took {worst:?}: {firsts:?}"
        );
        r.shutdown().await.unwrap();
    })
    .await
    .unwrap();
}
