//! vLLM KV events: types and the msgpack wire codec (`vllm/distributed/kv_events.py`).
//!
//! A ZMQ message is three frames `[topic, seq (u64 BE), payload]`; the payload is a msgpack array
//! `[ts, [event...], data_parallel_rank]`. Events arrive in the map encoding (vLLM ≥ mid-2026) or
//! the older array encoding; both decode to [`KvEvent`].

use thiserror::Error;

use crate::TokenId;
use crate::hashing::BlockHash;

/// Storage tier a KV event refers to. Compared case-insensitively on the wire; absent means GPU.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Medium {
    Gpu,
    Cpu,
    Storage,
    /// Any other tier name, kept verbatim (upper-cased).
    Other(String),
}

impl Medium {
    pub fn as_str(&self) -> &str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
            Medium::Storage => "STORAGE",
            Medium::Other(s) => s,
        }
    }

    /// Parses a wire medium name case-insensitively.
    pub fn parse(s: &str) -> Medium {
        if s.eq_ignore_ascii_case("gpu") {
            Medium::Gpu
        } else if s.eq_ignore_ascii_case("cpu") {
            Medium::Cpu
        } else if s.eq_ignore_ascii_case("storage") {
            Medium::Storage
        } else {
            Medium::Other(s.to_ascii_uppercase())
        }
    }
}

/// A stored block run: `block_hashes[i]` covers `token_ids[i*block_size..(i+1)*block_size]`.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockStored {
    pub block_hashes: Vec<BlockHash>,
    pub parent_block_hash: Option<BlockHash>,
    /// Concatenated tokens of all blocks; empty for CPU-tier events from vLLM's offloading
    /// connector unless it is self-describing.
    pub token_ids: Vec<TokenId>,
    /// Tokens per block; 0 when the event carries no tokens.
    pub block_size: u32,
    pub lora_id: Option<i64>,
    pub medium: Medium,
    pub lora_name: Option<String>,
    pub group_idx: Option<u32>,
    pub kv_cache_spec_kind: Option<String>,
}

/// Blocks dropped from one tier.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockRemoved {
    pub block_hashes: Vec<BlockHash>,
    pub medium: Medium,
    pub group_idx: Option<u32>,
}

/// One KV event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    BlockStored(BlockStored),
    BlockRemoved(BlockRemoved),
    AllBlocksCleared,
}

/// The decoded payload of one ZMQ message.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub data_parallel_rank: Option<i64>,
}

/// Which event encoding to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EventEncoding {
    /// vLLM's current map form (what vLLM 0.32 emits).
    #[default]
    Map,
    /// The older positional array form.
    Array,
}

/// Why a payload or frame could not be decoded.
#[derive(Debug, Error, PartialEq)]
pub enum EventDecodeError {
    #[error("malformed msgpack: {0}")]
    Msgpack(String),
    #[error("unexpected shape: {0}")]
    Shape(String),
    #[error("unknown event type `{0}`")]
    UnknownType(String),
    #[error("frame: {0}")]
    Frame(String),
}
