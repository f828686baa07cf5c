//! `kvmesh router`: the KV-cache-aware OpenAI router.
//!
//! ```text
//! kvmesh router --port 8000 --config configs/router-affinity.yaml
//! ```
//! Prints `listening on http://HOST:PORT` once serving; stops on Ctrl-C (in-flight responses finish).

use std::path::PathBuf;

use anyhow::Context;
use kvmesh_router::{RouterConfig, RouterOptions};

#[derive(clap::Args)]
pub struct RouterCmd {
    /// Router config (YAML): endpoints or endpoints_file, block_size, plugins, schedulingProfiles.
    #[arg(long)]
    pub config: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 = any free port; the chosen one is printed).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
}

pub async fn run(args: RouterCmd) -> anyhow::Result<()> {
    let config = RouterConfig::load(&args.config)
        .with_context(|| format!("loading {}", args.config.display()))?;
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
        if tokio::signal::ctrl_c().await.is_ok() {
            cancel.cancel();
        }
    });
    handle.wait().await.context("router server")?;
    Ok(())
}
