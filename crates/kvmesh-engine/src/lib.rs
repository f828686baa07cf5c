//! kvmesh engine: vLLM-compatible model server with paged prefix cache, CPU tier, KV events and P2P pull.
//!
//! Layers: [`pool`] (GPU-tier block pool) is a plain data structure and [`cpu_tier`] a thin
//! shared wrapper over `kvmesh-tier`'s; the compute loop ([`engine`]) drives them with a
//! [`compute::ComputeBackend`] on a dedicated thread; the HTTP API ([`api`]) talks to that loop
//! over channels and runs a [`request_hook::RequestHook`] around each request: [`p2p`] by
//! default, with [`pd`] layered on it.

pub mod api;
pub mod compute;
pub mod config;
pub mod cpu_tier;
pub mod engine;
pub mod layered_pull;
pub mod link;
pub mod link_pacer;
pub mod load_report;
pub mod metrics;
pub mod outbox;
pub mod p2p;
pub mod pd;
pub mod pool;
pub mod prefetch;
pub mod publish;
pub mod request_hook;
pub mod server;

pub use config::{EngineConfig, KvEventsConfig, P2pConfig, P2pLoadMode, Role};
pub use cpu_tier::{BlockStatus, CpuTier, CpuTierStats, OffloadBlock};
pub use engine::{
    Engine, EngineHandle, EngineRequest, FinishInfo, FinishReason, SeqOutput, SeqStream,
    SubmitError, build_engine,
};
pub use pool::{BlockPool, BlockState};
