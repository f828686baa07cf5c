//! `kvmesh hash`: vLLM-identical block hashes (being written).

#[derive(clap::Args)]
pub struct HashArgs {}

pub fn run(_args: HashArgs) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}
