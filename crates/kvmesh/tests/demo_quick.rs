//! CI-sized A/B through the real binary: a `quick` fork burst on 4 sim engines behind the router,
//! `load` vs `load-p2p` (same placement; only P2P differs), each on a fresh fleet.
//!
//! Asserts the evidence, not the timing: every request succeeded; the P2P arm moved bytes and the
//! consumers counted external prefix hits; the control arm moved nothing. The TTFT ratio is
//! printed (machines are noisy) — the benchmark record tracks it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::time::Duration;

use kvmesh_bench::Arm;
use kvmesh_bench::client::{Outcome, PromptFormat};
use kvmesh_bench::driver::{self, DriveConfig};
use kvmesh_bench::fleet::{Fleet, FleetSpec};
use kvmesh_bench::workload::StepKind;

/// The harness plumbing against the real engine binary (no router needed): launch two sim engines,
/// run the ladder on the first, read cached tokens and `/metrics`, shut down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_launch_drive_scrape_shutdown_with_real_engines() {
    let dir = tempfile::tempdir().unwrap();
    let spec = FleetSpec::from_yaml(
        "engines:\n  - count: 2\n    num_gpu_blocks: 4096\n    time_scale: 20\n    p2p: false\n    max_model_len: 16384\n",
    )
    .unwrap();
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_kvmesh"));
    let fleet = tokio::time::timeout(
        Duration::from_secs(60),
        Fleet::launch(&spec, &exe, dir.path()),
    )
    .await
    .expect("engines start within 60 s")
    .expect("engines start");
    assert_eq!(fleet.engines.len(), 2);
    assert!(fleet.describe().contains(&fleet.engines[1].url));
    let w = catalog::build("ladder", Scale::Quick, 3, &WorkloadOptions::default())
        .unwrap()
        .remove(0);
    let cfg = DriveConfig {
        base_urls: fleet.entry_urls(),
        model: fleet.served_model_name.clone(),
        time_scale: 20.0,
        prompt_format: PromptFormat::Text,
        progress: None,
    };
    let records = tokio::time::timeout(Duration::from_secs(120), driver::drive(&w, &cfg))
        .await
        .unwrap();
    assert_eq!(records.len(), w.num_requests());
    for r in &records {
        assert_eq!(r.outcome, Outcome::Ok, "{r:?}");
        assert!(r.ttft_s.is_some_and(|t| t <= r.e2e_s));
        if r.kind == StepKind::Probe {
            // Same engine, same prefix: every full block of the prefix is a local hit.
            let prefix = r.prompt_tokens - 16;
            assert!(
                r.cached_tokens.unwrap_or(0) as usize >= prefix / 16 * 16,
                "{r:?}"
            );
        }
    }
    let ev = runner::scrape_evidence(&fleet).await;
    assert!(ev.scrape_errors.is_empty(), "{:?}", ev.scrape_errors);
    assert!(ev.engines[0].local_hit_tokens > 0.0);
    assert_eq!(ev.external_hit_tokens, 0.0);
    assert!(!ev.moved_anything());
    let url = fleet.engines[0].url.clone();
    fleet.shutdown().await;
    assert!(
        reqwest::get(format!("{url}/health")).await.is_err(),
        "engine stopped"
    );
}
use kvmesh_bench::catalog;
use kvmesh_bench::runner::{self, FleetOptions, Plan};
use kvmesh_bench::workload::{Scale, WorkloadOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quick_fork_ab_moves_kv_only_with_p2p() {
    let out = tempfile::tempdir().unwrap();
    let plan = Plan {
        workloads: catalog::build("fork", Scale::Quick, 7, &WorkloadOptions::default()).unwrap(),
        arms: vec![Arm::Load, Arm::LoadP2p],
        exe: PathBuf::from(env!("CARGO_BIN_EXE_kvmesh")),
        out_dir: out.path().to_owned(),
        fleet: FleetOptions {
            time_scale: 2.0,
            ..Default::default()
        },
        command: "demo_quick test".into(),
        scale: "quick".into(),
        seed: 7,
        prompt_format: PromptFormat::Text,
        progress: false,
        settle: Duration::from_millis(1500),
        repeat: 1,
    };
    let report = tokio::time::timeout(Duration::from_secs(240), runner::run(&plan))
        .await
        .expect("the quick A/B finishes within 4 minutes")
        .expect("fleets start and the workload runs");
    println!("{}", report.markdown());
    assert_eq!(report.results.len(), 2);
    let (control, p2p) = (&report.results[0], &report.results[1]);
    for r in [control, p2p] {
        assert_eq!(
            r.stats.succeeded, r.stats.requests,
            "{}: every request succeeds: {:?}",
            r.arm, r.stats.sample_errors
        );
        assert!(
            r.evidence.scrape_errors.is_empty(),
            "{}: metrics readable",
            r.arm
        );
    }
    assert!(
        p2p.evidence.p2p_bytes > 0.0,
        "P2P arm moved bytes: {:?}",
        p2p.evidence.p2p_counters
    );
    assert!(
        p2p.evidence.external_hit_tokens > 0.0,
        "P2P arm counted external hits"
    );
    assert!(p2p.flags.is_empty(), "P2P arm flags: {:?}", p2p.flags);
    assert_eq!(control.evidence.p2p_bytes, 0.0, "control arm moved nothing");
    assert_eq!(
        control.evidence.external_hit_tokens, 0.0,
        "control arm had no external hits"
    );
    let kid = |r: &kvmesh_bench::ArmResult| {
        r.stats
            .ttft_by_kind
            .get("child")
            .map(|l| l.p90)
            .unwrap_or(0.0)
    };
    println!(
        "branch-start TTFT p90: load {:.3} s, load-p2p {:.3} s (ratio {:.2})",
        kid(control),
        kid(p2p),
        if kid(p2p) > 0.0 {
            kid(control) / kid(p2p)
        } else {
            f64::NAN
        }
    );
    assert!(
        out.path().join("report.json").exists() && out.path().join("fork-ttft-cdf.svg").exists()
    );
}
