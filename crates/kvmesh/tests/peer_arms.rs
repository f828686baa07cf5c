//! Peer routers as benchmark arms, through the real binary: `kvmesh bench` starts vllm-router
//! and smg (from `.venv-peers/`, made by `scripts/peer-routers.sh`) in front of fresh sim engines,
//! drives them with the same client, and reads requests and hit rates from the engines.
//!
//! Without the virtual environment the peer test prints SKIPPED, or fails when
//! `KVMESH_REQUIRE_EXTERNAL` is set (CI runs `scripts/setup.sh`, which installs it). A missing
//! router must fail its arm with the install hint, never be skipped silently.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_kvmesh");

/// The peer routers' virtual environment: `$KVMESH_PEER_VENV`, else the repository's.
fn peer_venv() -> PathBuf {
    std::env::var_os("KVMESH_PEER_VENV")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv-peers"))
}

fn bench(args: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .arg("bench")
        .args(args)
        .env("KVMESH_LOG", "warn")
        .output()
        .unwrap()
}

#[test]
fn vllm_router_and_smg_arms_serve_every_request_over_the_engines() {
    let venv = peer_venv();
    let missing: Vec<&str> = ["vllm-router", "smg"]
        .into_iter()
        .filter(|b| !venv.join("bin").join(b).exists())
        .collect();
    if !missing.is_empty() {
        assert!(
            std::env::var_os("KVMESH_REQUIRE_EXTERNAL").is_none(),
            "peer routers {missing:?} are required (KVMESH_REQUIRE_EXTERNAL is set) but not in {}; \
             run `bash scripts/peer-routers.sh`",
            venv.display()
        );
        println!(
            "SKIPPED: peer routers {missing:?} not in {} (run `bash scripts/peer-routers.sh`)",
            venv.display()
        );
        return;
    }
    let out = tempfile::tempdir().unwrap();
    let o = bench(&[
        "--workload",
        "pool@4",
        "--scale",
        "quick",
        "--time-scale",
        "4",
        "--arms",
        "vllm-router:round_robin,smg:cache_aware",
        "--peer-venv",
        venv.to_str().unwrap(),
        "--out",
        out.path().to_str().unwrap(),
        "--no-progress",
    ]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "kvmesh bench failed: {stderr}");
    let report: Value =
        serde_json::from_slice(&std::fs::read(out.path().join("report.json")).unwrap()).unwrap();
    assert_eq!(report["prompt_format"], "text");
    let results = report["results"].as_array().unwrap();
    assert_eq!(results.len(), 2);
    for r in results {
        let arm = r["arm"].as_str().unwrap();
        let stats = &r["stats"];
        let sent = stats["requests"].as_u64().unwrap();
        assert!(sent > 20, "{arm}: {sent} requests");
        assert_eq!(stats["succeeded"].as_u64(), Some(sent), "{arm}: {stats}");
        assert!(
            r["flags"].as_array().unwrap().is_empty(),
            "{arm}: {}",
            r["flags"]
        );
        assert!(
            r["router_version"]
                .as_str()
                .is_some_and(|v| v.starts_with(arm.split(':').next().unwrap())),
            "{arm}: {}",
            r["router_version"]
        );
        // The engines' own counters: every request served, spread over the engines.
        let per_engine: Vec<u64> = r["evidence"]["engines"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["requests"].as_f64().unwrap() as u64)
            .collect();
        assert_eq!(per_engine.len(), 4, "{arm}");
        assert_eq!(
            per_engine.iter().sum::<u64>(),
            sent,
            "{arm}: {per_engine:?}"
        );
        let (lo, hi) = (
            per_engine.iter().min().copied().unwrap(),
            per_engine.iter().max().copied().unwrap(),
        );
        if arm == "vllm-router:round_robin" {
            assert!(hi - lo <= 1, "{arm} rotates: {per_engine:?}");
        } else {
            let used = per_engine.iter().filter(|&&n| n > 0).count();
            assert!(used >= 2, "{arm} spreads its prefixes: {per_engine:?}");
        }
    }
    // Each peer arm's log folder keeps the router's exact command line.
    let logs: Vec<String> = std::fs::read_dir(out.path().join("logs"))
        .unwrap()
        .map(|e| e.unwrap().path().join("router-command.txt"))
        .filter(|p| p.exists())
        .map(|p| std::fs::read_to_string(p).unwrap())
        .collect();
    assert_eq!(logs.len(), 2, "each peer arm records its command line");
    assert!(logs.iter().any(|c| c.contains("--policy round_robin")));
    assert!(logs.iter().any(|c| c.contains("--policy cache_aware")));
    let md = std::fs::read_to_string(out.path().join("report.md")).unwrap();
    assert!(md.contains("routers side by side"), "{md}");
    assert!(md.contains("`cache_aware`"), "{md}");
}

#[test]
fn a_missing_peer_router_fails_its_arm_with_the_install_hint() {
    let out = tempfile::tempdir().unwrap();
    let empty = tempfile::tempdir().unwrap();
    let o = bench(&[
        "--workload",
        "pool@4",
        "--scale",
        "quick",
        "--arms",
        "smg:cache_aware",
        "--peer-venv",
        empty.path().to_str().unwrap(),
        "--out",
        out.path().to_str().unwrap(),
        "--no-progress",
    ]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "a failed arm fails the run: {stderr}");
    assert!(stderr.contains("scripts/peer-routers.sh"), "{stderr}");
    let report: Value =
        serde_json::from_slice(&std::fs::read(out.path().join("report.json")).unwrap()).unwrap();
    let flags = report["results"][0]["flags"][0].as_str().unwrap();
    assert!(
        flags.starts_with("FAILED TO RUN") && flags.contains("scripts/peer-routers.sh"),
        "{flags}"
    );
}
