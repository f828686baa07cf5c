//! `kvmesh up | bench | calibrate | demo`: launch a local fleet, run the reference experiments as
//! A/B arms on fresh fleets, price the P2P transfer, and the README's one-command demo.
//!
//! ```text
//! kvmesh up configs/fleet-sim4.yaml
//! kvmesh bench --workload fork --arms load,load-p2p --scale quick --out results/fork
//! kvmesh calibrate --profile gpt-oss-120b-h200            # fresh local pair
//! kvmesh calibrate --consumer http://a:8000 --source http://b:8000 --source-p2p b:7777
//! kvmesh demo
//! ```

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use kvmesh_bench::calibrate::{self, DEFAULT_LENGTHS, PairConfig};
use kvmesh_bench::catalog;
use kvmesh_bench::client::PromptFormat;
use kvmesh_bench::fleet::{EngineGroup, Fleet, FleetSpec};
use kvmesh_bench::peers;
use kvmesh_bench::runner::{self, FleetOptions, Plan};
use kvmesh_bench::tokens::TokenSpace;
use kvmesh_bench::workload::{Scale, WorkloadOptions};
use kvmesh_bench::{Arm, BenchReport};

#[derive(clap::Args)]
pub struct UpCmd {
    /// Fleet file (YAML): engines (count, backend, profile, block size, GPU blocks, CPU bytes,
    /// time scale, role, p2p) and the router profile. Examples in `configs/fleet-*.yaml`.
    pub fleet: PathBuf,
    /// Folder for logs and the generated router config (default: a fresh temp folder).
    #[arg(long)]
    pub log_dir: Option<PathBuf>,
    /// Override the router profile (arm) of the file.
    #[arg(long)]
    pub profile: Option<String>,
}

#[derive(clap::Args)]
pub struct BenchCmd {
    /// Workload(s): ladder, fork, pool, pool@RATE, docqa, docqa-warm, agentic (with its no-gap
    /// control agentic-nogap), agentic-paced (agentic's sessions, each at its own pace),
    /// agentic-pd, restart, restart-agg, fanout, fanout@N, fanout-waves@N (4 children, then
    /// the other N − 4 together 600 ms later), skew, skew@S, skew-heavy,
    /// skew-heavy@S, scaleout, trace:<file.jsonl>.
    #[arg(long, value_delimiter = ',', required = true)]
    pub workload: Vec<String>,
    /// Router arms, compared in order (the first is the baseline): round-robin, affinity, load,
    /// load-p2p, affinity-p2p, cost-p2p, ttft and ttft-p2p (the default placement: predicted
    /// TTFT with an admission queue, without / with priced pulls); P/D workloads (agentic-pd): pd, pd-bidir (prefill leg
    /// by prefix affinity), pd-load, pd-load-bidir (prefill leg by load, no affinity); `-bidir`
    /// arms pull the conversation history from the decoder; agentic: affinity-p2p-prefetch and
    /// ttft-p2p-prefetch add prefetch ahead of a session's next turn; affinity-p2p-replicate,
    /// ttft-p2p-replicate, and without on-demand pulls affinity-replicate, ttft-replicate, copy
    /// hot prefixes to a second holder ahead of demand. Peer routers in front of the same
    /// engines (install: `bash scripts/peer-routers.sh`): vllm-router:round_robin,
    /// vllm-router:cache_aware, vllm-router:kv_aware, vllm-router:kv_aware_sessions (its
    /// session affinity on, keyed by the client's X-Session-ID), vllm-router:power_of_two,
    /// smg:cache_aware, smg:round_robin.
    #[arg(long, value_delimiter = ',', default_value = "load,load-p2p")]
    pub arms: Vec<String>,
    /// Virtual environment with the peer routers (default: $KVMESH_PEER_VENV, else
    /// `.venv-peers/` in the working directory or above, as `scripts/peer-routers.sh` makes it).
    #[arg(long)]
    pub peer_venv: Option<PathBuf>,
    /// Run N replicas of each arm's router (kvmesh and peers alike), each with the same config;
    /// the client sends its requests to them in turn, as a Kubernetes Service would.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=8))]
    pub router_replicas: u64,
    /// How the client sends prompts: `text` (default; the same characters as the token ids on
    /// the byte-tokenizer sim engines, and what cache-aware peers match on) or `tokens` (id
    /// lists; smg rejects them).
    #[arg(long, default_value = "text")]
    pub prompt_format: PromptFormat,
    /// `quick` keeps each shape but shrinks counts/lengths/time; `full` is the published size.
    #[arg(long, default_value = "quick")]
    pub scale: String,
    /// Output folder (report.json, report.md, SVG plots, logs/).
    #[arg(long, default_value = "kvmesh-bench-out")]
    pub out: PathBuf,
    /// Speeds up the sim fleet: compute, pulls, arrival gaps and timeouts are divided by it.
    /// Reported times are converted back to model time.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Seed of every token sequence and arrival process.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Sim GPU profile of the engines.
    #[arg(long, default_value = "gpt-oss-120b-h200")]
    pub profile: String,
    /// Override the workload's number of (aggregated) engines.
    #[arg(long)]
    pub engines: Option<usize>,
    /// Override the workload's P2P pull threshold (tokens): the arm file's `min_pull_tokens`
    /// (predicted-ttft-scorer) or `min_cached_token_delta` (p2p-source-producer).
    #[arg(long)]
    pub min_cached_token_delta: Option<usize>,
    /// `pool`: offered rates (req/s), e.g. 4,8,12,16.
    #[arg(long, value_delimiter = ',')]
    pub rates: Option<Vec<f64>>,
    /// `trace`: timestamp speed-up (2 = twice as fast).
    #[arg(long)]
    pub speed: Option<f64>,
    /// `trace`: replayed window START:LENGTH in trace seconds, e.g. 0:300.
    #[arg(long)]
    pub window: Option<String>,
    /// Extra flags for every engine (repeatable), e.g. --engine-arg=--max-num-seqs=64.
    #[arg(long = "engine-arg", allow_hyphen_values = true)]
    pub engine_args: Vec<String>,
    /// The sim engines' modelled P2P link (`kvmesh engine --sim-link`): llmd-h200 (the
    /// engine's default), rdma-400g, tcp-100g, GBPS,MS, or ladder (the published pull ladder
    /// replayed by token count, blind to bytes and contention).
    #[arg(long)]
    pub sim_link: Option<String>,
    /// Hide progress bars.
    #[arg(long)]
    pub no_progress: bool,
    /// Runs of every (workload, arm), each on a fresh fleet, interleaved round by round (round
    /// 1 runs every arm, then round 2, …). With more than one run the report pools each arm's
    /// requests and shows the spread between runs; every arm is also paired request by request
    /// with the first arm (the control).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub repeat: u32,
}

#[derive(clap::Args)]
pub struct CalibrateCmd {
    /// Consumer engine URL (pulls).
    #[arg(long, requires = "source")]
    pub consumer: Option<String>,
    /// Source engine URL (seeded, serves the pull).
    #[arg(long, requires = "consumer")]
    pub source: Option<String>,
    /// Source P2P address as the consumer dials it (HOST:PORT); default: source host, port 7777.
    #[arg(long)]
    pub source_p2p: Option<String>,
    /// Start a fresh local sim pair with this profile instead of using URLs.
    #[arg(long, conflicts_with = "consumer")]
    pub profile: Option<String>,
    /// Prefix lengths (tokens).
    #[arg(long, value_delimiter = ',')]
    pub lengths: Option<Vec<usize>>,
    /// Repetitions per length (after a warm-up pull).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Threshold = crossover × margin (rounded up to whole blocks).
    #[arg(long, default_value_t = 1.5)]
    pub margin: f64,
    /// Time scale of the sim engines (local pair: also passed to them); times are reported in
    /// model time.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Model name for requests (default: the consumer's /v1/models).
    #[arg(long)]
    pub model: Option<String>,
    /// Set the P2P pull threshold (`min_pull_tokens` / `min_cached_token_delta`) in this router
    /// config to the recommendation.
    #[arg(long)]
    pub write_config: Option<PathBuf>,
    /// Also write the result as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

#[derive(clap::Args)]
pub struct DemoCmd {
    /// Output folder for the report and plots.
    #[arg(long, default_value = "kvmesh-demo")]
    pub out: PathBuf,
    /// Sim speed-up (default chosen so the demo takes a few minutes on 2 cores).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// `full` runs the published sizes (long).
    #[arg(long, default_value = "quick")]
    pub scale: String,
    /// The transfer ladder on one real-model pair (needs `kvmesh model fetch smollm2`).
    #[arg(long)]
    pub real: bool,
    /// Model file/directory for --real (default: the SmolLM2 fetched by `kvmesh model fetch`).
    #[arg(long)]
    pub model_path: Option<String>,
    #[arg(long)]
    pub no_progress: bool,
}

fn exe() -> anyhow::Result<PathBuf> {
    std::env::current_exe().context("locating the kvmesh executable")
}

fn default_log_dir(tag: &str) -> PathBuf {
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    std::env::temp_dir().join(format!("kvmesh-{tag}-{stamp}-{}", std::process::id()))
}

pub async fn run_up(args: UpCmd) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&args.fleet)
        .with_context(|| format!("reading {}", args.fleet.display()))?;
    let mut spec = FleetSpec::from_yaml(&text)?;
    if let (Some(p), Some(r)) = (&args.profile, spec.router.as_mut()) {
        r.profile = p.clone();
    }
    spec.validate()?;
    let log_dir = args
        .log_dir
        .or_else(|| spec.log_dir.clone())
        .unwrap_or_else(|| default_log_dir("fleet"));
    eprintln!(
        "starting fleet from {} (logs in {})",
        args.fleet.display(),
        log_dir.display()
    );
    let fleet = Fleet::launch(&spec, &exe()?, &log_dir).await?;
    println!("{}", fleet.describe());
    println!(
        "send requests to {}/v1/completions — Ctrl-C stops everything",
        fleet.entry_url()
    );
    let mut fleet = fleet;
    // SIGTERM/SIGHUP as well as Ctrl-C: children must not outlive the launcher.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
            _ = hup.recv() => break,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {
                if let Some(dead) = fleet.check_alive() {
                    eprintln!("{dead}; stopping the fleet");
                    fleet.shutdown().await;
                    bail!("a fleet process exited");
                }
            }
        }
    }
    eprintln!("stopping fleet");
    fleet.shutdown().await;
    Ok(())
}

/// Runs `fut` until it finishes or Ctrl-C/SIGTERM arrives; interrupting drops the future, and
/// with it any running fleet (children are killed on drop).
async fn interruptible<T>(
    what: &str,
    fut: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = fut => r,
        _ = tokio::signal::ctrl_c() => bail!("interrupted; {what}"),
        _ = term.recv() => bail!("terminated; {what}"),
    }
}

async fn run_interruptible(plan: &Plan) -> anyhow::Result<BenchReport> {
    let partial = format!("partial results in {}", plan.out_dir.display());
    interruptible(&partial, async { Ok(runner::run(plan).await?) }).await
}

fn parse_window(s: &str) -> anyhow::Result<(f64, f64)> {
    let (a, b) = s.split_once(':').context("--window START:LENGTH")?;
    Ok((
        a.parse().context("window start")?,
        b.parse().context("window length")?,
    ))
}

fn parse_arms(arms: &[String]) -> anyhow::Result<Vec<Arm>> {
    arms.iter()
        .map(|a| a.parse::<Arm>().map_err(anyhow::Error::msg))
        .collect()
}

fn print_outcome(report: &BenchReport, out: &Path) {
    println!("\n{}", report.side_by_side());
    println!("results: {}", out.display());
    if let Ok(entries) = std::fs::read_dir(out) {
        let mut files: Vec<_> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.extension()
                    .is_some_and(|x| x == "svg" || x == "json" || x == "md")
            })
            .collect();
        files.sort();
        for f in files {
            println!("  {}", f.display());
        }
    }
    let flagged: Vec<_> = report
        .results
        .iter()
        .filter(|r| !r.flags.is_empty())
        .collect();
    for r in flagged {
        eprintln!("FLAG {} / {}: {}", r.workload, r.arm, r.flags.join("; "));
    }
}

pub async fn run_bench(args: BenchCmd) -> anyhow::Result<()> {
    let scale: Scale = args.scale.parse()?;
    let arms = parse_arms(&args.arms)?;
    let opts = WorkloadOptions {
        rates: args.rates.clone(),
        speed: args.speed,
        window: args.window.as_deref().map(parse_window).transpose()?,
        token_space: None,
    };
    let mut workloads = Vec::new();
    for w in &args.workload {
        workloads.extend(catalog::build(w, scale, args.seed, &opts)?);
    }
    if let Some(n) = args.engines {
        // The description names the workload's own engine count; say what actually ran.
        for w in workloads.iter_mut().filter(|w| w.fleet.prefill == 0) {
            w.description
                .push_str(&format!(" (run on {n} engines: --engines)"));
        }
    }
    // A P/D workload under an aggregated arm (or the reverse) would not measure what it says:
    // refuse before starting any fleet.
    for w in &workloads {
        for &arm in &arms {
            runner::fleet_for(w, arm, &FleetOptions::default())
                .validate()
                .with_context(|| format!("workload {} / arm {}", w.name, arm.name()))?;
        }
    }
    let plan = Plan {
        workloads,
        arms,
        exe: exe()?,
        out_dir: args.out.clone(),
        fleet: FleetOptions {
            profile: Some(args.profile.clone()),
            time_scale: args.time_scale,
            engines: args.engines,
            min_cached_token_delta: args.min_cached_token_delta,
            extra_engine_args: args.engine_args.clone(),
            sim_link: args.sim_link.clone(),
            peer_venv: args.peer_venv.clone(),
            router_replicas: args.router_replicas as usize,
            ..Default::default()
        },
        command: std::env::args().collect::<Vec<_>>().join(" "),
        scale: args.scale.clone(),
        seed: args.seed,
        prompt_format: args.prompt_format,
        progress: !args.no_progress,
        settle: Duration::from_millis(1500),
        repeat: args.repeat,
    };
    // Say up front which peer arms cannot run (each still fails in the report, never skipped).
    let exe_path = plan.exe.clone();
    for &arm in &plan.arms {
        if let Arm::Peer(p) = arm
            && let Err(e) = peers::resolve(p, args.peer_venv.as_deref(), Some(&exe_path))
        {
            eprintln!("WARNING: {e}");
        }
    }
    let report = run_interruptible(&plan).await?;
    print_outcome(&report, &args.out);
    let failed: Vec<String> = report
        .results
        .iter()
        .filter(|r| r.flags.iter().any(|f| f.starts_with("FAILED TO RUN")))
        .map(|r| format!("{} / {}", r.workload, r.arm))
        .collect();
    if !failed.is_empty() {
        bail!(
            "{} arm(s) failed to run: {} (see the FLAG lines above)",
            failed.len(),
            failed.join(", ")
        );
    }
    Ok(())
}

fn host_of(url: &str) -> String {
    let rest = url.split("://").nth(1).unwrap_or(url);
    let hostport = rest.split('/').next().unwrap_or(rest);
    match hostport.rsplit_once(':') {
        Some((h, _)) => h.to_owned(),
        None => hostport.to_owned(),
    }
}

fn parse_host_port(s: &str) -> anyhow::Result<(String, u16)> {
    let (h, p) = s.rsplit_once(':').context("expected HOST:PORT")?;
    Ok((h.to_owned(), p.parse().context("port")?))
}

/// Runs the ladder on a pair (URLs, or a fresh local pair) and prints/writes the result.
async fn calibrate_pair(
    args: &CalibrateCmd,
    backend: &str,
    model_path: Option<String>,
    token_space: TokenSpace,
) -> anyhow::Result<calibrate::Calibration> {
    let lengths = args
        .lengths
        .clone()
        .unwrap_or_else(|| DEFAULT_LENGTHS.to_vec());
    let max_len = lengths.iter().copied().max().unwrap_or(0);
    let mut local: Option<Fleet> = None;
    let (consumer, source, source_p2p) = match (&args.consumer, &args.source) {
        (Some(c), Some(s)) => {
            let p2p = match &args.source_p2p {
                Some(x) => parse_host_port(x)?,
                None => (host_of(s), 7777),
            };
            (c.clone(), s.clone(), p2p)
        }
        _ => {
            let profile = args
                .profile
                .clone()
                .unwrap_or_else(|| "gpt-oss-120b-h200".into());
            let gpu_blocks = (max_len * 4).div_ceil(args.block_size).max(4096);
            let group = EngineGroup {
                count: 2,
                backend: backend.into(),
                profile: (backend == "sim").then(|| profile.clone()),
                model: model_path.clone(),
                block_size: args.block_size,
                num_gpu_blocks: Some(gpu_blocks),
                // The source serves pulls from its CPU tier, so the tier must hold every prefix
                // measured. The sim's payload is 16 B/token; a real model's KV is far larger
                // (SmolLM2 in f32: 46 KB/token, a 2K prefix 94 MB), and a tier sized for the sim
                // held no real prefix beyond 128 tokens: every pull found nothing.
                cpu_offload_bytes: Some(if backend == "sim" {
                    (2 * gpu_blocks * args.block_size * 64).to_string()
                } else {
                    "2GiB".to_owned()
                }),
                sim_kv_bytes_per_token: (backend == "sim").then_some(16),
                time_scale: (backend == "sim").then_some(args.time_scale),
                max_model_len: Some(max_len + 1024),
                ..Default::default()
            };
            let spec = FleetSpec {
                served_model_name: if backend == "sim" {
                    "sim-gpt-oss".into()
                } else {
                    "smollm2".into()
                },
                engines: vec![group],
                router: None,
                log_dir: None,
                ready_timeout_s: Some(300.0),
                seed: Some(args.seed),
            };
            let dir = default_log_dir("calibrate");
            let what = if backend == "sim" {
                profile.clone()
            } else {
                model_path
                    .clone()
                    .unwrap_or_else(|| "fetched SmolLM2".into())
            };
            eprintln!(
                "starting a local {backend} pair ({what}), logs in {}",
                dir.display()
            );
            let fleet = Fleet::launch(&spec, &exe()?, &dir).await?;
            let c = fleet.engines[0].url.clone();
            let s = fleet.engines[1].url.clone();
            let p = fleet.engines[1]
                .p2p_port
                .context("source has no P2P port")?;
            local = Some(fleet);
            (c, s, ("127.0.0.1".to_owned(), p))
        }
    };
    let model = match &args.model {
        Some(m) if args.consumer.is_some() => m.clone(),
        _ => calibrate::served_model(&consumer).await?,
    };
    let cfg = PairConfig {
        consumer_url: consumer,
        source_url: source,
        source_p2p,
        model,
        lengths,
        reps: args.reps,
        time_scale: args.time_scale,
        token_space,
        seed: args.seed,
        block_size: args.block_size,
        margin: args.margin,
        offload_wait: Duration::from_millis(300),
    };
    println!("| prefix tokens | recompute | P2P pull |");
    println!("|---|---|---|");
    let result = calibrate::calibrate(&cfg, |r| {
        println!(
            "| {} | {:.0} ms | {:.0} ms |",
            r.prefix_tokens, r.recompute_ms, r.pull_ms
        );
    })
    .await;
    if let Some(f) = local {
        f.shutdown().await;
    }
    let cal = result?;
    println!("\n{}", cal.markdown());
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_vec_pretty(&cal)?)?;
        println!("wrote {}", path.display());
    }
    if let Some(path) = &args.write_config {
        if !cal.verified {
            bail!(
                "not writing {}: the pulls were not verified",
                path.display()
            );
        }
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let out = calibrate::write_threshold(&text, cal.recommended_min_cached_token_delta)?;
        std::fs::write(path, out)?;
        println!(
            "set the pull threshold to {} tokens in {}",
            cal.recommended_min_cached_token_delta,
            path.display()
        );
    }
    Ok(cal)
}

pub async fn run_calibrate(args: CalibrateCmd) -> anyhow::Result<()> {
    interruptible(
        "calibration stopped",
        calibrate_pair(&args, "sim", None, TokenSpace::default()),
    )
    .await
    .map(|_| ())
}

pub async fn run_demo(args: DemoCmd) -> anyhow::Result<()> {
    if args.real {
        let cal = CalibrateCmd {
            consumer: None,
            source: None,
            source_p2p: None,
            profile: None,
            lengths: Some(vec![128, 256, 512, 1024, 2048]),
            reps: 2,
            margin: 1.5,
            time_scale: 1.0,
            block_size: 16,
            model: None,
            write_config: None,
            json: Some(args.out.join("real-ladder.json")),
            seed: 1,
        };
        std::fs::create_dir_all(&args.out)?;
        // Real vocabularies are larger than bytes; stay inside a common range.
        let space = TokenSpace {
            lo: 1000,
            hi: 20000,
        };
        interruptible(
            "real ladder stopped",
            calibrate_pair(&cal, "model", args.model_path.clone(), space),
        )
        .await?;
        return Ok(());
    }
    let scale: Scale = args.scale.parse()?;
    let mut workloads = catalog::build("fork", scale, 1, &WorkloadOptions::default())?;
    let pool_rate = match scale {
        Scale::Quick => "pool@12",
        Scale::Full => "pool@16",
    };
    workloads.extend(catalog::build(
        pool_rate,
        scale,
        1,
        &WorkloadOptions::default(),
    )?);
    println!(
        "kvmesh demo: a local sim fleet of 4 engines (gpt-oss-120b on H200, time-modelled), router \
         `load` vs `load-p2p` — the same placement, only P2P differs; fresh fleet per arm.\n\
         workloads: {}\n",
        workloads
            .iter()
            .map(|w| format!("{} ({})", w.name, w.description))
            .collect::<Vec<_>>()
            .join("; ")
    );
    let plan = Plan {
        workloads,
        arms: vec![Arm::Load, Arm::LoadP2p],
        exe: exe()?,
        out_dir: args.out.clone(),
        fleet: FleetOptions {
            time_scale: args.time_scale,
            ..Default::default()
        },
        command: std::env::args().collect::<Vec<_>>().join(" "),
        scale: args.scale.clone(),
        seed: 1,
        prompt_format: PromptFormat::Text,
        progress: !args.no_progress,
        settle: Duration::from_millis(1500),
        repeat: 1,
    };
    let report = run_interruptible(&plan).await?;
    print_outcome(&report, &args.out);
    Ok(())
}
