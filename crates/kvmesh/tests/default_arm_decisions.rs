//! What the benchmarks measure is what users run: the bench's `ttft-p2p` arm and
//! `kvmesh router --config configs/router.yaml` (the file loaded as that command loads it, with
//! the same endpoints and seed) make the same decisions in front of the same fleet — every
//! field of `/debug/decisions` but timings and scraped gauges, on a workload that places with a
//! local hit, a priced pull and a cold prompt.
#![allow(clippy::unwrap_used)]

#[path = "../../kvmesh-router/tests/common/mod.rs"]
mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::{FakeEngine, FakePrefix, Mode, get_json, scrape_metric};
use kvmesh_bench::Arm;
use kvmesh_bench::fleet::Role;
use kvmesh_bench::router_config::{
    DEFAULT_MIN_CACHED_TOKEN_DELTA, EndpointInfo, FleetRouter, arm_config,
};
use kvmesh_router::config::EndpointSpec;
use kvmesh_router::prefix::PrefixLookup;
use kvmesh_router::{RouterConfig, RouterOptions};
use serde_json::{Value, json};

const SEED: u64 = 11;

/// Fields that depend on when a decision ran, or on when the scrape loop last ran.
const TIMING: &[&str] = &["at", "scheduling_us", "held_ms"];
const SCRAPED: &[&str] = &["waiting", "running", "kv_usage"];

fn without_timing(mut decisions: Value) -> Value {
    for d in decisions.as_array_mut().unwrap() {
        let d = d.as_object_mut().unwrap();
        TIMING.iter().for_each(|k| drop(d.remove(*k)));
        for c in d["candidates"].as_array_mut().unwrap() {
            let c = c.as_object_mut().unwrap();
            SCRAPED.iter().for_each(|k| drop(c.remove(*k)));
        }
    }
    decisions
}

/// Runs the workload against a router started from `config`; returns its decisions.
async fn decisions_of(
    config: RouterConfig,
    prefix: Arc<dyn PrefixLookup>,
    e0: &FakeEngine,
) -> Value {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let options = RouterOptions {
        prefix: Some(prefix),
        ..RouterOptions::default()
    };
    let router = kvmesh_router::start(config, listener, options)
        .await
        .unwrap();
    let url = format!("http://{}", router.addr);
    let send = |id: &str, len: usize| {
        let (url, id) = (url.clone(), id.to_owned());
        async move {
            let r = common::client()
                .post(format!("{url}/v1/completions"))
                .header("x-request-id", id)
                .json(&json!({"model": "m", "prompt": common::doc(7, len), "max_tokens": 4}))
                .send()
                .await
                .unwrap();
            assert!(r.status().is_success());
            r.text().await.unwrap();
        }
    };
    // A long prompt that e0 holds the start of: computed there, and still prefilling (e0
    // answers slowly) while the rest arrive.
    let before = e0.count();
    let long = tokio::spawn(send("r1", 30_000));
    common::eventually(10, "the long prompt at e0", || e0.count() > before).await;
    // Then, one at a time, each after the previous one's load was released: a prompt whose
    // prefix e0 holds in its CPU tier (pulled to idle e1), a short one, and another pull.
    for (id, len) in [("r2", 6_000), ("r3", 200), ("r4", 3_000)] {
        send(id, len).await;
        common::eventually_async(10, "e1 idle again", || async {
            scrape_metric(&url, "kvmesh_router_endpoint_in_flight_requests", "e1").await == 0.0
        })
        .await;
    }
    let decisions = get_json(&format!("{url}/debug/decisions?last=10")).await;
    e0.set_mode(Mode::Echo);
    long.await.unwrap();
    router.shutdown().await.unwrap();
    without_timing(decisions)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bench_default_arm_decides_as_configs_router_yaml_does() {
    let e0 = FakeEngine::start("e0").await;
    let e1 = FakeEngine::start("e1").await;
    e0.set_mode(Mode::Slow(Duration::from_secs(4)));
    // e0 holds 256 blocks (4,096 tokens) of every prompt in both tiers; e1 holds nothing.
    let prefix = Arc::new(FakePrefix::default());
    prefix.set(&[(0, 256, 256)]);

    // `kvmesh router --config configs/router.yaml`, pointed at this fleet with a seed.
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../configs/router.yaml");
    let mut file = RouterConfig::load(Path::new(path)).unwrap();
    file.endpoints = [&e0, &e1]
        .iter()
        .enumerate()
        .map(|(i, e)| EndpointSpec {
            name: format!("e{i}"),
            url: e.url.clone(),
            kv_events: None,
            p2p: Some(format!("127.0.0.1:{}", 7000 + i)),
            role: Default::default(),
            kv_group: None,
        })
        .collect();
    file.seed = Some(SEED);

    // The bench's arm for the same fleet.
    let endpoints: Vec<EndpointInfo> = [&e0, &e1]
        .iter()
        .enumerate()
        .map(|(i, e)| EndpointInfo {
            name: format!("e{i}"),
            url: e.url.clone(),
            kv_events: format!("tcp://127.0.0.1:{}", 9000 + i),
            p2p: Some(format!("127.0.0.1:{}", 7000 + i)),
            role: Role::Both,
        })
        .collect();
    let fleet = FleetRouter {
        endpoints: &endpoints,
        seed: SEED,
        pull_threshold: Some(DEFAULT_MIN_CACHED_TOKEN_DELTA),
        time_scale: 1.0,
    };
    let arm = arm_config(Arm::TtftP2p, &fleet).unwrap();

    let from_file = decisions_of(file, prefix.clone(), &e0).await;
    e0.set_mode(Mode::Slow(Duration::from_secs(4)));
    let from_bench = decisions_of(arm, prefix, &e0).await;
    assert_eq!(from_file, from_bench);

    let outcomes: Vec<&str> = from_file
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["outcome"].as_str().unwrap())
        .collect();
    // Oldest first: the long prompt's local hit, a pull, a cold prompt, a pull.
    assert_eq!(
        outcomes,
        ["local_hit", "pull_named", "cold", "pull_named"],
        "{from_file:#}"
    );
    assert_eq!(from_file[1]["profile"], "ttft-p2p");
    assert_eq!(from_file[1]["p2p"]["source_endpoint"], "e0");
}
