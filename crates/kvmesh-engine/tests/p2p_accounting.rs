//! Pull bookkeeping on loopback with in-process sim engines: a P/D prefiller whose CPU tier is
//! full of blocks retained for decoders still lands a history read (retentions give way, the
//! pull is never refused for our own bookkeeping), and pulled tokens count as external hits
//! exactly once however many requests use them.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::complete_ignore_eos as complete;
use common::{
    PROFILE, cached_tokens, merge, p2p_config, prefill_leg, scrape_metric, source, start_engine,
    tokens,
};
use kvmesh_engine::server::RunningServer;
use kvmesh_engine::{EngineConfig, Role};
use tokio::time::timeout;

const BS: usize = 16;
/// KV bytes per token of these engines: 512-byte blocks.
const KV_BYTES: usize = 32;

fn cfg(role: Role, cpu_blocks: usize) -> EngineConfig {
    let mut cfg = p2p_config();
    cfg.p2p.role = role;
    cfg.p2p.bidirectional_kv_xfer = true;
    // Read even a few blocks of history (the default threshold would skip 48 tokens).
    cfg.p2p.kv_recompute_threshold = 0;
    cfg.cpu_offload_bytes = (cpu_blocks * BS * KV_BYTES) as u64;
    cfg
}

async fn start(cfg: EngineConfig) -> RunningServer {
    start_engine(cfg, PROFILE, 1000.0, KV_BYTES).await
}

/// The agentic P/D failure at small scale: the prefiller keeps every prompt for its decoder
/// (480 s), so its 64-block CPU tier fills with retained blocks; the next turn's history read
/// (the decoder's generated blocks) must still land — before, every such pull ended
/// `kvmesh_p2p_pulls_total{outcome="failed",reason="sink_rejected"}`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_history_read_lands_on_a_prefiller_full_of_retained_prompts() {
    timeout(Duration::from_secs(60), async {
        let p = start(cfg(Role::Prefill, 64)).await;
        let d = start(cfg(Role::Decode, 4096)).await;
        // Turn 1: 320 prompt tokens (20 blocks) prefilled on P, pulled and decoded on D.
        let prompt1 = tokens(7, 320);
        let pre = complete(p.addr, &prompt1, 1, Some(prefill_leg())).await;
        let dec = complete(
            d.addr,
            &prompt1,
            64,
            Some(pre["kv_transfer_params"].clone()),
        )
        .await;
        let hist = dec["kv_transfer_params"].clone();
        assert_eq!(hist["do_remote_decode"], serde_json::json!(true), "{hist}");
        // Other conversations' short prefill legs (their decoders never come): more retained
        // blocks than the tier holds, down to its last free slot.
        for seed in 100..140 {
            complete(p.addr, &tokens(seed, 64), 1, Some(prefill_leg())).await;
        }
        let retained = scrape_metric(p.addr, "kvmesh_engine_pd_retained_blocks_total", "").await;
        assert!(
            retained >= 60.0,
            "the tier is full of retentions ({retained})"
        );
        // Turn 2: history (prompt + 64 generated) + 300 new tokens. P has the prompt in its GPU
        // tier; it reads the decoder's generated blocks.
        let mut prompt2 = prompt1.clone();
        prompt2.extend(
            dec["choices"][0]["text"]
                .as_str()
                .unwrap()
                .bytes()
                .map(u32::from),
        );
        prompt2.extend(tokens(8, 300));
        let pre2 = complete(p.addr, &prompt2, 1, Some(merge(&hist))).await;
        let failed = scrape_metric(p.addr, "kvmesh_p2p_pulls_total", "outcome=\"failed\"").await;
        assert_eq!(failed, 0.0, "no pull failed on the prefiller");
        let history_blocks = (320 + 64 - 1) / BS;
        assert_eq!(cached_tokens(&pre2), (history_blocks * BS) as u64);
        assert_eq!(
            scrape_metric(p.addr, "kvmesh_engine_p2p_sink_rejected_total", "").await,
            0.0
        );
        assert_eq!(
            scrape_metric(
                p.addr,
                "kvmesh_engine_pd_remote_reads_total",
                "leg=\"history\",outcome=\"pulled\""
            )
            .await,
            1.0
        );
        assert_eq!(
            scrape_metric(p.addr, "vllm:external_prefix_cache_hits_total", "").await,
            ((history_blocks - 320 / BS) * BS) as f64
        );
        // Evidence of the mechanism: old retentions gave way.
        assert!(scrape_metric(p.addr, "kvmesh_engine_cpu_retained_evicted_blocks", "").await > 0.0);
        p.shutdown().await;
        d.shutdown().await;
    })
    .await
    .expect("bounded");
}

/// Several requests for one prefix arrive together on B: one pulls it from A, the others wait
/// for that pull (or find it local). Whatever the order they are scheduled in, the tokens that
/// crossed the wire are external hits once; every other use is a local hit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pulled_tokens_are_external_hits_exactly_once() {
    timeout(Duration::from_secs(60), async {
        let a = start(cfg(Role::Both, 4096)).await;
        let b = start(cfg(Role::Both, 4096)).await;
        let prompt = tokens(11, 1000);
        complete(a.addr, &prompt, 1, None).await;
        let src = source(a.p2p_addr.unwrap().port());
        let answers = futures::future::join_all((0..4).map(|_| {
            let src = src.clone();
            let prompt = prompt.clone();
            async move { complete(b.addr, &prompt, 1, Some(src)).await }
        }))
        .await;
        let cached: u64 = answers.iter().map(cached_tokens).sum();
        let blocks_in = scrape_metric(b.addr, "kvmesh_p2p_blocks_total", "direction=\"in\"").await;
        assert!(blocks_in > 0.0, "B pulled the prefix");
        let external = scrape_metric(b.addr, "vllm:external_prefix_cache_hits_total", "").await;
        let local = scrape_metric(b.addr, "vllm:prefix_cache_hits_total", "").await;
        assert_eq!(
            external,
            blocks_in * BS as f64,
            "each pulled token counted once"
        );
        assert_eq!(external + local, cached as f64);
        a.shutdown().await;
        b.shutdown().await;
    })
    .await
    .expect("bounded");
}
