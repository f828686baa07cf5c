//! kvmesh engine: vLLM-compatible model server with paged prefix cache, CPU tier, KV events and P2P pull.

pub mod compute;
