//! P2P KV transfer in the engine (`docs/architecture.md#p2p-pull`): peers pull prompt-prefix
//! blocks from each other's CPU tiers instead of recomputing them.
//!
//! | file | what |
//! |---|---|
//! | `producer` | serves this engine's CPU tier to peers (`CpuTierSource`, [`start_producer`]) |
//! | `consumer` | the one pull client and the one remote-read path ([`P2pConsumer::read`]) |
//! | `remote_read` | what a read names ([`RemoteRead`]: llm-d `remote_kv_source` or P/D params) and what it did ([`ReadOutcome`]) |
//! | `inflight` | pulls in flight: one pull per prefix, a prefetch promoted when a request joins it |
//! | `landing` | the sink that verifies each arriving block and lands it in the CPU tier |
//! | `hook` | [`P2pHook`], every server's default request hook ([`crate::request_hook`]) |
//! | `Handoffs` (kvmesh-transfer) | which P/D reader each retained block is kept for (shared by the P/D hook and the producer) |
//!
//! A pull never fails a request: whatever did not arrive is computed.

mod consumer;
mod error;
mod hook;
mod inflight;
mod landing;
mod producer;
mod remote_read;

pub use consumer::{P2pConsumer, release_pulled};
pub use error::P2pConfigError;
// The P/D hand-off ledger lives with the transfer protocol (the vLLM connector's tier uses it too).
pub use hook::P2pHook;
pub use kvmesh_transfer::Handoffs;
pub use producer::{P2pProducer, start_producer};
pub(crate) use remote_read::unix_now;
pub use remote_read::{PrefixPull, ReadOptions, ReadOutcome, RemoteRead};
