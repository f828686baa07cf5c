//! KV groups (`kv_group` on an endpoint): the router never names a pull source whose blocks the
//! computing endpoint cannot use. Three sim engines: e0 holds a prefix, e1 shares its group, e2
//! is in another group (standing in for a vLLM server beside kvmesh engines). Requests placed on
//! e2 are never told to pull (from e0 or from e1 once it has pulled); e2 receives no P2P blocks.
//! P/D: the decode leg reading a prefiller's hand-off is placed in the prefiller's group, and a
//! prefiller whose group has no decoder is not used.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::engines::{
    SimEngine, engine_metric, sim_config, start_engine, start_engine_with, stop,
};
use common::{
    LOAD_P2P_PROFILE, doc, get_json, post_json, scrape_metric, start_router, wait_for_prefix,
};
use kvmesh_engine::Role;
use serde_json::{Value, json};

const LIMIT: Duration = Duration::from_secs(90);

fn yaml(engines: &[(&SimEngine, &str)]) -> String {
    let mut s = format!("{LOAD_P2P_PROFILE}endpoints:\n");
    for (e, group) in engines {
        s.push_str(&format!(
            "  - {{name: {}, url: \"{}\", p2p: \"127.0.0.1:{}\", kv_group: {group}, kv_events: {{endpoint: \"{}\", topic: kv-events}}}}\n",
            e.name, e.url, e.p2p_port, e.events
        ));
    }
    s
}

/// Checks one `/debug/decisions` entry: a request on the other group's engine names no source;
/// one on the holder's group names, if anything, a source of that group.
fn check(d: &Value) -> &str {
    let group_of = |name: &str| if name == "e2" { "vllm" } else { "kvmesh" };
    let ep = d["endpoint"].as_str().unwrap();
    if let Some(src) = d["p2p"]["source_endpoint"].as_str()
        && d["p2p"]["skipped"].is_null()
    {
        assert_eq!(group_of(src), group_of(ep), "pull named across groups: {d}");
    }
    if ep == "e2" {
        assert_eq!(d["p2p"]["skipped"], "no_source", "{d}");
        assert_ne!(d["outcome"], "pull_named", "{d}");
        assert!(
            d["p2p"]["why"].as_str().unwrap().contains("other groups"),
            "{d}"
        );
    }
    // The report shows each candidate's group.
    for c in d["candidates"].as_array().unwrap() {
        let name = c["endpoint"].as_str().unwrap();
        assert_eq!(c["kv_group"], group_of(name), "{d}");
    }
    ep
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_pull_is_named_across_kv_groups() {
    tokio::time::timeout(LIMIT, async {
        let engines = vec![
            start_engine("e0", 1.0, 2048).await,
            start_engine("e1", 1.0, 2048).await,
            start_engine("e2", 1.0, 2048).await,
        ];
        let r = start_router(
            &yaml(&[
                (&engines[0], "kvmesh"),
                (&engines[1], "kvmesh"),
                (&engines[2], "vllm"),
            ]),
            None,
        )
        .await;
        let prefix = doc(42, 4096);
        // Seed directly on e0 (bypassing the router), as a previous turn would have.
        let seeded = post_json(
            &format!("{}/v1/completions", engines[0].url),
            &json!({"prompt": prefix, "max_tokens": 1}),
        )
        .await;
        assert_eq!(seeded.status(), 200);
        wait_for_prefix(&r, &prefix, "e0", "cpu_tokens", 4096).await;
        // A burst spreads over the fleet (queue + weighted random); then single requests until
        // both e1 and e2 have been placed on (bounded).
        let url = format!("http://{}/v1/completions", r.addr);
        let burst = (0..12).map(|i| {
            let url = url.clone();
            let prompt = format!("{prefix} child {i}");
            async move {
                let resp = post_json(&url, &json!({"prompt": prompt, "max_tokens": 4})).await;
                assert_eq!(resp.status(), 200);
            }
        });
        futures::future::join_all(burst).await;
        let mut sent = 12;
        let (on_e1, on_e2) = loop {
            let decisions =
                get_json(&format!("http://{}/debug/decisions?last={sent}", r.addr)).await;
            let decisions = decisions.as_array().unwrap();
            assert_eq!(decisions.len(), sent);
            let placed: Vec<&str> = decisions.iter().map(check).collect();
            let on = |e: &str| placed.iter().filter(|p| **p == e).count();
            let (on_e1, on_e2) = (on("e1"), on("e2"));
            if (on_e1 > 0 && on_e2 > 0) || sent >= 60 {
                break (on_e1, on_e2);
            }
            let resp = post_json(
                &url,
                &json!({"prompt": format!("{prefix} more {sent}"), "max_tokens": 4}),
            )
            .await;
            assert_eq!(resp.status(), 200);
            sent += 1;
        };
        assert!(
            on_e2 > 0,
            "no request landed on the other group's engine in {sent}"
        );
        // The other group's engine never received a block, and no pull failed anywhere: the
        // router asked no one for blocks it could not use.
        assert_eq!(
            scrape_metric(
                &engines[2].url,
                "kvmesh_p2p_blocks_total",
                "direction=\"in\""
            )
            .await,
            0.0
        );
        assert_eq!(
            engine_metric(&engines[2].url, "vllm:external_prefix_cache_hits_total").await,
            0.0
        );
        // Within the holder's group P2P still works: e1 was told to pull from e0 (or from itself
        // once it held the prefix).
        if on_e1 > 0 {
            let decisions =
                get_json(&format!("http://{}/debug/decisions?last={sent}", r.addr)).await;
            let named = decisions
                .as_array()
                .unwrap()
                .iter()
                .filter(|d| d["endpoint"] == "e1" && d["outcome"] == "pull_named")
                .count();
            assert!(named > 0, "{decisions}");
        }
        stop(r, engines).await;
    })
    .await
    .unwrap();
}

/// P/D over two groups: p0/d0 in `a`, p1/d1 in `b`, p2 in `c` with no decoder. The prefill profile
/// round-robins; the decode leg is always in the prefiller's group, and p2 never prefills.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pd_hand_offs_stay_inside_a_kv_group() {
    tokio::time::timeout(LIMIT, async {
        let spec = [
            ("p0", Role::Prefill, "a"),
            ("p1", Role::Prefill, "b"),
            ("p2", Role::Prefill, "c"),
            ("d0", Role::Decode, "a"),
            ("d1", Role::Decode, "b"),
        ];
        let mut engines = Vec::new();
        for (name, role, _) in spec {
            let mut config = sim_config(2048);
            config.p2p.role = role;
            engines.push(start_engine_with(name, config, 1000.0).await);
        }
        let mut cfg = String::from(
            "seed: 1\nplugins:\n  - {type: round-robin-picker, name: rr}\n  - {type: prefix-cache-scorer, name: prefix}\n\
             scheduling_profiles:\n  - {name: prefill, plugins: [{plugin_ref: rr}]}\n  - {name: decode, plugins: [{plugin_ref: prefix}]}\n\
             pd: {prefill_profile: prefill, decode_profile: decode, decider: always}\nendpoints:\n",
        );
        for (e, (_, role, group)) in engines.iter().zip(spec) {
            let role = if role == Role::Prefill { "prefill" } else { "decode" };
            cfg.push_str(&format!(
                "  - {{name: {}, role: {role}, kv_group: {group}, url: \"{}\", p2p: \"127.0.0.1:{}\", kv_events: {{endpoint: \"{}\", topic: kv-events}}}}\n",
                e.name, e.url, e.p2p_port, e.events
            ));
        }
        let r = start_router(&cfg, None).await;
        let group_of = |name: &str| spec.iter().find(|s| s.0 == name).map(|s| s.2).unwrap();
        let mut prefilled = Vec::new();
        for i in 0..8 {
            let resp = post_json(
                &format!("http://{}/v1/completions", r.addr),
                &json!({"prompt": doc(100 + i, 600), "max_tokens": 4}),
            )
            .await;
            assert_eq!(resp.status(), 200);
            let header = |k: &str| resp.headers()[k].to_str().unwrap().to_owned();
            let (p, d) = (header("x-kvmesh-prefill-endpoint"), header("x-kvmesh-endpoint"));
            assert_eq!(group_of(&p), group_of(&d), "request {i}: prefill {p}, decode {d}");
            prefilled.push(p);
        }
        assert!(!prefilled.iter().any(|p| p == "p2"), "{prefilled:?}");
        for p in ["p0", "p1"] {
            assert!(prefilled.iter().any(|x| x == p), "{prefilled:?}");
        }
        stop(r, engines).await;
    })
    .await
    .unwrap();
}
