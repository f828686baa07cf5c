//! `kvmesh` subcommand module (being written).

#[derive(clap::Args)]
pub struct ModelCmd {}

pub async fn run(_args: ModelCmd) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}

