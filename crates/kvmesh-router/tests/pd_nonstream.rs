//! P/D with bi-directional transfer for NON-streamed requests: the decoder's `kv_transfer_params`
//! in its JSON body must be cached for the conversation (like the last SSE chunk of a streamed
//! one) and the body must reach the client byte-for-byte. The engines are fakes that answer with
//! fixed bytes and a `Content-Length` (as vLLM and kvmesh engines do for non-stream bodies), so
//! the test can compare bytes exactly and see what the router attached to the next prefill leg.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use common::start_router;
use parking_lot::Mutex;
use serde_json::{Value, json};

const LIMIT: Duration = Duration::from_secs(30);

/// The decoder's non-stream answer, exactly as sent (vLLM key order, no trailing newline).
const DECODE_BODY: &str = r#"{"id":"cmpl-1","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"length"}],"usage":{"prompt_tokens":40,"completion_tokens":2,"total_tokens":42},"kv_transfer_params":{"do_remote_prefill":false,"do_remote_decode":true,"remote_engine_id":"d0","remote_block_ids":[5,6],"remote_host":"127.0.0.1","remote_port":7101,"remote_num_tokens":42,"remote_blocks_expiry_time":9999999999.0}}"#;

/// Prefill legs (`do_remote_decode: true`) get NIXL params back; decode legs get
/// [`DECODE_BODY`] (or an SSE stream whose last chunk carries the same params). Every request
/// body is recorded.
struct Fake {
    url: String,
    received: Arc<Mutex<Vec<Value>>>,
    _cancel: tokio_util::sync::DropGuard,
}

async fn answer(State(rx): State<Arc<Mutex<Vec<Value>>>>, body: Bytes) -> Response {
    let v: Value = serde_json::from_slice(&body).unwrap();
    rx.lock().push(v.clone());
    let json_headers = [("content-type", "application/json")];
    if v["kv_transfer_params"]["do_remote_decode"] == json!(true) {
        let out = json!({"id": "p", "object": "chat.completion", "choices": [],
            "kv_transfer_params": {"do_remote_prefill": true, "do_remote_decode": false,
                "remote_engine_id": "p0", "remote_block_ids": [1, 2], "remote_host": "127.0.0.1",
                "remote_port": 7100}});
        return (json_headers, out.to_string()).into_response();
    }
    if v["stream"] == json!(true) {
        let params: Value =
            serde_json::from_str::<Value>(DECODE_BODY).unwrap()["kv_transfer_params"].clone();
        let last = json!({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "length"}], "kv_transfer_params": params});
        let sse = format!("data: {}\n\ndata: [DONE]\n\n", last);
        return ([("content-type", "text/event-stream")], sse).into_response();
    }
    (json_headers, DECODE_BODY).into_response()
}

async fn start_fake() -> Fake {
    let received = Arc::new(Mutex::new(Vec::new()));
    let app = Router::new()
        .route("/v1/chat/completions", post(answer))
        .route("/v1/completions", post(answer))
        .route("/health", get(|| async { "ok" }))
        .route(
            "/metrics",
            get(|| async {
                "vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 0\nvllm:num_requests_running{engine=\"0\",model_name=\"m\"} 0\nvllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.1\n"
            }),
        )
        .with_state(Arc::clone(&received));
    let (url, cancel) = common::serve_on_loopback(app).await;
    Fake {
        url,
        received,
        _cancel: cancel.drop_guard(),
    }
}

fn yaml(p: &Fake, d: &Fake) -> String {
    format!(
        "seed: 1\nplugins:\n  - {{type: round-robin-picker, name: rr}}\n\
         scheduling_profiles:\n  - {{name: prefill, plugins: [{{plugin_ref: rr}}]}}\n  - {{name: decode, plugins: [{{plugin_ref: rr}}]}}\n\
         pd: {{prefill_profile: prefill, decode_profile: decode, decider: always, bidirectional: true}}\nendpoints:\n\
         \x20 - {{name: p0, role: prefill, url: \"{}\", p2p: \"127.0.0.1:7100\"}}\n\
         \x20 - {{name: d0, role: decode, url: \"{}\", p2p: \"127.0.0.1:7101\"}}\n",
        p.url, d.url
    )
}

async fn cached_conversations(addr: std::net::SocketAddr) -> Value {
    let h: Value = reqwest::get(format!("http://{addr}/health"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    h["cached_conversations"].clone()
}

/// Turn 1 non-streamed (by `conversation_id`, then by `X-Session-ID`): the client gets the
/// decoder's bytes unchanged, the router caches the decoder params, and turn 2's prefill leg
/// carries them (the history pull). Streamed turns behave the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_streamed_turns_cache_the_decoders_params() {
    tokio::time::timeout(LIMIT, async {
        let p = start_fake().await;
        let d = start_fake().await;
        let r = start_router(&yaml(&p, &d), None).await;
        let client = reqwest::Client::new();
        let url = format!("http://{}/v1/chat/completions", r.addr);
        let msgs = json!([{"role": "user", "content": "hello there, a prompt of some length"}]);
        for (i, stream) in [(0, false), (1, false), (2, true)] {
            let conv = format!("c-{i}");
            let mut body =
                json!({"model": "m", "messages": msgs, "max_tokens": 2, "stream": stream});
            let mut req = client.post(&url);
            if i == 1 {
                req = req.header("X-Session-ID", &conv);
            } else {
                body["conversation_id"] = json!(conv);
            }
            let resp = req.json(&body).send().await.unwrap();
            assert_eq!(resp.status(), 200);
            let bytes = resp.bytes().await.unwrap();
            if !stream {
                assert_eq!(
                    std::str::from_utf8(&bytes).unwrap(),
                    DECODE_BODY,
                    "the decoder's body passes through unchanged"
                );
            }
            // The entry is stored when the body ends: poll /health briefly for it.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            while cached_conversations(r.addr).await != json!(i + 1) {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "turn {i} (stream={stream}): no conversation entry: {}",
                    cached_conversations(r.addr).await
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            // Turn 2 of the same conversation: its prefill leg reads the history.
            let mut body2 = body.clone();
            body2["stream"] = json!(false);
            let mut req = client.post(&url);
            if i == 1 {
                req = req.header("X-Session-ID", &conv);
            }
            let resp = req.json(&body2).send().await.unwrap();
            assert_eq!(resp.status(), 200);
            resp.bytes().await.unwrap();
            let prefill_leg = p.received.lock().last().cloned().unwrap();
            let kv = &prefill_leg["kv_transfer_params"];
            assert_eq!(kv["do_remote_decode"], json!(true), "{prefill_leg}");
            assert_eq!(
                kv["remote_block_ids"],
                json!([5, 6]),
                "turn 2 of {conv}: {kv}"
            );
            assert_eq!(kv["remote_num_tokens"], json!(42));
            assert!(prefill_leg.get("conversation_id").is_none());
        }
        let decode_legs = d.received.lock().len();
        assert_eq!(decode_legs, 6);
        r.shutdown().await.unwrap();
    })
    .await
    .unwrap();
}
