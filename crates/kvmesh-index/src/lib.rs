//! The router's precise prefix index: which endpoint holds which block in which tier (no I/O).
//!
//! Blocks are keyed by the router's own [`ChainKey`] over the token ids carried in `BlockStored`
//! events, so any engine hash algorithm and any engine block size that is a multiple of the
//! router's works. Each endpoint has an engine-hash → key map used for `BlockRemoved` and for
//! CPU-tier stores that carry no tokens. Per block the index keeps two bitmasks over dense endpoint
//! slots (GPU, CPU); a lookup ANDs them along the prompt's keys and stops as soon as no endpoint is
//! still matching. Invariants are listed in this crate's `README.md`.
//!
//! Hybrid models (vLLM's HMA: sliding-window, Mamba and full-attention KV-cache groups, each
//! published separately): the index learns each endpoint's groups from its events, keeps which
//! group holds which block (a sliding or Mamba block is placed by its hash in the full-attention
//! chain, never by counting the event's tokens), and a lookup applies vLLM's prefix-hit rule to
//! the endpoint: full-attention run, each sliding spec's last window, Mamba's state at the hit's
//! end, to a fixpoint (`groups.rs`). So [`EndpointMatch`] counts what vLLM would report cached.
//! Dense models (one full-attention group, or no group fields) are indexed as before.
//!
//! ```
//! use kvmesh_core::chain::chain_keys;
//! use kvmesh_core::events::{BlockStored, KvEvent, Medium};
//! use kvmesh_core::BlockHash;
//! use kvmesh_index::{EndpointId, IndexConfig, PrefixIndex};
//!
//! let index = PrefixIndex::new(IndexConfig { block_size: 4, ..IndexConfig::default() });
//! let tokens: Vec<u32> = (0..8).collect();
//! let stored = KvEvent::BlockStored(BlockStored {
//!     block_hashes: vec![BlockHash(1), BlockHash(2)],
//!     parent_block_hash: None,
//!     token_ids: tokens.clone(),
//!     block_size: 4,
//!     lora_id: None,
//!     medium: Medium::Gpu,
//!     lora_name: None,
//!     group_idx: None,
//!     kv_cache_spec_kind: None,
//!     kv_cache_spec_sliding_window: None,
//!     cache_salt: None,
//! });
//! index.apply_event(EndpointId(7), &stored).expect("valid event");
//! let matches = index.find_matches(&chain_keys(&tokens, 4));
//! assert_eq!(matches[0].endpoint, EndpointId(7));
//! assert_eq!(matches[0].gpu_blocks, 2);
//! ```

mod groups;
mod index;
mod rate;
pub mod reference;
mod table;

use std::fmt;

use kvmesh_core::BlockHash;
pub use kvmesh_core::ChainKey;
use kvmesh_core::events::{KvEvent, Medium};
use thiserror::Error;

pub use index::PrefixIndex;
pub use rate::{BURST_SECONDS, DEFAULT_MAX_BLOCKS_PER_SECOND, StoreRate};

/// A router-assigned endpoint (engine / data-parallel rank) identity.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct EndpointId(pub u32);

impl fmt::Display for EndpointId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The tiers the index tracks.
///
/// `GPU` events map to [`Tier::Gpu`], `CPU` events to [`Tier::Cpu`]. `STORAGE` and any other medium
/// are *ignored* (counted in [`IndexStats::ignored_events`]): the P2P producer serves from its CPU
/// tier, so counting disk/remote tiers as "CPU" would over-state what a peer can hand out quickly.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub enum Tier {
    Gpu,
    Cpu,
}

impl Tier {
    /// The tier an event medium is indexed under, or `None` if the medium is not indexed.
    pub fn from_medium(medium: &Medium) -> Option<Tier> {
        match medium {
            Medium::Gpu => Some(Tier::Gpu),
            Medium::Cpu => Some(Tier::Cpu),
            Medium::Storage | Medium::Other(_) => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Gpu => "gpu",
            Tier::Cpu => "cpu",
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Sizing of a [`PrefixIndex`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct IndexConfig {
    /// The router's block size in tokens; lookups pass `chain_keys(tokens, block_size)`. Engine
    /// block sizes must be a multiple of it.
    pub block_size: usize,
    /// Upper bound on the router blocks all endpoints together hold (a block held by two
    /// endpoints counts twice), shared out equally among the registered endpoints: an endpoint
    /// past its share evicts its own least recently used blocks, never another's.
    pub max_blocks: usize,
    /// Number of table shards (rounded up to a power of two). Writers are serialised per shard;
    /// more shards = less writer contention and smaller table rebuilds.
    pub shards: usize,
    /// Maximum number of endpoints the index accepts at once.
    pub max_endpoints: usize,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            block_size: 16,
            max_blocks: 4_000_000,
            shards: 256,
            max_endpoints: 4096,
        }
    }
}

/// Why an event was not (fully) applied. The index stays consistent in every case.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum IndexError {
    /// `token_ids` length is not `block_hashes.len() × block_size`.
    #[error(
        "BlockStored carries {tokens} tokens for {blocks} blocks of declared size {block_size}"
    )]
    TokenCountMismatch {
        tokens: usize,
        blocks: usize,
        block_size: u32,
    },
    /// The engine block size is not a multiple of the router's.
    #[error("engine block size {engine} is not a multiple of the router block size {router}")]
    BlockSizeMismatch { engine: usize, router: usize },
    /// The parent block is unknown for this endpoint (missed events): the run cannot be keyed, so
    /// it was skipped ("orphan").
    #[error("parent block {parent} unknown for this endpoint; {blocks} stored blocks skipped")]
    UnknownParent { parent: BlockHash, blocks: usize },
    /// A store without tokens named engine hashes this endpoint never stored with tokens.
    #[error("{unresolved} of {total} token-less stored blocks have no known key; skipped")]
    UnresolvedHashes { unresolved: usize, total: usize },
    /// The endpoint table is full.
    #[error("too many endpoints (max {max})")]
    TooManyEndpoints { max: usize },
}

impl IndexError {
    /// A short stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            IndexError::TokenCountMismatch { .. } => "token_count_mismatch",
            IndexError::BlockSizeMismatch { .. } => "block_size_mismatch",
            IndexError::UnknownParent { .. } => "orphan",
            IndexError::UnresolvedHashes { .. } => "unresolved",
            IndexError::TooManyEndpoints { .. } => "too_many_endpoints",
        }
    }
}

/// One endpoint's match for a lookup, in router blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct EndpointMatch {
    pub endpoint: EndpointId,
    /// Longest consecutive prefix held in the GPU tier.
    pub gpu_blocks: usize,
    /// Longest consecutive prefix held in the CPU tier.
    pub cpu_blocks: usize,
    /// Longest consecutive prefix where each block is held in either tier.
    pub any_blocks: usize,
}

/// A point-in-time summary of the index.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct IndexStats {
    /// Distinct router blocks held by at least one endpoint.
    pub blocks: u64,
    /// (block, endpoint, tier) memberships.
    pub memberships: u64,
    /// Endpoints currently known.
    pub endpoints: u64,
    /// Approximate heap bytes of the block tables and the engine-hash maps.
    pub approx_bytes: u64,
    /// `approx_bytes / memberships` (0 when empty).
    pub bytes_per_membership: f64,
    /// Blocks dropped by the `max_blocks` bound (an endpoint past its share, or the per-shard
    /// memory backstop).
    pub evictions: u64,
    /// Of `evictions`, those an endpoint paid for being past its share of `max_blocks`.
    pub share_evictions: u64,
    /// BlockStored events skipped because their parent was unknown.
    pub orphan_events: u64,
    /// Token-less stored blocks whose engine hash had no known key, and sliding/Mamba-group
    /// blocks dropped while waiting for the full-attention store that places them.
    pub unresolved_blocks: u64,
    /// BlockRemoved hashes the endpoint was not known to hold.
    pub unknown_removals: u64,
    /// Events not indexed: STORAGE/other medium, LoRA without a name, a kv-cache group kind the
    /// index does not model (or a non-zero group without a kind), a group that changed kind or
    /// block size, an event without a group on a hybrid endpoint.
    pub ignored_events: u64,
}

/// The operations a prefix index backend offers; implemented by [`PrefixIndex`] and by the
/// naive [`reference::ReferenceIndex`] so tests can drive both with the same events.
pub trait IndexBackend {
    fn apply_event(&self, endpoint: EndpointId, event: &KvEvent) -> Result<(), IndexError>;
    fn clear_endpoint(&self, endpoint: EndpointId);
    fn remove_endpoint(&self, endpoint: EndpointId);
    /// Matches sorted by endpoint id.
    fn find_matches(&self, keys: &[ChainKey]) -> Vec<EndpointMatch>;
    fn mark_suspect(&self, endpoint: EndpointId);
    fn expire_suspect(&self, endpoint: EndpointId) -> usize;
}

impl IndexBackend for PrefixIndex {
    fn apply_event(&self, endpoint: EndpointId, event: &KvEvent) -> Result<(), IndexError> {
        PrefixIndex::apply_event(self, endpoint, event)
    }
    fn clear_endpoint(&self, endpoint: EndpointId) {
        PrefixIndex::clear_endpoint(self, endpoint)
    }
    fn remove_endpoint(&self, endpoint: EndpointId) {
        PrefixIndex::remove_endpoint(self, endpoint)
    }
    fn find_matches(&self, keys: &[ChainKey]) -> Vec<EndpointMatch> {
        PrefixIndex::find_matches(self, keys)
    }
    fn mark_suspect(&self, endpoint: EndpointId) {
        PrefixIndex::mark_suspect(self, endpoint)
    }
    fn expire_suspect(&self, endpoint: EndpointId) -> usize {
        PrefixIndex::expire_suspect(self, endpoint)
    }
}

/// The tier a stored event is indexed in, if any (see [`Tier::from_medium`] and README): LoRA
/// blocks without an adapter name are not indexed (the name is what puts them in their adapter's
/// key space). Groups are sorted out by `groups::store_group`.
pub(crate) fn indexed_store(ev: &kvmesh_core::events::BlockStored) -> Option<Tier> {
    if ev.lora_id.is_some() && ev.lora_name.is_none() {
        return None;
    }
    Tier::from_medium(&ev.medium)
}

/// The chain key block 0 of a stored run hangs from: the run's adapter and salt key space.
pub(crate) fn event_root(ev: &kvmesh_core::events::BlockStored) -> ChainKey {
    ChainKey::tenant_root(ev.lora_name.as_deref(), ev.cache_salt.as_deref())
}

/// The tier a removal applies to, if indexed (groups: `groups::remove_group`).
pub(crate) fn indexed_remove(ev: &kvmesh_core::events::BlockRemoved) -> Option<Tier> {
    Tier::from_medium(&ev.medium)
}
