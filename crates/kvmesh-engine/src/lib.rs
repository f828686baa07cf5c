//! kvmesh engine: vLLM-compatible model server with paged prefix cache, CPU tier, KV events and P2P pull.
//!
//! Layers: [`pool`] (GPU-tier block pool) and [`cpu_tier`] are plain data structures; the
//! compute loop drives them with a [`compute::ComputeBackend`] on a dedicated thread; the HTTP
//! API talks to that loop over channels.

pub mod admission;
pub mod compute;
pub mod config;
pub mod cpu_tier;
pub mod link;
pub mod link_pacer;
pub mod outbox;
pub mod p2p;
pub mod pd;
pub mod pool;
pub mod prefetch;
pub mod remote_read;

pub use config::{EngineConfig, KvEventsConfig, P2pConfig, Role};
pub use cpu_tier::{BlockStatus, CpuTier, CpuTierStats, OffloadBlock};
pub use pool::{BlockPool, BlockState};
pub mod engine;
pub mod metrics;

pub use engine::{
    Engine, EngineHandle, EngineRequest, FinishInfo, FinishReason, SeqOutput, SeqStream,
    SubmitError, build_engine,
};
pub mod api;
pub mod publish;
pub mod server;
