//! Peer routers as benchmark arms: vllm-router and smg (sglang-router's gateway), installed by
//! `scripts/peer-routers.sh` into `.venv-peers/`, started in front of the arm's freshly launched
//! engines instead of `kvmesh router`, so every arm runs on the same fleet with the same client.
//!
//! An arm is `ROUTER:POLICY`:
//!
//! | arm | what the peer needs from the engines |
//! |---|---|
//! | `vllm-router:round_robin`, `:power_of_two` | nothing |
//! | `vllm-router:cache_aware`, `smg:cache_aware` | nothing: an approximate prefix tree over the request, updated on routing (vllm-router 0.1.17 also fetches token ids from `/tokenize` for it; smg matches the text) |
//! | `vllm-router:kv_aware` | the engines' ZMQ KV events (`--kv-event-source URL=tcp://…`, replay socket too) published under vLLM's default empty topic (0.1.17 drops any other topic: no index hits), and token ids of each prompt: a text prompt is tokenized by the worker (`POST /v1/completions/render`, which the engines answer 404, then `POST /tokenize`, which they serve) — one extra round trip per engine and request; the router hashes the events' `token_ids` itself, so the engines' `sha256_cbor` block hashes need not match anything |
//! | `vllm-router:kv_aware_sessions` | as `kv_aware`, with its session affinity on (`--kv-aware-session-affinity-ttl-secs`): a session's turns stick to the engine its first turn went to while the session is active; the key is the `X-Session-ID` header the bench client sends (vllm-router also reads `session-id`, `x-claude-code-session-id` and `session_params.session_id`) |
//! | `smg:round_robin` | nothing |
//!
//! smg rejects token-id prompts (`prompt` must be a string or a list of strings), which is one
//! reason the bench client sends text by default.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::process::{Child, Command};

use crate::launch::{FleetError, log_tail};

/// Environment variable naming the peer routers' virtual environment.
pub const PEER_VENV_ENV: &str = "KVMESH_PEER_VENV";
/// The virtual environment `scripts/peer-routers.sh` creates at the repository root.
pub const DEFAULT_PEER_VENV: &str = ".venv-peers";
/// What to tell a user whose peer router is not installed.
pub const INSTALL_HINT: &str = "run `bash scripts/peer-routers.sh` at the repository root (it installs the pinned peer \
     routers into .venv-peers/), or point --peer-venv / KVMESH_PEER_VENV at a virtual environment \
     that has them";

/// An external router.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PeerRouter {
    /// `vllm-router` (PyPI `vllm-router`).
    VllmRouter,
    /// `smg launch` (PyPI `sglang-router`).
    Smg,
}

impl PeerRouter {
    pub fn name(self) -> &'static str {
        match self {
            Self::VllmRouter => "vllm-router",
            Self::Smg => "smg",
        }
    }

    /// The executable in the virtual environment's `bin/`.
    pub fn binary(self) -> &'static str {
        self.name()
    }

    /// The PyPI distribution that ships it (its `*.dist-info` names the installed version).
    fn distribution(self) -> &'static str {
        match self {
            Self::VllmRouter => "vllm_router",
            Self::Smg => "sglang_router",
        }
    }
}

/// A peer router's load-balancing policy (its own `--policy` value).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PeerPolicy {
    RoundRobin,
    CacheAware,
    KvAware,
    /// `kv_aware` with vllm-router's session affinity.
    KvAwareSessions,
    PowerOfTwo,
}

/// The idle TTL of `kv_aware_sessions`' affinity: longer than any bench session's gap, so a
/// session keeps its engine for its whole life.
pub const SESSION_AFFINITY_TTL_SECS: u32 = 300;

impl PeerPolicy {
    pub fn name(self) -> &'static str {
        match self {
            Self::RoundRobin => "round_robin",
            Self::CacheAware => "cache_aware",
            Self::KvAware => "kv_aware",
            Self::KvAwareSessions => "kv_aware_sessions",
            Self::PowerOfTwo => "power_of_two",
        }
    }

    /// The router's own `--policy` value.
    pub fn flag(self) -> &'static str {
        match self {
            Self::KvAwareSessions => Self::KvAware.name(),
            other => other.name(),
        }
    }
}

/// A benchmark arm run by an external router.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PeerArm {
    pub router: PeerRouter,
    pub policy: PeerPolicy,
}

/// Every supported peer arm, in the order the help text lists them.
pub const PEER_ARMS: &[PeerArm] = &[
    PeerArm::new(PeerRouter::VllmRouter, PeerPolicy::RoundRobin),
    PeerArm::new(PeerRouter::VllmRouter, PeerPolicy::CacheAware),
    PeerArm::new(PeerRouter::VllmRouter, PeerPolicy::KvAware),
    PeerArm::new(PeerRouter::VllmRouter, PeerPolicy::KvAwareSessions),
    PeerArm::new(PeerRouter::VllmRouter, PeerPolicy::PowerOfTwo),
    PeerArm::new(PeerRouter::Smg, PeerPolicy::CacheAware),
    PeerArm::new(PeerRouter::Smg, PeerPolicy::RoundRobin),
];

impl PeerArm {
    pub const fn new(router: PeerRouter, policy: PeerPolicy) -> Self {
        Self { router, policy }
    }

    /// `ROUTER:POLICY`, as given to `--arms`.
    pub fn name(self) -> &'static str {
        use PeerPolicy as P;
        use PeerRouter as R;
        match (self.router, self.policy) {
            (R::VllmRouter, P::RoundRobin) => "vllm-router:round_robin",
            (R::VllmRouter, P::CacheAware) => "vllm-router:cache_aware",
            (R::VllmRouter, P::KvAware) => "vllm-router:kv_aware",
            (R::VllmRouter, P::KvAwareSessions) => "vllm-router:kv_aware_sessions",
            (R::VllmRouter, P::PowerOfTwo) => "vllm-router:power_of_two",
            (R::Smg, P::CacheAware) => "smg:cache_aware",
            (R::Smg, P::RoundRobin) => "smg:round_robin",
            // Not constructible through `parse` (not in PEER_ARMS).
            (R::Smg, P::KvAware) => "smg:kv_aware",
            (R::Smg, P::KvAwareSessions) => "smg:kv_aware_sessions",
            (R::Smg, P::PowerOfTwo) => "smg:power_of_two",
        }
    }

    /// Whether the router subscribes to the engines' KV events.
    fn uses_kv_events(self) -> bool {
        matches!(
            self.policy,
            PeerPolicy::KvAware | PeerPolicy::KvAwareSessions
        )
    }

    /// Parses `ROUTER:POLICY` (one of [`PEER_ARMS`]).
    pub fn parse(s: &str) -> Result<Self, String> {
        PEER_ARMS
            .iter()
            .copied()
            .find(|a| a.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown peer arm {s:?}; known: {}",
                    PEER_ARMS
                        .iter()
                        .map(|a| a.name())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })
    }
}

impl std::fmt::Display for PeerArm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Where a peer router's executable may be, most specific first: `explicit` (`--peer-venv`),
/// then `$KVMESH_PEER_VENV`, then `.venv-peers/` in the working directory or any parent, then
/// beside the `kvmesh` executable's ancestors (a `target/release/kvmesh` finds the repository's).
pub fn venv_candidates(explicit: Option<&Path>, exe: Option<&Path>) -> Vec<PathBuf> {
    if let Some(p) = explicit {
        return vec![p.to_owned()];
    }
    if let Some(p) = std::env::var_os(PEER_VENV_ENV).filter(|p| !p.is_empty()) {
        return vec![PathBuf::from(p)];
    }
    let mut out: Vec<PathBuf> = Vec::new();
    let mut push_ancestors = |start: &Path| {
        for dir in start.ancestors() {
            let c = dir.join(DEFAULT_PEER_VENV);
            if !out.contains(&c) {
                out.push(c);
            }
        }
    };
    if let Ok(cwd) = std::env::current_dir() {
        push_ancestors(&cwd);
    }
    if let Some(dir) = exe.and_then(Path::parent) {
        push_ancestors(dir);
    }
    out
}

/// A peer router ready to start: its executable and the version installed beside it.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerInstall {
    pub binary: PathBuf,
    /// e.g. `vllm-router 0.1.17` (from the distribution's `*.dist-info`), when found.
    pub version: Option<String>,
}

/// Finds `arm`'s router executable, or says where it looked and how to install it.
pub fn resolve(
    arm: PeerArm,
    explicit: Option<&Path>,
    exe: Option<&Path>,
) -> Result<PeerInstall, String> {
    let candidates = venv_candidates(explicit, exe);
    for venv in &candidates {
        let bin = venv.join("bin").join(arm.router.binary());
        if is_executable(&bin) {
            return Ok(PeerInstall {
                version: installed_version(venv, arm.router),
                binary: bin,
            });
        }
    }
    let looked: Vec<String> = candidates
        .iter()
        .map(|c| {
            c.join("bin")
                .join(arm.router.binary())
                .display()
                .to_string()
        })
        .collect();
    Err(format!(
        "peer arm {} needs `{}`, which is not installed (looked for {}); {INSTALL_HINT}",
        arm.name(),
        arm.router.binary(),
        if looked.is_empty() {
            "nothing".to_owned()
        } else {
            looked.join(", ")
        }
    ))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// `ROUTER VERSION` from `VENV/lib/python*/site-packages/<dist>-<version>.dist-info`.
fn installed_version(venv: &Path, router: PeerRouter) -> Option<String> {
    let lib = std::fs::read_dir(venv.join("lib")).ok()?;
    for py in lib.filter_map(Result::ok) {
        let Ok(site) = std::fs::read_dir(py.path().join("site-packages")) else {
            continue;
        };
        for entry in site.filter_map(Result::ok) {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(v) = name
                .strip_prefix(router.distribution())
                .and_then(|r| r.strip_prefix('-'))
                .and_then(|r| r.strip_suffix(".dist-info"))
            {
                return Some(format!("{} {v}", router.name()));
            }
        }
    }
    None
}

/// One engine as a peer router sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerEngine {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    /// `tcp://127.0.0.1:PORT` of its KV-event publisher.
    pub kv_events: String,
    /// `tcp://127.0.0.1:PORT` of its replay socket, when it has one.
    pub kv_replay: Option<String>,
}

/// What a peer router is started with.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerLaunch<'a> {
    pub arm: PeerArm,
    pub port: u16,
    /// Its Prometheus exporter's port (both routers default to 29000, which would collide).
    pub metrics_port: u16,
    pub engines: &'a [PeerEngine],
    /// The engines' `--served-model-name` (vllm-router's `--kv-event-model`).
    pub served_model_name: &'a str,
    /// The engines' KV block size (vllm-router's `--kv-event-block-size`).
    pub block_size: usize,
}

/// The command-line arguments of the peer router (after the executable).
///
/// Defaults are the routers' own except two health-check settings, set like the `kvmesh router`
/// arms' (`timeout: 10s, unhealthy_threshold: 10`): a saturated engine on an oversubscribed host
/// answers `/health` slowly, and ejecting it would measure the health checker, not the policy.
pub fn args(l: &PeerLaunch<'_>) -> Vec<String> {
    let mut a: Vec<String> = Vec::new();
    if l.arm.router == PeerRouter::Smg {
        a.push("launch".into());
    }
    let mut push = |k: &str, v: String| {
        a.push(k.into());
        a.push(v);
    };
    push("--host", "127.0.0.1".into());
    push("--port", l.port.to_string());
    push("--policy", l.arm.policy.flag().into());
    if l.arm.policy == PeerPolicy::KvAwareSessions {
        push(
            "--kv-aware-session-affinity-ttl-secs",
            SESSION_AFFINITY_TTL_SECS.to_string(),
        );
    }
    push("--prometheus-host", "127.0.0.1".into());
    push("--prometheus-port", l.metrics_port.to_string());
    push("--health-check-timeout-secs", "10".into());
    push("--health-failure-threshold", "10".into());
    push("--log-level", "info".into());
    if l.arm.uses_kv_events() {
        for e in l.engines {
            push("--kv-event-source", format!("{}={}", e.url, e.kv_events));
            if let Some(r) = &e.kv_replay {
                push("--kv-event-replay-source", format!("{}={r}", e.url));
            }
        }
        push("--kv-event-block-size", l.block_size.to_string());
        push("--kv-event-model", l.served_model_name.into());
    }
    // Last: `--worker-urls` takes every following value.
    a.push("--worker-urls".into());
    a.extend(l.engines.iter().map(|e| e.url.clone()));
    a
}

/// Starts the peer router with its output in `log`, and the exact command line in `cmd_file`.
pub fn spawn(
    binary: &Path,
    args: &[String],
    log: &Path,
    cmd_file: &Path,
) -> Result<Child, FleetError> {
    let line = std::iter::once(binary.display().to_string())
        .chain(args.iter().cloned())
        .collect::<Vec<_>>()
        .join(" ");
    std::fs::write(cmd_file, format!("{line}\n"))?;
    let out = std::fs::File::create(log)?;
    let err = out.try_clone()?;
    let child = Command::new(binary)
        .args(args)
        // Plain logs (both routers colour their tracing output otherwise).
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        .kill_on_drop(true)
        .spawn()?;
    Ok(child)
}

/// Waits until the peer at `url` reports every one of `workers` engines healthy on its
/// `/readiness` (both routers answer `{"healthy_workers": N, ...}`; `/health` alone can be up
/// before smg has registered its workers, and early requests would then fail with 503).
pub async fn wait_ready(
    http: &reqwest::Client,
    url: &str,
    workers: usize,
    child: &mut Child,
    log: &Path,
    timeout: Duration,
) -> Result<(), FleetError> {
    let deadline = Instant::now() + timeout;
    let readiness = format!("{url}/readiness");
    let mut last = String::from("no answer");
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(FleetError::Exited {
                what: "peer router".into(),
                status: status.to_string(),
                log: log.display().to_string(),
                tail: log_tail(log, 20),
            });
        }
        if let Ok(Ok(r)) =
            tokio::time::timeout(Duration::from_secs(2), http.get(&readiness).send()).await
        {
            let ok = r.status().is_success();
            let text = r.text().await.unwrap_or_default();
            let healthy = serde_json::from_str::<serde_json::Value>(&text)
                .ok()
                .and_then(|v| v.get("healthy_workers").and_then(serde_json::Value::as_u64));
            if ok && healthy.is_some_and(|h| h as usize >= workers) {
                return Ok(());
            }
            last = text;
        }
        if Instant::now() >= deadline {
            return Err(FleetError::NotReady {
                what: format!("peer router ({url}/readiness said {last:?})"),
                secs: timeout.as_secs_f64(),
                log: log.display().to_string(),
                tail: log_tail(log, 20),
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn engines() -> Vec<PeerEngine> {
        (0..2)
            .map(|i| PeerEngine {
                url: format!("http://127.0.0.1:800{i}"),
                kv_events: format!("tcp://127.0.0.1:900{i}"),
                kv_replay: Some(format!("tcp://127.0.0.1:910{i}")),
            })
            .collect()
    }

    #[test]
    fn names_round_trip_and_unknown_ones_list_the_known() {
        for a in PEER_ARMS {
            assert_eq!(PeerArm::parse(a.name()).unwrap(), *a);
        }
        let e = PeerArm::parse("smg:kv_aware").unwrap_err();
        assert!(e.contains("vllm-router:kv_aware"), "{e}");
    }

    #[test]
    fn kv_aware_gets_every_engines_event_and_replay_source() {
        let e = engines();
        let launch = |arm| PeerLaunch {
            arm,
            port: 3000,
            metrics_port: 3001,
            engines: &e,
            served_model_name: "sim-gpt-oss",
            block_size: 16,
        };
        let kv = args(&launch(PeerArm::parse("vllm-router:kv_aware").unwrap())).join(" ");
        for want in [
            "--policy kv_aware",
            "--kv-event-source http://127.0.0.1:8000=tcp://127.0.0.1:9000",
            "--kv-event-source http://127.0.0.1:8001=tcp://127.0.0.1:9001",
            "--kv-event-replay-source http://127.0.0.1:8001=tcp://127.0.0.1:9101",
            "--kv-event-block-size 16",
            "--kv-event-model sim-gpt-oss",
            "--prometheus-port 3001",
        ] {
            assert!(kv.contains(want), "{want} missing in {kv}");
        }
        assert!(kv.ends_with("--worker-urls http://127.0.0.1:8000 http://127.0.0.1:8001"));
        assert!(!kv.contains("session-affinity"), "{kv}");
        let sessions = args(&launch(
            PeerArm::parse("vllm-router:kv_aware_sessions").unwrap(),
        ))
        .join(" ");
        for want in [
            "--policy kv_aware ",
            "--kv-aware-session-affinity-ttl-secs 300",
            "--kv-event-source http://127.0.0.1:8001=tcp://127.0.0.1:9001",
        ] {
            assert!(sessions.contains(want), "{want} missing in {sessions}");
        }
        let rr = args(&launch(PeerArm::parse("vllm-router:round_robin").unwrap())).join(" ");
        assert!(!rr.contains("--kv-event"), "{rr}");
        let smg = args(&launch(PeerArm::parse("smg:cache_aware").unwrap()));
        assert_eq!(smg[0], "launch");
        assert!(smg.join(" ").contains("--policy cache_aware"));
    }

    #[test]
    fn a_missing_router_names_the_install_script() {
        let dir = tempfile::tempdir().unwrap();
        let arm = PeerArm::parse("smg:cache_aware").unwrap();
        let err = resolve(arm, Some(dir.path()), None).unwrap_err();
        assert!(err.contains("scripts/peer-routers.sh"), "{err}");
        assert!(err.contains("smg:cache_aware"), "{err}");
        // An installed one is found, with the version its dist-info names.
        let bin = dir.path().join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        std::fs::write(bin.join("smg"), "#!/bin/sh\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(bin.join("smg"), std::fs::Permissions::from_mode(0o755)).unwrap();
        let site = dir.path().join("lib/python3.11/site-packages");
        std::fs::create_dir_all(site.join("sglang_router-0.3.2.dist-info")).unwrap();
        let got = resolve(arm, Some(dir.path()), None).unwrap();
        assert_eq!(got.binary, bin.join("smg"));
        assert_eq!(got.version.as_deref(), Some("smg 0.3.2"));
    }
}
