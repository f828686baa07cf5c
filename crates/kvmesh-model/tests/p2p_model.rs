//! Real KV over P2P: engine B pulls a prompt prefix's KV (real tensors from the tiny random
//! Llama) from engine A's CPU tier and then generates exactly the greedy tokens a full recompute
//! generates — pulled KV is bit-identical to recomputed KV, so the output cannot differ.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_core::{KvTransferParams, TokenId};
use kvmesh_engine::compute::SamplingParams;
use kvmesh_engine::layered_pull::{LayeredPull, StagingBudget};
use kvmesh_engine::server::{RunningServer, ServerOptions, start_server};
use kvmesh_engine::{EngineConfig, EngineRequest, P2pLoadMode, SeqOutput};
use kvmesh_model::tiny_random_llama;
use kvmesh_text::ByteTokenizer;
use kvmesh_transfer::{LayerPullReport, PullOutcome, PullReason, SegmentSink};
use tokio::time::timeout;

async fn start() -> RunningServer {
    start_with(P2pLoadMode::Async).await
}

async fn start_with(load_mode: P2pLoadMode) -> RunningServer {
    let mut cfg = EngineConfig {
        port: 0,
        served_model_name: "tiny".into(),
        num_gpu_blocks: 256,
        cpu_offload_bytes: 64 << 20,
        max_model_len: 4096,
        hash_seed: Some("0".into()),
        ..EngineConfig::default()
    };
    cfg.p2p.port = Some(0);
    cfg.p2p.allowed_peers = vec!["127.0.0.1".into()];
    cfg.p2p.load_mode = load_mode;
    start_server(
        cfg,
        Box::new(tiny_random_llama(7)),
        Arc::new(ByteTokenizer),
        ServerOptions::default(),
    )
    .await
    .unwrap()
}

fn request(prompt: &[TokenId]) -> EngineRequest {
    EngineRequest {
        request_id: "t".into(),
        prompt: prompt.to_vec(),
        sampling: SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            seed: None,
        },
        max_tokens: 12,
        ignore_eos: true,
        stop_token_ids: Vec::new(),
        kv_transfer_params: None,
        cache_salt: None,
        arrival: Instant::now(),
        external_hashes: Vec::new(),
        pull_pinned_hashes: Vec::new(),
        external_query_tokens: 0,
        pull_feedback: None,
        layered_pull: None,
    }
}

/// Runs `req` on `s` as it is: tokens and cached.
async fn run(s: &RunningServer, req: EngineRequest) -> (Vec<TokenId>, usize) {
    let mut stream = s.engine.submit(req).unwrap();
    let mut toks = Vec::new();
    loop {
        match stream.recv().await.unwrap() {
            SeqOutput::Started { .. } => {}
            SeqOutput::Token(t) => toks.push(t),
            SeqOutput::Finished(f) => return (toks, f.cached_tokens),
            SeqOutput::Error(e) => panic!("{e}"),
        }
    }
}

/// Runs `req` on `s` (after the P2P hook's read, `prepare_request`, when `source` is set): tokens
/// and cached.
async fn generate(
    s: &RunningServer,
    mut req: EngineRequest,
    source: Option<u16>,
) -> (Vec<TokenId>, usize) {
    if let Some(port) = source {
        let kvp = KvTransferParams::pull_from("kv-1", "127.0.0.1", port);
        let src = kvp.remote_kv_source.clone().unwrap();
        req.kv_transfer_params = Some(kvp);
        s.p2p
            .prepare_request(&s.engine, &mut req, &src, None)
            .await
            .expect("something to pull");
    }
    let mut stream = s.engine.submit(req).unwrap();
    let mut toks = Vec::new();
    loop {
        match stream.recv().await.unwrap() {
            SeqOutput::Started { .. } => {}
            SeqOutput::Token(t) => toks.push(t),
            SeqOutput::Finished(f) => return (toks, f.cached_tokens),
            SeqOutput::Error(e) => panic!("{e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pulled_real_kv_gives_the_same_greedy_output_as_recompute() {
    timeout(Duration::from_secs(120), async {
        let (a, b, c) = (start().await, start().await, start().await);
        let text = "Peer-to-peer KV: move the KV, not the work. The quick brown fox jumps over the lazy dog. ";
        let prefix: Vec<TokenId> = text.bytes().cycle().take(160).map(TokenId::from).collect();
        generate(&a, request(&prefix), None).await;
        let mut prompt = prefix.clone();
        prompt.extend("And then it asked a question?".bytes().map(TokenId::from));

        let (pulled, cached) = generate(&b, request(&prompt), Some(a.p2p_addr.unwrap().port())).await;
        assert_eq!(cached, 160, "all ten prefix blocks came from A");
        assert_eq!(b.engine.metrics().external_prefix_cache_hits.get(), 160);
        let (recomputed, cached_c) = generate(&c, request(&prompt), None).await;
        assert_eq!(cached_c, 0);
        assert_eq!(pulled, recomputed, "pulled KV must decode exactly like recomputed KV");
        // The pulled bytes are A's bytes: B's CPU tier holds identical payloads.
        let h = a.engine.block_hashes(&prefix);
        for hash in &h {
            assert_eq!(a.engine.cpu_tier().get(*hash), b.engine.cpu_tier().get(*hash));
        }
        for s in [a, b, c] {
            s.shutdown().await;
        }
    })
    .await
    .expect("test timed out");
}

const TEXT: &str =
    "Peer-to-peer KV: move the KV, not the work. The quick brown fox jumps over the lazy dog. ";

fn prefix_and_prompt() -> (Vec<TokenId>, Vec<TokenId>) {
    let prefix: Vec<TokenId> = TEXT.bytes().cycle().take(160).map(TokenId::from).collect();
    let mut prompt = prefix.clone();
    prompt.extend("And then it asked a question?".bytes().map(TokenId::from));
    (prefix, prompt)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layer_wise_pull_gives_the_same_greedy_output_as_recompute() {
    timeout(Duration::from_secs(120), async {
        let (a, c) = (start().await, start().await);
        let b = start_with(P2pLoadMode::Layerwise).await;
        let (prefix, prompt) = prefix_and_prompt();
        run(&a, request(&prefix)).await;

        // B asks for 11 blocks; A holds the first 10 (a MISS past them): the layers of those
        // 10 arrive while B's first step computes.
        let mut req = request(&prompt);
        let kvp = KvTransferParams::pull_from("kv-1", "127.0.0.1", a.p2p_addr.unwrap().port());
        let src = kvp.remote_kv_source.clone().unwrap();
        req.kv_transfer_params = Some(kvp);
        assert!(
            b.p2p
                .start_layered_read(&b.engine, &mut req, &src, None)
                .await
        );
        let pull = req
            .layered_pull
            .clone()
            .expect("a layer-wise pull is attached");
        assert_eq!(pull.served(), 10, "A serves its 10 blocks of the 11 asked");
        let (pulled, cached) = run(&b, req).await;
        assert_eq!(cached, 160, "all ten prefix blocks came from A");
        let m = b.engine.metrics();
        assert_eq!(m.external_prefix_cache_hits.get(), 160);
        assert_eq!(m.p2p_layerwise_short.get(), 0);
        let (recomputed, _) = run(&c, request(&prompt)).await;
        assert_eq!(
            pulled, recomputed,
            "layer-wise pulled KV must decode exactly like recomputed KV"
        );
        // The blocks became B's own: cached and offloaded like computed ones, so a second
        // request hits them locally.
        let (again, cached_again) = run(&b, request(&prompt)).await;
        assert_eq!((again, cached_again), (recomputed, 176));
        for s in [a, b, c] {
            s.shutdown().await;
        }
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layer_wise_pull_that_dies_mid_stream_is_recomputed_with_the_same_output() {
    timeout(Duration::from_secs(120), async {
        let a = start().await;
        let b = start_with(P2pLoadMode::Layerwise).await;
        let (prefix, prompt) = prefix_and_prompt();
        run(&a, request(&prefix)).await;
        let (expected, _) = run(&a, request(&prompt)).await;

        // Layer 0 of A's ten blocks arrives, then the peer is gone.
        let hashes = a.engine.block_hashes(&prefix);
        let layout = b.engine.kv_layout();
        let seg = layout.bytes_per_block / layout.num_layers as usize;
        let budget = StagingBudget::new(64 << 20);
        let give_up = std::time::Instant::now() + Duration::from_secs(2);
        let pull = LayeredPull::new(0, hashes.clone(), 2, seg, &budget, give_up).unwrap();
        let mut sink = pull.sink();
        for (i, h) in hashes.iter().enumerate() {
            let block = a.engine.cpu_tier().get(*h).unwrap();
            sink.destination(i, 0, seg)
                .unwrap()
                .copy_from_slice(&block[..seg]);
        }
        sink.segment_complete(0, hashes.len());
        sink.destination(0, 1, seg).unwrap();
        let report = LayerPullReport {
            outcome: PullOutcome::Failed {
                reason: PullReason::PeerClosed,
            },
            blocks: 0,
            segments: 1,
            segment_blocks: hashes.len(),
            bytes: (seg * hashes.len()) as u64,
            duration: Duration::from_millis(1),
        };
        let feedback = kvmesh_core::PullFeedback {
            outcome: kvmesh_core::PullFeedbackOutcome::Failed,
            reason: Some("peer_closed".into()),
            reached_tokens: 0,
            readable_tokens: 176,
            block_size: 16,
            elapsed_ms: 1.0,
            deadline_ms: 2000.0,
        };
        pull.end(report, feedback);

        let mut req = request(&prompt);
        req.layered_pull = Some(pull);
        let (out, cached) = run(&b, req).await;
        assert_eq!(
            out, expected,
            "a pull that died mid-layer costs a recompute, never the output"
        );
        assert_eq!(cached, 0, "nothing arrived on every layer");
        let m = b.engine.metrics();
        assert_eq!(m.p2p_layerwise_short.get(), 1, "counted");
        assert_eq!(m.external_prefix_cache_hits.get(), 0);
        for s in [a, b] {
            s.shutdown().await;
        }
    })
    .await
    .expect("test timed out");
}

/// POSTs a greedy completion of `prompt` (byte tokens as ids) to `s`: the body and the
/// `x-kvmesh-pull` header.
async fn complete_http(
    s: &RunningServer,
    prompt: &[TokenId],
    source: Option<u16>,
) -> (serde_json::Value, Option<String>) {
    let mut body = serde_json::json!({
        "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": true
    });
    if let Some(port) = source {
        body["kv_transfer_params"] = serde_json::json!({"remote_kv_source": {
            "kv_request_id": "r1", "remote_host": "127.0.0.1", "remote_port": port}});
    }
    let r = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", s.addr))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let header = r
        .headers()
        .get("x-kvmesh-pull")
        .map(|v| v.to_str().unwrap().to_owned());
    (r.json().await.unwrap(), header)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_naming_a_source_pulls_layer_wise_through_the_http_api() {
    timeout(Duration::from_secs(120), async {
        let (a, c) = (start().await, start().await);
        let b = start_with(P2pLoadMode::Layerwise).await;
        let (prefix, prompt) = prefix_and_prompt();
        complete_http(&a, &prefix, None).await;
        let port = a.p2p_addr.unwrap().port();
        let (got, header) = complete_http(&b, &prompt, Some(port)).await;
        let cached = &got["usage"]["prompt_tokens_details"]["cached_tokens"];
        assert_eq!(cached, 160, "{got}");
        let header = header.expect("the pull's outcome goes back to the router");
        assert!(
            header.contains("partial") && header.contains("miss"),
            "{header}"
        );
        let (cold, _) = complete_http(&c, &prompt, None).await;
        assert_eq!(got["choices"][0]["text"], cold["choices"][0]["text"]);
        let m = b.engine.metrics();
        assert_eq!(m.external_prefix_cache_hits.get(), 160);
        assert_eq!(m.p2p_layerwise_short.get(), 0);
        for s in [a, b, c] {
            s.shutdown().await;
        }
    })
    .await
    .expect("test timed out");
}
