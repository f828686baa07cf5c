//! kvmesh-core: the vLLM-compatible foundations every other kvmesh crate builds on.
//!
//! Nothing here does I/O or async: block hashing exactly as vLLM computes it, the router's own
//! chain keys, the KV-event wire codec, `kv_transfer_params`, the peer fingerprint that P2P
//! engines compare at connect time, and the Prometheus text format both servers read and write.

pub mod chain;
pub mod chat;
pub mod conn_gate;
pub mod events;
pub mod exposition;
pub mod fingerprint;
pub mod hashing;
pub mod lax;
pub mod load_report;
pub mod prompt;
pub mod pull_feedback;
pub mod sse;
pub mod transfer_params;

/// A token id as carried in prompts and KV events.
pub type TokenId = u32;

pub use chain::ChainKey;
pub use events::{
    BlockRemoved, BlockStored, EventBatch, EventDecodeError, EventEncoding, EventFrame, KvEvent,
    Medium, decode_batch, encode_batch,
};
pub use fingerprint::{Fingerprint, FingerprintDecodeError, FingerprintMismatch};
pub use hashing::{BlockDigest, BlockHash, BlockHasher, HashAlgo, LoraAdapter, TenantKeys};
pub use pull_feedback::{PULL_FEEDBACK_HEADER, PullFeedback, PullFeedbackOutcome};
pub use transfer_params::{
    KvTransferParams, RemoteDecoder, RemoteKvSource, RemotePrefiller, TransferParamsError,
};
