//! P/D through the router with real in-process sim engines on loopback: a 4-turn conversation
//! (`conversation_id`) over 4 prefill engines (round-robin, so each turn lands on a prefiller
//! that never saw the conversation) and 1 decode engine. With bi-directional transfer the
//! prefiller of turn k ≥ 2 loads the whole previous conversation (prompt + generated, minus the
//! partial block) from the decoder and its TTFT drops; with it off, it recomputes. Also: the
//! decider, `/health`, the reasoning-style template (dropped assistant text) and expiry.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::engines::{PROFILE, SimEngine, engine_metric, sim_config, start_engine_with, stop};
use common::{doc, get_json, post_json, scrape_metric, start_router, wait_for_prefix};
use futures::StreamExt;
use kvmesh_engine::Role;
use kvmesh_router::RouterHandle;
use serde_json::{Value, json};

const LIMIT: Duration = Duration::from_secs(30);
const BS: usize = 16;
const USER_TOKENS: usize = 1500;
const GEN_TOKENS: usize = 200;
/// Slows the sim down 2× so turn-4 prefills model a few hundred ms.
const TIME_SCALE: f64 = 0.5;

async fn engine(
    name: &str,
    role: Role,
    bidirectional: bool,
    ttl: Duration,
    time_scale: f64,
) -> SimEngine {
    let mut config = sim_config(4096);
    config.block_size = BS;
    config.p2p.role = role;
    config.p2p.bidirectional_kv_xfer = bidirectional;
    config.p2p.decoder_kv_blocks_ttl = ttl;
    start_engine_with(name, config, time_scale).await
}

fn role_name(e: &SimEngine) -> &'static str {
    match e.server.engine.config().p2p.role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
        Role::Both => "both",
    }
}

fn yaml(engines: &[SimEngine], bidirectional: bool, decider: &str) -> String {
    let mut s = format!(
        "seed: 1\nmetrics_scrape_interval: 50ms\nplugins:\n  - {{type: round-robin-picker, name: rr}}\n  - {{type: prefix-cache-scorer, name: prefix}}\n\
         scheduling_profiles:\n  - {{name: prefill, plugins: [{{plugin_ref: rr}}]}}\n  - {{name: decode, plugins: [{{plugin_ref: prefix}}]}}\n\
         pd: {{prefill_profile: prefill, decode_profile: decode, decider: {decider}, bidirectional: {bidirectional}}}\nendpoints:\n"
    );
    for e in engines {
        s.push_str(&format!(
            "  - {{name: {}, role: {}, url: \"{}\", p2p: \"127.0.0.1:{}\", kv_events: {{endpoint: \"{}\", topic: kv-events}}}}\n",
            e.name, role_name(e), e.url, e.p2p_port, e.events
        ));
    }
    s
}

struct Turn {
    text: String,
    ttft: Duration,
    prefill_endpoint: Option<String>,
    decode_endpoint: String,
    final_params: Value,
}

/// One streamed request through the router; TTFT = first text chunk.
async fn stream_turn(r: &RouterHandle, prompt: &str, conversation: Option<&str>) -> Turn {
    let mut body = json!({"model": "sim", "prompt": prompt, "max_tokens": GEN_TOKENS, "stream": true,
                          "temperature": 0, "ignore_eos": true});
    if let Some(c) = conversation {
        body["conversation_id"] = json!(c);
    }
    let t0 = Instant::now();
    let resp = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", r.addr))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let header = |k: &str| {
        resp.headers()
            .get(k)
            .map(|v| v.to_str().unwrap().to_owned())
    };
    let prefill_endpoint = header("x-kvmesh-prefill-endpoint");
    let decode_endpoint = header("x-kvmesh-endpoint").unwrap();
    let mut stream = resp.bytes_stream();
    let mut buf = String::new();
    let mut text = String::new();
    let mut ttft = None;
    let mut final_params = Value::Null;
    while let Some(chunk) = stream.next().await {
        buf.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
        while let Some(nl) = buf.find('\n') {
            let line: String = buf.drain(..=nl).collect();
            let Some(data) = line.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(data).unwrap();
            assert!(v.get("error").is_none(), "{v}");
            if let Some(t) = v["choices"][0]["text"].as_str()
                && !t.is_empty()
            {
                ttft.get_or_insert_with(|| t0.elapsed());
                text.push_str(t);
            }
            if v.get("kv_transfer_params").is_some_and(|p| !p.is_null()) {
                final_params = v["kv_transfer_params"].clone();
            }
        }
    }
    Turn {
        text,
        ttft: ttft.unwrap(),
        prefill_endpoint,
        decode_endpoint,
        final_params,
    }
}

async fn router_metric(r: &RouterHandle, name: &str, labels: &str) -> f64 {
    scrape_metric(&format!("http://{}", r.addr), name, labels).await
}

/// After a 4-turn conversation: the router is healthy, counted 4 prefill and 4 decode legs, and
/// (bi-directional) cached the conversation and found it on turns 2–4.
async fn assert_router_counted_four_pd_turns(r: &RouterHandle, bidirectional: bool) {
    let health = get_json(&format!("http://{}/health", r.addr)).await;
    assert_eq!(health["status"], json!("ok"));
    assert_eq!(
        health["cached_conversations"],
        json!(if bidirectional { 1 } else { 0 }),
        "{health}"
    );
    assert_eq!(health["evicted_stale"], json!(0));
    assert_eq!(
        router_metric(
            r,
            "kvmesh_router_pd_legs_total",
            "leg=\"prefill\",outcome=\"ok\""
        )
        .await,
        4.0
    );
    assert_eq!(
        router_metric(
            r,
            "kvmesh_router_pd_legs_total",
            "leg=\"decode\",outcome=\"ok\""
        )
        .await,
        4.0
    );
    if bidirectional {
        assert_eq!(
            router_metric(r, "kvmesh_router_pd_conversations_total", "result=\"hit\"").await,
            3.0
        );
    }
}

/// Runs a 4-turn conversation; returns per turn (ttft, external hits on the turn's prefiller,
/// expected history tokens, modelled pull time of that history).
async fn conversation(
    bidirectional: bool,
    time_scale: f64,
) -> Vec<(Duration, f64, usize, Duration)> {
    let mut engines = Vec::new();
    for i in 0..4 {
        engines.push(
            engine(
                &format!("p{i}"),
                Role::Prefill,
                bidirectional,
                Duration::from_secs(480),
                time_scale,
            )
            .await,
        );
    }
    engines.push(
        engine(
            "d0",
            Role::Decode,
            bidirectional,
            Duration::from_secs(480),
            time_scale,
        )
        .await,
    );
    let r = start_router(&yaml(&engines, bidirectional, "always"), None).await;
    let mut history = String::new();
    let mut out = Vec::new();
    for k in 0..4u32 {
        let prompt = format!("{history}{}", doc(100 + k, USER_TOKENS));
        let before: Vec<f64> = futures::future::join_all(
            engines
                .iter()
                .map(|e| engine_metric(&e.url, "vllm:external_prefix_cache_hits_total")),
        )
        .await;
        let t = stream_turn(&r, &prompt, Some("conv-1")).await;
        assert_eq!(t.decode_endpoint, "d0");
        let pname = t.prefill_endpoint.clone().expect("a prefill leg ran");
        let pi = engines.iter().position(|e| e.name == pname).unwrap();
        let ext = engine_metric(&engines[pi].url, "vllm:external_prefix_cache_hits_total").await
            - before[pi];
        // The decoder pulled from the prefiller everything it did not hold.
        assert_eq!(t.text.len(), GEN_TOKENS);
        if bidirectional {
            assert_eq!(
                t.final_params["do_remote_decode"],
                json!(true),
                "{}",
                t.final_params
            );
        } else {
            assert!(t.final_params.is_null(), "{}", t.final_params);
        }
        // What the previous turns left on the decoder: prompt + generated, full blocks.
        let expected = if history.is_empty() {
            0
        } else {
            (history.len() - 1) / BS * BS
        };
        eprintln!(
            "bidirectional={bidirectional} turn {} prefill {pname}: ttft {:?}, external hits {ext} (history {} tokens, expected {expected})",
            k + 1,
            t.ttft,
            history.len()
        );
        let pull = engines[0]
            .server
            .engine
            .modelled_pull_time(expected)
            .unwrap_or_default();
        out.push((t.ttft, ext, expected, pull));
        history = format!("{prompt}{}", t.text);
    }
    assert_router_counted_four_pd_turns(&r, bidirectional).await;
    // The decoder computed only what it was not given: its external hits are the prompts'
    // new parts pulled from the prefillers.
    let d_ext = engine_metric(&engines[4].url, "vllm:external_prefix_cache_hits_total").await;
    assert!(
        d_ext >= (4 * (USER_TOKENS - BS)) as f64,
        "decoder external hits {d_ext}"
    );
    stop(r, engines).await;
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_turn_conversation_reads_history_from_the_decoder() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let on = conversation(true, TIME_SCALE).await;
        let off = conversation(false, TIME_SCALE).await;
        for k in 1..4 {
            let (_, ext_on, expected, _) = on[k];
            assert_eq!(
                ext_on,
                expected as f64,
                "turn {}: history loaded from the decoder",
                k + 1
            );
            assert_eq!(
                off[k].1,
                0.0,
                "turn {}: bidirectional off recomputes",
                k + 1
            );
        }
        // Turn 4 prefills 6.6K tokens of which 5.1K are history: the profile predicts the TTFT
        // drop = prefill(all) − (prefill(suffix after history) + modelled pull(history)).
        let profile = kvmesh_engine::compute::profiles::profile(PROFILE).unwrap();
        for k in 1..4 {
            let hist = on[k].2;
            let prompt = (USER_TOKENS + GEN_TOKENS) * k + USER_TOKENS;
            // Already divided by the time scale.
            let pull_ms = on[k].3.as_secs_f64() * 1000.0;
            let predicted = (profile.prefill_total_ms(prompt)
                - profile.prefill_chunk_ms(hist, prompt - hist))
                / TIME_SCALE
                - pull_ms;
            let measured = (off[k].0.as_secs_f64() - on[k].0.as_secs_f64()) * 1000.0;
            eprintln!(
                "turn {}: TTFT on {:?} off {:?}: measured drop {measured:.0} ms, profile predicts {predicted:.0} ms",
                k + 1,
                on[k].0,
                off[k].0
            );
            if k == 3 {
                assert!(
                    measured > 0.5 * predicted - 20.0 && measured < 1.5 * predicted + 60.0,
                    "turn 4 TTFT drop {measured:.0} ms vs predicted {predicted:.0} ms"
                );
            }
        }
    })
    .await
    .unwrap();
}

/// The reasoning-style template drops turn 1's answer from turn 2's prompt: the decoder's block
/// hashes differ after the old prompt, the prefiller reads only the matching prefix and computes
/// the rest — same answer as a cold aggregated run, no error.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dropped_answer_text_is_recomputed_without_error() {
    tokio::time::timeout(LIMIT, async {
        let ttl = Duration::from_secs(480);
        let mut engines = vec![
            engine("p0", Role::Prefill, true, ttl, 1000.0).await,
            engine("p1", Role::Prefill, true, ttl, 1000.0).await,
            engine("d0", Role::Decode, true, ttl, 1000.0).await,
        ];
        let r = start_router(&yaml(&engines, true, "always"), None).await;
        let q1 = doc(7, 1000);
        let t1 = stream_turn(&r, &q1, Some("c-r")).await;
        let prompt2 = format!("{q1}{}", doc(8, 500)); // no assistant text
        let t2 = stream_turn(&r, &prompt2, Some("c-r")).await;
        assert_eq!(t2.text.len(), GEN_TOKENS);
        let p2 = engines
            .iter()
            .find(|e| Some(&e.name) == t2.prefill_endpoint.as_ref())
            .unwrap();
        assert_ne!(t1.prefill_endpoint, t2.prefill_endpoint);
        let decisions = get_json(&format!("http://{}/debug/decisions?last=2", r.addr)).await;
        let outcomes: Vec<&str> = decisions
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["outcome"].as_str().unwrap())
            .collect();
        assert!(
            outcomes.contains(&"pd_prefill") && outcomes.contains(&"pd_decode"),
            "{decisions}"
        );
        let mismatches = engine_metric(&p2.url, "kvmesh_engine_pd_remote_reads_total").await;
        assert_eq!(mismatches, 1.0);
        // Only the matching prefix (turn 1's prompt, full blocks) came from the decoder.
        assert_eq!(
            engine_metric(&p2.url, "vllm:external_prefix_cache_hits_total").await,
            (1000 / BS * BS) as f64
        );
        // Same text as an aggregated engine computing it all.
        let agg = engine("agg", Role::Both, false, ttl, 1000.0).await;
        let want: Value = post_json(
            &format!("{}/v1/completions", agg.url),
            &json!({"model": "sim", "prompt": prompt2, "max_tokens": GEN_TOKENS, "temperature": 0, "ignore_eos": true}),
        )
        .await
        .json()
        .await
        .unwrap();
        assert_eq!(json!(t2.text), want["choices"][0]["text"]);
        engines.push(agg);
        stop(r, engines).await;
    })
    .await
    .unwrap();
}

/// Decoder blocks expire (short engine TTL): the next prefill leg declines the read, counts it,
/// recomputes, and answers correctly. Also: `min_uncached_tokens` sends a short request
/// decode-only, and the router's conversation entry is single use.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn expired_history_is_declined_and_short_requests_go_decode_only() {
    tokio::time::timeout(LIMIT, async {
        let engines = vec![
            engine("p0", Role::Prefill, true, Duration::from_secs(480), 1000.0).await,
            engine("d0", Role::Decode, true, Duration::from_millis(300), 1000.0).await,
        ];
        let r = start_router(&yaml(&engines, true, "{min_uncached_tokens: 256}"), None).await;
        let q1 = doc(9, 1000);
        let t1 = stream_turn(&r, &q1, Some("c-e")).await;
        assert!(t1.prefill_endpoint.is_some());
        tokio::time::sleep(Duration::from_millis(500)).await;
        let prompt2 = format!("{q1}{}{}", t1.text, doc(10, 600));
        let t2 = stream_turn(&r, &prompt2, Some("c-e")).await;
        assert_eq!(t2.text.len(), GEN_TOKENS);
        assert_eq!(
            engine_metric(&engines[0].url, "vllm:nixl_num_kv_expired_reqs_total").await,
            1.0
        );
        assert_eq!(
            engine_metric(&engines[0].url, "vllm:external_prefix_cache_hits_total").await,
            0.0
        );
        // A short new conversation: fewer than 256 uncached tokens → decode only.
        let t3 = stream_turn(&r, &doc(11, 100), Some("c-short")).await;
        assert!(t3.prefill_endpoint.is_none());
        assert_eq!(t3.decode_endpoint, "d0");
        // The decode engine retains decode-only requests too: the conversation is cached.
        assert_eq!(
            t3.final_params["do_remote_decode"],
            json!(true),
            "{}",
            t3.final_params
        );
        assert_eq!(
            router_metric(
                &r,
                "kvmesh_router_pd_legs_total",
                "leg=\"decode_only\",outcome=\"ok\""
            )
            .await,
            1.0
        );
        stop(r, engines).await;
    })
    .await
    .unwrap();
}

/// Without a conversation id the decoder's published CPU-tier history still helps: the prefill
/// profile's `p2p-source-producer` (over prefill + decode endpoints) names the decoder as
/// source for a prefiller that lacks the prefix (llm-d's path).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn p2p_source_producer_names_the_decoder_for_a_prefiller() {
    tokio::time::timeout(LIMIT, async {
        let ttl = Duration::from_secs(480);
        let engines = vec![
            engine("p0", Role::Prefill, false, ttl, 1000.0).await,
            engine("p1", Role::Prefill, false, ttl, 1000.0).await,
            engine("d0", Role::Decode, false, ttl, 1000.0).await,
        ];
        let cfg = yaml(&engines, false, "always").replace(
            "  - {type: prefix-cache-scorer, name: prefix}\n",
            "  - {type: prefix-cache-scorer, name: prefix}\n  - {type: p2p-source-producer, name: p2p}\n",
        ).replace(
            "{name: prefill, plugins: [{plugin_ref: rr}]}",
            "{name: prefill, plugins: [{plugin_ref: rr}, {plugin_ref: p2p}]}",
        );
        let r = start_router(&cfg, None).await;
        let q1 = doc(12, 1000);
        let t1 = stream_turn(&r, &q1, None).await;
        assert_eq!(t1.prefill_endpoint.as_deref(), Some("p0"));
        let prompt2 = format!("{q1}{}{}", t1.text, doc(13, 300));
        let held = (q1.len() + GEN_TOKENS - 1) / BS * BS;
        // Wait until the index shows the decoder's CPU tier holding the conversation.
        wait_for_prefix(&r, &prompt2, "d0", "cpu_tokens", held as u64).await;
        let t2 = stream_turn(&r, &prompt2, None).await;
        assert_eq!(t2.prefill_endpoint.as_deref(), Some("p1"));
        assert_eq!(t2.text.len(), GEN_TOKENS);
        assert_eq!(
            engine_metric(&engines[1].url, "vllm:external_prefix_cache_hits_total").await,
            held as f64,
            "p1 pulled the conversation from the decoder"
        );
        // The decision record names the source the prefiller was actually sent, and P/D legs
        // are counted like any placement.
        let decisions = get_json(&format!("http://{}/debug/decisions?last=2", r.addr)).await;
        let prefill = decisions
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["outcome"] == "pd_prefill")
            .unwrap_or_else(|| panic!("no prefill decision in {decisions}"));
        assert_eq!(prefill["p2p"]["source_endpoint"], "d0", "{prefill}");
        // The prefiller's report on that pull reached the source's reputation.
        assert_eq!(
            router_metric(&r, "kvmesh_router_p2p_source_served_total", "source=\"d0\"").await,
            1.0
        );
        let placed = |labels: &'static str| router_metric(&r, "kvmesh_router_decisions_total", labels);
        // t1: prefill cold, decode reads from the prefiller; t2: both legs read KV from a peer.
        assert_eq!(placed("outcome=\"pull_named\"").await, 3.0);
        assert_eq!(placed("outcome=\"cold\"").await, 1.0);
        assert_eq!(
            router_metric(
                &r,
                "kvmesh_router_requests_total",
                "profile=\"prefill\",endpoint=\"p1\""
            )
            .await,
            1.0
        );
        stop(r, engines).await;
    })
    .await
    .unwrap();
}

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A/B measurement for docs/benchmarks.md (`## P/D`): mean TTFT per turn of N sequential 4-turn
/// conversations through the router, bi-directional on vs off (4 round-robin prefillers, 1
/// decoder; each turn lands on a prefiller that never saw the conversation).
/// `KVMESH_PD_CONVS` (8), `KVMESH_PD_USER_TOKENS` (4000), `KVMESH_PD_TIME_SCALE` (1).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "measurement; run with --ignored --nocapture"]
async fn pd_multiturn_ttft_ab() {
    let convs = env_or("KVMESH_PD_CONVS", 8);
    let user = env_or("KVMESH_PD_USER_TOKENS", 4000);
    let scale: f64 = std::env::var("KVMESH_PD_TIME_SCALE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1.0);
    let ttl = Duration::from_secs(480);
    for bidirectional in [false, true] {
        let mut engines = Vec::new();
        for i in 0..4 {
            engines.push(engine(&format!("p{i}"), Role::Prefill, bidirectional, ttl, scale).await);
        }
        engines.push(engine("d0", Role::Decode, bidirectional, ttl, scale).await);
        let r = start_router(&yaml(&engines, bidirectional, "always"), None).await;
        let mut sums = [0.0f64; 4];
        for c in 0..convs {
            let mut history = String::new();
            for (k, sum) in sums.iter_mut().enumerate() {
                let prompt = format!("{history}{}", doc((1000 * c + k) as u32, user));
                let t = stream_turn(&r, &prompt, Some(&format!("bench-{c}"))).await;
                *sum += t.ttft.as_secs_f64() * 1000.0;
                history = format!("{prompt}{}", t.text);
            }
        }
        let ext: f64 = futures::future::join_all(
            engines[..4]
                .iter()
                .map(|e| engine_metric(&e.url, "vllm:external_prefix_cache_hits_total")),
        )
        .await
        .iter()
        .sum();
        let means: Vec<String> = sums
            .iter()
            .map(|s| format!("{:.0}", s / convs as f64))
            .collect();
        println!(
            "bidirectional={bidirectional}: mean TTFT ms per turn [{}], prefillers' external hits {ext}",
            means.join(", ")
        );
        stop(r, engines).await;
    }
}
