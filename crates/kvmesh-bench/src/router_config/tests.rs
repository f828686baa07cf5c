//! The arms' files: each is a router config, two arms differ only in what they name, the default
//! arm is the default placement, and the bench fills in only what belongs to its fleet.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use kvmesh_router::RouterConfig;
use kvmesh_sched::Scheduler;
use kvmesh_sched::cost_model::CostModel;
use kvmesh_sched::scheduler::ProfileShape;

use super::*;

fn eps(roles: &[Role]) -> Vec<EndpointInfo> {
    roles
        .iter()
        .enumerate()
        .map(|(i, r)| EndpointInfo {
            name: format!("e{i}"),
            url: format!("http://127.0.0.1:{}", 8000 + i),
            kv_events: format!("tcp://127.0.0.1:{}", 9000 + i),
            p2p: Some(format!("127.0.0.1:{}", 7000 + i)),
            role: *r,
        })
        .collect()
}

/// P/D arms run on a prefill + decode pair, the others on aggregated engines.
fn eps_for(arm: Arm) -> Vec<EndpointInfo> {
    if arm.is_pd() {
        eps(&[Role::Prefill, Role::Decode])
    } else {
        eps(&[Role::Both, Role::Both])
    }
}

fn all_arms() -> Vec<Arm> {
    ARM_NAMES.iter().map(|n| n.parse().unwrap()).collect()
}

/// `arm` in front of `e` as `kvmesh bench` runs it (seed 1, time scale 1).
fn config(arm: Arm, e: &[EndpointInfo], threshold: Option<usize>) -> RouterConfig {
    let fleet = FleetRouter {
        endpoints: e,
        seed: 1,
        pull_threshold: threshold,
        time_scale: 1.0,
    };
    arm_config(arm, &fleet).unwrap_or_else(|err| panic!("{arm}: {err}"))
}

fn scheduler(cfg: &RouterConfig) -> Scheduler {
    let cm = Arc::new(CostModel::new(cfg.cost_model.clone()));
    Scheduler::build(
        &cfg.plugins,
        &cfg.scheduling_profiles,
        cfg.default_profile.as_deref(),
        cfg.seed,
        &cm,
    )
    .unwrap()
}

/// Everything about a config that decides placement: the built profiles with every parameter
/// (defaults filled in), the cost model's rates, the admission queue, how fresh the scraped
/// gauges are, and how prompts are cut into blocks.
fn placement(cfg: RouterConfig) -> impl PartialEq + std::fmt::Debug {
    let cfg = cfg.with_default_placement().unwrap();
    let shape: Vec<ProfileShape> = scheduler(&cfg).shape();
    (
        shape,
        cfg.cost_model.clone(),
        cfg.admission_queue.clone(),
        cfg.metrics_scrape_interval,
        cfg.block_size,
        cfg.tokenizer.clone(),
    )
}

/// The evidence: the file a user runs, the router's built-in default and the bench's
/// default arm build the same scheduler. Any drift — a threshold, a weight, a rate, the admission
/// queue, the scrape interval — fails here.
#[test]
fn the_default_placement_is_one_file_the_router_and_the_bench_share() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../configs/router.yaml");
    let file = RouterConfig::load(Path::new(path)).unwrap();
    let e = eps(&[Role::Both, Role::Both]);
    let builtin = RouterConfig {
        endpoints: e.iter().map(EndpointInfo::spec).collect(),
        ..RouterConfig::default()
    };
    let bench = config(Arm::TtftP2p, &e, Some(DEFAULT_MIN_CACHED_TOKEN_DELTA));
    let want = placement(file);
    assert_eq!(placement(builtin), want, "the router's built-in default");
    assert_eq!(placement(bench), want, "the bench's ttft-p2p arm");
    // What the bench changes is operational only.
    let bench = config(Arm::TtftP2p, &e, None);
    assert_eq!(bench.seed, Some(1));
    assert_eq!(bench.endpoints.len(), 2);
    assert_eq!(bench.decisions_capacity, BENCH_DECISIONS);
}

#[test]
fn every_arm_file_is_a_router_config_for_its_policy() {
    for arm in all_arms() {
        let e = eps_for(arm);
        let cfg = config(arm, &e, None);
        assert_eq!(cfg.endpoints.len(), 2, "{arm}");
        assert_eq!(cfg.pd.is_some(), arm.is_pd(), "{arm}");
        assert_eq!(cfg.prefetch.is_some(), arm.prefetches(), "{arm}");
        assert_eq!(cfg.replication.is_some(), arm.replicates(), "{arm}");
        let has_p2p_step = cfg.plugins.iter().any(|p| p.kind == "p2p-source-producer");
        assert_eq!(has_p2p_step, arm.pulls() && !arm.is_pd(), "{arm}");
        let s = scheduler(&cfg);
        let default = s.profile(None).unwrap();
        let want = if arm.is_pd() { "decode" } else { arm.name() };
        assert_eq!(default.name, want, "{arm}");
        // The file a user runs carries endpoints of its own (two local engines).
        let file = RouterConfig::from_yaml(arm_file(arm).unwrap(), Path::new("f")).unwrap();
        file.validate().unwrap();
        assert_eq!(file.endpoints.len(), 2, "{arm}");
        assert!(file.endpoints.iter().all(|e| e.p2p.is_some()), "{arm}");
    }
    assert!(arm_file("vllm-router:kv_aware".parse().unwrap()).is_none());
}

/// A prefetch or replication arm is its base arm plus that one section: its placement cannot
/// drift from the base's.
#[test]
fn derived_arms_are_their_base_arm_plus_one_feature() {
    let e = eps(&[Role::Both, Role::Both]);
    for arm in all_arms().into_iter().filter(|a| a.base() != *a) {
        let mut derived = config(arm, &e, None);
        let base = config(arm.base(), &e, None);
        assert!(derived.prefetch.take().is_some() || derived.replication.take().is_some());
        derived.scheduling_profiles[0].name = arm.base().name().to_owned();
        assert_eq!(derived, base, "{arm} vs {}", arm.base());
    }
}

#[test]
fn pd_arms_differ_only_in_bidirectional_and_the_prefill_leg() {
    let e = eps(&[Role::Prefill, Role::Decode]);
    let pd = |arm| config(arm, &e, None);
    for (arm, bidir) in [
        (Arm::Pd, false),
        (Arm::PdBidir, true),
        (Arm::PdLoad, false),
        (Arm::PdLoadBidir, true),
    ] {
        let cfg = pd(arm);
        let section = cfg.pd.clone().unwrap();
        assert_eq!(section.bidirectional, bidir, "{arm}");
        assert_eq!(arm.moves_history(), bidir);
        assert_eq!(
            section.decider,
            kvmesh_router::pd::config::Decider::default(),
            "{arm}: always"
        );
        assert!(section.conversation_ttl_s < 480.0);
        let s = scheduler(&cfg);
        section.validate(&s).unwrap();
    }
    let same_but_bidir = |a: Arm, b: Arm| {
        let mut x = pd(b);
        x.pd.as_mut().unwrap().bidirectional = false;
        assert_eq!(pd(a), x, "{a} vs {b}");
    };
    same_but_bidir(Arm::Pd, Arm::PdBidir);
    same_but_bidir(Arm::PdLoad, Arm::PdLoadBidir);
    // pd-load places the prefill leg by load (no prefix scorer), the decode leg as pd does.
    let shapes = |arm| scheduler(&pd(arm)).shape();
    let (aff, load) = (shapes(Arm::Pd), shapes(Arm::PdLoad));
    let step_kinds = |p: &ProfileShape| -> Vec<String> {
        p.steps
            .iter()
            .map(|s| format!("{}:{:?}", s.kind, s.weight))
            .collect()
    };
    let prefill = |v: &[ProfileShape]| v.iter().find(|p| p.name == "prefill").unwrap().clone();
    let decode = |v: &[ProfileShape]| v.iter().find(|p| p.name == "decode").unwrap().clone();
    assert_eq!(
        step_kinds(&prefill(&load)),
        vec![
            "queue-scorer:Some(3.0)",
            "kv-cache-utilization-scorer:Some(2.0)",
            "weighted-random-picker:None"
        ]
    );
    assert_eq!(
        step_kinds(&prefill(&aff))[0],
        "prefix-cache-scorer:Some(3.0)"
    );
    assert_eq!(decode(&aff), decode(&load), "decode leg unchanged");
}

#[test]
fn the_workloads_threshold_goes_to_whichever_plugin_owns_it() {
    let e = eps(&[Role::Both, Role::Both]);
    let param = |cfg: &RouterConfig, kind: &str| {
        let p = cfg.plugins.iter().find(|p| p.kind == kind).unwrap();
        p.parameters.clone().unwrap_or_default()
    };
    let load = config(Arm::LoadP2p, &e, Some(4096));
    assert_eq!(
        param(&load, "p2p-source-producer")["min_cached_token_delta"],
        4096
    );
    // The default placement: the scorer owns the threshold, the P2P step has none to set.
    let ttft = config(Arm::TtftP2p, &e, Some(512));
    assert_eq!(
        param(&ttft, "predicted-ttft-scorer")["min_pull_tokens"],
        512
    );
    let step = param(&ttft, "p2p-source-producer");
    assert_eq!(step, serde_json::json!({"mode": "predicted"}));
    scheduler(&ttft);
    // None keeps the file's.
    let file = config(Arm::TtftP2p, &e, None);
    assert_eq!(
        param(&file, "predicted-ttft-scorer")["min_pull_tokens"],
        DEFAULT_MIN_CACHED_TOKEN_DELTA
    );
}

/// Files hold model time; a sped-up fleet gets rates × the scale and delays ÷ the scale, exactly
/// the values the bench's arms ran with before they were files.
#[test]
fn a_sped_up_fleet_gets_its_rates_and_delays_on_its_own_clock() {
    let e = eps(&[Role::Both, Role::Both]);
    let scaled = |arm, ts| {
        let fleet = FleetRouter {
            endpoints: &e,
            seed: 1,
            pull_threshold: None,
            time_scale: ts,
        };
        arm_config(arm, &fleet).unwrap()
    };
    let fast = scaled(Arm::TtftP2pPrefetch, 2.0);
    let cm = &fast.cost_model;
    assert_eq!(
        (
            cm.prefill_tokens_per_second,
            cm.pull_tokens_per_second,
            cm.pull_floor_ms
        ),
        (50_000.0, 470_000.0, 13.0)
    );
    let p = fast.prefetch.as_ref().unwrap();
    assert_eq!((p.delay_ms, p.lead_ms), (250.0, 250.0));
    let q = fast.admission_queue.as_ref().unwrap();
    assert_eq!(
        q.max_hold,
        Duration::from_secs(10),
        "a client's wait is not scaled"
    );
    let r = scaled(Arm::TtftReplicate, 2.0).replication.unwrap();
    assert_eq!((r.window_s, r.cooldown_s), (5.0, 15.0));
    // Time scale 1 (or an unusable one) changes nothing.
    assert_eq!(
        scaled(Arm::TtftP2pPrefetch, 1.0),
        scaled(Arm::TtftP2pPrefetch, 0.0)
    );
    assert_eq!(
        scaled(Arm::TtftP2pPrefetch, 1.0).cost_model,
        kvmesh_sched::cost_model::CostModelParams::default()
    );
}

#[test]
fn arms_round_trip_and_only_p2p_arms_pull() {
    for n in ARM_NAMES {
        let a: Arm = n.parse().unwrap();
        assert_eq!(a.name(), *n);
        assert_eq!(
            a.pulls(),
            n.ends_with("-p2p")
                || n.ends_with("-p2p-prefetch")
                || n.ends_with("-p2p-replicate")
                || n.starts_with("pd")
        );
        assert_eq!(a.prefetches(), n.ends_with("-prefetch"));
        assert_eq!(a.replicates(), n.ends_with("-replicate"));
        assert_eq!(a.moves_blocks(), a.pulls() || n.ends_with("-replicate"));
        assert_eq!(a.is_pd(), n.starts_with("pd"));
    }
    assert!("nope".parse::<Arm>().is_err());
}

/// The router accepts every arm's file as the bench writes it (not just the typed config).
#[tokio::test]
async fn the_router_starts_with_every_arm_as_written() {
    let path = tempfile::NamedTempFile::new().unwrap();
    for arm in all_arms() {
        let e = eps_for(arm);
        let fleet = FleetRouter {
            endpoints: &e,
            seed: 3,
            pull_threshold: Some(1024),
            time_scale: 2.0,
        };
        std::fs::write(path.path(), arm_yaml(arm, &fleet).unwrap()).unwrap();
        let cfg = RouterConfig::load(path.path()).unwrap();
        assert_eq!(cfg, arm_config(arm, &fleet).unwrap(), "{arm}: round trip");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let handle = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            kvmesh_router::start(cfg, listener, kvmesh_router::RouterOptions::default()),
        )
        .await
        .unwrap_or_else(|_| panic!("{arm}: router start timed out"))
        .unwrap_or_else(|err| panic!("{arm}: {err}"));
        tokio::time::timeout(std::time::Duration::from_secs(10), handle.shutdown())
            .await
            .unwrap()
            .unwrap();
    }
}

#[test]
fn roles_are_passed_to_the_router() {
    let cfg = config(Arm::LoadP2p, &eps(&[Role::Prefill, Role::Decode]), None);
    let roles: Vec<_> = cfg.endpoints.iter().map(|e| e.role).collect();
    use kvmesh_router::config::Role as R;
    assert_eq!(roles, vec![R::Prefill, R::Decode]);
    assert_eq!(cfg.endpoints[1].p2p.as_deref(), Some("127.0.0.1:7001"));
}
