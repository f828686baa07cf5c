//! Runs workloads × arms, each arm on a fresh fleet (cold caches), and assembles the report.

use std::path::PathBuf;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use thiserror::Error;

use crate::audit::{Audit, ClientView, audit};
use crate::client::PromptFormat;
use crate::driver::{self, DriveConfig, RequestRecord};
use crate::fleet::{EngineGroup, Fleet, FleetError, FleetSpec, Role, RouterSpec};
use crate::metrics::{EngineEvidence, Evidence};
use crate::report::{ArmResult, BenchReport, flags_for, pd_flags};
use crate::router_config::Arm;
use crate::stats::summarize;
use crate::workload::Workload;

/// Sim KV payload bytes per token the harness asks for (small: the data path is real, the size
/// is scaled down; pull *time* comes from the profile).
pub const DEFAULT_SIM_KV_BYTES_PER_TOKEN: usize = 16;

/// Fleet settings the command line may override.
#[derive(Debug, Clone)]
pub struct FleetOptions {
    pub backend: String,
    pub profile: Option<String>,
    pub model: Option<String>,
    pub time_scale: f64,
    /// Override the workload's number of aggregated engines.
    pub engines: Option<usize>,
    pub min_cached_token_delta: Option<usize>,
    pub sim_kv_bytes_per_token: usize,
    /// The sim engines' `--sim-link` (None = the engine's default).
    pub sim_link: Option<String>,
    pub extra_engine_args: Vec<String>,
    pub extra_router_args: Vec<String>,
    /// Where peer arms find their router (see [`crate::peers::venv_candidates`]).
    pub peer_venv: Option<PathBuf>,
    /// Router replicas per arm (the client takes them in turn).
    pub router_replicas: usize,
}

impl Default for FleetOptions {
    fn default() -> Self {
        Self {
            backend: "sim".into(),
            profile: Some("gpt-oss-120b-h200".into()),
            model: None,
            time_scale: 1.0,
            engines: None,
            min_cached_token_delta: None,
            sim_kv_bytes_per_token: DEFAULT_SIM_KV_BYTES_PER_TOKEN,
            sim_link: None,
            extra_engine_args: Vec::new(),
            extra_router_args: Vec::new(),
            peer_venv: None,
            router_replicas: 1,
        }
    }
}

/// The fleet a workload runs on under one arm.
pub fn fleet_for(w: &Workload, arm: Arm, o: &FleetOptions) -> FleetSpec {
    let block_size = 16usize;
    let gpu = w.fleet.num_gpu_blocks.max(256);
    // CPU tier = the workload's ratio × the GPU pool (2 for most: llm-d's deployment rule).
    let cpu_bytes =
        w.fleet.cpu_tier_ratio.max(1) * gpu * block_size * o.sim_kv_bytes_per_token.max(1);
    let pd = w.fleet.prefill > 0;
    let mut extra = o.extra_engine_args.clone();
    if pd && arm.moves_history() {
        extra.push("--bidirectional-kv-xfer".into());
    }
    let group = |count: usize, role: Role| EngineGroup {
        count,
        backend: o.backend.clone(),
        profile: o.profile.clone(),
        model: o.model.clone(),
        block_size,
        num_gpu_blocks: Some(gpu),
        cpu_offload_bytes: Some(cpu_bytes.to_string()),
        sim_kv_bytes_per_token: (o.backend == "sim").then_some(o.sim_kv_bytes_per_token),
        time_scale: Some(o.time_scale),
        sim_link: o.sim_link.clone(),
        role,
        // P/D handoff itself travels over P2P, so P/D fleets keep the service in both arms.
        p2p: arm.moves_blocks() || pd,
        max_model_len: Some(w.fleet.max_model_len),
        extra_args: extra.clone(),
    };
    let engines = if pd {
        vec![
            group(w.fleet.prefill, Role::Prefill),
            group(w.fleet.decode, Role::Decode),
        ]
    } else {
        vec![group(
            o.engines.unwrap_or(w.fleet.engines).max(1),
            Role::Both,
        )]
    };
    FleetSpec {
        served_model_name: "sim-gpt-oss".into(),
        engines,
        router: Some(RouterSpec {
            profile: arm.name().into(),
            min_cached_token_delta: Some(
                o.min_cached_token_delta.unwrap_or(w.min_cached_token_delta),
            ),
            extra_args: o.extra_router_args.clone(),
            peer_venv: o.peer_venv.clone(),
            replicas: o.router_replicas.max(1),
        }),
        log_dir: None,
        ready_timeout_s: Some(120.0),
        seed: Some(w.seed),
    }
}

#[derive(Debug, Error)]
pub enum RunError {
    #[error(transparent)]
    Fleet(#[from] FleetError),
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}

/// A whole A/B (or A/B/C...) run.
pub struct Plan {
    pub workloads: Vec<Workload>,
    pub arms: Vec<Arm>,
    pub exe: PathBuf,
    pub out_dir: PathBuf,
    pub fleet: FleetOptions,
    pub command: String,
    pub scale: String,
    pub seed: u64,
    /// Prompts as text or token ids (the same for every arm).
    pub prompt_format: PromptFormat,
    /// Show progress bars (off in tests).
    pub progress: bool,
    /// Seconds between fleet readiness and the first request, so the router's KV-event
    /// subscriptions are live (PUB/SUB drops messages sent before a subscriber joins).
    pub settle: Duration,
    /// Runs of every (workload, arm), each on a fresh fleet (`--repeat`; 0 counts as 1).
    pub repeat: u32,
}

/// Runs every workload under every arm on a fresh fleet, `plan.repeat` times; writes the report
/// after each arm.
///
/// Repeats are interleaved — round 1 runs every arm, then round 2 every arm, and so on — so a
/// drift of the machine over time (other load, thermal state) falls on all arms alike rather
/// than on whichever arm happened to run last.
pub async fn run(plan: &Plan) -> Result<BenchReport, RunError> {
    let mut report = BenchReport {
        command: plan.command.clone(),
        scale: plan.scale.clone(),
        seed: plan.seed,
        prompt_format: plan.prompt_format,
        results: Vec::new(),
        paired: Vec::new(),
    };
    std::fs::create_dir_all(&plan.out_dir)?;
    for w in &plan.workloads {
        for run in 0..plan.repeat.max(1) {
            for &arm in &plan.arms {
                // A fleet that cannot start fails its arm, not the whole run: the report says why.
                let result = match run_arm(plan, w, arm, run).await {
                    Ok(r) => r,
                    Err(e) => failed_arm(plan, w, arm, run, &e),
                };
                report.add_result(result);
                report.write(&plan.out_dir)?;
            }
        }
    }
    Ok(report)
}

fn failed_arm(plan: &Plan, w: &Workload, arm: Arm, run: u32, e: &RunError) -> ArmResult {
    ArmResult {
        workload: w.name.clone(),
        workload_description: w.description.clone(),
        arm: arm.name().into(),
        run,
        pulls: arm.pulls(),
        time_scale: plan.fleet.time_scale,
        fleet: fleet_for(w, arm, &plan.fleet),
        stats: Default::default(),
        bound_ttft: None,
        evidence: Default::default(),
        prefill_external_hit_tokens: 0.0,
        flags: vec![format!("FAILED TO RUN: {e}")],
        records: Vec::new(),
        router_version: None,
        audit: None,
        prefetch: None,
        restart: None,
        scale_out: None,
        replication: None,
    }
}

/// The folder under `logs/` of one (workload, arm, run): workload and arm names made safe for
/// a path (`trace:…`, `vllm-router:kv_aware`), and from the second run on `-run2`, `-run3`, …
/// so repeats keep their own logs (the first run keeps the name a single run always had).
fn log_dir_name(workload: &str, arm: &str, run: u32) -> String {
    let suffix = if run > 0 {
        format!("-run{}", run + 1)
    } else {
        String::new()
    };
    format!("{workload}-{arm}{suffix}")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// One arm on a fresh fleet; `run` is the repeat index (0-based).
async fn run_arm(plan: &Plan, w: &Workload, arm: Arm, run: u32) -> Result<ArmResult, RunError> {
    let spec = fleet_for(w, arm, &plan.fleet);
    let log_dir = plan
        .out_dir
        .join("logs")
        .join(log_dir_name(&w.name, arm.name(), run));
    let mut fleet = Fleet::launch(&spec, &plan.exe, &log_dir).await?;
    tokio::time::sleep(plan.settle).await;
    let pb = plan.progress.then(|| {
        let prefix = if plan.repeat > 1 {
            format!("{} / {} #{}", w.name, arm.name(), run + 1)
        } else {
            format!("{} / {}", w.name, arm.name())
        };
        bar(w, &prefix)
    });
    let cfg = DriveConfig {
        base_urls: fleet.entry_urls(),
        model: fleet.served_model_name.clone(),
        time_scale: plan.fleet.time_scale,
        prompt_format: plan.prompt_format,
        progress: pb.clone(),
    };
    let driven = drive_phases(plan, w, &spec, &mut fleet, &cfg).await;
    let records = driven.records;
    if let Some(pb) = &pb {
        pb.finish();
    }
    let died = fleet.check_alive();
    let router_version = fleet.router.as_ref().and_then(|r| r.version.clone());
    let mut evidence = scrape_evidence(&fleet).await;
    if let Some(before) = &driven.baseline {
        evidence = evidence.since(before);
    }
    if let Some((parent, before)) = &driven.wave_before {
        let children: Vec<&RequestRecord> = records
            .iter()
            .filter(|r| r.kind == crate::workload::StepKind::Child)
            .collect();
        evidence.child_wave = Some(crate::metrics::WaveCounters::from_delta(
            &evidence.since(before),
            &children,
            crate::waves::shared_context_tokens(w, *parent),
        ));
    }
    let prefill_hits: f64 = fleet
        .engines
        .iter()
        .zip(&evidence.engines)
        .filter(|(e, _)| e.role == Role::Prefill)
        .map(|(_, ev)| ev.external_hit_tokens)
        .sum();
    let restart = driven.restart.as_ref().map(|(shape, log)| {
        use crate::restart::{AfterRestart, analyse};
        let ts = plan.fleet.time_scale;
        match (&log.before, crate::restart::is_aggregated(w)) {
            (Some(before), true) => {
                // Replaced engines are not in `before`: they count from zero.
                let since = evidence.since(before);
                analyse(
                    &records,
                    ts,
                    *shape,
                    log,
                    AfterRestart::Fleet(&since.engines),
                )
            }
            _ => {
                let prefill: Vec<&crate::metrics::EngineEvidence> = fleet
                    .engines
                    .iter()
                    .zip(&evidence.engines)
                    .filter(|(e, _)| e.role == Role::Prefill)
                    .map(|(_, ev)| ev)
                    .collect();
                analyse(
                    &records,
                    ts,
                    *shape,
                    log,
                    AfterRestart::Prefillers(&prefill),
                )
            }
        }
    });
    let (mut prefetch, mut replication) = (None, None);
    if let Some(r) = &fleet.router
        && let Ok(resp) = reqwest::get(&r.metrics_url).await
        && let Ok(text) = resp.text().await
    {
        prefetch = crate::agentic::PrefetchStats::from_router_metrics(&text);
        if arm.replicates() {
            replication = Some(crate::hot_prefix::replication_outcomes(&text));
        }
        let _ = std::fs::write(log_dir.join("router-metrics.txt"), text);
    }
    // Why each request went where it did (the router keeps its last `decisions_capacity`; a
    // peer router has no such endpoint).
    let mut audit = None;
    let mut decisions = String::new();
    if let Some(r) = &fleet.router
        && r.peer.is_none()
        && let Ok(resp) = reqwest::get(format!("{}/debug/decisions?last=100000", r.url)).await
        && let Ok(text) = resp.text().await
    {
        let _ = std::fs::write(log_dir.join("router-decisions.json"), &text);
        audit = audit_arm(&text, &records, w.seed, plan.fleet.time_scale, arm);
        decisions = text;
    }
    let engines_before = spec.engines.iter().map(|g| g.count).sum();
    let scale_out = driven.join.map(|(shape, log)| {
        crate::scale_out::analyse(
            &records,
            &decisions,
            w.seed,
            plan.fleet.time_scale,
            shape,
            engines_before,
            &log,
        )
    });
    fleet.shutdown().await;
    let stats = summarize(&records, plan.fleet.time_scale, w.offered_rate);
    let pd = w.fleet.prefill > 0;
    // P/D hand-offs and hot-prefix copies move blocks without the arm pulling on demand.
    let mut flags = flags_for(arm.pulls(), pd || arm.replicates(), &stats, &evidence);
    if arm.is_pd() {
        flags.extend(pd_flags(arm.moves_history(), prefill_hits, &evidence));
    }
    if let Some(d) = died {
        flags.push(format!("CRASHED: {d}"));
    }
    if let Some(a) = &audit {
        priced_pull_flags(arm, a, &mut flags);
    }
    // A prefetched history is read from the target's own CPU tier (a local hit, restored at
    // host-to-device speed), so the engines' external-hit counter does not see it; the router's
    // `used` count and the engines' `kvmesh_engine_prefetch_blocks_total` are its evidence.
    if arm.prefetches() && prefetch.as_ref().is_some_and(|p| p.landed > 0.0) {
        flags.retain(|f| !f.starts_with("UNVERIFIED"));
    }
    Ok(ArmResult {
        workload: w.name.clone(),
        workload_description: w.description.clone(),
        arm: arm.name().into(),
        run,
        pulls: arm.pulls(),
        time_scale: plan.fleet.time_scale,
        bound_ttft: crate::bound::bound_ttft(
            &records,
            spec.engines.first().and_then(|g| g.profile.as_deref()),
        ),
        fleet: spec,
        stats,
        evidence,
        prefill_external_hit_tokens: prefill_hits,
        flags,
        records,
        router_version,
        audit,
        prefetch,
        restart,
        scale_out,
        replication,
    })
}

/// What driving one arm produced besides the measured records.
struct Driven {
    records: Vec<RequestRecord>,
    /// Counters after an unmeasured warm-up (the arm's evidence is measured from here).
    baseline: Option<Evidence>,
    /// Fork: the parent's session and the counters between the parent's and children's waves.
    wave_before: Option<(usize, Evidence)>,
    /// Scale-out: the newcomer's schedule and what its join saw.
    join: Option<(crate::scale_out::ScaleOutShape, crate::scale_out::JoinLog)>,
    /// Restart: when the prefill fleet was replaced.
    restart: Option<(crate::restart::RestartShape, crate::restart::RestartLog)>,
}

/// Drives `w` on the arm's fleet: a warm-up first if the workload has one ([`crate::waves`]),
/// then the measured requests — in two waves for a fork (counters scraped in between), beside a
/// newcomer's join for scale-out ([`crate::scale_out`]), else in one go.
async fn drive_phases(
    plan: &Plan,
    w: &Workload,
    spec: &FleetSpec,
    fleet: &mut Fleet,
    cfg: &DriveConfig,
) -> Driven {
    let ts = plan.fleet.time_scale;
    let mut out = Driven {
        records: Vec::new(),
        baseline: None,
        wave_before: None,
        join: None,
        restart: None,
    };
    if let Some(warm) = crate::waves::warmup_for(w) {
        let wpb = plan
            .progress
            .then(|| bar(&warm, &format!("{} (not measured)", warm.name)));
        let wcfg = DriveConfig {
            progress: wpb.clone(),
            ..cfg.clone()
        };
        let _ = driver::drive(&warm, &wcfg).await;
        if let Some(wpb) = &wpb {
            wpb.finish();
        }
        // Same settle as before the first request: the router sees the warm-up's KV events.
        tokio::time::sleep(plan.settle).await;
        out.baseline = Some(scrape_evidence(fleet).await);
    }
    if let Some(shape) = crate::scale_out::shape_of(w) {
        // The drive and the newcomer's join run side by side; the join task stops sampling
        // when the drive is done.
        let (done_tx, done_rx) = tokio::sync::watch::channel(false);
        let start = std::time::Instant::now();
        let drive = async {
            let r = driver::drive(w, cfg).await;
            let _ = done_tx.send(true);
            r
        };
        let joining = crate::scale_out::join_one(
            fleet,
            spec,
            &plan.exe,
            shape,
            ts,
            start,
            done_rx,
            cfg.progress.clone(),
        );
        let (records, log) = tokio::join!(drive, joining);
        out.records = records;
        out.join = Some((shape, log));
    } else if let Some(shape) = crate::restart::shape_of(w, &plan.scale) {
        // The drive and the engines' replacement run side by side.
        let (done_tx, done_rx) = tokio::sync::watch::channel(false);
        let start = std::time::Instant::now();
        let drive = async {
            let r = driver::drive(w, cfg).await;
            let _ = done_tx.send(true);
            r
        };
        let restarting =
            crate::restart::restart_engines(fleet, spec, &plan.exe, shape, ts, start, done_rx);
        let (records, log) = tokio::join!(drive, restarting);
        out.records = records;
        out.restart = Some((shape, log));
    } else if let Some(parent) = crate::waves::fork_parent(w) {
        // Fork in two waves (parent, then children) with the counters scraped in between, so
        // the children's recomputes are read from the engines (see crate::waves).
        let t0 = std::time::Instant::now();
        let mut records = driver::drive(&crate::waves::parent_wave(w, parent), cfg).await;
        let t = std::time::Instant::now();
        out.wave_before = Some((parent, scrape_evidence(fleet).await));
        let spent = t.elapsed().mul_f64(ts);
        // The children's send times count from the parent's start, as in one wave.
        let offset = t0.elapsed().as_secs_f64();
        let children = driver::drive(&crate::waves::child_wave(w, parent, spent), cfg).await;
        records.extend(children.into_iter().map(|mut r| {
            r.sent_s += offset;
            r
        }));
        records.sort_by_key(|r| (r.session, r.step));
        out.records = records;
    } else {
        out.records = driver::drive(w, cfg).await;
    }
    out
}

/// A progress bar over `w`'s requests.
fn bar(w: &Workload, prefix: &str) -> ProgressBar {
    let pb = ProgressBar::new(w.num_requests() as u64);
    if let Ok(style) =
        ProgressStyle::with_template("{prefix:>24} [{elapsed_precise}] {bar:40} {pos}/{len} {msg}")
    {
        pb.set_style(style);
    }
    pb.set_prefix(prefix.to_owned());
    pb
}

/// An arm that prices its pulls may rightly pull nothing (the holder was the best place for
/// every request, or no pull beat recompute): moving 0 bytes is then not a misconfiguration, as
/// long as the router named no pull. A named pull that moved nothing still is.
fn priced_pull_flags(arm: Arm, audit: &Audit, flags: &mut Vec<String>) {
    if !arm.prices_pulls() || audit.pulls_named > 0 {
        return;
    }
    let before = flags.len();
    flags.retain(|f| !f.starts_with("MISCONFIGURED: P2P arm moved 0 bytes"));
    if flags.len() != before {
        flags.push(format!(
            "no pulls: the router named none ({} skipped for cost), so 0 bytes moved",
            audit.pulls_skipped_for_cost
        ));
    }
}

/// Joins the router's decision records with what the client saw (see [`crate::audit`]).
fn audit_arm(
    decisions: &str,
    records: &[RequestRecord],
    seed: u64,
    time_scale: f64,
    arm: Arm,
) -> Option<Audit> {
    let decisions: Vec<serde_json::Value> = serde_json::from_str(decisions).ok()?;
    let ids: Vec<String> = records
        .iter()
        .map(|r| driver::request_id(seed, r.session, r.step))
        .collect();
    let ts = time_scale;
    let clients: Vec<ClientView<'_>> = records
        .iter()
        .zip(&ids)
        .map(|(r, id)| ClientView {
            request_id: id,
            ttft_s: r.ttft_s.map(|t| t * ts),
            cached_tokens: r.cached_tokens,
        })
        .collect();
    Some(audit(&decisions, &clients, arm.pulls(), 16))
}

/// Reads every engine's `/metrics` (the arm's fleet is fresh, so totals are the arm's own).
pub async fn scrape_evidence(fleet: &Fleet) -> Evidence {
    let http = reqwest::Client::new();
    let mut engines = Vec::new();
    let mut errors = Vec::new();
    for e in &fleet.engines {
        match crate::fleet::scrape(&http, &e.url).await {
            Ok(text) => {
                let _ =
                    std::fs::write(fleet.log_dir.join(format!("{}-metrics.txt", e.name)), &text);
                engines.push(EngineEvidence::from_exposition(&e.url, &text));
            }
            Err(err) => {
                errors.push(format!("{}: {err}", e.url));
                engines.push(EngineEvidence {
                    url: e.url.clone(),
                    ..Default::default()
                });
            }
        }
    }
    Evidence::from_engines(engines, errors)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::workload::{self, Scale};

    #[test]
    fn a_priced_arm_that_named_no_pull_is_not_misconfigured() {
        let misconfigured =
            "MISCONFIGURED: P2P arm moved 0 bytes (check kvmesh_p2p_* counters, router p2p config)";
        let quiet = Audit {
            pulls_skipped_for_cost: 3,
            ..Audit::default()
        };
        let mut flags = vec![misconfigured.to_owned()];
        priced_pull_flags(Arm::TtftP2p, &quiet, &mut flags);
        assert_eq!(flags.len(), 1);
        assert!(flags[0].starts_with("no pulls") && flags[0].contains("3 skipped"));
        // A named pull that moved nothing, or a threshold arm, stays flagged.
        let named = Audit {
            pulls_named: 2,
            ..Audit::default()
        };
        for (arm, audit) in [(Arm::TtftP2p, &named), (Arm::LoadP2p, &quiet)] {
            let mut flags = vec![misconfigured.to_owned()];
            priced_pull_flags(arm, audit, &mut flags);
            assert_eq!(flags, vec![misconfigured.to_owned()]);
        }
    }

    #[test]
    fn arms_differ_only_in_router_policy_and_p2p_service() {
        let w = workload::fork(Scale::Quick, 1);
        let o = FleetOptions {
            time_scale: 5.0,
            ..Default::default()
        };
        let a = fleet_for(&w, Arm::Load, &o);
        let b = fleet_for(&w, Arm::LoadP2p, &o);
        assert_eq!(a.engines[0].count, 4);
        assert_eq!(a.engines[0].num_gpu_blocks, b.engines[0].num_gpu_blocks);
        assert!(!a.engines[0].p2p && b.engines[0].p2p);
        assert_eq!(a.time_scale(), 5.0);
        assert_eq!(b.router.as_ref().unwrap().profile, "load-p2p");
        assert_eq!(
            b.router.as_ref().unwrap().min_cached_token_delta,
            Some(2048)
        );
    }

    #[test]
    fn pd_workloads_get_prefill_and_decode_groups() {
        let w = workload::agentic_pd(Scale::Full, 1);
        let s = fleet_for(&w, Arm::PdBidir, &FleetOptions::default());
        s.validate().unwrap();
        assert_eq!(s.engines.len(), 2);
        assert_eq!((s.engines[0].role, s.engines[0].count), (Role::Prefill, 2));
        assert_eq!((s.engines[1].role, s.engines[1].count), (Role::Decode, 4));
        assert!(
            s.engines[1]
                .extra_args
                .iter()
                .any(|a| a == "--bidirectional-kv-xfer")
        );
        let c = fleet_for(&w, Arm::Pd, &FleetOptions::default());
        c.validate().unwrap();
        assert!(c.engines[1].p2p && c.engines[1].extra_args.is_empty());
        // The load-placed pair: same fleet, only the bidir arm's engines move history.
        let lb = fleet_for(&w, Arm::PdLoadBidir, &FleetOptions::default());
        lb.validate().unwrap();
        assert_eq!(lb.router.as_ref().unwrap().profile, "pd-load-bidir");
        assert!(
            lb.engines
                .iter()
                .all(|g| g.p2p && g.extra_args.iter().any(|a| a == "--bidirectional-kv-xfer"))
        );
        let l = fleet_for(&w, Arm::PdLoad, &FleetOptions::default());
        l.validate().unwrap();
        assert!(l.engines.iter().all(|g| g.p2p && g.extra_args.is_empty()));
        assert_eq!(
            (l.engines[0].count, l.engines[1].count),
            (lb.engines[0].count, lb.engines[1].count)
        );
        // Aggregated arms would spray P/D engines with ordinary requests: refused up front.
        let err = fleet_for(&w, Arm::Load, &FleetOptions::default())
            .validate()
            .unwrap_err();
        assert!(err.to_string().contains("pd-bidir"), "{err}");
        let err = fleet_for(
            &workload::fork(Scale::Quick, 1),
            Arm::Pd,
            &FleetOptions::default(),
        )
        .validate()
        .unwrap_err();
        assert!(err.to_string().contains("prefill"), "{err}");
    }

    /// Two arms of `fork` whose fleets cannot start (no such executable), `repeat` times.
    fn unstartable_plan(out: &std::path::Path, repeat: u32) -> Plan {
        Plan {
            workloads: vec![workload::fork(Scale::Quick, 1)],
            arms: vec![Arm::Load, Arm::LoadP2p],
            exe: out.join("no-such-kvmesh"),
            out_dir: out.to_owned(),
            fleet: FleetOptions::default(),
            command: "test".into(),
            scale: "quick".into(),
            seed: 1,
            prompt_format: PromptFormat::Text,
            progress: false,
            settle: Duration::ZERO,
            repeat,
        }
    }

    #[tokio::test]
    async fn an_arm_whose_fleet_cannot_start_is_reported_not_fatal() {
        let out = tempfile::tempdir().unwrap();
        let plan = unstartable_plan(out.path(), 1);
        let report = run(&plan).await.unwrap();
        assert_eq!(report.results.len(), 2);
        assert!(
            report
                .results
                .iter()
                .all(|r| r.flags[0].starts_with("FAILED TO RUN"))
        );
        assert!(out.path().join("report.md").exists());
    }

    /// Repeats run round by round (every arm of round 1, then of round 2), each result
    /// carrying its run, and the report's paired comparison is kept up to date.
    #[tokio::test]
    async fn repeats_are_interleaved_round_by_round() {
        let out = tempfile::tempdir().unwrap();
        let plan = unstartable_plan(out.path(), 3);
        let report = run(&plan).await.unwrap();
        let order: Vec<(u32, &str)> = report
            .results
            .iter()
            .map(|r| (r.run, r.arm.as_str()))
            .collect();
        assert_eq!(
            order,
            vec![
                (0, "load"),
                (0, "load-p2p"),
                (1, "load"),
                (1, "load-p2p"),
                (2, "load"),
                (2, "load-p2p"),
            ]
        );
        assert_eq!(report.paired.len(), 1);
        assert_eq!(report.paired[0].control, "load");
        let back: BenchReport =
            serde_json::from_slice(&std::fs::read(out.path().join("report.json")).unwrap())
                .unwrap();
        assert_eq!(back.results[5].run, 2);
        assert_eq!(back.paired, report.paired);
        let md = std::fs::read_to_string(out.path().join("report.md")).unwrap();
        assert!(md.contains("| fork | load-p2p (run 3) |"), "{md}");
        assert!(md.contains("### Repeated runs"), "{md}");
    }

    #[test]
    fn repeats_keep_their_own_log_folders() {
        assert_eq!(log_dir_name("fork", "load-p2p", 0), "fork-load-p2p");
        assert_eq!(log_dir_name("fork", "load-p2p", 1), "fork-load-p2p-run2");
        assert_eq!(
            log_dir_name("trace:a.jsonl", "vllm-router:kv_aware", 2),
            "trace_a_jsonl-vllm-router_kv_aware-run3"
        );
    }
}
