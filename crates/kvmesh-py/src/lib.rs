//! kvmesh-py: the native half of `kvmesh_vllm`, the package that makes a vLLM server a member of
//! the kvmesh mesh through vLLM's KV connector interface (issue 14, `docs/vllm.md`).
//!
//! Pure Rust, testable without Python: [`tier`] (the bounded CPU tier: `kvmesh-tier`'s store,
//! shared, as a kvmesh-transfer `BlockSource`), [`node`] (tier + P2P producer + pull client on a
//! private runtime), [`kv_memory`] (vLLM's KV tensors as the destination of a layer-major pull)
//! and [`pacer`] (the producer's optional serve-bandwidth cap). The
//! Python bindings ([`python`], feature `python`, built by maturin as `kvmesh_vllm._native`) only
//! convert arguments and release the GIL around everything that touches sockets or copies blocks
//! (`buffers` gives them GIL-free views of vLLM's tensors).

pub mod kv_memory;
pub mod node;
pub mod pacer;
pub mod tier;

#[cfg(feature = "python")]
mod buffers;
#[cfg(feature = "python")]
pub mod python;

pub use kv_memory::{DestinationError, KvDestination, LayerTarget};
pub use node::{LayerWait, Node, NodeConfig, NodeError, PullDone};
pub use tier::NodeTier;
