//! Tenants and LoRA adapters in the router's keys (issue 36): blocks an engine stored for one
//! `cache_salt` or adapter are scored, explained and pulled only for requests of that salt and
//! adapter, as vLLM's own hashes keep them apart. A real index is fed the engines' `BlockStored`
//! events (salt in block 0's extra keys, adapter in `lora_name`, as vLLM publishes them); fake
//! engines record what the router sends them.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::engines::{SimEngine, engines_yaml, start_engine, stop};
use common::{FakeEngine, client, doc, endpoints_yaml, post_json, start_router};
use kvmesh_core::{BlockHash, BlockStored, KvEvent, Medium};
use kvmesh_index::{EndpointId, IndexConfig, PrefixIndex};
use kvmesh_router::RouterHandle;
use serde_json::{Value, json};

const LIMIT: Duration = Duration::from_secs(30);
const BS: usize = 16;

/// Round robin (so every request also lands on the engine without the blocks) plus P2P sources
/// from a 64-token lead, and one LoRA adapter.
const CONFIG: &str = r#"
seed: 7
block_size: 16
plugins:
  - {type: queue-scorer, name: queue}
  - {type: round-robin-picker, name: rr}
  - {type: p2p-source-producer, name: p2p, parameters: {min_cached_token_delta: 64}}
scheduling_profiles:
  - name: load-p2p
    plugins: [{plugin_ref: queue, weight: 1}, {plugin_ref: rr}, {plugin_ref: p2p}]
lora_adapters:
  - {name: sql-lora, path: /models/adapters/sql-lora}
"#;

fn prompt() -> Vec<u32> {
    (0..320u32).map(|i| 1000 + i * 7 % 997).collect()
}

/// Endpoint `ep` stored all of `prompt()` in its GPU and CPU tiers (P2P serves from the CPU
/// tier), for `salt` and adapter `lora`.
fn store(index: &PrefixIndex, ep: u32, salt: Option<&str>, lora: Option<&str>) {
    let tokens = prompt();
    let base = (u64::from(ep) << 32) | (u64::from(salt.is_some()) << 16);
    let hashes: Vec<BlockHash> = (0..(tokens.len() / BS) as u64)
        .map(|i| BlockHash(base + i))
        .collect();
    for medium in [Medium::Gpu, Medium::Cpu] {
        let mut ev = BlockStored::run(medium, None, BS as u32, hashes.clone(), tokens.clone())
            .in_full_attention_group()
            .with_cache_salt(salt);
        if let Some(name) = lora {
            ev.lora_id = Some(1);
            ev.lora_name = Some(name.to_owned());
        }
        index
            .apply_event(EndpointId(ep), &KvEvent::BlockStored(ev))
            .unwrap();
    }
}

/// `/debug/prefix` for `body` with `extra` fields (a key space) merged in.
async fn debug_prefix(r: &RouterHandle, mut body: Value, extra: Value) -> Value {
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    post_json(&format!("http://{}/debug/prefix", r.addr), &body)
        .await
        .json()
        .await
        .unwrap()
}

/// `/debug/prefix` for the prompt in a key space: tokens each endpoint holds.
async fn held(r: &RouterHandle, extra: Value) -> (u64, u64) {
    let v = debug_prefix(r, json!({"token_ids": prompt()}), extra).await;
    let t = |e: &str| v["endpoints"][e]["any_tokens"].as_u64().unwrap();
    (t("e0"), t("e1"))
}

/// Sends the prompt four times (round robin: twice to each engine) with `extra` body fields;
/// returns each placement's (endpoint, outcome, named P2P source).
async fn route(r: &RouterHandle, extra: Value) -> Vec<(String, String, Value)> {
    let mut out = Vec::new();
    for _ in 0..4 {
        let mut body = json!({"prompt": prompt(), "max_tokens": 1});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let resp = client()
            .post(format!("http://{}/v1/completions", r.addr))
            .header("x-kvmesh-explain", "1")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let d: Value =
            serde_json::from_str(resp.headers()["x-kvmesh-decision"].to_str().unwrap()).unwrap();
        let endpoint = d["endpoint"].as_str().unwrap().to_owned();
        let last: Value = client()
            .get(format!("http://{}/debug/decisions?last=1", r.addr))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let outcome = last[0]["outcome"].as_str().unwrap().to_owned();
        out.push((endpoint, outcome, d["p2p_source"].clone()));
    }
    out
}

fn assert_cold(what: &str, placements: &[(String, String, Value)]) {
    for (ep, outcome, src) in placements {
        assert_eq!(outcome, "cold", "{what} on {ep}: {placements:?}");
        assert!(
            src.is_null(),
            "{what} on {ep} must pull nothing: {placements:?}"
        );
    }
}

#[tokio::test]
async fn tenants_and_adapters_never_score_or_pull_each_others_blocks() {
    tokio::time::timeout(LIMIT, async {
        let (e0, e1) = (FakeEngine::start("e0").await, FakeEngine::start("e1").await);
        let index = Arc::new(PrefixIndex::new(IndexConfig {
            block_size: BS,
            ..IndexConfig::default()
        }));
        let yaml = format!("{CONFIG}{}", endpoints_yaml(&[&e0, &e1]));
        let r = start_router(&yaml, Some(index.clone())).await;
        let n = prompt().len() as u64;

        // e0 holds the prompt for tenant-a only.
        store(&index, 0, Some("tenant-a"), None);
        let a = json!({"cache_salt": "tenant-a"});
        assert_eq!(held(&r, a.clone()).await, (n, 0));
        assert_eq!(held(&r, json!({"cache_salt": "tenant-b"})).await, (0, 0));
        assert_eq!(
            held(&r, json!({})).await,
            (0, 0),
            "unsalted sees no salted block"
        );
        assert_eq!(held(&r, json!({"model": "sql-lora"})).await, (0, 0));

        // Same tenant: a local hit on e0, a pull from e0 when placed on e1.
        let placements = route(&r, a.clone()).await;
        for (ep, outcome, src) in &placements {
            if ep == "e0" {
                assert_eq!(outcome, "local_hit", "{placements:?}");
            } else {
                assert_eq!(src, "e0", "tenant-a on e1 pulls from e0: {placements:?}");
            }
        }
        // Another tenant, no tenant, or the adapter: nothing to score, nothing to pull.
        assert_cold(
            "tenant-b",
            &route(&r, json!({"cache_salt": "tenant-b"})).await,
        );
        assert_cold("unsalted", &route(&r, json!({})).await);
        assert_cold("sql-lora", &route(&r, json!({"model": "sql-lora"})).await);
        // The salt reached the engines untouched (they hash it themselves).
        let bodies: Vec<Value> = e1
            .state
            .received
            .lock()
            .iter()
            .map(|x| x.body.clone())
            .collect();
        assert!(bodies.iter().any(|b| b["cache_salt"] == "tenant-a"));

        // e1 holds it for the adapter, and unsalted for the base model: each request finds its
        // own, never the other's. A `model` that is not a configured adapter is the base model.
        store(&index, 1, None, Some("sql-lora"));
        assert_eq!(held(&r, json!({"model": "sql-lora"})).await, (0, n));
        assert_eq!(
            held(&r, json!({"model": "sql-lora", "cache_salt": "tenant-a"})).await,
            (0, 0)
        );
        assert_eq!(
            held(&r, json!({})).await,
            (0, 0),
            "base sees no adapter block"
        );
        store(&index, 0, None, None);
        assert_eq!(held(&r, json!({})).await, (n, 0));
        assert_eq!(held(&r, json!({"model": "m"})).await, (n, 0));
        assert_eq!(held(&r, json!({"model": "sql-lora"})).await, (0, n));
        assert_eq!(held(&r, a).await, (n, 0));
        r.shutdown().await.unwrap();
    })
    .await
    .unwrap();
}

/// `/debug/prefix` for a text prompt in a key space: (gpu, cpu) tokens `endpoint` holds.
async fn held_text(r: &RouterHandle, prompt: &str, extra: Value, endpoint: &str) -> (u64, u64) {
    let v = debug_prefix(r, json!({"prompt": prompt}), extra).await;
    let t = |tier: &str| v["endpoints"][endpoint][tier].as_u64().unwrap_or(0);
    (t("gpu_tokens"), t("cpu_tokens"))
}

/// A real engine's events for a salted prompt land in the router's index in that salt's key
/// space, GPU and CPU tier alike: the router predicts for tenant-a exactly what the engine then
/// reports cached, and nothing for tenant-b or unsalted requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sim_engines_salted_blocks_are_indexed_for_their_tenant_only() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let engines = vec![start_engine("e0", 100.0, 1024).await];
        let refs: Vec<&SimEngine> = engines.iter().collect();
        let r = start_router(&format!("seed: 1\n{}", engines_yaml(&refs)), None).await;
        let prompt = doc(7, 1600);
        let send = |salt: Option<&'static str>| {
            let mut body = json!({"prompt": prompt, "max_tokens": 2});
            if let Some(s) = salt {
                body["cache_salt"] = json!(s);
            }
            let url = format!("http://{}/v1/completions", r.addr);
            async move {
                let v: Value = post_json(&url, &body).await.json().await.unwrap();
                v["usage"]["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap()
            }
        };
        assert_eq!(send(Some("tenant-a")).await, 0);
        let a = json!({"cache_salt": "tenant-a"});
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        // Both tiers: the GPU store, then the offload to the CPU tier.
        loop {
            let (gpu, cpu) = held_text(&r, &prompt, a.clone(), "e0").await;
            if gpu >= 1584 && cpu >= 1584 {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "tenant-a's blocks never indexed: gpu {gpu} cpu {cpu}"
            );
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
        let (predicted, _) = held_text(&r, &prompt, a.clone(), "e0").await;
        assert_eq!(held_text(&r, &prompt, json!({}), "e0").await, (0, 0));
        assert_eq!(
            held_text(&r, &prompt, json!({"cache_salt": "tenant-b"}), "e0").await,
            (0, 0)
        );
        // All 100 blocks held; the engine serves all but the one with the last prompt token.
        assert_eq!(predicted, 1600);
        assert_eq!(
            send(Some("tenant-a")).await,
            1584,
            "router predicted {predicted}"
        );
        assert_eq!(send(Some("tenant-b")).await, 0);
        assert_eq!(send(None).await, 0);
        stop(r, engines).await;
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn a_cache_salt_that_is_not_a_string_is_refused_like_vllm() {
    tokio::time::timeout(LIMIT, async {
        let e0 = FakeEngine::start("e0").await;
        let yaml = format!("{CONFIG}{}", endpoints_yaml(&[&e0]));
        let r = start_router(&yaml, None).await;
        let resp = post_json(
            &format!("http://{}/v1/completions", r.addr),
            &json!({"prompt": "hi", "cache_salt": 5}),
        )
        .await;
        assert_eq!(resp.status(), 400);
        let v: Value = resp.json().await.unwrap();
        assert_eq!(v["error"]["param"], "cache_salt");
        assert_eq!(e0.count(), 0);
        r.shutdown().await.unwrap();
    })
    .await
    .unwrap();
}

#[test]
fn lora_adapters_are_validated() {
    use kvmesh_router::RouterConfig;
    let check = |yaml: &str| {
        RouterConfig::from_yaml(yaml, std::path::Path::new("t.yaml"))
            .unwrap()
            .validate()
    };
    assert!(check("lora_adapters: [{name: a, path: /a}, {name: b, path: /b}]").is_ok());
    let dup = check("lora_adapters: [{name: a, path: /a}, {name: a, path: /b}]").unwrap_err();
    assert!(dup.to_string().contains("duplicated"), "{dup}");
    assert!(check("lora_adapters: [{name: '', path: /a}]").is_err());
    assert!(check("lora_adapters: [{name: a, path: ''}]").is_err());
    assert!(
        RouterConfig::from_yaml(
            "lora_adapters: [{name: a, path: /a, id: 1}]",
            std::path::Path::new("t.yaml")
        )
        .is_err(),
        "unknown adapter keys are refused"
    );
}
