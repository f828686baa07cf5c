//! `kvmesh router`: the KV-cache-aware OpenAI router.
//!
//! ```text
//! kvmesh router --port 8000 --config configs/router-affinity.yaml
//! ```
//! Prints `listening on http://HOST:PORT` once serving. SIGTERM or Ctrl-C closes the listener,
//! lets in-flight requests (streams included) finish for up to `--drain-timeout`, then exits 0.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use kvmesh_router::{RouterConfig, RouterOptions};

#[derive(clap::Args)]
pub struct RouterCmd {
    /// Router config (YAML): endpoints or endpoints_file, block_size, plugins, scheduling_profiles.
    #[arg(long)]
    pub config: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 = any free port; the chosen one is printed).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// On SIGTERM / Ctrl-C, how long in-flight requests may take to finish (e.g. `30s`);
    /// overrides the config's `drain_timeout` (default 30s).
    #[arg(long, value_parser = crate::parse_duration)]
    pub drain_timeout: Option<Duration>,
    /// Drop a client that has not sent complete request headers within this (also bounds idle
    /// keep-alive connections and stalled bodies); overrides the config's `header_read_timeout`
    /// (default 10s).
    #[arg(long, value_parser = crate::parse_duration)]
    pub header_read_timeout: Option<Duration>,
}

pub async fn run(args: RouterCmd) -> anyhow::Result<()> {
    let mut config = RouterConfig::load(&args.config)
        .with_context(|| format!("loading {}", args.config.display()))?;
    if let Some(d) = args.drain_timeout {
        config.drain_timeout = d;
    }
    if let Some(d) = args.header_read_timeout {
        config.header_read_timeout = d;
    }
    let drain = config.drain_timeout;
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("binding {}:{}", args.host, args.port))?;
    let options = RouterOptions {
        config_path: Some(args.config.clone()),
        ..RouterOptions::default()
    };
    let handle = kvmesh_router::start(config, listener, options).await?;
    println!("listening on http://{}", handle.addr);
    let cancel = handle.cancel_token();
    tokio::spawn(async move {
        let signal = crate::shutdown_signal().await;
        eprintln!(
            "kvmesh router: {signal}: not accepting new connections; draining in-flight requests (up to {})",
            humantime::format_duration(drain)
        );
        cancel.cancel();
    });
    handle.wait().await.context("router server")?;
    eprintln!("kvmesh router: drained, exiting");
    Ok(())
}
