//! The router's HTTP server under hostile or departing clients, and its validation next to the
//! engine's (loopback, in-process): silent, slow-header and stalled-body clients are dropped after
//! `header_read_timeout` while normal requests are served; shutdown refuses new connections,
//! lets a running stream finish and is bounded by `drain_timeout`; a malformed field is the
//! same 400, naming the same `param`, from the router and from a kvmesh engine, and lax values
//! vLLM accepts (`"16"`, `"true"`) pass through both.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::engines::{start_engine, stop};
use common::{FakeEngine, Mode, endpoints_yaml, start_router};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio::time::timeout;

/// Reads until EOF or error; returns what arrived and how long the server kept the socket.
async fn read_until_closed(tcp: &mut TcpStream) -> (Vec<u8>, Duration) {
    let started = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match timeout(Duration::from_secs(5), tcp.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (got, started.elapsed()),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => panic!("connection still open after 5 s"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_silent_clients_are_dropped_while_normal_requests_work() {
    timeout(Duration::from_secs(30), async {
        let engine = FakeEngine::start("e0").await;
        let yaml = format!("header_read_timeout: 700ms\n{}", endpoints_yaml(&[&engine]));
        let r = start_router(&yaml, None).await;
        let addr = r.addr;

        let mut silent = TcpStream::connect(addr).await.unwrap();
        let mut partial = TcpStream::connect(addr).await.unwrap();
        partial.write_all(b"POST /v1/comp").await.unwrap();
        let mut trickle = TcpStream::connect(addr).await.unwrap();
        let trickler = tokio::spawn(async move {
            let started = Instant::now();
            for b in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaa" {
                if trickle.write_all(&[*b]).await.is_err() {
                    return started.elapsed();
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            panic!("the router read a trickled header for {:?}", started.elapsed());
        });
        let mut slow_body = TcpStream::connect(addr).await.unwrap();
        slow_body
            .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
            .await
            .unwrap();

        let resp = common::post_json(
            &format!("http://{addr}/v1/completions"),
            &json!({"prompt": "hello", "max_tokens": 2}),
        )
        .await;
        assert_eq!(resp.status(), 200);

        for (what, tcp) in [("silent", &mut silent), ("partial", &mut partial)] {
            let (got, after) = read_until_closed(tcp).await;
            assert!(got.is_empty() || got.starts_with(b"HTTP/1.1 408"), "{what}: {got:?}");
            assert!(after < Duration::from_secs(3), "{what} held for {after:?}");
        }
        let trickled_for = trickler.await.unwrap();
        assert!(trickled_for < Duration::from_secs(3), "{trickled_for:?}");
        let (got, after) = read_until_closed(&mut slow_body).await;
        assert!(after < Duration::from_secs(3), "slow body held for {after:?}: {got:?}");
        assert_eq!(engine.count(), 1, "only the normal request reached the engine");

        let health = reqwest::get(format!("http://{addr}/health")).await.unwrap();
        assert_eq!(health.status(), 200);
        r.shutdown().await.unwrap();
    })
    .await
    .expect("test timed out");
}

/// Opens a streamed completion through the router and waits for its first chunk.
async fn open_stream(base: &str) -> tokio::task::JoinHandle<Result<String, String>> {
    let mut resp = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .json(&json!({"prompt": "hello", "max_tokens": 3, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let first = resp.chunk().await.unwrap().expect("no first chunk");
    tokio::spawn(async move {
        let mut text = String::from_utf8_lossy(&first).into_owned();
        loop {
            match resp.chunk().await {
                Ok(Some(c)) => text.push_str(&String::from_utf8_lossy(&c)),
                Ok(None) => return Ok(text),
                Err(e) => return Err(format!("{e} after {text:?}")),
            }
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_a_stream_refuses_new_connections_and_is_bounded() {
    timeout(Duration::from_secs(30), async {
        // A gated stream is running when shutdown starts; it finishes once the gate opens.
        let engine = FakeEngine::start("e0").await;
        let gate = Arc::new(Notify::new());
        engine.set_mode(Mode::Gated(Arc::clone(&gate)));
        let r = start_router(&endpoints_yaml(&[&engine]), None).await;
        let addr = r.addr;
        let stream = open_stream(&format!("http://{addr}")).await;
        let cancel = r.cancel_token();
        let shutdown = tokio::spawn(r.shutdown());
        cancel.cancelled().await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            TcpStream::connect(addr).await.is_err(),
            "accepted a connection while draining"
        );
        assert!(
            !shutdown.is_finished(),
            "shutdown did not wait for the running stream"
        );
        gate.notify_waiters();
        gate.notify_one();
        let text = stream.await.unwrap().expect("the stream was cut");
        assert!(text.contains("[DONE]"), "{text}");
        timeout(Duration::from_secs(5), shutdown)
            .await
            .unwrap()
            .unwrap()
            .unwrap();

        // A stream that never ends is cut at the drain bound.
        let engine = FakeEngine::start("e0").await;
        engine.set_mode(Mode::Hang);
        let yaml = format!("drain_timeout: 300ms\n{}", endpoints_yaml(&[&engine]));
        let r = start_router(&yaml, None).await;
        let stream = open_stream(&format!("http://{}", r.addr)).await;
        let started = Instant::now();
        r.shutdown().await.unwrap();
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(250) && took < Duration::from_secs(3),
            "{took:?}"
        );
        let cut = timeout(Duration::from_secs(5), stream)
            .await
            .unwrap()
            .unwrap();
        assert!(
            cut.as_ref().map_or(true, |t| !t.contains("[DONE]")),
            "not cut: {cut:?}"
        );
    })
    .await
    .expect("test timed out");
}

/// Status and `error.param` of a POST.
async fn status_param(url: &str, body: &Value) -> (u16, Value, Value) {
    let resp = common::post_json(url, body).await;
    let status = resp.status().as_u16();
    let body: Value = resp.json().await.unwrap_or(Value::Null);
    (status, body["error"]["param"].clone(), body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_and_engine_give_the_same_400_naming_the_same_param() {
    timeout(Duration::from_secs(60), async {
        let e = start_engine("e0", 100.0, 512).await;
        let r = start_router(&common::engines::engines_yaml(&[&e]), None).await;
        let router = format!("http://{}", r.addr);
        let chat = |extra: Value| {
            let mut b = json!({"messages": [{"role": "user", "content": "hi"}]});
            for (k, v) in extra.as_object().unwrap() {
                b[k] = v.clone();
            }
            b
        };
        let cases = [
            ("/v1/completions", json!({"prompt": "hi", "max_tokens": "abc"}), "max_tokens"),
            ("/v1/completions", json!({"prompt": "hi", "max_tokens": 16.5}), "max_tokens"),
            ("/v1/completions", json!({"prompt": "hi", "max_tokens": -1}), "max_tokens"),
            ("/v1/completions", json!({"prompt": "hi", "stream": "maybe"}), "stream"),
            ("/v1/completions", json!({"prompt": "hi", "model": 3}), "model"),
            ("/v1/completions", json!({"prompt": []}), "prompt"),
            ("/v1/completions", json!({"prompt": [1, -2]}), "prompt"),
            ("/v1/completions", json!({"max_tokens": 2}), "prompt"),
            ("/v1/chat/completions", json!({"messages": []}), "messages"),
            ("/v1/chat/completions", json!({"messages": "x"}), "messages"),
            ("/v1/chat/completions", chat(json!({"max_completion_tokens": "x"})), "max_completion_tokens"),
            ("/v1/chat/completions", chat(json!({"add_generation_prompt": "nope"})), "add_generation_prompt"),
        ];
        for (path, body, param) in &cases {
            let (rs, rp, rb) = status_param(&format!("{router}{path}"), body).await;
            let (es, ep, eb) = status_param(&format!("{}{path}", e.url), body).await;
            assert_eq!((rs, es), (400, 400), "{body}: router {rb}, engine {eb}");
            assert_eq!((rp.as_str(), ep.as_str()), (Some(*param), Some(*param)), "{body}: router {rb}, engine {eb}");
        }
        // Fields the router passes through are checked by the engine, which names them.
        for (body, param) in [
            (json!({"prompt": "hi", "temperature": 5}), "temperature"),
            (json!({"prompt": "hi", "temperature": "hot"}), "temperature"),
            (json!({"prompt": "hi", "n": 2}), "n"),
            (json!({"prompt": "hi", "stop": 5}), "stop"),
            (json!({"prompt": "hi", "top_p": 0}), "top_p"),
        ] {
            let (rs, rp, rb) = status_param(&format!("{router}/v1/completions"), &body).await;
            assert_eq!((rs, rp.as_str()), (400, Some(param)), "{body}: {rb}");
        }
        // What vLLM's pydantic models accept in lax mode works end to end.
        let (status, _, body) = status_param(
            &format!("{router}/v1/completions"),
            &json!({"prompt": "hi", "max_tokens": "3", "temperature": "0", "ignore_eos": "yes", "stream": "false"}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["usage"]["completion_tokens"], 3, "{body}");
        let resp = common::post_json(
            &format!("{router}/v1/chat/completions"),
            &chat(json!({"max_completion_tokens": 2.0, "stream": "true", "ignore_eos": 1})),
        )
        .await;
        assert_eq!(resp.status(), 200);
        let text = resp.text().await.unwrap();
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        stop(r, vec![e]).await;
    })
    .await
    .expect("test timed out");
}
