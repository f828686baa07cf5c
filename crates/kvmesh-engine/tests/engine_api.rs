//! Engine acceptance tests: an in-process server on loopback (sim backend), driven over HTTP,
//! its KV events read by a ZMQ subscriber.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::{TestServer, base_config, cached_tokens, tokens};
use futures::StreamExt;
use kvmesh_core::{BlockHash, BlockHasher, HashAlgo, KvEvent, Medium};
use serde_json::{Value, json};

const FAST: f64 = 1000.0;
const QUIET: Duration = Duration::from_millis(400);

fn hashes(prompt: &[u32]) -> Vec<BlockHash> {
    BlockHasher::new(HashAlgo::Sha256Cbor, Some("0"), 16)
        .hash_prompt(prompt)
        .iter()
        .map(|d| d.event_hash())
        .collect()
}

fn stored(events: &[(u64, KvEvent)], medium: Medium) -> Vec<kvmesh_core::events::BlockStored> {
    events
        .iter()
        .filter_map(|(_, e)| match e {
            KvEvent::BlockStored(s) if s.medium == medium => Some(s.clone()),
            _ => None,
        })
        .collect()
}

fn removed(events: &[(u64, KvEvent)], medium: Medium) -> Vec<BlockHash> {
    events
        .iter()
        .filter_map(|(_, e)| match e {
            KvEvent::BlockRemoved(r) if r.medium == medium => Some(r.block_hashes.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}

async fn within<F: std::future::Future>(secs: u64, f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .expect("test timed out")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_prompt_publishes_gpu_then_cpu_block_stored_with_tokens_and_parents() {
    within(30, async {
        let mut s = TestServer::start(base_config(), FAST).await;
        let prompt = tokens(1, 70); // 4 full blocks + 6 tokens
        let body = s.complete_ids(&prompt, 2).await;
        assert_eq!(cached_tokens(&body), 0);
        let events = s.drain_events(QUIET).await;
        let expect = hashes(&prompt);
        assert_eq!(expect.len(), 4);
        let gpu = stored(&events, Medium::Gpu);
        let gpu_hashes: Vec<BlockHash> = gpu.iter().flat_map(|e| e.block_hashes.clone()).collect();
        assert_eq!(
            gpu_hashes, expect,
            "GPU BlockStored for every full prompt block, in order"
        );
        assert_eq!(gpu[0].parent_block_hash, None);
        assert_eq!(gpu[0].block_size, 16);
        let gpu_tokens: Vec<u32> = gpu.iter().flat_map(|e| e.token_ids.clone()).collect();
        assert_eq!(gpu_tokens, prompt[..64].to_vec());
        let cpu = stored(&events, Medium::Cpu);
        let cpu_hashes: Vec<BlockHash> = cpu.iter().flat_map(|e| e.block_hashes.clone()).collect();
        assert_eq!(cpu_hashes, expect, "offloaded to the CPU tier");
        // GPU store of a block is published before its CPU store; sequence numbers increase.
        let first_cpu = events
            .iter()
            .position(|(_, e)| matches!(e, KvEvent::BlockStored(x) if x.medium == Medium::Cpu))
            .unwrap();
        let first_gpu = events
            .iter()
            .position(|(_, e)| matches!(e, KvEvent::BlockStored(x) if x.medium == Medium::Gpu))
            .unwrap();
        assert!(first_gpu < first_cpu);
        assert!(events.windows(2).all(|w| w[0].0 <= w[1].0));
        // The CPU tier holds verifiable sim payloads.
        let payload = s.server.engine.cpu_tier().get(expect[2]).unwrap();
        assert!(kvmesh_engine::compute::sim::verify_sim_block_payload(
            expect[2], &payload
        ));
        assert_eq!(payload.len(), 16 * 32);
        s.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeats_report_cached_tokens_except_the_last_prompt_token() {
    within(30, async {
        let s = TestServer::start(base_config(), FAST).await;
        let prompt = tokens(2, 640);
        assert_eq!(cached_tokens(&s.complete_ids(&prompt, 1).await), 0);
        // vLLM: a fully repeated 640-token prompt with block 16 reports 624 cached.
        assert_eq!(cached_tokens(&s.complete_ids(&prompt, 1).await), 624);
        // A prompt sharing a 320-token prefix reports that prefix.
        let mut other = prompt[..320].to_vec();
        other.extend(tokens(3, 100));
        assert_eq!(cached_tokens(&s.complete_ids(&other, 1).await), 320);
        assert_eq!(s.metric("vllm:prefix_cache_hits_total").await, 944.0);
        assert_eq!(s.metric("vllm:prefix_cache_queries_total").await, 1700.0);
        assert_eq!(s.metric("vllm:prompt_tokens_by_source_total{model_name=\"sim-test\",engine=\"0\",source=\"local_cache_hit\"}").await, 944.0);
        s.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_evicted_prefix_is_restored_from_the_cpu_tier_as_a_local_hit() {
    within(30, async {
        let mut cfg = base_config();
        cfg.num_gpu_blocks = 48; // one 640-token prompt (40 blocks) at a time
        let mut s = TestServer::start(cfg, FAST).await;
        let a = tokens(10, 640);
        let b = tokens(11, 640);
        s.complete_ids(&a, 1).await;
        s.complete_ids(&b, 1).await; // evicts most of a from the GPU tier
        let events = s.drain_events(QUIET).await;
        let gone = removed(&events, Medium::Gpu);
        let ha = hashes(&a);
        assert!(
            !gone.is_empty() && gone.iter().all(|h| ha.contains(h)),
            "GPU evictions of a's blocks published"
        );
        assert!(
            removed(&events, Medium::Cpu).is_empty(),
            "CPU tier is big enough"
        );
        let again = s.complete_ids(&a, 1).await;
        assert_eq!(
            cached_tokens(&again),
            624,
            "restored from CPU, counted as cached"
        );
        let restorable = gone.iter().filter(|h| ha[..39].contains(h)).count();
        assert!(
            restorable >= 30,
            "most of a was evicted from the GPU tier: {restorable}"
        );
        assert_eq!(
            s.metric("kvmesh_engine_cpu_restored_blocks_total").await,
            restorable as f64
        );
        assert_eq!(s.metric("vllm:prefix_cache_hits_total").await, 624.0);
        // Restored blocks are announced again on the GPU tier.
        let events = s.drain_events(QUIET).await;
        let regpu: Vec<BlockHash> = stored(&events, Medium::Gpu)
            .iter()
            .flat_map(|e| e.block_hashes.clone())
            .collect();
        assert!(
            gone.iter()
                .filter(|h| ha[..39].contains(h))
                .all(|h| regpu.contains(h))
        );
        s.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pressure_on_both_tiers_publishes_block_removed_per_medium() {
    within(30, async {
        let mut cfg = base_config();
        cfg.num_gpu_blocks = 48;
        cfg.cpu_offload_bytes = 50 * 16 * 32; // 50 blocks of 512 bytes
        let mut s = TestServer::start(cfg, FAST).await;
        for i in 0..4 {
            s.complete_ids(&tokens(20 + i, 640), 1).await;
        }
        let events = s.drain_events(QUIET).await;
        let gpu_gone = removed(&events, Medium::Gpu);
        let cpu_gone = removed(&events, Medium::Cpu);
        assert!(gpu_gone.len() >= 80, "GPU evictions: {}", gpu_gone.len());
        assert!(cpu_gone.len() >= 100, "CPU evictions: {}", cpu_gone.len());
        // Every removed block had been stored in that tier before.
        let gpu_stored: Vec<BlockHash> = stored(&events, Medium::Gpu)
            .iter()
            .flat_map(|e| e.block_hashes.clone())
            .collect();
        assert!(gpu_gone.iter().all(|h| gpu_stored.contains(h)));
        assert!(s.metric("kvmesh_engine_cpu_used_bytes").await <= (50 * 16 * 32) as f64);
        assert!(s.metric("kvmesh_engine_cpu_evicted_blocks").await >= 100.0);
        assert!(s.metric("kvmesh_engine_gpu_evicted_blocks_total").await >= 80.0);
        s.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_prefix_cache_publishes_all_blocks_cleared_and_forgets() {
    within(30, async {
        let mut s = TestServer::start(base_config(), FAST).await;
        let p = tokens(30, 200);
        s.complete_ids(&p, 1).await;
        let r = s
            .client
            .post(format!("{}/reset_prefix_cache", s.base))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let events = s.drain_events(QUIET).await;
        assert!(
            matches!(events.last(), Some((_, KvEvent::AllBlocksCleared))),
            "{events:?}"
        );
        assert_eq!(cached_tokens(&s.complete_ids(&p, 1).await), 0);
        assert_eq!(s.server.engine.cpu_tier().stats().blocks, 12);
        s.stop().await;
    })
    .await;
}

/// Streams one request; says on `submitted` when the response head is back (the engine has
/// queued the request by then) and returns when the first text chunk arrived.
async fn stream_first_text(
    base: String,
    prompt: Vec<u32>,
    submitted: tokio::sync::oneshot::Sender<()>,
) -> Instant {
    let client = reqwest::Client::new();
    let resp = client
        .post(format!("{base}/v1/completions"))
        .json(&json!({"model": "sim-test", "prompt": prompt, "max_tokens": 2, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    submitted.send(()).ok();
    let mut body = resp.bytes_stream();
    let mut first_text = None;
    let mut buf = String::new();
    while let Some(chunk) = body.next().await {
        buf.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
        if first_text.is_none() && buf.contains("\"text\"") {
            first_text = Some(Instant::now());
        }
    }
    assert!(buf.contains("[DONE]"));
    first_text.expect("a text chunk")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fcfs_with_one_running_sequence_serves_in_arrival_order() {
    within(60, async {
        let mut cfg = base_config(); // KV events on: they show the order prefills ran in
        cfg.max_num_seqs = 1;
        // 8K-token prompts: 250 ms modelled each; at time scale 5 → 50 ms of compute each.
        let mut s = TestServer::start(cfg, 5.0).await;
        let n = 5;
        let prompts: Vec<Vec<u32>> = (0..n).map(|i| tokens(100 + i as u32, 8192)).collect();
        let first_sent = Instant::now();
        let mut tasks = Vec::new();
        for prompt in &prompts {
            let (submitted, accepted) = tokio::sync::oneshot::channel();
            tasks.push(tokio::spawn(stream_first_text(
                s.base.clone(),
                prompt.clone(),
                submitted,
            )));
            // Fix the arrival order: the next request leaves only once this one is queued
            // (a fixed sleep was not enough on a loaded machine).
            accepted.await.unwrap();
        }
        let mut first_texts = Vec::new();
        for t in tasks {
            first_texts.push(t.await.unwrap());
        }
        // Service order from evidence, not from client-side clocks: each prompt's GPU
        // BlockStored is published when its prefill runs, in one ordered event stream.
        let events = s.drain_events(QUIET).await;
        let first_blocks: Vec<BlockHash> = prompts.iter().map(|p| hashes(p)[0]).collect();
        let served: Vec<usize> = stored(&events, Medium::Gpu)
            .iter()
            .flat_map(|e| e.block_hashes.clone())
            .filter_map(|h| first_blocks.iter().position(|f| *f == h))
            .collect();
        assert_eq!(
            served,
            (0..n).collect::<Vec<_>>(),
            "prefills must run in arrival order"
        );
        // The last one's first token needed the n-1 prefills before it, run one at a time
        // (at least (n-1) x 50 ms after the first arrival; load only makes it later).
        let last_wait = first_texts[n - 1] - first_sent;
        assert!(
            last_wait >= Duration::from_millis(180),
            "{last_wait:?} after the first arrival"
        );
        s.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors_and_do_not_disturb_others() {
    within(60, async {
        let mut cfg = base_config();
        cfg.kv_events = None;
        cfg.max_model_len = 4096;
        cfg.max_num_seqs = 1;
        cfg.max_waiting = 1;
        let s = TestServer::start(cfg, 1.0).await;
        // One long request in flight the whole time.
        let base = s.base.clone();
        let inflight = tokio::spawn(async move {
            let c = reqwest::Client::new();
            c.post(format!("{base}/v1/completions"))
                .json(&json!({"model": "sim-test", "prompt": tokens(7, 4000), "max_tokens": 80, "ignore_eos": true}))
                .send()
                .await
                .unwrap()
                .json::<Value>()
                .await
                .unwrap()
        });
        tokio::time::sleep(Duration::from_millis(30)).await;
        let raw = s
            .client
            .post(format!("{}/v1/completions", s.base))
            .body("{not json")
            .send()
            .await
            .unwrap();
        assert_eq!(raw.status(), 400);
        let e: Value = raw.json().await.unwrap();
        assert_eq!(e["error"]["type"], "BadRequestError");
        assert_eq!(e["error"]["code"], 400);
        assert!(e["error"]["message"].as_str().unwrap().contains("invalid"));
        let (st, e) = s
            .post("/v1/completions", json!({"model": "nope", "prompt": "hi"}))
            .await;
        assert_eq!(st, 404, "unknown model is vLLM's 404 NotFoundError: {e}");
        assert_eq!(e["error"]["param"], "model");
        let (st, e) = s
            .post("/v1/completions", json!({"prompt": tokens(8, 5000)}))
            .await;
        assert_eq!(st, 400);
        assert!(
            e["error"]["message"]
                .as_str()
                .unwrap()
                .contains("maximum context length")
        );
        let (st, e) = s
            .post("/v1/completions", json!({"prompt": [1, 2, 70_000]}))
            .await;
        assert_eq!(st, 400, "{e}");
        assert!(
            e["error"]["message"]
                .as_str()
                .unwrap()
                .contains("token id 70000 is out of vocabulary"),
            "{e}"
        );
        let (st, _) = s
            .post(
                "/v1/completions",
                json!({"prompt": "hi", "temperature": -1}),
            )
            .await;
        assert_eq!(st, 400);
        let (st, _) = s
            .post("/v1/completions", json!({"prompt": "hi", "max_tokens": 0}))
            .await;
        assert_eq!(st, 400);
        let (st, _) = s
            .post("/v1/chat/completions", json!({"messages": []}))
            .await;
        assert_eq!(st, 400);
        // Overload: one running, one waiting fills --max-waiting 1; the next gets 429.
        let base = s.base.clone();
        let waiting = tokio::spawn(async move {
            reqwest::Client::new()
                .post(format!("{base}/v1/completions"))
                .json(&json!({"prompt": tokens(9, 2000), "max_tokens": 1}))
                .send()
                .await
                .unwrap()
                .status()
        });
        tokio::time::sleep(Duration::from_millis(30)).await;
        let r = s
            .client
            .post(format!("{}/v1/completions", s.base))
            .json(&json!({"prompt": "x", "max_tokens": 1}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 429);
        assert_eq!(r.headers().get("retry-after").unwrap(), "1");
        let done = inflight.await.unwrap();
        assert_eq!(done["usage"]["completion_tokens"], 80, "{done}");
        assert_eq!(waiting.await.unwrap(), 200);
        let metrics = s.metrics().await;
        for reason in [
            "malformed_json",
            "unknown_model",
            "prompt_too_long",
            "bad_param",
            "overloaded",
        ] {
            assert!(
                metrics.contains(&format!("reason=\"{reason}\"")),
                "{reason} counted"
            );
        }
        s.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_cancels_and_frees_blocks() {
    within(30, async {
        let mut cfg = base_config();
        cfg.kv_events = None;
        let s = TestServer::start(cfg, 1.0).await;
        let resp = s
            .client
            .post(format!("{}/v1/completions", s.base))
            .json(&json!({"prompt": tokens(40, 1000), "max_tokens": 50000, "ignore_eos": true, "stream": true}))
            .send()
            .await
            .unwrap();
        let mut body = resp.bytes_stream();
        let _ = body.next().await;
        assert_eq!(s.metric("vllm:num_requests_running").await, 1.0);
        assert!(s.metric("vllm:kv_cache_usage_perc").await > 0.0);
        drop(body);
        let t0 = Instant::now();
        loop {
            if s.metric("vllm:num_requests_running").await == 0.0 && s.metric("vllm:kv_cache_usage_perc").await == 0.0 {
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(5), "request not cancelled");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let m = s.metrics().await;
        assert!(m.contains("finished_reason=\"abort\"} 1"), "{m}");
        s.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preemption_delays_requests_but_never_drops_them() {
    within(60, async {
        let mut cfg = base_config();
        cfg.kv_events = None;
        cfg.num_gpu_blocks = 40; // 640 tokens of KV in total
        let s = TestServer::start(cfg, FAST).await;
        let mut tasks = Vec::new();
        for i in 0..4 {
            let base = s.base.clone();
            tasks.push(tokio::spawn(async move {
                reqwest::Client::new()
                    .post(format!("{base}/v1/completions"))
                    .json(&json!({"prompt": tokens(50 + i, 100), "max_tokens": 200, "ignore_eos": true}))
                    .send()
                    .await
                    .unwrap()
                    .json::<Value>()
                    .await
                    .unwrap()
            }));
        }
        for t in tasks {
            let body = t.await.unwrap();
            assert_eq!(body["usage"]["completion_tokens"], 200, "{body}");
            assert_eq!(body["choices"][0]["finish_reason"], "length");
        }
        assert!(s.metric("vllm:num_preemptions_total").await > 0.0);
        s.stop().await;
    })
    .await;
}

/// The keys of every JSON object, recursively, as dotted paths (shape comparison).
fn shape(v: &Value, prefix: &str, out: &mut std::collections::BTreeSet<String>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let p = format!("{prefix}.{k}");
                out.insert(p.clone());
                shape(x, &p, out);
            }
        }
        Value::Array(a) => {
            for x in a {
                shape(x, &format!("{prefix}[]"), out);
            }
        }
        _ => {}
    }
}

fn shapes(v: &Value) -> std::collections::BTreeSet<String> {
    let mut s = std::collections::BTreeSet::new();
    shape(v, "", &mut s);
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_shapes_match_the_vllm_fixtures() {
    within(30, async {
        let mut cfg = base_config();
        cfg.kv_events = None;
        let s = TestServer::start(cfg, FAST).await;
        let fixture: Value = serde_json::from_str(
            &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/vllm/completion.json")).unwrap(),
        )
        .unwrap();
        let (st, ours) = s.post("/v1/completions", json!({"model": "sim-test", "prompt": "Hello there", "max_tokens": 3})).await;
        assert_eq!(st, 200);
        assert_eq!(shapes(&ours), shapes(&fixture));
        assert_eq!(ours["kv_transfer_params"], Value::Null);
        // Streaming chat, chunk by chunk, against chat_stream.txt.
        let fixture_chunks: Vec<Value> =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/vllm/chat_stream.txt"))
                .unwrap()
                .lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .filter(|d| *d != "[DONE]")
                .map(|d| serde_json::from_str(d).unwrap())
                .collect();
        let text = s
            .client
            .post(format!("{}/v1/chat/completions", s.base))
            .json(&json!({"model": "sim-test", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                          "stream": true, "stream_options": {"include_usage": true},
                          "kv_transfer_params": {"remote_kv_source": null}}))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let lines: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
        assert_eq!(*lines.last().unwrap(), "[DONE]");
        let ours: Vec<Value> = lines[..lines.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
        assert_eq!(ours.len(), fixture_chunks.len(), "role chunk + 5 content chunks + usage chunk");
        for (o, f) in ours.iter().zip(&fixture_chunks) {
            assert_eq!(shapes(o), shapes(f), "chunk shape differs:\nours {o}\nvllm {f}");
        }
        let usage = &ours.last().unwrap()["usage"];
        assert_eq!(usage["completion_tokens"], 5);
        assert!(usage["prompt_tokens_details"]["cached_tokens"].is_u64());
        s.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_models_health_and_stop_strings() {
    within(30, async {
        let mut cfg = base_config();
        cfg.kv_events = None;
        let s = TestServer::start(cfg, FAST).await;
        let (st, t) = s.post("/tokenize", json!({"prompt": "abc"})).await;
        assert_eq!(st, 200);
        assert_eq!(
            t,
            json!({"count": 3, "max_model_len": 65536, "tokens": [97, 98, 99], "token_strs": null})
        );
        let m: Value = s
            .client
            .get(format!("{}/v1/models", s.base))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(m["data"][0]["id"], "sim-test");
        assert_eq!(
            s.client
                .get(format!("{}/health", s.base))
                .send()
                .await
                .unwrap()
                .status(),
            200
        );
        // Greedy sim output is a deterministic letter stream; stop on its third character.
        let (_, full) = s
            .post(
                "/v1/completions",
                json!({"prompt": "q", "max_tokens": 8, "temperature": 0}),
            )
            .await;
        let text = full["choices"][0]["text"].as_str().unwrap().to_owned();
        assert_eq!(text.len(), 8);
        let stop = text[2..3].to_owned();
        let cut = text.find(&stop).unwrap();
        let (_, stopped) = s
            .post(
                "/v1/completions",
                json!({"prompt": "q", "max_tokens": 8, "temperature": 0, "stop": [stop]}),
            )
            .await;
        assert_eq!(stopped["choices"][0]["text"], text[..cut]);
        assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
        assert_eq!(stopped["choices"][0]["stop_reason"], text[2..3]);
        let t0 = Instant::now();
        while !s.metrics().await.contains("finished_reason=\"stop\"} 1") {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "stop-string finish counted as stop"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Same seed, same output.
        let (_, a) = s
            .post(
                "/v1/completions",
                json!({"prompt": "q", "max_tokens": 8, "seed": 5}),
            )
            .await;
        let (_, b) = s
            .post(
                "/v1/completions",
                json!({"prompt": "z", "max_tokens": 8, "seed": 5}),
            )
            .await;
        assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
        s.stop().await;
    })
    .await;
}

/// The project's Python: the virtual environment `scripts/setup.sh` creates at the repository
/// root (`.venv/`), which holds the `openai` client. Never the system Python.
fn venv_python() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_client_streams_chat_when_installed() {
    let python = venv_python();
    let ok = std::process::Command::new(&python)
        .args(["-c", "import openai"])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok {
        // CI installs the client (scripts/setup.sh) and sets KVMESH_REQUIRE_EXTERNAL so a broken
        // install fails loudly instead of silently skipping the compatibility check.
        assert!(
            std::env::var_os("KVMESH_REQUIRE_EXTERNAL").is_none(),
            "the `openai` Python package is required (KVMESH_REQUIRE_EXTERNAL is set) but {} cannot import it; run bash scripts/setup.sh",
            python.display()
        );
        println!(
            "SKIPPED: {} cannot import the `openai` package (bash scripts/setup.sh creates .venv/ and installs it)",
            python.display()
        );
        return;
    }
    within(60, async {
        let mut cfg = base_config();
        cfg.kv_events = None;
        let s = TestServer::start(cfg, FAST).await;
        let script = format!(
            "import openai\nc=openai.OpenAI(base_url='{}/v1',api_key='x')\n\
             out=''\nfor ch in c.chat.completions.create(model='sim-test',messages=[{{'role':'user','content':'hi'}}],max_tokens=7,stream=True,stream_options={{'include_usage':True}}):\n\
             \x20   out+= (ch.choices[0].delta.content or '') if ch.choices else ''\n\
             \x20   u=ch.usage or None\nprint(len(out))\n",
            s.base
        );
        let out = tokio::process::Command::new(&python).args(["-c", &script]).output().await.unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "7");
        s.stop().await;
    })
    .await;
}

/// Echoes the request's `kv_transfer_params` and marks the first two prompt blocks as pulled
/// (the shape a P2P/PD integration plugs in).
struct EchoHook;

impl kvmesh_engine::request_hook::RequestHook for EchoHook {
    fn before_submit<'a>(
        &'a self,
        engine: &'a kvmesh_engine::EngineHandle,
        req: &'a mut kvmesh_engine::EngineRequest,
    ) -> futures::future::BoxFuture<'a, ()> {
        Box::pin(async move {
            let hashes = engine.block_hashes(&req.prompt);
            for (i, h) in hashes.iter().enumerate().take(2) {
                let parent = if i == 0 { None } else { Some(hashes[i - 1]) };
                let payload = kvmesh_engine::compute::sim::sim_block_payload(*h, 16 * 32);
                engine.cpu_tier().insert_external(
                    *h,
                    parent,
                    req.prompt[i * 16..(i + 1) * 16].to_vec(),
                    payload.into(),
                );
            }
            req.external_hashes = hashes[..2].to_vec();
            req.external_query_tokens = req.prompt.len();
        })
    }

    fn on_finish(
        &self,
        _engine: &kvmesh_engine::EngineHandle,
        req: &kvmesh_engine::EngineRequest,
        info: &mut kvmesh_engine::FinishInfo,
    ) {
        info.kv_transfer_params = req.kv_transfer_params.clone();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_hook_lands_external_blocks_and_sets_response_kv_transfer_params() {
    within(30, async {
        let mut cfg = base_config();
        cfg.kv_events = None;
        let options = kvmesh_engine::server::ServerOptions { request_hook: Some(std::sync::Arc::new(EchoHook)), ..Default::default() };
        let s = TestServer::start_with(cfg, FAST, options).await;
        let params = json!({"remote_kv_source": {"kv_request_id": "r1", "remote_host": "127.0.0.1", "remote_port": 7777}});
        let (st, body) = s
            .post("/v1/completions", json!({"prompt": tokens(60, 100), "max_tokens": 2, "kv_transfer_params": params}))
            .await;
        assert_eq!(st, 200, "{body}");
        assert_eq!(cached_tokens(&body), 32);
        assert_eq!(body["kv_transfer_params"], params);
        assert_eq!(s.metric("vllm:external_prefix_cache_hits_total").await, 32.0);
        assert_eq!(s.metric("vllm:prefix_cache_hits_total").await, 0.0);
        // Streaming responses carry them on the final chunk.
        let text = s
            .client
            .post(format!("{}/v1/completions", s.base))
            .json(&json!({"prompt": tokens(61, 100), "max_tokens": 2, "stream": true, "kv_transfer_params": params}))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let finals: Vec<Value> = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap())
            .filter(|v: &Value| v.get("kv_transfer_params").is_some())
            .collect();
        assert_eq!(finals.len(), 1);
        assert_eq!(finals[0]["kv_transfer_params"], params);
        s.stop().await;
    })
    .await;
}

/// A router's P2P hint that does not parse (here a string port, no request id) is ignored and
/// counted: the request is served from local compute, never refused for it. Malformed P/D keys
/// are still the client's error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_p2p_hint_is_ignored_not_fatal() {
    within(30, async {
        let mut cfg = base_config();
        cfg.kv_events = None;
        let s = TestServer::start(cfg, 1.0).await;
        let hint = json!({"remote_kv_source": {"remote_host": "127.0.0.1", "remote_port": "x"}});
        let (st, body) = s
            .post(
                "/v1/completions",
                json!({"prompt": tokens(21, 64), "max_tokens": 2, "kv_transfer_params": hint}),
            )
            .await;
        assert_eq!(st, 200, "{body}");
        assert_eq!(body["usage"]["completion_tokens"], 2, "{body}");
        let metrics = s.metrics().await;
        assert!(
            metrics.contains("reason=\"malformed_remote_kv_source\"} 1"),
            "{metrics}"
        );
        let (st, e) = s
            .post(
                "/v1/completions",
                json!({"prompt": "hi", "kv_transfer_params": {"do_remote_decode": "maybe"}}),
            )
            .await;
        assert_eq!(st, 400, "{e}");
        assert_eq!(e["error"]["param"], "kv_transfer_params");
        s.stop().await;
    })
    .await;
}

/// An engine with an HF tokenizer (a word-level vocabulary whose tokens are several bytes long,
/// so a 2 MiB text is not too long by its length alone) counts a prompt of more than any real
/// context a piece at a time and refuses it with vLLM's context-length 400, naming how many
/// tokens it counted, rather than encoding it whole.
#[tokio::test]
async fn a_huge_prompt_through_an_hf_tokenizer_is_counted_in_pieces_and_refused() {
    use kvmesh_engine::server::{ServerOptions, sim_backend, start_server};
    let tok = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tokenizers/wordlevel.json");
    let tokenizer = kvmesh_text::HfTokenizer::load(&tok, None).unwrap();
    let mut cfg = base_config();
    cfg.max_model_len = 131_072;
    let backend = sim_backend(&cfg, "gpt-oss-120b-h200", 100.0, 32).unwrap();
    let s = start_server(
        cfg,
        backend,
        std::sync::Arc::new(tokenizer),
        ServerOptions::default(),
    )
    .await
    .unwrap();
    let text = "hello world ".repeat((2 << 20) / 12);
    let r = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", s.addr))
        .json(&json!({"model": "sim-test", "prompt": text, "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    let message = body["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        message.contains("maximum context length is 131072") && message.contains("at least"),
        "{body}"
    );
    // A prompt that fits is encoded and served as before.
    let r = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", s.addr))
        .json(&json!({"model": "sim-test", "prompt": "hello world hello", "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    s.shutdown().await;
}
