//! Local fleet launcher: N engines plus the router as child processes of the same `kvmesh`
//! executable, each on its own loopback ports, logs in one folder, readiness waits on `/health`,
//! and every child killed on shutdown or drop.

use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::process::{Child, Command};

pub use crate::launch::{FleetError, KV_EVENTS_TOPIC, Role, log_tail};
use crate::peers::{self, PeerEngine, PeerLaunch};
use crate::router_config::{self, Arm, EndpointInfo};

fn one() -> usize {
    1
}
fn sim() -> String {
    "sim".into()
}
fn bs() -> usize {
    16
}
fn yes() -> bool {
    true
}
fn default_model() -> String {
    "sim-gpt-oss".into()
}

/// A group of identical engines in a fleet file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineGroup {
    #[serde(default = "one")]
    pub count: usize,
    /// `sim` or `model`.
    #[serde(default = "sim")]
    pub backend: String,
    /// Sim GPU profile (e.g. `gpt-oss-120b-h200`).
    #[serde(default)]
    pub profile: Option<String>,
    /// Real model name or path (backend `model`).
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default = "bs")]
    pub block_size: usize,
    #[serde(default)]
    pub num_gpu_blocks: Option<usize>,
    /// CPU tier size, e.g. `2GiB` (passed to the engine verbatim).
    #[serde(default)]
    pub cpu_offload_bytes: Option<String>,
    /// Sim KV payload bytes per token.
    #[serde(default)]
    pub sim_kv_bytes_per_token: Option<usize>,
    /// Divides all modelled time (sim).
    #[serde(default)]
    pub time_scale: Option<f64>,
    /// The sim engines' modelled P2P link (`--sim-link`: `llmd-h200`, `rdma-400g`, `tcp-100g`,
    /// `GBPS,MS` or `ladder`); unset = the engine's default (`llmd-h200`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sim_link: Option<String>,
    #[serde(default)]
    pub role: Role,
    /// Start the P2P transfer service.
    #[serde(default = "yes")]
    pub p2p: bool,
    #[serde(default)]
    pub max_model_len: Option<usize>,
    /// Extra engine flags appended verbatim.
    #[serde(default)]
    pub extra_args: Vec<String>,
}

impl Default for EngineGroup {
    fn default() -> Self {
        Self {
            count: 1,
            backend: sim(),
            profile: Some("gpt-oss-120b-h200".into()),
            model: None,
            block_size: 16,
            num_gpu_blocks: None,
            cpu_offload_bytes: None,
            sim_kv_bytes_per_token: None,
            time_scale: None,
            sim_link: None,
            role: Role::Both,
            p2p: true,
            max_model_len: None,
            extra_args: Vec::new(),
        }
    }
}

/// The router in a fleet file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouterSpec {
    /// Arm / scheduling profile name (`round-robin`, `affinity`, `load`, `load-p2p`, ...).
    #[serde(default = "default_profile")]
    pub profile: String,
    #[serde(default)]
    pub min_cached_token_delta: Option<usize>,
    /// Extra `kvmesh router` flags (not passed to a peer router).
    #[serde(default)]
    pub extra_args: Vec<String>,
    /// Peer arms (`vllm-router:…`, `smg:…`): the virtual environment holding the external
    /// router (default: `$KVMESH_PEER_VENV`, else `.venv-peers/` found upwards; see
    /// [`peers::venv_candidates`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer_venv: Option<PathBuf>,
    /// How many replicas of the router run, each with the same config (clients take them in
    /// turn, as a Kubernetes Service would).
    #[serde(default = "one")]
    pub replicas: usize,
}

fn default_profile() -> String {
    "load-p2p".into()
}

/// A fleet file (`kvmesh up fleet.yaml`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetSpec {
    #[serde(default = "default_model")]
    pub served_model_name: String,
    pub engines: Vec<EngineGroup>,
    /// `None` = engines only (e.g. a calibration pair).
    #[serde(default)]
    pub router: Option<RouterSpec>,
    /// Where logs and generated configs go (default: a fresh folder under the system temp dir).
    #[serde(default)]
    pub log_dir: Option<PathBuf>,
    /// Seconds to wait for every `/health`.
    #[serde(default)]
    pub ready_timeout_s: Option<f64>,
    /// Seed of the router's random choices (reproducible arms).
    #[serde(default)]
    pub seed: Option<u64>,
}

impl FleetSpec {
    pub fn from_yaml(text: &str) -> Result<Self, FleetError> {
        let spec: Self =
            serde_norway::from_str(text).map_err(|e| FleetError::Spec(e.to_string()))?;
        spec.validate()?;
        Ok(spec)
    }

    pub fn validate(&self) -> Result<(), FleetError> {
        if self.engines.iter().map(|g| g.count).sum::<usize>() == 0 {
            return Err(FleetError::Spec("the fleet has no engines".into()));
        }
        for g in &self.engines {
            if !matches!(g.backend.as_str(), "sim" | "model") {
                return Err(FleetError::Spec(format!(
                    "backend {:?} (sim|model)",
                    g.backend
                )));
            }
            if g.time_scale.is_some_and(|t| !(t.is_finite() && t > 0.0)) {
                return Err(FleetError::Spec("time_scale must be > 0".into()));
            }
        }
        if let Some(r) = &self.router {
            let arm = r.profile.parse::<Arm>().map_err(FleetError::Spec)?;
            let has = |role: Role| self.engines.iter().any(|g| g.count > 0 && g.role == role);
            let disaggregated = has(Role::Prefill) || has(Role::Decode);
            if arm.is_pd() && !(has(Role::Prefill) && has(Role::Decode)) {
                return Err(FleetError::Spec(format!(
                    "router profile {arm:?} needs engines with role: prefill and role: decode",
                    arm = arm.name()
                )));
            }
            check_block_sizes(&self.engines, router_block_size(arm, &self.engines)?)?;
            if !arm.is_pd() && disaggregated {
                return Err(FleetError::Spec(format!(
                    "router profile {:?} does not disaggregate, but the fleet has prefill/decode \
                     engines; use `pd` (P/D, history recomputed) or `pd-bidir` (P/D with \
                     bi-directional history pulls), or `pd-load` / `pd-load-bidir` (the same \
                     with the prefill leg placed by load)",
                    arm.name()
                )));
            }
        }
        Ok(())
    }

    /// The time scale of the fleet (of its first engine group; groups are expected to agree).
    pub fn time_scale(&self) -> f64 {
        self.engines
            .first()
            .and_then(|g| g.time_scale)
            .unwrap_or(1.0)
    }
}

/// The router's `block_size` in front of this fleet: its arm file's, or for a peer arm (which
/// is handed the first group's) that.
fn router_block_size(arm: Arm, engines: &[EngineGroup]) -> Result<usize, FleetError> {
    match router_config::arm_file(arm) {
        Some(yaml) => kvmesh_router::config::RouterConfig::from_yaml(yaml, Path::new(arm.name()))
            .map(|c| c.block_size)
            .map_err(|e| FleetError::Spec(e.to_string())),
        None => Ok(engines.first().map_or(16, |g| g.block_size)),
    }
}

/// Every engine group's block size is a multiple of the router's: otherwise the router's block
/// hashes never match the engines' KV events and every prefix looks cold (issue 37: a router at
/// 7 in front of engines at 16 was accepted).
fn check_block_sizes(engines: &[EngineGroup], router_block_size: usize) -> Result<(), FleetError> {
    for (i, g) in engines.iter().enumerate() {
        if g.block_size == 0 || router_block_size == 0 || g.block_size % router_block_size != 0 {
            return Err(FleetError::Spec(format!(
                "engines[{i}].block_size {} is not a multiple of the router's block_size {router_block_size}",
                g.block_size
            )));
        }
    }
    Ok(())
}

/// A running engine.
#[derive(Debug)]
pub struct EngineProc {
    pub name: String,
    pub url: String,
    pub port: u16,
    pub p2p_port: Option<u16>,
    pub kv_events_port: u16,
    /// Port of the KV-event replay socket (vLLM's `replay_endpoint`).
    pub kv_replay_port: Option<u16>,
    pub role: Role,
    pub log: PathBuf,
    child: Child,
}

/// A running router: `kvmesh router`, or an external peer router.
#[derive(Debug)]
pub struct RouterProc {
    pub url: String,
    pub port: u16,
    /// The generated `router.yaml`, or for a peer the file with its exact command line.
    pub config: PathBuf,
    pub log: PathBuf,
    /// Where its Prometheus metrics are (`{url}/metrics` for `kvmesh router`).
    pub metrics_url: String,
    /// The external router of a peer arm.
    pub peer: Option<peers::PeerArm>,
    /// e.g. `vllm-router 0.1.17` for a peer (when the installed version is known).
    pub version: Option<String>,
    child: Child,
}

/// A running fleet; dropping it kills every child.
#[derive(Debug)]
pub struct Fleet {
    pub engines: Vec<EngineProc>,
    /// The router (the first replica when there are several).
    pub router: Option<RouterProc>,
    /// The other replicas of the router.
    pub more_routers: Vec<RouterProc>,
    pub log_dir: PathBuf,
    pub served_model_name: String,
}

/// Picks a free loopback port (bind to :0, read, release).
pub fn free_port() -> Result<u16, FleetError> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    Ok(l.local_addr()?.port())
}

/// Fetch streams one peer address may run on a local fleet's producers (every engine is
/// 127.0.0.1 there); the engines' own default is `kvmesh_transfer`'s 4.
const LOCAL_FLEET_FETCHES_PER_PEER: usize = 64;

/// The engine command line for one engine of `group` (ports already chosen).
pub fn engine_args(
    group: &EngineGroup,
    served_model_name: &str,
    index: usize,
    port: u16,
    kv_events_port: u16,
    kv_replay_port: Option<u16>,
    p2p_port: Option<u16>,
) -> Vec<String> {
    let mut a: Vec<String> = vec![
        "engine".into(),
        "--host".into(),
        "127.0.0.1".into(),
        "--port".into(),
        port.to_string(),
        "--served-model-name".into(),
        served_model_name.into(),
        "--backend".into(),
        group.backend.clone(),
        "--block-size".into(),
        group.block_size.to_string(),
        "--engine-label".into(),
        index.to_string(),
    ];
    let mut push = |k: &str, v: String| {
        a.push(k.into());
        a.push(v);
    };
    if let Some(p) = &group.profile
        && group.backend == "sim"
    {
        push("--profile", p.clone());
    }
    if let Some(m) = &group.model {
        push("--model", m.clone());
    }
    if let Some(n) = group.num_gpu_blocks {
        push("--num-gpu-blocks", n.to_string());
    }
    if let Some(b) = &group.cpu_offload_bytes {
        push("--cpu-offload-bytes", b.clone());
    }
    if let Some(b) = group.sim_kv_bytes_per_token
        && group.backend == "sim"
    {
        push("--sim-kv-bytes-per-token", b.to_string());
    }
    if let Some(t) = group.time_scale {
        push("--time-scale", t.to_string());
    }
    if let Some(l) = &group.sim_link
        && group.backend == "sim"
    {
        push("--sim-link", l.clone());
    }
    if group.role != Role::Both {
        push("--role", group.role.as_str().into());
    }
    if let Some(l) = group.max_model_len {
        push("--max-model-len", l.to_string());
    }
    let mut events = serde_json::json!({
        "enable_kv_cache_events": true,
        "publisher": "zmq",
        // `*` = the engine binds (vLLM rule); the router connects to 127.0.0.1.
        "endpoint": format!("tcp://*:{kv_events_port}"),
        // vLLM's default (empty) topic: vllm-router 0.1.17's static `--kv-event-source` drops
        // messages under any other topic.
        "topic": KV_EVENTS_TOPIC,
    });
    if let Some(r) = kv_replay_port {
        // Lets a subscriber that joined late catch up (vllm-router's `--kv-event-replay-source`).
        events["replay_endpoint"] = format!("tcp://*:{r}").into();
    }
    push("--kv-events-config", events.to_string());
    if let Some(p) = p2p_port {
        push("--p2p-port", p.to_string());
        // Peers are other local engines: allow loopback only (remote_host is untrusted input).
        push("--p2p-allowed-peers", "127.0.0.1".into());
        // Every local engine pulls from 127.0.0.1, one address for the whole fleet: the
        // per-peer fetch cap (4) would queue fan-out beyond 4 pullers at the holder, an artefact
        // of one host, not of the modelled network.
        push(
            "--p2p-max-fetches-per-peer",
            LOCAL_FLEET_FETCHES_PER_PEER.to_string(),
        );
    }
    a.extend(group.extra_args.iter().cloned());
    a
}

impl Fleet {
    /// Starts every engine, waits for them, writes the router config for its arm, starts the
    /// router and waits for it. `exe` is the `kvmesh` executable.
    pub async fn launch(spec: &FleetSpec, exe: &Path, log_dir: &Path) -> Result<Self, FleetError> {
        spec.validate()?;
        std::fs::create_dir_all(log_dir)?;
        let ready = Duration::from_secs_f64(spec.ready_timeout_s.unwrap_or(60.0));
        // A peer arm whose router is not installed fails here, before any engine starts.
        let peer = match &spec.router {
            Some(r) => match r.profile.parse::<Arm>().map_err(FleetError::Spec)? {
                Arm::Peer(p) => Some((
                    p,
                    peers::resolve(p, r.peer_venv.as_deref(), Some(exe))
                        .map_err(FleetError::Spec)?,
                )),
                _ => None,
            },
            None => None,
        };
        let mut fleet = Fleet {
            engines: Vec::new(),
            router: None,
            more_routers: Vec::new(),
            log_dir: log_dir.to_owned(),
            served_model_name: spec.served_model_name.clone(),
        };
        let mut idx = 0usize;
        let mut groups = Vec::new();
        for group in &spec.engines {
            for _ in 0..group.count {
                let name = format!("engine-{idx}-{}", group.role.as_str());
                let log = log_dir.join(format!("{name}.log"));
                fleet.engines.push(spawn_engine(
                    exe,
                    group,
                    &spec.served_model_name,
                    idx,
                    name,
                    log,
                    None,
                )?);
                groups.push(group);
                idx += 1;
            }
        }
        let http = reqwest::Client::new();
        for (i, (e, group)) in fleet.engines.iter_mut().zip(groups).enumerate() {
            wait_ready_or_respawn(&http, exe, group, &spec.served_model_name, i, e, ready).await?;
        }
        let replicas = spec.router.as_ref().map_or(0, |r| r.replicas.max(1));
        for replica in 0..replicas {
            let router = match (&peer, &spec.router) {
                (Some((arm, install)), _) => {
                    fleet
                        .launch_peer(spec, *arm, install, &http, ready, replica)
                        .await?
                }
                (None, Some(r)) => {
                    fleet
                        .launch_router(spec, r, exe, &http, ready, replica)
                        .await?
                }
                (None, None) => break,
            };
            if fleet.router.is_none() {
                fleet.router = Some(router);
            } else {
                fleet.more_routers.push(router);
            }
        }
        Ok(fleet)
    }

    /// Starts replica `replica` of `kvmesh router` (0 is the first; its files carry no number).
    async fn launch_router(
        &self,
        spec: &FleetSpec,
        r: &RouterSpec,
        exe: &Path,
        http: &reqwest::Client,
        ready: Duration,
        replica: usize,
    ) -> Result<RouterProc, FleetError> {
        let log_dir = &self.log_dir;
        let suffix = replica_suffix(replica);
        {
            let config = log_dir.join(format!("router{suffix}.yaml"));
            std::fs::write(&config, self.render_router_config(spec, r)?)?;
            let port = free_port()?;
            let mut args: Vec<String> = vec![
                "router".into(),
                "--host".into(),
                "127.0.0.1".into(),
                "--port".into(),
                port.to_string(),
                "--config".into(),
                config.display().to_string(),
            ];
            args.extend(r.extra_args.iter().cloned());
            let log = log_dir.join(format!("router{suffix}.log"));
            let mut child = spawn(exe, &args, &log)?;
            let url = format!("http://127.0.0.1:{port}");
            wait_ready(http, &url, &mut child, "router", &log, ready).await?;
            Ok(RouterProc {
                metrics_url: format!("{url}/metrics"),
                url,
                port,
                config,
                log,
                peer: None,
                version: None,
                child,
            })
        }
    }

    /// The router YAML for the current engines: the arm's file with the fleet's endpoints (the
    /// router's static endpoint list), seed, pull threshold and clock.
    fn render_router_config(&self, spec: &FleetSpec, r: &RouterSpec) -> Result<String, FleetError> {
        let arm: Arm = r.profile.parse().map_err(FleetError::Spec)?;
        let endpoints: Vec<EndpointInfo> = self
            .engines
            .iter()
            .map(|e| EndpointInfo {
                name: e.name.clone(),
                url: e.url.clone(),
                kv_events: format!("tcp://127.0.0.1:{}", e.kv_events_port),
                p2p: e.p2p_port.map(|p| format!("127.0.0.1:{p}")),
                role: e.role,
            })
            .collect();
        let fleet = router_config::FleetRouter {
            endpoints: &endpoints,
            seed: spec.seed.unwrap_or(0),
            pull_threshold: r.min_cached_token_delta,
            time_scale: spec.time_scale(),
        };
        router_config::arm_yaml(arm, &fleet).map_err(FleetError::Spec)
    }

    /// Starts one more engine of `group` (named and numbered after the existing ones), waits
    /// until its `/health` answers and returns its index in [`Fleet::engines`]. The router does
    /// not know it yet: [`Fleet::publish_endpoints`] tells it (scale-out experiments).
    pub async fn add_engine(
        &mut self,
        exe: &Path,
        group: &EngineGroup,
        ready: Duration,
    ) -> Result<usize, FleetError> {
        let idx = self.engines.len();
        let name = format!("engine-{idx}-{}", group.role.as_str());
        let log = self.log_dir.join(format!("{name}.log"));
        let e = self
            .start_ready(exe, group, idx, name, log, ready, None)
            .await?;
        self.engines.push(e);
        Ok(idx)
    }

    /// Kills engine `idx` and starts a fresh one of `group` in its place: same name and, like a
    /// pod restarting behind its Service, the same ports (empty caches, counters from zero), so
    /// any router — a peer's fixed worker list too — finds it where it was. Waits until it
    /// answers `/health`. Returns whether the address changed (a port was taken meanwhile and
    /// fresh ones were picked): then [`Fleet::publish_endpoints`] must tell the router.
    pub async fn replace_engine(
        &mut self,
        idx: usize,
        exe: &Path,
        group: &EngineGroup,
        ready: Duration,
    ) -> Result<bool, FleetError> {
        let Some(old) = self.engines.get_mut(idx) else {
            return Err(FleetError::Spec(format!("no engine {idx} to replace")));
        };
        let _ = old.child.start_kill();
        let _ = tokio::time::timeout(Duration::from_secs(5), old.child.wait()).await;
        let name = old.name.clone();
        let _ = std::fs::rename(&old.log, old.log.with_extension("log.before-restart"));
        let log = old.log.clone();
        let ports = EnginePorts {
            http: old.port,
            kv_events: old.kv_events_port,
            kv_replay: old.kv_replay_port,
            p2p: old.p2p_port,
        };
        let url = old.url.clone();
        let e = self
            .start_ready(exe, group, idx, name, log, ready, Some(ports))
            .await?;
        let moved = e.url != url;
        self.engines[idx] = e;
        Ok(moved)
    }

    /// Starts engine number `idx` of `group` on `ports` (fresh ones when None, or when those
    /// turn out to be taken) and waits until it answers `/health`.
    #[allow(clippy::too_many_arguments)]
    async fn start_ready(
        &self,
        exe: &Path,
        group: &EngineGroup,
        idx: usize,
        name: String,
        log: PathBuf,
        ready: Duration,
        ports: Option<EnginePorts>,
    ) -> Result<EngineProc, FleetError> {
        let mut e = spawn_engine(exe, group, &self.served_model_name, idx, name, log, ports)?;
        let http = reqwest::Client::new();
        wait_ready_or_respawn(
            &http,
            exe,
            group,
            &self.served_model_name,
            idx,
            &mut e,
            ready,
        )
        .await?;
        Ok(e)
    }

    /// Rewrites the running `kvmesh router`'s config with the current engine list. The router
    /// watches its config file and re-applies the inline `endpoints:` list on change (static
    /// discovery, `docs/discovery.md`), so this is how an engine joins or leaves a running fleet.
    /// The file is replaced by rename so the watcher never reads a half-written list.
    pub fn publish_endpoints(&self, spec: &FleetSpec) -> Result<(), FleetError> {
        let (Some(router), Some(r)) = (&self.router, &spec.router) else {
            return Err(FleetError::Spec("the fleet has no router to tell".into()));
        };
        if router.peer.is_some() {
            return Err(FleetError::Spec(
                "a peer router's engine list is fixed at start".into(),
            ));
        }
        let tmp = router.config.with_extension("yaml.new");
        std::fs::write(&tmp, self.render_router_config(spec, r)?)?;
        std::fs::rename(&tmp, &router.config)?;
        Ok(())
    }

    /// Starts the external router of a peer arm in front of the (ready) engines.
    async fn launch_peer(
        &self,
        spec: &FleetSpec,
        arm: peers::PeerArm,
        install: &peers::PeerInstall,
        http: &reqwest::Client,
        ready: Duration,
        replica: usize,
    ) -> Result<RouterProc, FleetError> {
        let engines: Vec<PeerEngine> = self
            .engines
            .iter()
            .map(|e| PeerEngine {
                url: e.url.clone(),
                kv_events: format!("tcp://127.0.0.1:{}", e.kv_events_port),
                kv_replay: e.kv_replay_port.map(|p| format!("tcp://127.0.0.1:{p}")),
            })
            .collect();
        let block_size = spec.engines.first().map(|g| g.block_size).unwrap_or(16);
        let port = free_port()?;
        let metrics_port = free_port()?;
        // `RouterSpec::extra_args` are `kvmesh router` flags: not passed to a peer.
        let args = peers::args(&PeerLaunch {
            arm,
            port,
            metrics_port,
            engines: &engines,
            served_model_name: &spec.served_model_name,
            block_size,
        });
        let suffix = replica_suffix(replica);
        let log = self.log_dir.join(format!("router{suffix}.log"));
        let config = self.log_dir.join(format!("router{suffix}-command.txt"));
        let mut child = peers::spawn(&install.binary, &args, &log, &config)?;
        let url = format!("http://127.0.0.1:{port}");
        peers::wait_ready(http, &url, engines.len(), &mut child, &log, ready).await?;
        Ok(RouterProc {
            url,
            port,
            config,
            log,
            metrics_url: format!("http://127.0.0.1:{metrics_port}/metrics"),
            peer: Some(arm),
            version: install.version.clone(),
            child,
        })
    }

    /// Where clients should send requests, in turn: every router replica, else the first engine.
    pub fn entry_urls(&self) -> Vec<String> {
        match &self.router {
            Some(r) => std::iter::once(r)
                .chain(&self.more_routers)
                .map(|r| r.url.clone())
                .collect(),
            None => vec![self.entry_url().to_owned()],
        }
    }

    /// Where clients should send requests: the (first) router, else the first engine.
    pub fn entry_url(&self) -> &str {
        match &self.router {
            Some(r) => &r.url,
            None => self.engines.first().map(|e| e.url.as_str()).unwrap_or(""),
        }
    }

    /// A human summary of where everything is.
    pub fn describe(&self) -> String {
        let mut s = String::new();
        for r in self.router.iter().chain(&self.more_routers) {
            match r.peer {
                Some(p) => s.push_str(&format!(
                    "router   {}  peer {p} ({})  command {}  metrics {}  log {}\n",
                    r.url,
                    r.version.as_deref().unwrap_or("version unknown"),
                    r.config.display(),
                    r.metrics_url,
                    r.log.display()
                )),
                None => s.push_str(&format!(
                    "router   {}  config {}  log {}\n",
                    r.url,
                    r.config.display(),
                    r.log.display()
                )),
            }
        }
        for e in &self.engines {
            s.push_str(&format!(
                "{:<18} {}  role {:<7} kv-events tcp://127.0.0.1:{}  p2p {}  log {}\n",
                e.name,
                e.url,
                e.role.as_str(),
                e.kv_events_port,
                e.p2p_port
                    .map(|p| format!("127.0.0.1:{p}"))
                    .unwrap_or_else(|| "off".into()),
                e.log.display()
            ));
        }
        s
    }

    /// Returns the first child that has exited, if any (a crashed engine invalidates an arm).
    pub fn check_alive(&mut self) -> Option<String> {
        for r in self.router.iter_mut().chain(&mut self.more_routers) {
            if let Ok(Some(st)) = r.child.try_wait() {
                return Some(format!("router exited with {st} (log {})", r.log.display()));
            }
        }
        for e in &mut self.engines {
            if let Ok(Some(st)) = e.child.try_wait() {
                return Some(format!(
                    "{} exited with {st} (log {})",
                    e.name,
                    e.log.display()
                ));
            }
        }
        None
    }

    /// Stops the router first (no new work), then the engines; waits for each to exit.
    pub async fn shutdown(mut self) {
        for r in self.router.iter_mut().chain(&mut self.more_routers) {
            stop(&mut r.child).await;
        }
        for e in &mut self.engines {
            stop(&mut e.child).await;
        }
    }
}

/// What the files of router replica `replica` carry after `router`: nothing for the first,
/// `-2`, `-3`, … for the others.
fn replica_suffix(replica: usize) -> String {
    if replica == 0 {
        String::new()
    } else {
        format!("-{}", replica + 1)
    }
}

fn spawn(exe: &Path, args: &[String], log: &Path) -> Result<Child, FleetError> {
    let out = std::fs::File::create(log)?;
    let err = out.try_clone()?;
    let child = Command::new(exe)
        .args(args)
        .env(
            "KVMESH_LOG",
            std::env::var("KVMESH_LOG").unwrap_or_else(|_| "info".into()),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        .kill_on_drop(true)
        .spawn()?;
    Ok(child)
}

async fn stop(child: &mut Child) {
    if let Some(pid) = child.id() {
        // Polite first (SIGTERM lets servers drain), then forceful.
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(pid.to_string())
            .status()
            .await;
        if tokio::time::timeout(Duration::from_secs(3), child.wait())
            .await
            .is_ok()
        {
            return;
        }
    }
    let _ = child.start_kill();
    let _ = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
}

/// GET `{url}/metrics` with a timeout.
pub async fn scrape(http: &reqwest::Client, url: &str) -> Result<String, String> {
    let fut = async {
        let r = http
            .get(format!("{url}/metrics"))
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if !r.status().is_success() {
            return Err(format!("HTTP {}", r.status()));
        }
        r.text().await.map_err(|e| e.to_string())
    };
    tokio::time::timeout(Duration::from_secs(10), fut)
        .await
        .map_err(|_| "timeout".to_owned())?
}

/// Relaunches of an engine whose port was taken between `free_port` and its bind.
const PORT_RETRIES: usize = 3;

/// Waits until `e` answers `/health`. `free_port` releases a port before the engine binds it, so
/// another process on a busy machine can take it first: an engine that exited with "Address
/// already in use" is started again on fresh ports (its log kept aside), up to [`PORT_RETRIES`].
async fn wait_ready_or_respawn(
    http: &reqwest::Client,
    exe: &Path,
    group: &EngineGroup,
    served_model_name: &str,
    idx: usize,
    e: &mut EngineProc,
    ready: Duration,
) -> Result<(), FleetError> {
    let mut attempt = 0;
    loop {
        match wait_ready(http, &e.url, &mut e.child, &e.name, &e.log, ready).await {
            Ok(()) => return Ok(()),
            Err(FleetError::Exited { .. })
                if attempt < PORT_RETRIES
                    && std::fs::read_to_string(&e.log)
                        .is_ok_and(|t| t.contains("Address already in use")) =>
            {
                attempt += 1;
                let _ = std::fs::rename(&e.log, e.log.with_extension(format!("log.{attempt}")));
                *e = spawn_engine(
                    exe,
                    group,
                    served_model_name,
                    idx,
                    e.name.clone(),
                    e.log.clone(),
                    None,
                )?;
            }
            Err(err) => return Err(err),
        }
    }
}

/// An engine's listening ports.
#[derive(Debug, Clone, Copy)]
struct EnginePorts {
    http: u16,
    kv_events: u16,
    kv_replay: Option<u16>,
    p2p: Option<u16>,
}

/// Starts engine number `idx` of `group` on `ports`, or on fresh ones.
fn spawn_engine(
    exe: &Path,
    group: &EngineGroup,
    served_model_name: &str,
    idx: usize,
    name: String,
    log: PathBuf,
    ports: Option<EnginePorts>,
) -> Result<EngineProc, FleetError> {
    let ports = match ports {
        Some(p) => p,
        None => EnginePorts {
            http: free_port()?,
            kv_events: free_port()?,
            kv_replay: Some(free_port()?),
            p2p: if group.p2p { Some(free_port()?) } else { None },
        },
    };
    let (port, kv_events_port, kv_replay_port, p2p_port) =
        (ports.http, ports.kv_events, ports.kv_replay, ports.p2p);
    let args = engine_args(
        group,
        served_model_name,
        idx,
        port,
        kv_events_port,
        kv_replay_port,
        p2p_port,
    );
    let child = spawn(exe, &args, &log)?;
    Ok(EngineProc {
        name,
        url: format!("http://127.0.0.1:{port}"),
        port,
        p2p_port,
        kv_events_port,
        kv_replay_port,
        role: group.role,
        log,
        child,
    })
}

async fn wait_ready(
    http: &reqwest::Client,
    url: &str,
    child: &mut Child,
    what: &str,
    log: &Path,
    timeout: Duration,
) -> Result<(), FleetError> {
    let deadline = Instant::now() + timeout;
    let health = format!("{url}/health");
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(FleetError::Exited {
                what: what.into(),
                status: status.to_string(),
                log: log.display().to_string(),
                tail: log_tail(log, 20),
            });
        }
        if let Ok(Ok(r)) =
            tokio::time::timeout(Duration::from_secs(2), http.get(&health).send()).await
            && r.status().is_success()
        {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(FleetError::NotReady {
                what: what.into(),
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
    use super::*;

    #[test]
    fn fleet_yaml_parses_with_defaults_and_rejects_typos() {
        let s = FleetSpec::from_yaml(
            "engines:\n  - count: 4\n    profile: gpt-oss-120b-h200\n    time_scale: 10\nrouter:\n  profile: load-p2p\n",
        )
        .unwrap();
        assert_eq!(s.engines[0].count, 4);
        assert_eq!(s.engines[0].backend, "sim");
        assert!(s.engines[0].p2p);
        assert_eq!(s.time_scale(), 10.0);
        assert!(FleetSpec::from_yaml("engines:\n  - cuont: 4\n").is_err());
        assert!(FleetSpec::from_yaml("engines: []\n").is_err());
        assert!(FleetSpec::from_yaml("engines:\n  - {}\nrouter:\n  profile: nope\n").is_err());
    }

    #[test]
    fn engine_block_sizes_must_be_multiples_of_the_routers() {
        let spec = |bs: usize| {
            format!("engines:\n  - {{count: 2, block_size: {bs}}}\nrouter:\n  profile: load-p2p\n")
        };
        assert!(FleetSpec::from_yaml(&spec(16)).is_ok());
        assert!(FleetSpec::from_yaml(&spec(32)).is_ok());
        let err = FleetSpec::from_yaml(&spec(8)).unwrap_err().to_string();
        assert!(
            err.contains("engines[0].block_size 8") && err.contains("router's block_size 16"),
            "{err}"
        );
        // Engines only: nothing to agree with.
        assert!(FleetSpec::from_yaml("engines:\n  - {block_size: 8}\n").is_ok());
    }

    #[test]
    fn engine_args_carry_every_setting() {
        let g = EngineGroup {
            num_gpu_blocks: Some(100),
            cpu_offload_bytes: Some("1GiB".into()),
            time_scale: Some(4.0),
            sim_link: Some("tcp-100g".into()),
            role: Role::Decode,
            ..Default::default()
        };
        let a = engine_args(&g, "m", 0, 8000, 9000, Some(9100), Some(7000)).join(" ");
        for want in [
            "--sim-link tcp-100g",
            "engine",
            "--port 8000",
            "--profile gpt-oss-120b-h200",
            "--num-gpu-blocks 100",
            "--cpu-offload-bytes 1GiB",
            "--time-scale 4",
            "--role decode",
            "--p2p-port 7000",
            "--p2p-max-fetches-per-peer 64",
            "tcp://*:9000",
            "tcp://*:9100",
        ] {
            assert!(a.contains(want), "{want} missing in {a}");
        }
        let no_p2p = engine_args(
            &EngineGroup {
                p2p: false,
                ..Default::default()
            },
            "m",
            0,
            1,
            2,
            None,
            None,
        )
        .join(" ");
        assert!(!no_p2p.contains("--p2p-port") && !no_p2p.contains("--role"));
    }

    #[test]
    fn every_shipped_fleet_file_parses() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../configs");
        let mut n = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let p = entry.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            if name.starts_with("fleet-") && name.ends_with(".yaml") {
                FleetSpec::from_yaml(&std::fs::read_to_string(&p).unwrap())
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
                n += 1;
            }
        }
        assert!(n >= 2);
    }

    #[tokio::test]
    async fn a_child_that_exits_is_reported_with_its_log() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("x.log");
        let mut child = spawn(
            Path::new("sh"),
            &["-c".into(), "echo boom; exit 3".into()],
            &log,
        )
        .unwrap();
        let http = reqwest::Client::new();
        let port = free_port().unwrap();
        let err = wait_ready(
            &http,
            &format!("http://127.0.0.1:{port}"),
            &mut child,
            "x",
            &log,
            Duration::from_secs(5),
        )
        .await
        .unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("exited") && msg.contains("boom"), "{msg}");
    }

    /// An engine that lost its port to another process is relaunched on fresh ports (here it
    /// always loses, so launch fails after the retries, each attempt's log kept).
    #[tokio::test]
    async fn a_port_collision_is_retried_on_fresh_ports() {
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join("fake-kvmesh");
        std::fs::write(
            &exe,
            "#!/bin/sh\necho 'Error: starting engine'\necho 'Address already in use (os error 98)'\nexit 1\n",
        )
        .unwrap();
        std::process::Command::new("chmod")
            .arg("+x")
            .arg(&exe)
            .status()
            .unwrap();
        let spec = FleetSpec::from_yaml("engines: [{count: 1}]\nready_timeout_s: 5\n").unwrap();
        let err = tokio::time::timeout(
            Duration::from_secs(60),
            Fleet::launch(&spec, &exe, dir.path()),
        )
        .await
        .unwrap()
        .unwrap_err();
        assert!(err.to_string().contains("Address already in use"), "{err}");
        for attempt in 1..=PORT_RETRIES {
            assert!(
                dir.path()
                    .join(format!("engine-0-both.log.{attempt}"))
                    .exists(),
                "attempt {attempt} log missing"
            );
        }
    }
}
