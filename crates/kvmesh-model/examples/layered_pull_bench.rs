//! Does a layer-pipelined pull hide the pull behind the suffix's compute? Two engines of a real
//! (random-weight) transformer with a heavy KV — by default 32 layers × 8 KV heads × 128 head
//! dim in bf16, 128 KiB per token like Llama-3.1-8B, with a small hidden size so the CPU can
//! compute it — on loopback. Engine A holds a prefix; engine B receives prefix + suffix and
//! either recomputes it, pulls the prefix whole then computes (`async`), or computes while the
//! prefix arrives layer by layer (`layerwise`). Also timed: the suffix alone (A, which holds the
//! prefix) and the pull alone (the `async` read). Target: layerwise TTFT ≤ 1.1 × max(pull alone,
//! suffix alone).
//!
//! Engine A's prefix is placed in its CPU tier directly (random bytes under the prompt's real
//! block hashes: a transfer's and an attention's cost do not depend on the values), so long
//! prefixes need no prefill on A; recomputing on B is timed up to `--recompute-up-to` tokens
//! (it grows with the square of the prefix). Output equality of the three ways is held by
//! `tests/p2p_model.rs`, not here.
//!
//! ```text
//! RAYON_NUM_THREADS=1 cargo run --release -p kvmesh-model --example layered_pull_bench -- \
//!     --sizes 1024,2048,4096,8192,16384 --suffix 32 --runs 3
//! ```
//!
//! `RAYON_NUM_THREADS=1` keeps the model's compute on one core, as a GPU would leave the CPU
//! to the transfer; on a 2-core machine the pull (producer and consumer in this one process)
//! gets the other.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_core::{KvTransferParams, TokenId};
use kvmesh_engine::server::{RunningServer, ServerOptions, start_server};
use kvmesh_engine::{EngineConfig, EngineRequest, OffloadBlock, SeqOutput};
use kvmesh_model::{KvDtype, LlamaConfig, LoadOptions, RopeStyle, random_llama_backend};
use kvmesh_text::ByteTokenizer;

struct Args {
    sizes: Vec<usize>,
    suffix: usize,
    runs: usize,
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
    recompute_up_to: usize,
}

fn args() -> Args {
    let mut a = Args {
        sizes: vec![1024, 2048, 4096],
        suffix: 32,
        runs: 3,
        layers: 32,
        kv_heads: 8,
        head_dim: 128,
        recompute_up_to: 4096,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_default();
        let num = |v: &str| -> usize {
            v.parse()
                .unwrap_or_else(|_| panic!("{flag} needs a number, got {v:?}"))
        };
        match flag.as_str() {
            "--sizes" => a.sizes = value.split(',').map(num).collect(),
            "--suffix" => a.suffix = num(&value),
            "--runs" => a.runs = num(&value),
            "--layers" => a.layers = num(&value),
            "--kv-heads" => a.kv_heads = num(&value),
            "--head-dim" => a.head_dim = num(&value),
            "--recompute-up-to" => a.recompute_up_to = num(&value),
            other => panic!(
                "unknown flag {other}; flags: --sizes --suffix --runs --layers --kv-heads --head-dim --recompute-up-to"
            ),
        }
    }
    a
}

const BLOCK: usize = 16;

async fn engine(a: &Args, max_tokens: usize) -> RunningServer {
    let cfg = LlamaConfig {
        vocab_size: ByteTokenizer::VOCAB_SIZE,
        hidden_size: 256,
        intermediate_size: 512,
        num_layers: a.layers,
        num_heads: a.kv_heads,
        num_kv_heads: a.kv_heads,
        head_dim: a.head_dim,
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-5,
        max_position: max_tokens + 64,
        rope_style: RopeStyle::Half,
    };
    let opts = LoadOptions {
        block_size: BLOCK,
        kv_dtype: KvDtype::Bf16,
        model_id: Some("heavy-kv-bench".into()),
        tokenizer: None,
    };
    let backend = random_llama_backend(cfg, 11, &opts).expect("model shapes");
    let bytes_per_token = (backend.geometry().bytes_per_block() / BLOCK) as u64;
    let mut cfg = EngineConfig {
        port: 0,
        served_model_name: "heavy".into(),
        num_gpu_blocks: max_tokens / BLOCK + 64,
        cpu_offload_bytes: (max_tokens as u64 + 1024) * bytes_per_token * 5 / 4,
        max_model_len: max_tokens + 64,
        max_num_batched_tokens: max_tokens + 64,
        hash_seed: Some("0".into()),
        ..EngineConfig::default()
    };
    cfg.p2p.port = Some(0);
    cfg.p2p.allowed_peers = vec!["127.0.0.1".into()];
    start_server(
        cfg,
        Box::new(backend),
        Arc::new(ByteTokenizer),
        ServerOptions::default(),
    )
    .await
    .expect("engine starts")
}

fn request(prompt: Vec<TokenId>) -> EngineRequest {
    EngineRequest::greedy("bench", prompt, 1)
}

/// Submits `req` and waits for its first token: (time from `t0`, cached tokens).
async fn first_token(s: &RunningServer, req: EngineRequest, t0: Instant) -> (Duration, usize) {
    let mut stream = s.engine.submit(req).expect("submitted");
    let mut ttft = None;
    loop {
        match stream.recv().await.expect("engine alive") {
            SeqOutput::Token(_) if ttft.is_none() => ttft = Some(t0.elapsed()),
            SeqOutput::Finished(f) => return (ttft.unwrap_or_default(), f.cached_tokens),
            SeqOutput::Error(e) => panic!("{e}"),
            _ => {}
        }
    }
}

/// Random tokens from a seed (a new prefix per run, so nothing is cached by accident).
fn tokens(seed: u64, n: usize) -> Vec<TokenId> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 256) as TokenId
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Puts `prefix`'s full blocks in `s`'s CPU tier under their real hashes, with random bytes.
fn seed_tier(s: &RunningServer, prefix: &[TokenId]) {
    let hashes = s.engine.block_hashes(prefix);
    let bytes = s.engine.kv_layout().bytes_per_block;
    let payload = bytes::Bytes::from(
        tokens(7, bytes)
            .iter()
            .map(|&t| t as u8)
            .collect::<Vec<_>>(),
    );
    let blocks: Vec<OffloadBlock> = hashes
        .iter()
        .enumerate()
        .map(|(i, &hash)| OffloadBlock {
            hash,
            parent: i.checked_sub(1).map(|p| hashes[p]),
            tokens: prefix[i * BLOCK..(i + 1) * BLOCK].to_vec(),
            payload: payload.clone(),
            cache_salt: None,
        })
        .collect();
    let stored = s.engine.cpu_tier().insert_run(&blocks);
    assert_eq!(stored, blocks.len(), "A's tier holds the whole prefix");
}

#[derive(Default)]
struct Row {
    recompute: Vec<f64>,
    suffix_alone: Vec<f64>,
    pull_alone: Vec<f64>,
    pull_gbps: Vec<f64>,
    async_ttft: Vec<f64>,
    layered_pull_alone: Vec<f64>,
    layerwise: Vec<f64>,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let a = args();
    let max_tokens = a.sizes.iter().max().copied().unwrap_or(1024) + a.suffix;
    let (pa, pb) = (engine(&a, max_tokens).await, engine(&a, max_tokens).await);
    let kv = pb.engine.kv_layout();
    let per_token = kv.bytes_per_block / BLOCK;
    println!(
        "model: {} layers x {} KV heads x {} head dim, bf16 = {} KiB of KV per token; suffix {} tokens; {} runs (medians)",
        a.layers,
        a.kv_heads,
        a.head_dim,
        per_token / 1024,
        a.suffix,
        a.runs
    );
    let port = pa.p2p_addr.expect("A serves P2P").port();
    println!(
        "{:>7} | {:>10} {:>10} {:>10} {:>7} {:>10} | {:>10} {:>10} | {:>8} {:>9}",
        "prefix",
        "recompute",
        "suffix",
        "pull",
        "GB/s",
        "lw pull",
        "async",
        "layerwise",
        "lw/async",
        "lw/bound"
    );
    for &size in &a.sizes {
        let mut row = Row::default();
        for run in 0..a.runs {
            let prefix = tokens((size * 1000 + run) as u64, size);
            let with = |suffix_seed: u64| {
                let mut p = prefix.clone();
                p.extend(tokens(suffix_seed, a.suffix));
                p
            };
            // A holds the prefix in its CPU tier (what its producer serves); a first request
            // brings it into A's GPU tier.
            seed_tier(&pa, &prefix);
            first_token(&pa, request(with(1)), Instant::now()).await;
            // The suffix alone: A holds the prefix.
            let (t, cached) = first_token(&pa, request(with(2)), Instant::now()).await;
            assert!(cached >= size - BLOCK, "A hit its own prefix ({cached})");
            row.suffix_alone.push(t.as_secs_f64());
            let prompt = with(3);
            let kvp = KvTransferParams::pull_from("bench", "127.0.0.1", port);
            let src = kvp.remote_kv_source.clone().expect("source");

            if size <= a.recompute_up_to {
                pb.engine.reset_prefix_cache().await;
                let (t, cached) = first_token(&pb, request(prompt.clone()), Instant::now()).await;
                assert_eq!(cached, 0);
                row.recompute.push(t.as_secs_f64());
            }

            pb.engine.reset_prefix_cache().await;
            let mut req = request(prompt.clone());
            req.kv_transfer_params = Some(kvp.clone());
            let t0 = Instant::now();
            let pull = pb
                .p2p
                .prepare_request(&pb.engine, &mut req, &src, None)
                .await
                .expect("a pull");
            let pulled = t0.elapsed();
            let (t, cached) = first_token(&pb, req, t0).await;
            assert!(cached >= size - BLOCK, "async pulled the prefix ({cached})");
            row.pull_alone.push(pulled.as_secs_f64());
            row.pull_gbps
                .push(pull.report.bytes as f64 / pulled.as_secs_f64() / 1e9);
            row.async_ttft.push(t.as_secs_f64());

            // The layer-major pull alone (its frames are one layer of one block each).
            pb.engine.reset_prefix_cache().await;
            let mut req = request(prompt.clone());
            let t0 = Instant::now();
            assert!(
                pb.p2p
                    .start_layered_read(&pb.engine, &mut req, &src, None)
                    .await
            );
            let pull = req.layered_pull.take().expect("a layer-wise pull");
            pull.feedback().await.expect("the pull ends");
            row.layered_pull_alone.push(t0.elapsed().as_secs_f64());
            pull.release();

            pb.engine.reset_prefix_cache().await;
            let mut req = request(prompt.clone());
            req.kv_transfer_params = Some(kvp.clone());
            let t0 = Instant::now();
            let started = pb
                .p2p
                .start_layered_read(&pb.engine, &mut req, &src, None)
                .await;
            let m = pb.engine.metrics();
            assert!(
                started,
                "layer-wise read did not start: no staging {}, cpu tier {:?}",
                m.p2p_layerwise_no_staging.get(),
                pb.engine.cpu_tier().stats()
            );
            let submitted = t0.elapsed();
            let lw = req.layered_pull.clone().expect("a layer-wise pull");
            let (t, cached) = first_token(&pb, req, t0).await;
            let fb = lw.feedback().await.expect("the pull ended");
            eprintln!(
                "  layerwise {size}: submitted after {:.0} ms, pull ended after {:.0} ms, first token {:.0} ms",
                submitted.as_secs_f64() * 1e3,
                fb.elapsed_ms,
                t.as_secs_f64() * 1e3
            );
            assert!(
                cached >= size - BLOCK,
                "layer-wise pulled the prefix ({cached})"
            );
            row.layerwise.push(t.as_secs_f64());
        }
        let ms = |v: &Vec<f64>| median(v.clone()) * 1000.0;
        let recompute = if row.recompute.is_empty() {
            "-".to_owned()
        } else {
            format!("{:.0}ms", ms(&row.recompute))
        };
        let bound = ms(&row.layered_pull_alone).max(ms(&row.suffix_alone));
        println!(
            "{:>7} | {:>10} {:>8.0}ms {:>8.0}ms {:>7.2} {:>8.0}ms | {:>8.0}ms {:>8.0}ms | {:>8.2} {:>9.2}",
            size,
            recompute,
            ms(&row.suffix_alone),
            ms(&row.pull_alone),
            median(row.pull_gbps.clone()),
            ms(&row.layered_pull_alone),
            ms(&row.async_ttft),
            ms(&row.layerwise),
            ms(&row.layerwise) / ms(&row.async_ttft),
            ms(&row.layerwise) / bound,
        );
    }
    let m = pb.engine.metrics();
    println!(
        "B: layer-wise pulls that ended short: {}, unused: {}, without staging room: {}",
        m.p2p_layerwise_short.get(),
        m.p2p_layerwise_unused.get(),
        m.p2p_layerwise_no_staging.get()
    );
    pa.shutdown().await;
    pb.shutdown().await;
}
