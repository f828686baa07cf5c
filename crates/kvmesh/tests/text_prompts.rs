//! Text prompts tokenize to exactly the token ids the bench generated, in the engine and in the
//! router (issue 13: the comparison sends text so cache-aware peers can match on it; kvmesh's
//! numbers must not change because of it).
//!
//! A `sim` engine behind `kvmesh router` (byte tokenizer on both): the engine's `/tokenize` gives
//! back the ids; a prompt sent as ids and then as text hits the same cached blocks (and the other
//! way round); the router's index lookup of the *text* finds the blocks the engine announced for
//! the *ids*.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::time::Duration;

use kvmesh_bench::client::{self, CompletionRequest, Outcome, PromptFormat, prompt_text};
use kvmesh_bench::fleet::{Fleet, FleetSpec};
use kvmesh_bench::tokens::{Segment, TokenGen, TokenSpace};
use serde_json::{Value, json};

const BLOCK: usize = 16;

/// POSTs `body` and returns the JSON answer.
async fn post_json(http: &reqwest::Client, url: &str, body: Value) -> Value {
    http.post(url)
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

async fn send(
    http: &reqwest::Client,
    base: &str,
    prompt: &[u32],
    format: PromptFormat,
) -> client::Completion {
    let c = client::complete(
        http,
        CompletionRequest {
            base_url: base,
            model: "sim-gpt-oss",
            prompt,
            prompt_format: format,
            max_tokens: 2,
            kv_transfer_params: None,
            session_id: None,
            request_id: None,
            want_token_ids: false,
            timeout: Duration::from_secs(60),
        },
    )
    .await;
    assert_eq!(c.outcome, Outcome::Ok, "{c:?}");
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_and_token_prompts_are_the_same_tokens_in_engine_and_router() {
    let dir = tempfile::tempdir().unwrap();
    let spec = FleetSpec::from_yaml(
        "engines:\n  - count: 1\n    num_gpu_blocks: 2048\n    time_scale: 20\n    p2p: false\n    max_model_len: 16384\nrouter:\n  profile: affinity\n",
    )
    .unwrap();
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_kvmesh"));
    let fleet = tokio::time::timeout(
        Duration::from_secs(90),
        Fleet::launch(&spec, &exe, dir.path()),
    )
    .await
    .expect("fleet starts within 90 s")
    .expect("fleet starts");
    // The router's KV-event subscription must be live before the first block is stored.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let http = reqwest::Client::new();
    let engine = fleet.engines[0].url.clone();
    let router = fleet.entry_url().to_owned();
    let g = TokenGen::new(5, TokenSpace::default());

    // 1. The engine's tokenizer turns the text back into exactly the ids.
    let a = g.render(&[Segment::seeded(1, 40 * BLOCK + 5)]);
    let a_text = prompt_text(&a).expect("the default token space is printable ASCII");
    let tok = post_json(
        &http,
        &format!("{engine}/tokenize"),
        json!({"prompt": a_text}),
    )
    .await;
    let ids: Vec<u32> = serde_json::from_value(tok["tokens"].clone()).unwrap();
    assert_eq!(ids, a, "engine /tokenize of the text prompt");

    // 2. Ids first, then text: the text request hits every full block the ids request stored.
    let full = |p: &[u32]| ((p.len() - 1) / BLOCK * BLOCK) as u64;
    let cold = send(&http, &router, &a, PromptFormat::Tokens).await;
    assert_eq!(cold.cached_tokens.unwrap_or(0), 0);
    let warm = send(&http, &router, &a, PromptFormat::Text).await;
    assert_eq!(warm.cached_tokens, Some(full(&a)), "text after ids");
    // And the other way round, on a fresh prompt.
    let b = g.render(&[Segment::seeded(2, 33 * BLOCK + 3)]);
    send(&http, &router, &b, PromptFormat::Text).await;
    let again = send(&http, &router, &b, PromptFormat::Tokens).await;
    assert_eq!(again.cached_tokens, Some(full(&b)), "ids after text");

    // 3. The router tokenizes the text to the same ids: its index (fed by the engine's events
    //    for the ids) finds the prompt's blocks on the engine.
    let name = fleet.engines[0].name.clone();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let v = post_json(
            &http,
            &format!("{router}/debug/prefix"),
            json!({"prompt": a_text}),
        )
        .await;
        assert_eq!(v["prompt_tokens"], json!(a.len()), "{v}");
        let held = v["endpoints"][&name]["any_tokens"].as_u64().unwrap_or(0);
        if held >= (a.len() / BLOCK * BLOCK) as u64 - BLOCK as u64 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the router never found the text prompt's blocks on {name}: {v}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    fleet.shutdown().await;
}
