//! P/D on loopback with in-process sim engines: a `--role prefill` engine answers the prefill leg
//! with NIXL-style params and keeps the blocks; a `--role decode` engine pulls the prompt KV from
//! it (computing only the tail); with `--bidirectional-kv-xfer` the decoder retains prompt +
//! generated blocks and the next turn's prefill leg reads them — or declines when expired, or
//! reads only the hash-matching prefix when the template dropped earlier text. Never an error.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

// P/D turns generate exactly the tokens asked for (EOS ignored).
use common::complete_ignore_eos as complete;
use common::{
    PROFILE, cached_tokens, merge, p2p_config, prefill_leg, scrape_metric, source, start_engine,
    tokens,
};
use kvmesh_core::BlockHash;
use kvmesh_engine::server::RunningServer;
use kvmesh_engine::{EngineConfig, Role};
use serde_json::{Value, json};
use tokio::time::timeout;

const BS: usize = 16;

fn cfg(role: Role, bidirectional: bool) -> EngineConfig {
    let mut cfg = p2p_config();
    cfg.p2p.role = role;
    cfg.p2p.bidirectional_kv_xfer = bidirectional;
    cfg
}

async fn start(cfg: EngineConfig) -> RunningServer {
    start_engine(cfg, PROFILE, 1000.0, 32).await
}

fn text_tokens(resp: &Value) -> Vec<u32> {
    resp["choices"][0]["text"]
        .as_str()
        .unwrap()
        .bytes()
        .map(u32::from)
        .collect()
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// Prefill params + the decoder pulling the prompt; same answer as an aggregated engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_leg_pulls_the_prompt_from_the_prefiller() {
    timeout(Duration::from_secs(30), async {
        let p = start(cfg(Role::Prefill, false)).await;
        let d = start(cfg(Role::Decode, false)).await;
        let agg = start(cfg(Role::Both, false)).await;
        let prompt = tokens(1, 1000);

        let pre = complete(p.addr, &prompt, 1, Some(prefill_leg())).await;
        let kvp = pre["kv_transfer_params"].clone();
        let pp = p.p2p_addr.unwrap();
        assert_eq!(kvp["do_remote_prefill"], json!(true), "{kvp}");
        assert_eq!(kvp["do_remote_decode"], json!(false));
        assert_eq!(kvp["remote_host"], json!(pp.ip().to_string()));
        assert_eq!(kvp["remote_port"], json!(pp.port()));
        assert_eq!(kvp["remote_num_tokens"], json!(1000));
        assert_eq!(kvp["tp_size"], json!(1));
        assert!(kvp["remote_request_id"].is_string());
        assert!(kvp["remote_engine_id"].is_string());
        let ids: Vec<BlockHash> = kvp["remote_block_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| BlockHash(v.as_u64().unwrap()))
            .collect();
        assert_eq!(ids.len(), 1000 / BS);
        assert_eq!(ids, p.engine.block_hashes(&prompt)[..1000 / BS].to_vec());
        let expiry = kvp["remote_blocks_expiry_time"].as_f64().unwrap();
        assert!(
            (expiry - unix_now() - 480.0).abs() < 5.0,
            "default TTL 480 s"
        );
        assert!(
            ids.iter().all(|h| p.engine.cpu_tier().pin_count(*h) >= 1),
            "the prefiller keeps the blocks pinned"
        );

        let got = complete(d.addr, &prompt, 40, Some(kvp)).await;
        let want = complete(agg.addr, &prompt, 40, None).await;
        assert_eq!(got["choices"][0]["text"], want["choices"][0]["text"]);
        // Everything but the block holding the last prompt token came from the prefiller.
        let pulled = 999 / BS * BS;
        assert_eq!(cached_tokens(&got), pulled as u64);
        assert_eq!(
            scrape_metric(d.addr, "vllm:external_prefix_cache_hits_total", "").await,
            pulled as f64
        );
        assert_eq!(
            scrape_metric(
                d.addr,
                "kvmesh_engine_pd_remote_reads_total",
                "outcome=\"pulled\""
            )
            .await,
            1.0
        );
        // Without bi-directional mode the decoder returns nothing.
        assert!(
            got["kv_transfer_params"].is_null(),
            "{}",
            got["kv_transfer_params"]
        );
        for s in [p, d, agg] {
            s.shutdown().await;
        }
    })
    .await
    .expect("test timed out");
}

/// P/D is layered on the P2P hook: a prefill leg whose router also named another engine's CPU
/// tier as `remote_kv_source` pulls the prefix from it first (P2P), computes only the rest, and
/// still keeps its prompt blocks for the decoder and returns the decoder's params (P/D).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_leg_naming_a_source_pulls_it_then_hands_off_to_the_decoder() {
    timeout(Duration::from_secs(30), async {
        let holder = start(cfg(Role::Both, false)).await;
        let p = start(cfg(Role::Prefill, false)).await;
        let d = start(cfg(Role::Decode, false)).await;
        let prefix = tokens(21, 640);
        complete(holder.addr, &prefix, 1, None).await;
        let mut prompt = prefix.clone();
        prompt.extend(tokens(22, 40));

        let mut leg = prefill_leg();
        leg["remote_kv_source"] =
            source(holder.p2p_addr.unwrap().port())["remote_kv_source"].clone();
        let pre = complete(p.addr, &prompt, 1, Some(leg)).await;
        assert_eq!(cached_tokens(&pre), 640, "the prefix came from the holder");
        assert_eq!(
            scrape_metric(p.addr, "vllm:external_prefix_cache_hits_total", "").await,
            640.0
        );
        let kvp = pre["kv_transfer_params"].clone();
        assert_eq!(kvp["do_remote_prefill"], json!(true), "{kvp}");
        assert_eq!(kvp["remote_num_tokens"], json!(680));
        let got = complete(d.addr, &prompt, 8, Some(kvp)).await;
        assert_eq!(cached_tokens(&got), (679 / BS * BS) as u64);
        for s in [holder, p, d] {
            s.shutdown().await;
        }
    })
    .await
    .expect("test timed out");
}

/// Runs one P/D turn; returns (prefill response, decode response).
async fn turn(
    p: &RunningServer,
    d: &RunningServer,
    prompt: &[u32],
    history: Option<&Value>,
    max_tokens: usize,
) -> (Value, Value) {
    let mut leg = prefill_leg();
    if let Some(h) = history {
        for k in [
            "remote_engine_id",
            "remote_block_ids",
            "remote_host",
            "remote_port",
            "remote_request_id",
            "remote_num_tokens",
            "remote_blocks_expiry_time",
            "tp_size",
        ] {
            if let Some(v) = h.get(k) {
                leg[k] = v.clone();
            }
        }
    }
    let pre = complete(p.addr, prompt, 1, Some(leg)).await;
    let dec = complete(
        d.addr,
        prompt,
        max_tokens,
        Some(pre["kv_transfer_params"].clone()),
    )
    .await;
    (pre, dec)
}

/// The decoder returns prompt + generated blocks; the next turn's prefill leg on a fresh
/// prefiller loads them all (its external hits = the whole previous conversation but the last
/// partial block); with the prefill side's bi-directional mode off it recomputes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bidirectional_history_is_read_by_the_next_prefill() {
    timeout(Duration::from_secs(30), async {
        let p1 = start(cfg(Role::Prefill, true)).await;
        let p2 = start(cfg(Role::Prefill, true)).await;
        let p_off = start(cfg(Role::Prefill, false)).await;
        let d = start(cfg(Role::Decode, true)).await;
        let agg = start(cfg(Role::Both, false)).await;
        let prompt1 = tokens(2, 1000);
        let (_, dec1) = turn(&p1, &d, &prompt1, None, 200).await;
        let hist = dec1["kv_transfer_params"].clone();
        let dp = d.p2p_addr.unwrap();
        assert_eq!(hist["do_remote_decode"], json!(true), "{hist}");
        assert_eq!(hist["remote_port"], json!(dp.port()));
        assert_eq!(hist["remote_num_tokens"], json!(1200));
        // Prompt and generated tokens: every full block the decoder computed (the last
        // generated token has no KV yet).
        let n_blocks = 1199 / BS;
        assert_eq!(hist["remote_block_ids"].as_array().unwrap().len(), n_blocks);
        let mut history_tokens = prompt1.clone();
        history_tokens.extend(text_tokens(&dec1));
        let ids: Vec<u64> = d.engine.block_hashes(&history_tokens)[..n_blocks]
            .iter()
            .map(|h| h.0)
            .collect();
        assert_eq!(
            hist["remote_block_ids"],
            json!(ids),
            "generated blocks are hashed"
        );
        assert!(
            ids.iter()
                .all(|&h| d.engine.cpu_tier().pin_count(BlockHash(h)) >= 1),
            "retained (pinned) in the decoder's CPU tier"
        );

        let mut prompt2 = history_tokens.clone();
        prompt2.extend(tokens(3, 300));
        // A fresh prefiller: everything the decoder holds is external.
        let pre2 = complete(p2.addr, &prompt2, 1, Some(merge(&hist))).await;
        assert_eq!(cached_tokens(&pre2), (n_blocks * BS) as u64);
        assert_eq!(
            scrape_metric(p2.addr, "vllm:external_prefix_cache_hits_total", "").await,
            (n_blocks * BS) as f64
        );
        assert_eq!(
            scrape_metric(
                p2.addr,
                "kvmesh_engine_pd_remote_reads_total",
                "leg=\"history\",outcome=\"pulled\""
            )
            .await,
            1.0
        );
        // The prefiller of turn 1 has the prompt locally: it reads only the generated part.
        let pre1 = complete(p1.addr, &prompt2, 1, Some(merge(&hist))).await;
        assert_eq!(cached_tokens(&pre1), (n_blocks * BS) as u64);
        assert_eq!(
            scrape_metric(p1.addr, "vllm:external_prefix_cache_hits_total", "").await,
            ((n_blocks - 1000 / BS) * BS) as f64
        );
        // Bi-directional off on the prefill engine: the history is ignored, recomputed.
        let off = complete(p_off.addr, &prompt2, 1, Some(merge(&hist))).await;
        assert_eq!(cached_tokens(&off), 0);
        assert_eq!(
            scrape_metric(
                p_off.addr,
                "kvmesh_engine_pd_remote_reads_total",
                "outcome=\"bidirectional_off\""
            )
            .await,
            1.0
        );
        let want = complete(agg.addr, &prompt2, 1, None).await;
        for got in [&pre1, &pre2, &off] {
            assert_eq!(got["choices"][0]["text"], want["choices"][0]["text"]);
        }
        for s in [p1, p2, p_off, d, agg] {
            s.shutdown().await;
        }
    })
    .await
    .expect("test timed out");
}

/// An expired history entry is declined ("Declining expired remote read"), counted in
/// `vllm:nixl_num_kv_expired_reqs`, and recomputed: same answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_history_is_declined_and_recomputed() {
    timeout(Duration::from_secs(30), async {
        let p = start(cfg(Role::Prefill, true)).await;
        let mut dcfg = cfg(Role::Decode, true);
        dcfg.p2p.decoder_kv_blocks_ttl = Duration::from_millis(300);
        let d = start(dcfg).await;
        let agg = start(cfg(Role::Both, false)).await;
        let prompt1 = tokens(4, 600);
        let (_, dec1) = turn(&p, &d, &prompt1, None, 200).await;
        let hist = dec1["kv_transfer_params"].clone();
        assert!(hist["remote_blocks_expiry_time"].as_f64().unwrap() < unix_now() + 1.0);
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut prompt2 = prompt1.clone();
        prompt2.extend(text_tokens(&dec1));
        prompt2.extend(tokens(5, 100));
        let got = complete(p.addr, &prompt2, 8, Some(merge(&hist))).await;
        assert_eq!(
            scrape_metric(p.addr, "vllm:nixl_num_kv_expired_reqs_total", "").await,
            1.0
        );
        assert_eq!(
            scrape_metric(p.addr, "vllm:external_prefix_cache_hits_total", "").await,
            0.0
        );
        // Only its own turn-1 prompt is local.
        assert_eq!(cached_tokens(&got), (600 / BS * BS) as u64);
        let want = complete(agg.addr, &prompt2, 8, None).await;
        assert_eq!(got["choices"][0]["text"], want["choices"][0]["text"]);
        for s in [p, d, agg] {
            s.shutdown().await;
        }
    })
    .await
    .expect("test timed out");
}

/// A reasoning-style template drops turn 1's generated text from turn 2's prompt: block hashes
/// differ from the first block after the old prompt, so only the matching prefix is usable (it
/// is local here), the rest is computed — correct output, no error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_generated_text_mismatches_and_recomputes() {
    timeout(Duration::from_secs(30), async {
        let p = start(cfg(Role::Prefill, true)).await;
        let fresh = start(cfg(Role::Prefill, true)).await;
        let d = start(cfg(Role::Decode, true)).await;
        let agg = start(cfg(Role::Both, false)).await;
        let prompt1 = tokens(6, 1000);
        let (_, dec1) = turn(&p, &d, &prompt1, None, 200).await;
        let hist = dec1["kv_transfer_params"].clone();
        let mut prompt2 = prompt1.clone();
        prompt2.extend(tokens(7, 300)); // no assistant text
        let got = complete(p.addr, &prompt2, 8, Some(merge(&hist))).await;
        assert_eq!(
            scrape_metric(
                p.addr,
                "kvmesh_engine_pd_remote_reads_total",
                "outcome=\"mismatch\""
            )
            .await,
            1.0
        );
        assert_eq!(
            scrape_metric(p.addr, "vllm:external_prefix_cache_hits_total", "").await,
            0.0
        );
        assert_eq!(cached_tokens(&got), (1000 / BS * BS) as u64);
        // A prefiller without the prompt reads the matching prefix only.
        let got_fresh = complete(fresh.addr, &prompt2, 8, Some(merge(&hist))).await;
        assert_eq!(cached_tokens(&got_fresh), (1000 / BS * BS) as u64);
        assert_eq!(
            scrape_metric(
                fresh.addr,
                "kvmesh_engine_pd_remote_reads_total",
                "outcome=\"mismatch_partial_read\""
            )
            .await,
            1.0
        );
        let want = complete(agg.addr, &prompt2, 8, None).await;
        assert_eq!(got["choices"][0]["text"], want["choices"][0]["text"]);
        assert_eq!(got_fresh["choices"][0]["text"], want["choices"][0]["text"]);
        for s in [p, fresh, d, agg] {
            s.shutdown().await;
        }
    })
    .await
    .expect("test timed out");
}

/// Fewer reusable tokens than `--kv-recompute-threshold` (64): no remote read, recomputed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_below_the_recompute_threshold_is_recomputed() {
    timeout(Duration::from_secs(30), async {
        let p = start(cfg(Role::Prefill, true)).await;
        let d = start(cfg(Role::Decode, true)).await;
        let prompt1 = tokens(8, 1000);
        // 20 generated tokens: the decoder holds one block (16 tokens) beyond the prompt the
        // prefiller already has.
        let (_, dec1) = turn(&p, &d, &prompt1, None, 20).await;
        let hist = dec1["kv_transfer_params"].clone();
        let mut prompt2 = prompt1.clone();
        prompt2.extend(text_tokens(&dec1));
        prompt2.extend(tokens(9, 100));
        let got = complete(p.addr, &prompt2, 4, Some(merge(&hist))).await;
        assert_eq!(
            scrape_metric(
                p.addr,
                "kvmesh_engine_pd_remote_reads_total",
                "outcome=\"below_threshold\""
            )
            .await,
            1.0
        );
        assert_eq!(
            scrape_metric(p.addr, "vllm:external_prefix_cache_hits_total", "").await,
            0.0
        );
        assert_eq!(cached_tokens(&got), (1000 / BS * BS) as u64);
        for s in [p, d] {
            s.shutdown().await;
        }
    })
    .await
    .expect("test timed out");
}
