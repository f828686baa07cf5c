//! kvmesh router: OpenAI gateway with KV-cache-aware scheduling and P2P source selection.

pub mod indexer;
