//! `kvmesh` subcommand module (being written).

#[derive(clap::Args)]
pub struct RouterCmd {}

pub async fn run(_args: RouterCmd) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}

