//! `kvmesh` subcommand module (being written).

#[derive(clap::Args)]
pub struct UpCmd {}

#[derive(clap::Args)]
pub struct BenchCmd {}

#[derive(clap::Args)]
pub struct CalibrateCmd {}

#[derive(clap::Args)]
pub struct DemoCmd {}

pub async fn run_up(_args: UpCmd) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}

pub async fn run_bench(_args: BenchCmd) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}

pub async fn run_calibrate(_args: CalibrateCmd) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}

pub async fn run_demo(_args: DemoCmd) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}

