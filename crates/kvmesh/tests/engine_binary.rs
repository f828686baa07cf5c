//! `kvmesh engine` run as the built binary: port 0 reported on stdout, OpenAI completions with
//! cached-token accounting, and KV events read by a libzmq SUB socket (bound on
//! loopback; the engine connects to it, vLLM's non-`*` endpoint rule); and the real-model backend
//! answering a chat question over HTTP.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use kvmesh_core::events::{KvEvent, Medium, decode_batch};
use kvmesh_core::{BlockHasher, HashAlgo};
use serde_json::{Value, json};
use tokio::time::timeout;

/// Receives one message from a libzmq SUB socket within `wait` (blocking this test thread).
fn recv(sub: &zmq::Socket, wait: Duration) -> Option<Vec<Vec<u8>>> {
    match sub.poll(zmq::POLLIN, wait.as_millis() as i64) {
        Ok(n) if n > 0 => sub.recv_multipart(zmq::DONTWAIT).ok(),
        _ => None,
    }
}

mod common;

use common::spawn_engine;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_binary_serves_completions_and_publishes_kv_events() {
    timeout(Duration::from_secs(60), async {
        let ctx = zmq::Context::new();
        let sub = ctx.socket(zmq::SUB).unwrap();
        sub.set_linger(0).unwrap();
        sub.bind("tcp://127.0.0.1:0").unwrap();
        let ep = sub.get_last_endpoint().unwrap().unwrap();
        sub.set_subscribe(b"").unwrap();
        let cfg = json!({"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": ep, "topic": "kv-events"});
        let cfg = cfg.to_string();
        let mut engine = spawn_engine([
            "--served-model-name", "sim-bin", "--backend", "sim", "--profile", "gpt-oss-120b-h200",
            "--block-size", "16", "--num-gpu-blocks", "512", "--cpu-offload-bytes", "2GiB",
            "--time-scale", "100", "--kv-events-config", &cfg,
        ])
        .await;
        let base = engine.http.clone();
        // PUB/SUB slow joiner: probe with resets until their AllBlocksCleared reaches us.
        let client = reqwest::Client::new();
        loop {
            let r = client.post(format!("{base}/reset_prefix_cache")).send().await.unwrap();
            assert_eq!(r.status(), 200);
            if let Some(msg) = recv(&sub, Duration::from_millis(200)) {
                let batch = decode_batch(&msg[2]).unwrap();
                assert_eq!(batch.events, vec![KvEvent::AllBlocksCleared]);
                break;
            }
        }
        // Drop any further probe echoes.
        while recv(&sub, Duration::from_millis(200)).is_some() {}
        let prompt: Vec<u32> = (0..100u32).map(|i| (i * 7 + 3) % 256).collect();
        let mut cached = Vec::new();
        for _ in 0..2 {
            let body: Value = client
                .post(format!("{base}/v1/completions"))
                .json(&json!({"model": "sim-bin", "prompt": prompt, "max_tokens": 3}))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            assert_eq!(body["usage"]["completion_tokens"], 3, "{body}");
            cached.push(body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap());
        }
        assert_eq!(cached, vec![0, 96]);
        // First message: GPU BlockStored of the 6 full prompt blocks, hashed like vLLM.
        let frames = recv(&sub, Duration::from_secs(5)).expect("no kv event");
        assert_eq!(frames.len(), 3);
        assert_eq!(frames[0], b"kv-events");
        assert_eq!(frames[1].len(), 8);
        let batch = decode_batch(&frames[2]).unwrap();
        let KvEvent::BlockStored(st) = &batch.events[0] else { panic!("expected BlockStored: {batch:?}") };
        assert_eq!(st.medium, Medium::Gpu);
        let expect: Vec<_> = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0"), 16)
            .hash_prompt(&prompt)
            .iter()
            .map(|d| d.event_hash())
            .collect();
        assert_eq!(st.block_hashes, expect);
        assert_eq!(st.token_ids, prompt[..96].to_vec());
        let metrics = client.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
        assert!(metrics.contains("vllm:prefix_cache_hits_total{model_name=\"sim-bin\",engine=\"0\"} 96"), "{metrics}");
        engine.child.kill().await.unwrap();
    })
    .await
    .expect("test timed out");
}

/// `kvmesh engine --backend model` (SmolLM2-135M from the setup script's cache) over HTTP: a real
/// answer, the model's own context length as `max_model_len`, and a prompt beyond it refused
/// with a 400 while the engine keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_engine_binary_answers_and_refuses_prompts_beyond_its_context() {
    if kvmesh_model::find_smollm2(&kvmesh_model::default_cache_dir()).is_none() {
        // CI fetches the model (scripts/setup.sh) and sets KVMESH_REQUIRE_EXTERNAL.
        assert!(
            std::env::var_os("KVMESH_REQUIRE_EXTERNAL").is_none(),
            "SmolLM2 is required (KVMESH_REQUIRE_EXTERNAL is set) but was not found"
        );
        eprintln!("skipped: SmolLM2 not fetched (`kvmesh model fetch smollm2`)");
        return;
    }
    timeout(Duration::from_secs(120), async {
        let engine = spawn_engine(["--backend", "model", "--num-gpu-blocks", "1024"]).await;
        let base = engine.http.clone();
        let client = reqwest::Client::new();
        let models: Value = client.get(format!("{base}/v1/models")).send().await.unwrap().json().await.unwrap();
        assert_eq!(models["data"][0]["max_model_len"], 8192, "{models}");
        let model = models["data"][0]["id"].as_str().unwrap().to_owned();
        let long = "hello ".repeat(9000);
        let r = client
            .post(format!("{base}/v1/completions"))
            .json(&json!({"model": model, "prompt": long, "max_tokens": 1}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400);
        let body: Value = client
            .post(format!("{base}/v1/chat/completions"))
            .json(&json!({"model": model, "max_tokens": 32, "temperature": 0,
                          "messages": [{"role": "user", "content": "What is the capital of France?"}]}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let answer = body["choices"][0]["message"]["content"].as_str().unwrap_or_default();
        assert!(answer.contains("Paris"), "{body}");
    })
    .await
    .expect("test timed out");
}

/// Issue 37, finding 8: a GPU-block count no machine can hold used to abort the engine with an
/// allocation failure (SIGABRT, exit 134); now it is a configuration error naming the flag.
#[test]
fn an_impossible_gpu_tier_is_a_clear_config_error_not_an_abort() {
    for blocks in ["100000000000", "4000000000"] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvmesh"))
            .args([
                "engine",
                "--port",
                "0",
                "--backend",
                "sim",
                "--num-gpu-blocks",
                blocks,
            ])
            .args(["--sim-kv-bytes-per-token", "1048576"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{blocks}: {stderr}");
        assert!(
            stderr.contains(&format!("--num-gpu-blocks {blocks}")),
            "{blocks}: {stderr}"
        );
    }
}
