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
use kvmesh_bench::runner::{self, FleetOptions, Plan};
use kvmesh_bench::workload::{self, Scale, WorkloadOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs P2P integration"]
async fn quick_fork_ab_moves_kv_only_with_p2p() {
    let out = tempfile::tempdir().unwrap();
    let plan = Plan {
        workloads: workload::build("fork", Scale::Quick, 7, &WorkloadOptions::default()).unwrap(),
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
        progress: false,
        settle: Duration::from_millis(1500),
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
