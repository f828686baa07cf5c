//! `kvmesh` subcommand module (being written).

#[derive(clap::Args)]
pub struct EventsArgs {}

pub async fn run(_args: EventsArgs) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}

