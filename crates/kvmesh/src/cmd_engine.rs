//! `kvmesh` subcommand module (being written).

#[derive(clap::Args)]
pub struct EngineCmd {}

pub async fn run(_args: EngineCmd) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}

