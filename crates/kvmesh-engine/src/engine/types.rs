//! What goes in and out of the compute loop.

use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::{Duration, Instant};

use kvmesh_core::{BlockDigest, BlockHash, KvTransferParams, PullFeedback, TokenId};
use tokio::sync::{mpsc, oneshot};

use crate::compute::SamplingParams;
use crate::layered_pull::LayeredPull;
use crate::pool::BlockPool;

/// Why a sequence finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS or a stop token id.
    Stop,
    /// `max_tokens` or the model length reached.
    Length,
    Abort,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// A generation request as the compute loop sees it (already tokenized and validated).
#[derive(Debug, Clone)]
pub struct EngineRequest {
    /// Client-visible id (e.g. `cmpl-…`), for logs.
    pub request_id: String,
    pub prompt: Vec<TokenId>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub ignore_eos: bool,
    pub stop_token_ids: Vec<TokenId>,
    pub kv_transfer_params: Option<KvTransferParams>,
    /// vLLM's `cache_salt`: hashed into the prompt's block 0 (and so into every later block
    /// through the parent chain), so the request shares cached blocks only with requests of the
    /// same salt, locally and through P2P. `None` (or empty) is the shared, unsalted space.
    pub cache_salt: Option<String>,
    /// When the request arrived (TTFT and queue time are measured from here).
    pub arrival: Instant,
    /// Blocks a request hook pulled into the CPU tier for this request from a peer: their
    /// restores count as external hits (`vllm:external_prefix_cache_hits`), not local ones.
    pub external_hashes: Vec<BlockHash>,
    /// Those of `external_hashes` on which this request holds a `Pull` pin (blocks landed
    /// unpinned at the pull-pin cap are not here): released when it finishes.
    pub pull_pinned_hashes: Vec<BlockHash>,
    /// Prompt tokens that were queried against an external source (P2P), for
    /// `vllm:external_prefix_cache_queries`.
    pub external_query_tokens: usize,
    /// What this request's remote read did (set by [`crate::p2p::P2pConsumer::read`]): the
    /// engine sends it back as the `x-kvmesh-pull` response header, so the router can judge the
    /// source it named.
    pub pull_feedback: Option<PullFeedback>,
    /// A layer-major pull of this request's missing prefix still arriving
    /// (`--p2p-load-mode layerwise`): its first step waits for each layer as it computes.
    pub layered_pull: Option<Arc<LayeredPull>>,
}

impl EngineRequest {
    /// A greedy request for `max_tokens` tokens of `prompt`, arriving now, with nothing pulled
    /// or attached yet (the fields a hook or the HTTP layer sets keep their empty values).
    pub fn greedy(request_id: impl Into<String>, prompt: Vec<TokenId>, max_tokens: usize) -> Self {
        Self {
            request_id: request_id.into(),
            prompt,
            sampling: SamplingParams {
                temperature: 0.0,
                top_p: 1.0,
                seed: None,
            },
            max_tokens,
            ignore_eos: true,
            stop_token_ids: Vec::new(),
            kv_transfer_params: None,
            cache_salt: None,
            arrival: Instant::now(),
            external_hashes: Vec::new(),
            pull_pinned_hashes: Vec::new(),
            external_query_tokens: 0,
            pull_feedback: None,
            layered_pull: None,
        }
    }
}

/// Final accounting of a sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct FinishInfo {
    pub reason: FinishReason,
    /// The stop token id that ended it (vLLM `stop_reason`), if any.
    pub stop_token: Option<TokenId>,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose KV came from a cache (local or external), per vLLM's rule.
    pub cached_tokens: usize,
    /// Prompt tokens in full blocks this request newly stored.
    pub created_cache_tokens: usize,
    /// What the response's `kv_transfer_params` should carry (None → null).
    pub kv_transfer_params: Option<KvTransferParams>,
    /// Hashes of every full block the sequence computed, prompt and generated tokens (P/D
    /// bi-directional retention); empty when the HTTP layer ended it on a stop string.
    pub block_hashes: Vec<BlockHash>,
}

/// What the compute loop sends back for one sequence.
#[derive(Debug, Clone, PartialEq)]
pub enum SeqOutput {
    /// First scheduling: how many prompt tokens were cache hits and how long it queued.
    Started {
        cached_tokens: usize,
        queue_time: Duration,
    },
    Token(TokenId),
    Finished(Box<FinishInfo>),
    Error(String),
}

/// Counters shared between handlers and the loop.
#[derive(Debug, Default)]
pub struct SharedCounters {
    /// Submitted but not yet scheduled (admission control for `--max-waiting`).
    pub queued: AtomicUsize,
    pub running: AtomicUsize,
}

/// Why a request could not be submitted.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SubmitError {
    #[error("engine is overloaded: {0} requests waiting")]
    Overloaded(usize),
    #[error("engine stopped")]
    Stopped,
}

/// What the handle sends the compute loop.
pub(super) enum Command {
    Add(Box<NewSeq>),
    /// End a sequence early: `Abort` when its client left, `Stop` when a stop string matched.
    Abort(u64, FinishReason),
    Reset(oneshot::Sender<bool>),
    /// Restore ahead of a request (a router's restore prefetch): see [`RestoreAhead`].
    Restore(Box<RestoreAhead>),
    /// Runs a closure on the compute thread with the pool (tests / debugging).
    Inspect(Box<dyn FnOnce(&BlockPool) + Send>),
    Shutdown,
}

/// Bring the CPU-tier blocks of a history into the GPU tier now, before the request that will
/// use them arrives (`POST /kvmesh/prefetch` without `remote_kv_source`).
pub(super) struct RestoreAhead {
    /// The history's tokens (the restored blocks' `BlockStored` events carry them).
    pub(super) tokens: Vec<TokenId>,
    /// Event hashes of every full block of `tokens`.
    pub(super) hashes: Vec<BlockHash>,
    pub(super) reply: oneshot::Sender<RestoreReport>,
}

/// What a restore ahead did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RestoreReport {
    /// Full blocks of the history.
    pub blocks: usize,
    /// Leading blocks already in the GPU tier.
    pub gpu_blocks: usize,
    /// Blocks after those that the CPU tier holds (what a restore could bring up).
    pub wanted_blocks: usize,
    /// Blocks brought into the GPU tier.
    pub restored_blocks: usize,
    /// Why it restored fewer than `wanted_blocks`: `requests_waiting` or `gpu_short`.
    pub stopped: Option<&'static str>,
    /// Modelled host-to-device time charged for the copy (unscaled ms; 0 on real backends).
    pub modelled_ms: f64,
}

/// A submitted request, hashed and numbered, on its way to the loop.
pub(super) struct NewSeq {
    pub(super) id: u64,
    pub(super) req: EngineRequest,
    pub(super) digests: Vec<BlockDigest>,
    pub(super) tx: mpsc::UnboundedSender<SeqOutput>,
}
