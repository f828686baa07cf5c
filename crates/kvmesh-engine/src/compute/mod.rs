//! The compute interface between the engine's scheduler/block pool and a backend that produces KV.
//!
//! The engine owns the paged KV memory ([`KvArena`]) and the block tables; a backend only sees,
//! per step, which tokens to process for which sequence, which blocks hold that sequence's KV,
//! and the arena to read and write. It never decides pool policy (allocation, caching, eviction).
//!
//! Contract for one [`ComputeBackend::step`]:
//! - For each [`SeqStep`], the KV of positions `0..start_pos` is already valid in
//!   `block_table` (computed earlier, restored from the CPU tier, or pulled from a peer).
//! - The backend writes the KV of positions `start_pos..start_pos + tokens.len()` into the
//!   blocks of `block_table` (position `p` lives in block `block_table[p / block_size]`, slot
//!   `p % block_size`), using its own layout inside a block's bytes.
//! - When `sample` is set, the backend returns the next token for that sequence.

pub mod profiles;
pub mod sim;
pub mod sim_link;

use std::time::Duration;

use kvmesh_core::{BlockHash, TokenId};
use thiserror::Error;

/// Index of a block in the engine's GPU-tier pool.
pub type BlockId = u32;

/// Byte layout of one KV block; peers compare it (via the fingerprint) before moving KV.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvLayout {
    /// Tokens per block.
    pub block_size: usize,
    /// Bytes of one block's KV for all layers.
    pub bytes_per_block: usize,
    pub num_layers: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    /// KV element type name, e.g. "f32", "bf16", or "sim".
    pub dtype: String,
    /// Identity of the weights (peers must match).
    pub model_id: String,
}

/// Paged KV memory: `num_blocks` blocks of `bytes_per_block` bytes, 16-byte aligned so backends
/// can view a block as `f32`/`bf16` slices with `bytemuck`.
pub struct KvArena {
    storage: Vec<u128>,
    bytes_per_block: usize,
    num_blocks: usize,
}

impl KvArena {
    /// `bytes_per_block` is rounded up to a multiple of 16.
    pub fn new(num_blocks: usize, bytes_per_block: usize) -> Self {
        let words_per_block = bytes_per_block.div_ceil(16);
        Self {
            storage: vec![0u128; words_per_block * num_blocks],
            bytes_per_block: words_per_block * 16,
            num_blocks,
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn bytes_per_block(&self) -> usize {
        self.bytes_per_block
    }

    /// The bytes of one block. Panics on an out-of-range id (ids come from the pool, never input).
    pub fn block(&self, id: BlockId) -> &[u8] {
        let words = self.bytes_per_block / 16;
        let start = id as usize * words;
        bytemuck::cast_slice(&self.storage[start..start + words])
    }

    /// Mutable bytes of one block.
    pub fn block_mut(&mut self, id: BlockId) -> &mut [u8] {
        let words = self.bytes_per_block / 16;
        let start = id as usize * words;
        bytemuck::cast_slice_mut(&mut self.storage[start..start + words])
    }
}

/// Sampling controls a backend applies when it produces a token.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_p: f32,
    /// Per-request seed; `None` = engine-chosen.
    pub seed: Option<u64>,
}

/// One sequence's share of a batch step.
pub struct SeqStep<'a> {
    /// Engine-internal request id (stable for the request's lifetime).
    pub seq_id: u64,
    /// Tokens to process now: a prefill chunk, or the last sampled token when decoding.
    pub tokens: &'a [TokenId],
    /// Position of `tokens[0]`; the KV of `0..start_pos` is already valid in `block_table`.
    pub start_pos: usize,
    /// Blocks covering at least positions `0..start_pos + tokens.len()`.
    pub block_table: &'a [BlockId],
    /// Produce the next token for this sequence (last prefill chunk, or a decode step).
    pub sample: Option<&'a SamplingParams>,
    /// Number of tokens already generated for this sequence (for deterministic sim output).
    pub num_generated: usize,
}

/// Errors a backend can report for a step; the engine fails only the affected requests.
#[derive(Debug, Error)]
pub enum ComputeError {
    #[error("backend failure: {0}")]
    Backend(String),
}

/// What a backend's timings and payloads mean, for the code around the compute loop (the P2P
/// consumer) that must treat a time-modelled backend differently from a real one. Asked once,
/// when the engine is built.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BackendCapabilities {
    /// Transfers are modelled, not real ([`ComputeBackend::modelled_pull_time`]): a pulled prefix
    /// is held until the modelled link would have delivered it, and a request whose blocks are
    /// still being pulled waits for that pull rather than getting them at loopback speed.
    pub models_pull_time: bool,
    /// A block's KV payload is a function of its hash (the `sim` backend's synthetic KV), so a
    /// receiver verifies the content of a pulled block, not only its size and transport CRC.
    pub hash_derived_payloads: bool,
    /// The backend computes layer by layer, calling [`ComputeBackend::step_layered`]'s hook
    /// before each layer, and a block's bytes are `num_layers` equal runs, layer 0 first: a
    /// pulled prefix can then arrive layer by layer while the step computes
    /// (`--p2p-load-mode layerwise`).
    pub layered_blocks: bool,
}

/// What a host-to-device restore copy costs ([`ComputeBackend::on_host_restore`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum HostRestoreCost {
    /// Nothing more: the copy already took its real time (real backends).
    Paid,
    /// Charged to the backend's next step, so it holds up the whole batch (`--sim-h2d step`).
    /// Carries the modelled (unscaled) duration.
    NextStep { modelled: Duration },
    /// Runs on a copy engine beside compute (`--sim-h2d overlap`): the engine queues it and only
    /// the requests needing the copied blocks wait `wall` (the modelled duration divided by the
    /// time scale) for it.
    CopyEngine { modelled: Duration, wall: Duration },
}

impl HostRestoreCost {
    /// The modelled (unscaled) duration of the copy, however it is charged.
    pub fn modelled(&self) -> Duration {
        match self {
            Self::Paid => Duration::ZERO,
            Self::NextStep { modelled } | Self::CopyEngine { modelled, .. } => *modelled,
        }
    }
}

/// A backend's modelled link ([`ComputeBackend::modelled_link`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelledLink {
    pub params: crate::link::LinkParams,
    /// Modelled time runs this many times faster than the wall clock (`--time-scale`).
    pub time_scale: f64,
    /// Modelled bytes of one KV block: block size × the real model's KV bytes per token.
    pub bytes_per_block: u64,
}

/// A producer of KV and tokens. Runs on the engine's dedicated compute thread: `step` may block.
pub trait ComputeBackend: Send {
    /// Short name shown in logs and /metrics ("sim", "model").
    fn name(&self) -> &str;
    /// How the engine should treat this backend's timings and payloads (default: a real
    /// backend, nothing modelled).
    fn capabilities(&self) -> BackendCapabilities {
        BackendCapabilities::default()
    }
    /// Layout of a KV block; the engine sizes its arena and CPU tier from it.
    fn kv_layout(&self) -> KvLayout;
    /// Runs one batch step; returns, per input sequence in order, the sampled token if asked.
    fn step(
        &mut self,
        seqs: &[SeqStep<'_>],
        kv: &mut KvArena,
    ) -> Result<Vec<Option<TokenId>>, ComputeError>;
    /// [`ComputeBackend::step`], calling `before_layer(l, kv)` before the step reads or writes
    /// any KV of layer `l`, for every layer in order: the engine copies layers of a prefix still
    /// arriving from a peer into the arena there. Backends that do not compute layer by layer
    /// keep the default (every layer first, then the step).
    fn step_layered(
        &mut self,
        seqs: &[SeqStep<'_>],
        kv: &mut KvArena,
        before_layer: &mut dyn FnMut(usize, &mut KvArena),
    ) -> Result<Vec<Option<TokenId>>, ComputeError> {
        for layer in 0..self.kv_layout().num_layers as usize {
            before_layer(layer, kv);
        }
        self.step(seqs, kv)
    }
    /// End-of-sequence token ids (generation stops on them unless `ignore_eos`).
    fn eos_token_ids(&self) -> Vec<TokenId>;
    /// The longest sequence (prompt + output) the model can process, when it has such a limit
    /// (a real model's context length); `None` for time-modelled backends.
    fn max_context(&self) -> Option<usize> {
        None
    }
    /// For time-modelled backends: how long pulling `tokens` of KV from a peer takes on the modelled
    /// hardware, so a consumer can hold a pulled prefix until then. Real backends return `None`
    /// (the real transfer time is the truth).
    fn modelled_pull_time(&self, _tokens: usize) -> Option<std::time::Duration> {
        None
    }
    /// For time-modelled backends whose transfers cross a modelled shared link
    /// ([`crate::link`]): its parameters, so the engine can pace its P2P producer and consumer
    /// by it. `None`: real backends, and the `sim` backend in `--sim-link ladder` mode (then
    /// [`ComputeBackend::modelled_pull_time`] alone prices a pull).
    fn modelled_link(&self) -> Option<ModelledLink> {
        None
    }
    /// Called by the engine once block `block` is full, its KV valid and its chained hash known,
    /// right before the block is published and offloaded. The `sim` backend writes its
    /// hash-derived payload here; real backends keep the default (their KV is already written).
    fn finalize_block(&mut self, _block: BlockId, _hash: BlockHash, _kv: &mut KvArena) {}
    /// Called when the engine copied `tokens` worth of KV from the CPU tier into the arena (a
    /// local prefix hit restored from host memory, or a restore ahead of a request): what that
    /// host-to-device copy costs ([`HostRestoreCost`]). Real backends keep the default (their
    /// copy already took its time).
    fn on_host_restore(&mut self, _tokens: usize) -> HostRestoreCost {
        HostRestoreCost::Paid
    }
    /// Called when the engine is idle with host-to-device copies charged to the next step but no
    /// step to charge them to (a restore ahead of a request on an idle engine): time-modelled
    /// backends spend that time now, on the idle compute thread, so it is neither lost nor
    /// pushed onto the next request's first step.
    fn run_pending_restore(&mut self) {}
}
