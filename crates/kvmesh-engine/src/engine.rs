//! The compute loop: scheduler + block pool + CPU tier + backend, on one dedicated std thread.
//!
//! HTTP handlers hold an [`EngineHandle`]; [`EngineHandle::submit`] sends the request to the loop
//! and returns a stream of [`SeqOutput`]. Dropping that stream (client disconnect) aborts the
//! request and frees its blocks.
//!
//! Scheduling (vLLM v1 style, one step at a time):
//! 1. running sequences first, in order, each taking up to its remaining tokens from the step's
//!    token budget (`max_num_batched_tokens`); when blocks run out the *last* running sequence is
//!    preempted (blocks freed, state reset, back to the *front* of the queue — delayed, never
//!    dropped; its computed full blocks stay cached, so resuming is mostly prefix hits);
//! 2. then waiting sequences FCFS while budget and `max_num_seqs` allow; on first scheduling a
//!    sequence takes its prefix hit (GPU tier, then restore from the CPU tier) and prompts longer
//!    than the budget are prefilled in chunks over several steps.
//!
//! After the backend step, newly full blocks get their hash, are published (`BlockStored` GPU)
//! and offloaded to the CPU tier (`BlockStored` CPU). Evictions publish `BlockRemoved` before the
//! block is reused.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hashbrown::{HashMap, HashSet};
use kvmesh_core::events::BlockStored;
use kvmesh_core::{
    BlockDigest, BlockHash, BlockHasher, KvEvent, KvTransferParams, Medium, TokenId,
};
use kvmesh_text::Tokenizer;
use tokio::sync::{mpsc, oneshot};

use crate::compute::{BlockId, ComputeBackend, KvArena, KvLayout, SamplingParams, SeqStep};
use crate::config::EngineConfig;
use crate::cpu_tier::{CpuTier, OffloadBlock};
use crate::metrics::{EngineMetrics, ReasonLabel, SourceLabel};
use crate::outbox::KvEventSink;
use crate::pool::{BlockPool, BlockState};

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
    /// When the request arrived (TTFT and queue time are measured from here).
    pub arrival: Instant,
    /// Blocks a pre-admission hook pulled into the CPU tier for this request from a peer: their
    /// restores count as external hits (`vllm:external_prefix_cache_hits`), not local ones.
    pub external_hashes: Vec<BlockHash>,
    /// Those of `external_hashes` on which this request holds a `Pull` pin (blocks landed
    /// unpinned at the pull-pin cap are not here): released when it finishes.
    pub pull_pinned_hashes: Vec<BlockHash>,
    /// Prompt tokens that were queried against an external source (P2P), for
    /// `vllm:external_prefix_cache_queries`.
    pub external_query_tokens: usize,
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

enum Command {
    Add(Box<NewSeq>),
    /// End a sequence early: `Abort` when its client left, `Stop` when a stop string matched.
    Abort(u64, FinishReason),
    Reset(oneshot::Sender<bool>),
    /// Runs a closure on the compute thread with the pool (tests / debugging).
    Inspect(Box<dyn FnOnce(&BlockPool) + Send>),
    Shutdown,
}

struct NewSeq {
    id: u64,
    req: EngineRequest,
    digests: Vec<BlockDigest>,
    tx: mpsc::UnboundedSender<SeqOutput>,
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

/// Cloneable access to a running engine.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::UnboundedSender<Command>,
    inner: Arc<HandleInner>,
}

struct HandleInner {
    config: EngineConfig,
    tokenizer: Arc<dyn Tokenizer>,
    hasher: BlockHasher,
    cpu: Arc<CpuTier>,
    metrics: Arc<EngineMetrics>,
    counters: Arc<SharedCounters>,
    layout: KvLayout,
    backend_name: String,
    modelled_pull: Arc<dyn Fn(usize) -> Option<Duration> + Send + Sync>,
    next_id: std::sync::atomic::AtomicU64,
}

/// A submitted request's output stream; dropping it aborts the request.
pub struct SeqStream {
    id: u64,
    rx: mpsc::UnboundedReceiver<SeqOutput>,
    tx: mpsc::UnboundedSender<Command>,
    done: bool,
    cached_tokens: Option<usize>,
    metrics: Arc<EngineMetrics>,
    /// The finish reason to count when the stream goes away (`abort` if never finished).
    outcome: &'static str,
}

impl SeqStream {
    /// Next output, `None` when the loop has gone away.
    pub async fn recv(&mut self) -> Option<SeqOutput> {
        let out = self.rx.recv().await;
        match &out {
            Some(SeqOutput::Started { cached_tokens, .. }) => {
                self.cached_tokens = Some(*cached_tokens)
            }
            Some(SeqOutput::Finished(f)) if self.outcome == "abort" => {
                self.outcome = f.reason.as_str()
            }
            Some(SeqOutput::Error(_)) => self.outcome = "error",
            _ => {}
        }
        if matches!(
            out,
            Some(SeqOutput::Finished(_)) | Some(SeqOutput::Error(_)) | None
        ) {
            self.done = true;
        }
        out
    }

    /// Ends the sequence as finished by a stop string (counted as `stop`, not `abort`).
    pub fn finish_stopped(&mut self) {
        self.outcome = "stop";
        if !self.done {
            self.done = true;
            let _ = self.tx.send(Command::Abort(self.id, FinishReason::Stop));
        }
    }

    /// Prompt tokens served from cache, once the request has been scheduled.
    pub fn cached_tokens(&self) -> Option<usize> {
        self.cached_tokens
    }

    /// Engine-internal sequence id.
    pub fn id(&self) -> u64 {
        self.id
    }
}

impl Drop for SeqStream {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.tx.send(Command::Abort(self.id, FinishReason::Abort));
        }
        self.metrics
            .request_success
            .get_or_create(&ReasonLabel {
                finished_reason: self.outcome,
            })
            .inc();
    }
}

impl EngineHandle {
    pub fn config(&self) -> &EngineConfig {
        &self.inner.config
    }

    pub fn tokenizer(&self) -> &Arc<dyn Tokenizer> {
        &self.inner.tokenizer
    }

    /// The shared CPU tier (the P2P producer serves from it).
    pub fn cpu_tier(&self) -> &Arc<CpuTier> {
        &self.inner.cpu
    }

    pub fn metrics(&self) -> &Arc<EngineMetrics> {
        &self.inner.metrics
    }

    pub fn counters(&self) -> &Arc<SharedCounters> {
        &self.inner.counters
    }

    pub fn kv_layout(&self) -> &KvLayout {
        &self.inner.layout
    }

    pub fn backend_name(&self) -> &str {
        &self.inner.backend_name
    }

    /// A hasher configured like the engine's (algorithm, seed, block size).
    pub fn hasher(&self) -> BlockHasher {
        self.inner.hasher.clone()
    }

    /// The fingerprint peers compare before moving KV.
    pub fn fingerprint(&self) -> kvmesh_core::Fingerprint {
        let l = &self.inner.layout;
        kvmesh_core::Fingerprint {
            model_id: l.model_id.clone(),
            kv_dtype: l.dtype.clone(),
            block_size: l.block_size as u32,
            num_layers: l.num_layers,
            num_kv_heads: l.num_kv_heads,
            head_dim: l.head_dim,
            hash_algo: self.inner.hasher.algo(),
            none_hash: self.inner.hasher.none_hash().to_hex(),
        }
    }

    /// The backend's modelled pull time for `tokens` (sim only).
    pub fn modelled_pull_time(&self, tokens: usize) -> Option<Duration> {
        (self.inner.modelled_pull)(tokens)
    }

    /// [`EngineHandle::modelled_pull_time`] of `blocks` full blocks, as a shareable function
    /// (for the P2P client's duration metric).
    pub fn modelled_block_pull_time(&self) -> Arc<dyn Fn(usize) -> Option<Duration> + Send + Sync> {
        let per_token = Arc::clone(&self.inner.modelled_pull);
        let block_size = self.inner.config.block_size;
        Arc::new(move |blocks| per_token(blocks * block_size))
    }

    /// Event hashes of every full block of `tokens`.
    pub fn block_hashes(&self, tokens: &[TokenId]) -> Vec<BlockHash> {
        self.inner
            .hasher
            .clone()
            .hash_prompt(tokens)
            .iter()
            .map(|d| d.event_hash())
            .collect()
    }

    /// Queues a request. Fails fast when `--max-waiting` requests already wait.
    /// `Some(waiting)` when the waiting queue is full: [`EngineHandle::submit`] would refuse.
    pub fn waiting_at_capacity(&self) -> Option<usize> {
        let queued = self.inner.counters.queued.load(Ordering::Relaxed);
        (queued >= self.inner.config.max_waiting).then_some(queued)
    }

    pub fn submit(&self, req: EngineRequest) -> Result<SeqStream, SubmitError> {
        let c = &self.inner.counters;
        let queued = c.queued.load(Ordering::Relaxed);
        if queued >= self.inner.config.max_waiting {
            return Err(SubmitError::Overloaded(queued));
        }
        let digests = self.inner.hasher.clone().hash_prompt(&req.prompt);
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        c.queued.fetch_add(1, Ordering::Relaxed);
        if self
            .tx
            .send(Command::Add(Box::new(NewSeq {
                id,
                req,
                digests,
                tx,
            })))
            .is_err()
        {
            c.queued.fetch_sub(1, Ordering::Relaxed);
            return Err(SubmitError::Stopped);
        }
        Ok(SeqStream {
            id,
            rx,
            tx: self.tx.clone(),
            done: false,
            cached_tokens: None,
            metrics: self.inner.metrics.clone(),
            outcome: "abort",
        })
    }

    /// Clears the prefix cache of both tiers (publishes `AllBlocksCleared`).
    pub async fn reset_prefix_cache(&self) -> bool {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Command::Reset(tx)).is_err() {
            return false;
        }
        rx.await.unwrap_or(false)
    }

    /// Runs `f` on the compute thread against the GPU pool (tests, debugging).
    pub async fn inspect_pool<R: Send + 'static>(
        &self,
        f: impl FnOnce(&BlockPool) -> R + Send + 'static,
    ) -> Option<R> {
        let (tx, rx) = oneshot::channel();
        let cmd = Command::Inspect(Box::new(move |p| {
            let _ = tx.send(f(p));
        }));
        self.tx.send(cmd).ok()?;
        rx.await.ok()
    }
}

/// A running engine: its handle and the compute thread.
pub struct Engine {
    pub handle: EngineHandle,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Engine {
    /// Stops the loop (in-flight requests are aborted) and joins the compute thread.
    pub fn shutdown(mut self) {
        let _ = self.handle.tx.send(Command::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Builds an engine around `backend` and starts its compute thread. `sink` receives KV events.
pub fn build_engine(
    config: EngineConfig,
    backend: Box<dyn ComputeBackend>,
    tokenizer: Arc<dyn Tokenizer>,
    sink: Arc<dyn KvEventSink>,
) -> Result<Engine, crate::config::ConfigError> {
    config.validate()?;
    let layout = backend.kv_layout();
    if layout.block_size != config.block_size {
        return Err(crate::config::ConfigError::Invalid(format!(
            "backend block size {} != --block-size {}",
            layout.block_size, config.block_size
        )));
    }
    let hasher = BlockHasher::new(
        config.hash_algo,
        config.hash_seed.as_deref(),
        config.block_size,
    );
    let metrics = Arc::new(EngineMetrics::new(
        &config.served_model_name,
        &config.engine_label,
    ));
    let cpu = Arc::new(CpuTier::new(
        config.cpu_offload_bytes,
        config.block_size,
        sink.clone(),
    ));
    cpu.set_pull_pin_fraction(config.p2p.pull_pin_fraction);
    let counters = Arc::new(SharedCounters::default());
    let (tx, rx) = mpsc::unbounded_channel();
    let backend_name = backend.name().to_owned();
    // The backend lives on the compute thread, but the P2P consumer asks for modelled pull
    // times from async tasks: sample the backend's curve once (every 256 tokens up to 128K,
    // linear beyond) and interpolate.
    let pull_table: Vec<(usize, Option<Duration>)> = (0..=512usize)
        .map(|i| i * 256)
        .map(|t| (t, backend.modelled_pull_time(t)))
        .collect();
    let modelled_pull: Arc<dyn Fn(usize) -> Option<Duration> + Send + Sync> =
        Arc::new(move |tokens| interpolate_pull(&pull_table, tokens));
    let inner = Arc::new(HandleInner {
        config: config.clone(),
        tokenizer,
        hasher: hasher.clone(),
        cpu: cpu.clone(),
        metrics: metrics.clone(),
        counters: counters.clone(),
        layout: layout.clone(),
        backend_name,
        modelled_pull,
        next_id: std::sync::atomic::AtomicU64::new(1),
    });
    metrics
        .cpu_capacity_bytes
        .set(config.cpu_offload_bytes as f64);
    let eos = backend.eos_token_ids();
    let arena = KvArena::new(config.num_gpu_blocks, layout.bytes_per_block);
    let core = Core {
        pool: BlockPool::new(config.num_gpu_blocks),
        arena,
        bytes_per_block: layout.bytes_per_block,
        backend,
        cpu,
        sink,
        hasher,
        eos,
        waiting: VecDeque::new(),
        running: Vec::new(),
        seqs: HashMap::new(),
        metrics,
        counters,
        outbox: Vec::new(),
        stop: false,
        cfg: config,
    };
    let thread = std::thread::Builder::new()
        .name("kvmesh-compute".into())
        .spawn(move || core.run(rx))
        .map_err(|e| {
            crate::config::ConfigError::Invalid(format!("cannot start compute thread: {e}"))
        })?;
    Ok(Engine {
        handle: EngineHandle { tx, inner },
        thread: Some(thread),
    })
}

fn interpolate_pull(table: &[(usize, Option<Duration>)], tokens: usize) -> Option<Duration> {
    let pts: Vec<(f64, f64)> = table
        .iter()
        .filter_map(|(t, d)| d.map(|d| (*t as f64, d.as_secs_f64())))
        .collect();
    if pts.is_empty() {
        return None;
    }
    if tokens == 0 {
        return Some(Duration::ZERO);
    }
    let x = tokens as f64;
    let i = pts
        .iter()
        .position(|p| p.0 >= x)
        .unwrap_or(pts.len() - 1)
        .max(1)
        .min(pts.len() - 1);
    if pts.len() == 1 {
        return Some(Duration::from_secs_f64(pts[0].1));
    }
    let (x0, y0) = pts[i - 1];
    let (x1, y1) = pts[i];
    let y = if x1 > x0 {
        y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    } else {
        y1
    };
    Some(Duration::from_secs_f64(y.max(0.0)))
}

struct Seq {
    req: EngineRequest,
    tokens: Vec<TokenId>,
    prompt_len: usize,
    digests: Vec<BlockDigest>,
    blocks: Vec<BlockId>,
    num_computed: usize,
    /// Full blocks whose hash has been handled (registered or found duplicate).
    num_finalized: usize,
    /// Set once, at first scheduling.
    cached_tokens: Option<usize>,
    created_cache_tokens: usize,
    /// Prefix lookup done for the current residency (reset by preemption).
    resident: bool,
    first_token_at: Option<Instant>,
    external: HashSet<BlockHash>,
    tx: mpsc::UnboundedSender<SeqOutput>,
}

impl Seq {
    fn output_len(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
}

struct Core {
    cfg: EngineConfig,
    pool: BlockPool,
    arena: KvArena,
    bytes_per_block: usize,
    backend: Box<dyn ComputeBackend>,
    cpu: Arc<CpuTier>,
    sink: Arc<dyn KvEventSink>,
    hasher: BlockHasher,
    eos: Vec<TokenId>,
    waiting: VecDeque<u64>,
    running: Vec<u64>,
    seqs: HashMap<u64, Seq>,
    metrics: Arc<EngineMetrics>,
    counters: Arc<SharedCounters>,
    outbox: Vec<KvEvent>,
    stop: bool,
}

/// One scheduled piece of work.
struct Planned {
    id: u64,
    start: usize,
    n: usize,
}

impl Core {
    fn run(mut self, mut rx: mpsc::UnboundedReceiver<Command>) {
        loop {
            if self.running.is_empty() && self.waiting.is_empty() {
                match rx.blocking_recv() {
                    Some(cmd) => self.handle(cmd),
                    None => break,
                }
                if self.stop {
                    break;
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => {
                        self.abort_all();
                        return;
                    }
                }
            }
            if self.stop {
                break;
            }
            let progressed = self.step();
            self.update_gauges();
            if !progressed && (!self.running.is_empty() || !self.waiting.is_empty()) {
                // Waiting work that cannot be scheduled yet and nothing running: wait for a
                // command (an abort or reset may free blocks) instead of spinning.
                match rx.blocking_recv() {
                    Some(cmd) => self.handle(cmd),
                    None => break,
                }
            }
        }
        self.abort_all();
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Add(ns) => {
                let NewSeq {
                    id,
                    req,
                    digests,
                    tx,
                } = *ns;
                let prompt_len = req.prompt.len();
                let external = req.external_hashes.iter().copied().collect();
                let seq = Seq {
                    tokens: req.prompt.clone(),
                    prompt_len,
                    digests,
                    blocks: Vec::new(),
                    num_computed: 0,
                    num_finalized: 0,
                    cached_tokens: None,
                    created_cache_tokens: 0,
                    resident: false,
                    first_token_at: None,
                    external,
                    tx,
                    req,
                };
                self.seqs.insert(id, seq);
                self.waiting.push_back(id);
            }
            Command::Abort(id, reason) => {
                if self.seqs.contains_key(&id) {
                    self.finish(id, reason, None);
                }
            }
            Command::Reset(reply) => {
                self.pool.reset(&mut self.outbox);
                self.flush_events();
                self.cpu.clear();
                // Sequences in flight keep computing; their blocks are simply no longer cached
                // (they will not be re-registered: mark everything finalized).
                let bs = self.cfg.block_size;
                for s in self.seqs.values_mut() {
                    s.num_finalized = (s.num_computed / bs).max(s.num_finalized);
                }
                let _ = reply.send(true);
            }
            Command::Inspect(f) => f(&self.pool),
            Command::Shutdown => self.stop = true,
        }
    }

    fn abort_all(&mut self) {
        let ids: Vec<u64> = self.seqs.keys().copied().collect();
        for id in ids {
            self.finish(id, FinishReason::Abort, None);
        }
    }

    fn flush_events(&mut self) {
        if !self.outbox.is_empty() {
            self.sink.publish(std::mem::take(&mut self.outbox));
        }
    }

    fn update_gauges(&self) {
        self.metrics
            .num_requests_running
            .set(self.running.len() as f64);
        self.metrics
            .num_requests_waiting
            .set(self.waiting.len() as f64);
        self.metrics.kv_cache_usage_perc.set(self.pool.usage());
        self.counters
            .running
            .store(self.running.len(), Ordering::Relaxed);
        let ev = self.pool.evictions();
        let seen = self.metrics.gpu_evicted_blocks.get();
        if ev > seen {
            self.metrics.gpu_evicted_blocks.inc_by(ev - seen);
        }
    }

    fn block_size(&self) -> usize {
        self.cfg.block_size
    }

    /// Grows `id`'s block table to cover `upto` tokens. False if the pool ran dry (the blocks
    /// already taken stay with the sequence).
    fn ensure_blocks(&mut self, id: u64, upto: usize) -> bool {
        let bs = self.block_size();
        let Some(seq) = self.seqs.get_mut(&id) else {
            return false;
        };
        let need = upto.div_ceil(bs);
        while seq.blocks.len() < need {
            match self.pool.allocate(&mut self.outbox) {
                Some(b) => seq.blocks.push(b),
                None => return false,
            }
        }
        true
    }

    /// Frees a sequence's blocks (tail first) and resets its compute state.
    fn release_blocks(&mut self, id: u64) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            for &b in seq.blocks.iter().rev() {
                self.pool.release(b);
            }
            seq.blocks.clear();
        }
    }

    fn preempt(&mut self, id: u64) {
        self.release_blocks(id);
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.num_computed = 0;
            seq.num_finalized = 0;
            seq.resident = false;
        }
        self.running.retain(|&r| r != id);
        self.waiting.push_front(id);
        self.metrics.num_preemptions.inc();
        tracing::debug!(seq = id, "preempted (out of GPU blocks)");
    }

    /// Prefix hit on (re)admission: GPU-tier blocks, then restores from the CPU tier. Returns
    /// false (and leaves the sequence untouched) when its blocks for `chunk_tokens` more tokens
    /// cannot be had now.
    fn admit(&mut self, id: u64, budget: usize) -> Option<usize> {
        let bs = self.block_size();
        let seq = self.seqs.get(&id)?;
        let total = seq.tokens.len();
        let max_hit_blocks = (total.saturating_sub(1)) / bs;
        // Digests of every full prompt block: the last one is never a hit, but it is still
        // computed here and peers may wait for it (PENDING).
        let prompt_blocks = seq.prompt_len / bs;
        self.extend_digests(id, max_hit_blocks.max(prompt_blocks));
        let seq = self.seqs.get(&id)?;
        let hashes: Vec<BlockHash> = seq.digests[..max_hit_blocks.min(seq.digests.len())]
            .iter()
            .map(|d| d.event_hash())
            .collect();
        let gpu_hit = self.pool.lookup_prefix(&hashes);
        // The prefix is in use: keep its CPU copies (what peers pull) from ageing out while the
        // GPU copy serves it, or a hot prefix vanishes from the tier peers can see.
        self.cpu.touch(&hashes[..gpu_hit]);
        let cpu_hit = self.cpu.lookup_prefix(&hashes[gpu_hit..]);
        let hit_blocks = gpu_hit + cpu_hit;
        let hit_tokens = hit_blocks * bs;
        let n = (total - hit_tokens).min(budget);
        if n == 0 {
            return None;
        }
        // Blocks the hit pins that are currently evictable stop being allocatable.
        let evictable_hits = hashes[..gpu_hit]
            .iter()
            .filter(|h| {
                self.pool
                    .get(**h)
                    .is_some_and(|b| self.pool.state(b) == BlockState::Cached)
            })
            .count();
        let new_blocks = (hit_tokens + n).div_ceil(bs) - gpu_hit;
        if self.pool.num_allocatable().saturating_sub(evictable_hits) < new_blocks {
            return None;
        }
        let mut blocks = Vec::with_capacity(new_blocks + gpu_hit);
        for h in &hashes[..gpu_hit] {
            if let Some(b) = self.pool.acquire_cached(*h) {
                blocks.push(b);
            }
        }
        // Restore from the CPU tier; stop at the first block that vanished or does not fit.
        let mut restored = 0;
        let mut restored_external = 0;
        let mut stored_run: Option<BlockStored> = None;
        for (i, h) in hashes.iter().enumerate().skip(gpu_hit).take(cpu_hit) {
            let Some(payload) = self.cpu.get(*h) else {
                break;
            };
            if payload.len() > self.bytes_per_block {
                break;
            }
            let Some(b) = self.pool.allocate(&mut self.outbox) else {
                break;
            };
            let dst = self.arena.block_mut(b);
            dst[..payload.len()].copy_from_slice(&payload);
            blocks.push(b);
            if self.pool.register(b, *h) {
                let tokens = &seq.tokens[i * bs..(i + 1) * bs];
                let parent = if i == 0 { None } else { Some(hashes[i - 1]) };
                let run = stored_run.get_or_insert_with(|| gpu_stored(parent, bs));
                run.block_hashes.push(*h);
                run.token_ids.extend_from_slice(tokens);
            }
            restored += 1;
            if seq.external.contains(h) {
                restored_external += 1;
            }
        }
        if let Some(run) = stored_run {
            self.outbox.push(KvEvent::BlockStored(run));
        }
        let hit_blocks = gpu_hit + restored;
        let hit_tokens = hit_blocks * bs;
        let first_time = seq.cached_tokens.is_none();
        let prompt_len = seq.prompt_len;
        let pending: Vec<BlockHash> = if first_time {
            seq.digests
                .iter()
                .take(prompt_len / bs)
                .skip(hit_blocks)
                .map(|d| d.event_hash())
                .collect()
        } else {
            Vec::new()
        };
        let seq = self.seqs.get_mut(&id)?;
        seq.blocks = blocks;
        seq.num_computed = hit_tokens;
        seq.num_finalized = hit_blocks;
        seq.resident = true;
        self.metrics.cpu_restored_blocks.inc_by(restored as u64);
        // Pulled (external) blocks are not charged again: the profile's pull time covers
        // landing them.
        if restored > restored_external {
            self.backend
                .on_host_restore((restored - restored_external) * bs);
        }
        if first_time {
            let cached = hit_tokens.min(prompt_len);
            seq.cached_tokens = Some(cached);
            // External exactly once: the hit blocks this request pulled (or waited for) that
            // still carry the tier's external flag — whether restored from the CPU tier or
            // already in the GPU tier because another request restored them first. The first
            // request to be scheduled takes the flag; later users count a local hit.
            let claimed: Vec<BlockHash> = hashes[..hit_blocks]
                .iter()
                .filter(|h| seq.external.contains(*h))
                .copied()
                .collect();
            let external_blocks = self.cpu.take_external(&claimed);
            let external_tokens = (external_blocks * bs).min(cached);
            let local = cached - external_tokens;
            let m = &self.metrics;
            m.prefix_cache_queries.inc_by(prompt_len as u64);
            m.prefix_cache_hits.inc_by(local as u64);
            m.prompt_tokens.inc_by(prompt_len as u64);
            if seq.req.external_query_tokens > 0 {
                m.external_prefix_cache_queries
                    .inc_by(seq.req.external_query_tokens as u64);
            }
            m.external_prefix_cache_hits.inc_by(external_tokens as u64);
            m.prompt_tokens_by_source
                .get_or_create(&SourceLabel {
                    source: "local_cache_hit",
                })
                .inc_by(local as u64);
            m.prompt_tokens_by_source
                .get_or_create(&SourceLabel {
                    source: "external_kv_transfer",
                })
                .inc_by(external_tokens as u64);
            m.prompt_tokens_by_source
                .get_or_create(&SourceLabel {
                    source: "local_compute",
                })
                .inc_by((prompt_len - cached) as u64);
            let queue_time = seq.req.arrival.elapsed();
            m.request_queue_time.observe(queue_time.as_secs_f64());
            self.counters.queued.fetch_sub(1, Ordering::Relaxed);
            let _ = seq.tx.send(SeqOutput::Started {
                cached_tokens: cached,
                queue_time,
            });
            // Blocks this request will compute: a peer asking for them now gets PENDING.
            self.cpu.mark_pending(&pending);
        }
        let remaining = seq.tokens.len() - seq.num_computed;
        let n = remaining.min(budget);
        if !self.ensure_blocks(id, hit_tokens + n) {
            // Cannot happen after the capacity check above; undo to stay consistent.
            self.release_blocks(id);
            return None;
        }
        Some(n)
    }

    /// Makes sure digests exist for the first `n_blocks` full blocks of the sequence's tokens.
    fn extend_digests(&mut self, id: u64, n_blocks: usize) {
        let bs = self.block_size();
        let Some(seq) = self.seqs.get_mut(&id) else {
            return;
        };
        while seq.digests.len() < n_blocks && (seq.digests.len() + 1) * bs <= seq.tokens.len() {
            let i = seq.digests.len();
            let parent = if i == 0 {
                self.hasher.none_hash()
            } else {
                seq.digests[i - 1]
            };
            let d = self
                .hasher
                .hash_block(&parent, &seq.tokens[i * bs..(i + 1) * bs]);
            seq.digests.push(d);
        }
    }

    /// Plans and runs one step. Returns false when nothing could be scheduled.
    fn step(&mut self) -> bool {
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut plan: Vec<Planned> = Vec::new();
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let Some(seq) = self.seqs.get(&id) else {
                self.running.remove(i);
                continue;
            };
            let start = seq.num_computed;
            let n = (seq.tokens.len() - start).min(budget);
            if n == 0 {
                i += 1;
                continue;
            }
            let mut scheduled = true;
            while !self.ensure_blocks(id, start + n) {
                let Some(&victim) = self.running.last() else {
                    break;
                };
                if victim == id {
                    if self.running.len() == 1 {
                        // Alone and still out of blocks: it can never grow; end it.
                        self.finish(id, FinishReason::Length, None);
                    } else {
                        self.preempt(id);
                    }
                    preempted = true;
                    scheduled = false;
                    break;
                }
                plan.retain(|p| p.id != victim);
                self.preempt(victim);
                preempted = true;
            }
            if !scheduled {
                break;
            }
            plan.push(Planned { id, start, n });
            budget -= n;
            i += 1;
        }
        // Recompute budget: preempted sequences' planned tokens were dropped from the plan.
        budget = self.cfg.max_num_batched_tokens - plan.iter().map(|p| p.n).sum::<usize>();
        if !preempted {
            while budget > 0 && self.running.len() < self.cfg.max_num_seqs {
                let Some(&id) = self.waiting.front() else {
                    break;
                };
                let Some(n) = self.admit(id, budget) else {
                    break;
                };
                self.waiting.pop_front();
                self.running.push(id);
                let start = self.seqs.get(&id).map_or(0, |s| s.num_computed);
                plan.push(Planned { id, start, n });
                budget -= n;
            }
        }
        self.flush_events();
        if plan.is_empty() {
            return false;
        }
        self.execute(&plan);
        true
    }

    fn execute(&mut self, plan: &[Planned]) {
        let t0 = Instant::now();
        let result = {
            let mut steps = Vec::with_capacity(plan.len());
            for p in plan {
                let Some(seq) = self.seqs.get(&p.id) else {
                    continue;
                };
                let end = p.start + p.n;
                steps.push(SeqStep {
                    seq_id: p.id,
                    tokens: &seq.tokens[p.start..end],
                    start_pos: p.start,
                    block_table: &seq.blocks,
                    sample: (end == seq.tokens.len()).then_some(&seq.req.sampling),
                    num_generated: seq.output_len(),
                });
            }
            self.backend.step(&steps, &mut self.arena)
        };
        self.metrics
            .step_seconds
            .observe(t0.elapsed().as_secs_f64());
        let sampled = match result {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, "backend step failed; failing the batch");
                for p in plan {
                    if let Some(seq) = self.seqs.get(&p.id) {
                        let _ = seq.tx.send(SeqOutput::Error(e.to_string()));
                    }
                    self.finish(p.id, FinishReason::Abort, None);
                }
                return;
            }
        };
        let mut offloads: Vec<Vec<OffloadBlock>> = Vec::new();
        for p in plan {
            if let Some(seq) = self.seqs.get_mut(&p.id) {
                seq.num_computed = p.start + p.n;
            } else {
                continue;
            }
            if let Some(off) = self.finalize_full_blocks(p.id) {
                offloads.push(off);
            }
        }
        // GPU stores and removals first, then the CPU tier's own events; both before any
        // sequence finishes, so a finished request's blocks are already servable to peers.
        self.flush_events();
        for off in offloads {
            self.cpu.insert_run(&off);
        }
        for (p, tok) in plan.iter().zip(sampled) {
            if let Some(t) = tok {
                self.on_token(p.id, t);
            }
        }
    }

    /// Hashes, publishes and prepares for offload every block that became full.
    fn finalize_full_blocks(&mut self, id: u64) -> Option<Vec<OffloadBlock>> {
        let bs = self.block_size();
        let full = self.seqs.get(&id)?.num_computed / bs;
        let done = self.seqs.get(&id)?.num_finalized;
        if full <= done {
            return None;
        }
        self.extend_digests(id, full);
        let seq = self.seqs.get_mut(&id)?;
        let mut run: Option<BlockStored> = None;
        let mut off = Vec::new();
        for i in done..full.min(seq.digests.len()) {
            let hash = seq.digests[i].event_hash();
            let block = seq.blocks[i];
            let parent = if i == 0 {
                None
            } else {
                Some(seq.digests[i - 1].event_hash())
            };
            if self.pool.register(block, hash) {
                self.backend.finalize_block(block, hash, &mut self.arena);
                let tokens = &seq.tokens[i * bs..(i + 1) * bs];
                let r = run.get_or_insert_with(|| gpu_stored(parent, bs));
                r.block_hashes.push(hash);
                r.token_ids.extend_from_slice(tokens);
                if (i + 1) * bs <= seq.prompt_len {
                    seq.created_cache_tokens += bs;
                }
                off.push(OffloadBlock {
                    hash,
                    parent,
                    tokens: tokens.to_vec(),
                    payload: Bytes::copy_from_slice(self.arena.block(block)),
                });
            } else if let Some(r) = run.take() {
                self.outbox.push(KvEvent::BlockStored(r));
            }
            seq.num_finalized = i + 1;
        }
        if let Some(r) = run {
            self.outbox.push(KvEvent::BlockStored(r));
        }
        (!off.is_empty()).then_some(off)
    }

    fn on_token(&mut self, id: u64, token: TokenId) {
        let max_model_len = self.cfg.max_model_len;
        let Some(seq) = self.seqs.get_mut(&id) else {
            return;
        };
        seq.tokens.push(token);
        self.metrics.generation_tokens.inc();
        if seq.first_token_at.is_none() {
            let now = Instant::now();
            seq.first_token_at = Some(now);
            self.metrics
                .time_to_first_token
                .observe((now - seq.req.arrival).as_secs_f64());
        }
        let _ = seq.tx.send(SeqOutput::Token(token));
        let is_eos = self.eos.contains(&token);
        let is_stop_id = seq.req.stop_token_ids.contains(&token);
        let finish = if is_stop_id {
            Some((FinishReason::Stop, Some(token)))
        } else if is_eos && !seq.req.ignore_eos {
            Some((FinishReason::Stop, None))
        } else if seq.output_len() >= seq.req.max_tokens || seq.tokens.len() >= max_model_len {
            Some((FinishReason::Length, None))
        } else {
            None
        };
        if let Some((reason, stop)) = finish {
            self.finish(id, reason, stop);
        }
    }

    fn finish(&mut self, id: u64, reason: FinishReason, stop_token: Option<TokenId>) {
        self.release_blocks(id);
        let was_waiting = self.waiting.iter().any(|&w| w == id);
        self.waiting.retain(|&w| w != id);
        self.running.retain(|&r| r != id);
        let bs = self.block_size();
        let Some(seq) = self.seqs.remove(&id) else {
            return;
        };
        if seq.cached_tokens.is_none() && was_waiting {
            self.counters.queued.fetch_sub(1, Ordering::Relaxed);
        }
        if seq.num_finalized < seq.prompt_len / bs {
            // Blocks it promised to compute will not come (aborted, or ended early by
            // `length`): peers waiting on them stop waiting.
            let promised: Vec<BlockHash> = seq
                .digests
                .iter()
                .take(seq.prompt_len / bs)
                .skip(seq.num_finalized)
                .map(|d| d.event_hash())
                .collect();
            self.cpu.clear_pending(&promised);
        }
        // `vllm:request_success` is counted by the SeqStream (its owner knows about stop
        // strings and disconnects).
        self.metrics
            .e2e_request_latency
            .observe(seq.req.arrival.elapsed().as_secs_f64());
        let info = FinishInfo {
            reason,
            stop_token,
            prompt_tokens: seq.prompt_len,
            completion_tokens: seq.output_len(),
            cached_tokens: seq.cached_tokens.unwrap_or(0),
            created_cache_tokens: seq.created_cache_tokens,
            kv_transfer_params: None,
            block_hashes: seq
                .digests
                .iter()
                .take(seq.num_finalized)
                .map(|d| d.event_hash())
                .collect(),
        };
        let _ = seq.tx.send(SeqOutput::Finished(Box::new(info)));
    }
}

fn gpu_stored(parent: Option<BlockHash>, bs: usize) -> BlockStored {
    BlockStored::run(Medium::Gpu, parent, bs as u32, Vec::new(), Vec::new())
        .in_full_attention_group()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::compute::profiles::GPT_OSS_120B_H200;
    use crate::compute::sim::{SimBackend, SimConfig};
    use crate::cpu_tier::PinKind;
    use crate::outbox::CollectingSink;

    fn engine(cfg: EngineConfig, sink: CollectingSink) -> Engine {
        let backend = SimBackend::without_sleep(SimConfig {
            profile: &GPT_OSS_120B_H200,
            time_scale: 1.0,
            kv_bytes_per_token: 8,
            block_size: cfg.block_size,
            model_id: "sim".into(),
        });
        build_engine(
            cfg,
            Box::new(backend),
            Arc::new(kvmesh_text::ByteTokenizer),
            Arc::new(sink),
        )
        .unwrap()
    }

    fn request(prompt: Vec<TokenId>, max_tokens: usize) -> EngineRequest {
        EngineRequest {
            request_id: "t".into(),
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
            arrival: Instant::now(),
            external_hashes: Vec::new(),
            pull_pinned_hashes: Vec::new(),
            external_query_tokens: 0,
        }
    }

    async fn run_to_end(mut s: SeqStream) -> (Option<usize>, Vec<TokenId>, FinishInfo) {
        let mut toks = Vec::new();
        loop {
            match s.recv().await.unwrap() {
                SeqOutput::Started { .. } => {}
                SeqOutput::Token(t) => toks.push(t),
                SeqOutput::Finished(f) => return (s.cached_tokens(), toks, *f),
                SeqOutput::Error(e) => panic!("{e}"),
            }
        }
    }

    #[tokio::test]
    async fn modelled_pull_time_follows_the_profile_off_the_compute_thread() {
        let e = engine(
            EngineConfig {
                num_gpu_blocks: 64,
                ..EngineConfig::default()
            },
            CollectingSink::default(),
        );
        let d = e.handle.modelled_pull_time(49_152).unwrap();
        assert!((d.as_secs_f64() - 0.235).abs() < 1e-3, "{d:?}");
        let d = e.handle.modelled_pull_time(8192).unwrap();
        assert!((d.as_secs_f64() - 0.057).abs() < 1e-3, "{d:?}");
        assert_eq!(e.handle.modelled_pull_time(0), Some(Duration::ZERO));
        e.shutdown();
    }

    #[tokio::test]
    async fn pulled_blocks_in_the_cpu_tier_count_as_external_hits() {
        let sink = CollectingSink::default();
        let e = engine(
            EngineConfig {
                num_gpu_blocks: 64,
                ..EngineConfig::default()
            },
            sink.clone(),
        );
        let prompt: Vec<TokenId> = (0..100).map(|i| i % 200).collect();
        let hashes = e.handle.block_hashes(&prompt);
        // A P2P consumer would land these from a peer; here they come from nowhere.
        for (i, h) in hashes.iter().enumerate().take(4) {
            let parent = if i == 0 { None } else { Some(hashes[i - 1]) };
            let payload = crate::compute::sim::sim_block_payload(*h, 16 * 8);
            assert!(e.handle.cpu_tier().insert_external(
                *h,
                parent,
                prompt[i * 16..(i + 1) * 16].to_vec(),
                payload.into()
            ));
        }
        let mut req = request(prompt, 2);
        req.external_hashes = hashes[..4].to_vec();
        req.external_query_tokens = 100;
        let (cached, toks, fin) = run_to_end(e.handle.submit(req).unwrap()).await;
        assert_eq!(cached, Some(64));
        assert_eq!(fin.cached_tokens, 64);
        assert_eq!(toks.len(), 2);
        let m = e.handle.metrics().encode();
        assert!(
            m.contains("vllm:external_prefix_cache_hits_total{model_name=\"sim\",engine=\"0\"} 64"),
            "{m}"
        );
        assert!(
            m.contains(
                "vllm:external_prefix_cache_queries_total{model_name=\"sim\",engine=\"0\"} 100"
            ),
            "{m}"
        );
        assert!(
            m.contains("vllm:prefix_cache_hits_total{model_name=\"sim\",engine=\"0\"} 0"),
            "{m}"
        );
        // The pulled blocks were published on the CPU tier, then restored into the GPU tier.
        let ev = sink.take();
        let stored_cpu = ev
            .iter()
            .filter(|e| matches!(e, KvEvent::BlockStored(s) if s.medium == Medium::Cpu))
            .count();
        let stored_gpu: Vec<BlockHash> = ev
            .iter()
            .filter_map(|e| match e {
                KvEvent::BlockStored(s) if s.medium == Medium::Gpu => Some(s.block_hashes.clone()),
                _ => None,
            })
            .flatten()
            .collect();
        assert!(stored_cpu >= 4);
        assert_eq!(stored_gpu, hashes);
        // Both tiers describe their KV group as vLLM 0.32 does (capture2: group 0, full attention).
        for event in &ev {
            if let KvEvent::BlockStored(s) = event {
                assert_eq!(
                    (s.group_idx, s.kv_cache_spec_kind.as_deref()),
                    (Some(0), Some(kvmesh_core::events::FULL_ATTENTION)),
                    "{s:?}"
                );
            }
        }
        e.shutdown();
    }

    #[tokio::test]
    async fn pulled_tokens_count_as_external_once_whatever_the_order() {
        let e = engine(
            EngineConfig {
                num_gpu_blocks: 64,
                ..EngineConfig::default()
            },
            CollectingSink::default(),
        );
        let prompt: Vec<TokenId> = (0..100).map(|i| i % 200).collect();
        let hashes = e.handle.block_hashes(&prompt);
        let lease = Instant::now() + Duration::from_secs(60);
        for (i, h) in hashes.iter().enumerate().take(4) {
            let payload = crate::compute::sim::sim_block_payload(*h, 16 * 8);
            let landed = e.handle.cpu_tier().insert_external_pinned(
                OffloadBlock {
                    hash: *h,
                    parent: i.checked_sub(1).map(|p| hashes[p]),
                    tokens: prompt[i * 16..(i + 1) * 16].to_vec(),
                    payload: payload.into(),
                },
                lease,
            );
            assert_eq!(landed, crate::cpu_tier::Landed::Pinned);
        }
        let metric = |name: &str| {
            let m = e.handle.metrics().encode();
            let key = format!("{name}{{model_name=\"sim\",engine=\"0\"}} ");
            m.lines()
                .find_map(|l| l.strip_prefix(key.as_str()))
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap()
        };
        // A request routed here as a local hit uses the pulled blocks first: a local hit for
        // it (it did not cause the pull)...
        let (cached, _, _) = run_to_end(e.handle.submit(request(prompt.clone(), 1)).unwrap()).await;
        assert_eq!(cached, Some(64));
        assert_eq!(metric("vllm:external_prefix_cache_hits_total"), 0);
        assert_eq!(metric("vllm:prefix_cache_hits_total"), 64);
        // ...and the request that pulled them still counts them external, though they are now
        // a GPU-tier hit.
        let mut puller = request(prompt.clone(), 1);
        puller.external_hashes = hashes[..4].to_vec();
        let (cached, _, _) = run_to_end(e.handle.submit(puller).unwrap()).await;
        assert_eq!(cached, Some(96));
        assert_eq!(metric("vllm:external_prefix_cache_hits_total"), 64);
        // A request that waited on the same pull comes later: local, not counted twice.
        let mut waiter = request(prompt, 1);
        waiter.external_hashes = hashes[..4].to_vec();
        run_to_end(e.handle.submit(waiter).unwrap()).await;
        assert_eq!(metric("vllm:external_prefix_cache_hits_total"), 64);
        assert_eq!(metric("vllm:prefix_cache_hits_total"), 64 + 32 + 96);
        e.shutdown();
    }

    #[tokio::test]
    async fn a_block_landed_unpinned_at_the_cap_leaves_other_requests_pull_pins_alone() {
        let e = engine(
            EngineConfig {
                num_gpu_blocks: 64,
                ..EngineConfig::default()
            },
            CollectingSink::default(),
        );
        let prompt: Vec<TokenId> = (0..32).map(|i| i % 200).collect();
        let hashes = e.handle.block_hashes(&prompt);
        let tier = e.handle.cpu_tier();
        // Pull pins hold their whole share: the block lands unpinned.
        tier.set_pull_pin_fraction(0.0);
        let landed = tier.insert_external_pinned(
            OffloadBlock {
                hash: hashes[0],
                parent: None,
                tokens: prompt[..16].to_vec(),
                payload: crate::compute::sim::sim_block_payload(hashes[0], 16 * 8).into(),
            },
            Instant::now() + Duration::from_secs(60),
        );
        assert_eq!(landed, crate::cpu_tier::Landed::Unpinned);
        // A request that waited on that pull pins what landed until it is scheduled.
        let mut waiter = request(prompt.clone(), 1);
        let n = tier.pin_as(
            PinKind::Pull,
            &hashes[..1],
            Instant::now() + Duration::from_secs(60),
        );
        waiter.external_hashes = hashes[..n].to_vec();
        waiter.pull_pinned_hashes = hashes[..n].to_vec();
        // The puller finishes first: the block counts external for it, but the pin is not its own.
        let mut puller = request(prompt, 1);
        puller.external_hashes = hashes[..1].to_vec();
        crate::p2p::release_pulled(&e.handle, &puller);
        assert_eq!(tier.pin_count(hashes[0]), 1, "the waiter's pin survives");
        crate::p2p::release_pulled(&e.handle, &waiter);
        assert_eq!(tier.pin_count(hashes[0]), 0);
        e.shutdown();
    }

    #[tokio::test]
    async fn chunked_prefill_marks_pending_and_completes_blocks_progressively() {
        let sink = CollectingSink::default();
        let cfg = EngineConfig {
            num_gpu_blocks: 64,
            max_num_batched_tokens: 32,
            ..EngineConfig::default()
        };
        let e = engine(cfg, sink);
        let prompt: Vec<TokenId> = (0..160).map(|i| (i * 3) % 250).collect();
        let hashes = e.handle.block_hashes(&prompt);
        let (cached, toks, fin) =
            run_to_end(e.handle.submit(request(prompt.clone(), 3)).unwrap()).await;
        assert_eq!(
            (cached, toks.len(), fin.reason),
            (Some(0), 3, FinishReason::Length)
        );
        assert_eq!(fin.created_cache_tokens, 160);
        for h in &hashes {
            assert!(e.handle.cpu_tier().contains(*h));
            assert!(!e.handle.cpu_tier().is_pending(*h));
        }
        // Greedy sim output is a function of position only: a repeat gives the same tokens.
        let (cached, toks2, _) = run_to_end(e.handle.submit(request(prompt, 3)).unwrap()).await;
        assert_eq!(cached, Some(144));
        assert_eq!(toks, toks2);
        let usage = e
            .handle
            .inspect_pool(|p| (p.usage(), p.check_invariants()))
            .await
            .unwrap();
        assert_eq!(usage.0, 0.0);
        usage.1.unwrap();
        e.shutdown();
    }

    /// Random mixes of shared-prefix prompts, tiny pools (preemption), chunking and aborts: every
    /// kept request finishes with its full output and the pool ends empty and consistent.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn random_workloads_finish_and_leave_a_consistent_pool() {
        use rand::{Rng, SeedableRng};
        let seed = std::env::var("KVMESH_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(11u64);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut preemptions = 0;
        for round in 0..4 {
            let cfg = EngineConfig {
                num_gpu_blocks: rng.random_range(24..64),
                max_num_batched_tokens: rng.random_range(16..300),
                max_num_seqs: rng.random_range(1..8),
                cpu_offload_bytes: rng.random_range(1_000..40_000),
                ..EngineConfig::default()
            };
            let e = engine(cfg.clone(), CollectingSink::default());
            let bases: Vec<Vec<TokenId>> = (0..3)
                .map(|b| (0..200).map(|i| (i * 7 + b * 13) % 250).collect())
                .collect();
            let mut tasks = Vec::new();
            for i in 0..30 {
                let base = &bases[rng.random_range(0..3)];
                let keep = rng.random_range(0..base.len());
                let mut prompt = base[..keep].to_vec();
                prompt
                    .extend((0..rng.random_range(1..60)).map(|j| ((i * 31 + j) % 250) as TokenId));
                let max_tokens = rng.random_range(1..40);
                let abort = rng.random_bool(0.2);
                let stream = e.handle.submit(request(prompt, max_tokens)).unwrap();
                tasks.push(tokio::spawn(async move {
                    if abort {
                        drop(stream);
                        return;
                    }
                    let (_, toks, fin) = run_to_end(stream).await;
                    assert!(
                        fin.reason == FinishReason::Length,
                        "seed {seed} round {round}: {fin:?}"
                    );
                    // Every sequence fits the pool alone (≤ 300 tokens), so none is cut short.
                    assert_eq!(
                        (toks.len(), fin.completion_tokens),
                        (max_tokens, max_tokens)
                    );
                }));
            }
            for t in tasks {
                tokio::time::timeout(Duration::from_secs(30), t)
                    .await
                    .expect("request hung")
                    .unwrap();
            }
            // Aborted streams are processed asynchronously; wait for the pool to drain.
            let t0 = Instant::now();
            loop {
                let (usage, ok) = e
                    .handle
                    .inspect_pool(|p| (p.usage(), p.check_invariants()))
                    .await
                    .unwrap();
                ok.unwrap_or_else(|err| panic!("seed {seed} round {round}: {err}"));
                if usage == 0.0 {
                    break;
                }
                assert!(
                    t0.elapsed() < Duration::from_secs(5),
                    "blocks leaked: usage {usage}"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let st = e.handle.cpu_tier().stats();
            assert!(st.used_bytes <= cfg.cpu_offload_bytes);
            preemptions += e.handle.metrics().num_preemptions.get();
            e.shutdown();
        }
        assert!(preemptions > 0, "the workload should exercise preemption");
    }
}
