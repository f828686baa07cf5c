//! The `kvmesh` binary: one command line for every part of the system.
//!
//! Each subcommand lives in its own `cmd_*` module; this file only parses and dispatches.

mod cmd_bench;
mod cmd_engine;
mod cmd_events;
mod cmd_hash;
mod cmd_model;
mod cmd_router;
mod malloc;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "kvmesh",
    version,
    about = "Move the KV, not the work: a KV-cache-aware router and P2P-pulling engine for vLLM fleets"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Compute vLLM-identical block hashes for a JSON array of token ids read on stdin.
    Hash(cmd_hash::HashArgs),
    /// Work with vLLM KV events (ZMQ).
    Events(cmd_events::EventsArgs),
    /// Run a vLLM-compatible engine (model server) with prefix cache, CPU tier, KV events and P2P.
    Engine(Box<cmd_engine::EngineCmd>),
    /// Run the KV-cache-aware OpenAI router.
    Router(cmd_router::RouterCmd),
    /// Manage real model weights.
    Model(cmd_model::ModelCmd),
    /// Start a local fleet (engines + router) from a YAML file.
    Up(cmd_bench::UpCmd),
    /// Run a benchmark workload as an A/B over router arms.
    Bench(cmd_bench::BenchCmd),
    /// Measure recompute vs pull on a consumer/producer pair and recommend a threshold.
    Calibrate(cmd_bench::CalibrateCmd),
    /// The main job: a local sim fleet, fork and pool workloads, P2P off vs on, A/B report.
    Demo(cmd_bench::DemoCmd),
}

fn main() -> std::process::ExitCode {
    malloc::fix_mmap_threshold();
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Error: {e:?}");
            std::process::ExitCode::from(exit_code(&e))
        }
    }
}

/// 2 for a configuration the engine or router refused (as clap exits 2 for a bad flag), so a
/// supervisor can tell "fix the config" from a failure at run time (1).
fn exit_code(e: &anyhow::Error) -> u8 {
    use kvmesh_engine::server::ServerError;
    use kvmesh_router::error::RouterError;
    let refused_config = e.chain().any(|c| {
        c.is::<kvmesh_engine::config::ConfigError>()
            || c.is::<kvmesh_router::config::ConfigError>()
            || matches!(
                c.downcast_ref::<ServerError>(),
                Some(ServerError::Config(_))
            )
            || matches!(
                c.downcast_ref::<RouterError>(),
                Some(RouterError::Config(_))
            )
    });
    if refused_config { 2 } else { 1 }
}

fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_tracing();
    match cli.command {
        // Pure CPU commands stay off the async runtime.
        Command::Hash(args) => cmd_hash::run(args),
        other => {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            runtime.block_on(async move {
                match other {
                    Command::Hash(_) => unreachable!("handled above"),
                    Command::Events(args) => cmd_events::run(args).await,
                    Command::Engine(args) => cmd_engine::run(*args).await,
                    Command::Router(args) => cmd_router::run(args).await,
                    Command::Model(args) => cmd_model::run(args).await,
                    Command::Up(args) => cmd_bench::run_up(args).await,
                    Command::Bench(args) => cmd_bench::run_bench(args).await,
                    Command::Calibrate(args) => cmd_bench::run_calibrate(args).await,
                    Command::Demo(args) => cmd_bench::run_demo(args).await,
                }
            })
        }
    }
}

/// Resolves on the first SIGTERM or Ctrl-C (SIGINT), returning its name: servers then stop
/// accepting and drain. A second signal while draining exits at once (status 130).
pub(crate) async fn shutdown_signal() -> &'static str {
    let name = first_signal().await;
    tokio::spawn(async {
        let again = first_signal().await;
        eprintln!("kvmesh: {again} again while draining; exiting now");
        std::process::exit(130);
    });
    name
}

async fn first_signal() -> &'static str {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            // Without a SIGTERM handler the default action (exit) still applies.
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => "SIGINT",
        _ = term => "SIGTERM",
    }
}

/// `30s`, `500ms`, `1m` (humantime) for duration flags.
pub(crate) fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    humantime::parse_duration(s).map_err(|e| e.to_string())
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVMESH_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}
