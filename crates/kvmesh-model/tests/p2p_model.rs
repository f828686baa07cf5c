//! Real KV over P2P: engine B pulls a prompt prefix's KV (real tensors from the tiny random
//! Llama) from engine A's CPU tier and then generates exactly the greedy tokens a full recompute
//! generates — pulled KV is bit-identical to recomputed KV, so the output cannot differ.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_core::{KvTransferParams, TokenId};
use kvmesh_engine::compute::SamplingParams;
use kvmesh_engine::server::{RunningServer, ServerOptions, start_server};
use kvmesh_engine::{EngineConfig, EngineRequest, SeqOutput};
use kvmesh_model::tiny_random_llama;
use kvmesh_text::ByteTokenizer;
use tokio::time::timeout;

async fn start() -> RunningServer {
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
        arrival: Instant::now(),
        external_hashes: Vec::new(),
        pull_pinned_hashes: Vec::new(),
        external_query_tokens: 0,
        pull_feedback: None,
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
