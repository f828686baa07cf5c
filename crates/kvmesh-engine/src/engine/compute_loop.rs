//! The compute loop (see the [module docs](super)): one step at a time, it schedules running
//! then waiting sequences, runs the backend, finalizes full blocks (publish, offload) and streams
//! tokens back.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hashbrown::{HashMap, HashSet};
use kvmesh_core::events::BlockStored;
use kvmesh_core::{BlockDigest, BlockHash, BlockHasher, KvEvent, Medium, TokenId};
use tokio::sync::mpsc;

use crate::compute::{BlockId, ComputeBackend, HostRestoreCost, KvArena, SeqStep};
use crate::config::{ConfigError, EngineConfig};
use crate::cpu_tier::{CpuTier, OffloadBlock};
use crate::layered_pull::LayeredPull;
use crate::metrics::{EngineMetrics, SourceLabel};
use crate::outbox::KvEventSink;
use crate::pool::BlockPool;

use super::copy_engine::{CopyClass, CopyEngine};
use super::types::{
    Command, EngineRequest, FinishInfo, FinishReason, NewSeq, RestoreAhead, RestoreReport,
    SeqOutput, SharedCounters,
};

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
    /// Admitted, but its restored blocks are still on the copy engine until then: it holds its
    /// blocks and is not scheduled (other requests run meanwhile).
    kv_ready_at: Option<Instant>,
    external: HashSet<BlockHash>,
    /// A layer-major pull of the prefix not yet used (`--p2p-load-mode layerwise`).
    layered_pull: Option<Arc<LayeredPull>>,
    /// The pulled blocks its next step loads layer by layer (set at admission).
    window: Option<PulledWindow>,
    /// Blocks below this index were pulled, not created here (`created_cache_tokens`).
    pulled_until: usize,
    tx: mpsc::UnboundedSender<SeqOutput>,
}

/// Pulled blocks a sequence's first step loads layer by layer, and what its admission would
/// have reported had they been local (reported once the step shows what arrived).
struct PulledWindow {
    pull: Arc<LayeredPull>,
    /// Index of the first pulled block in the sequence's block table.
    first: usize,
    blocks: usize,
    /// The first scheduling's report, when this is the first scheduling.
    deferred_start: Option<DeferredStart>,
}

/// What a first admission would report, waiting for its layer-wise pull's step.
struct DeferredStart {
    local_cached: usize,
    local_external: usize,
    queue_time: Duration,
}

impl Seq {
    fn output_len(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
}

/// The compute loop's state: owned by the compute thread, reached only through [`Command`]s.
pub(super) struct Core {
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
    /// Host-to-device restores in flight (backends that overlap them with compute).
    copies: CopyEngine,
    stop: bool,
}

/// One scheduled piece of work.
struct Planned {
    id: u64,
    start: usize,
    n: usize,
}

impl Core {
    /// The loop's state for a fresh engine (empty pool and queues); an error names
    /// `--num-gpu-blocks` when the pool's bookkeeping cannot be allocated.
    pub(super) fn new(
        cfg: EngineConfig,
        backend: Box<dyn ComputeBackend>,
        cpu: Arc<CpuTier>,
        sink: Arc<dyn KvEventSink>,
        hasher: BlockHasher,
        metrics: Arc<EngineMetrics>,
        counters: Arc<SharedCounters>,
    ) -> Result<Self, ConfigError> {
        let layout = backend.kv_layout();
        let eos = backend.eos_token_ids();
        let pool = BlockPool::try_new(cfg.num_gpu_blocks).map_err(|e| {
            ConfigError::Invalid(format!(
                "--num-gpu-blocks {}: cannot allocate the GPU tier's block pool: {e}",
                cfg.num_gpu_blocks
            ))
        })?;
        Ok(Self {
            pool,
            arena: KvArena::new(cfg.num_gpu_blocks, layout.bytes_per_block),
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
            copies: CopyEngine::default(),
            stop: false,
            cfg,
        })
    }

    /// Runs until shutdown or until every handle is gone. Borrows the loop's state and channel
    /// so that, if a step panics, the caller records why *before* they are dropped (dropping
    /// them is what ends the requests in flight and closes the handle's channel).
    pub(super) fn run(&mut self, rx: &mut mpsc::UnboundedReceiver<Command>) {
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
            if !progressed && let Some(ready) = self.next_landing() {
                // Only requests whose blocks are still being copied: wait for the first to land
                // (in short slices, so commands are not held up).
                let wait = ready.saturating_duration_since(Instant::now());
                std::thread::sleep(wait.min(Duration::from_millis(2)));
                continue;
            }
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
                    mut req,
                    digests,
                    tx,
                } = *ns;
                let layered_pull = req.layered_pull.take();
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
                    kv_ready_at: None,
                    external,
                    layered_pull,
                    window: None,
                    pulled_until: 0,
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
            Command::Restore(r) => {
                let RestoreAhead {
                    tokens,
                    hashes,
                    reply,
                } = *r;
                let report = self.restore_ahead(&tokens, &hashes);
                let _ = reply.send(report);
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
            // Readmission looks its blocks up again (and waits for any still landing).
            seq.kv_ready_at = None;
            if let Some(w) = seq.window.take() {
                seq.layered_pull = Some(w.pull);
            }
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
        self.cpu.touch_prefix(&hashes[..gpu_hit]);
        let cpu_hit = self.cpu.lookup_prefix(&hashes[gpu_hit..]);
        let hit_blocks = gpu_hit + cpu_hit;
        let layered = layered_blocks(seq.layered_pull.as_deref(), &hashes, hit_blocks);
        let hit_tokens = (hit_blocks + layered) * bs;
        let n = (total - hit_tokens).min(budget);
        if n == 0 {
            return None;
        }
        // Blocks the hit pins that are currently evictable stop being allocatable.
        let evictable_hits = self.pool.count_evictable(&hashes[..gpu_hit]);
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
        let mut copied: Vec<BlockHash> = Vec::new();
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
                let salt = seq.req.cache_salt.as_deref();
                let run = stored_run.get_or_insert_with(|| gpu_stored(parent, bs, salt));
                run.block_hashes.push(*h);
                run.token_ids.extend_from_slice(tokens);
            }
            restored += 1;
            if !seq.external.contains(h) {
                copied.push(*h);
            }
        }
        if let Some(run) = stored_run {
            self.outbox.push(KvEvent::BlockStored(run));
        }
        let hit_blocks = gpu_hit + restored;
        let hit_tokens = hit_blocks * bs;
        // The pulled blocks continue the local prefix where it ends, or are not used.
        let layered = if restored == cpu_hit { layered } else { 0 };
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
        self.metrics.cpu_restored_blocks.inc_by(restored as u64);
        // Pulled (external) blocks are not charged again: the profile's pull time covers
        // landing them.
        if !copied.is_empty() {
            self.charge_host_restore(copied, CopyClass::Demand);
        }
        // Blocks copied for this request, or still landing from an earlier copy (a restore
        // ahead, another request's restore), hold it until they land.
        let now = Instant::now();
        let kv_ready_at = self.copies.ready_at(now, &hashes[..hit_blocks]);
        if let Some(t) = kv_ready_at {
            self.metrics
                .cpu_restore_wait_seconds
                .inc_by(t.saturating_duration_since(now).as_secs_f64());
        }
        let seq = self.seqs.get_mut(&id)?;
        seq.blocks = blocks;
        seq.num_computed = hit_tokens + layered * bs;
        seq.num_finalized = hit_blocks;
        seq.resident = true;
        seq.kv_ready_at = kv_ready_at;
        let pull = seq.layered_pull.take();
        let window = match pull {
            Some(pull) if layered > 0 => {
                seq.pulled_until = hit_blocks + layered;
                Some((pull, hit_blocks, layered))
            }
            Some(pull) => {
                // The local prefix changed since the pull started (evicted, or computed here
                // meanwhile): what it brings no longer continues it.
                pull.release();
                self.metrics.p2p_layerwise_unused.inc();
                None
            }
            None => None,
        };
        let mut deferred_start = None;
        if first_time {
            let cached = hit_tokens.min(prompt_len);
            seq.cached_tokens = Some((hit_tokens + layered * bs).min(prompt_len));
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
            let queue_time = seq.req.arrival.elapsed();
            self.counters.queued.fetch_sub(1, Ordering::Relaxed);
            if window.is_some() {
                // Reported after the first step, when it is known what arrived.
                deferred_start = Some(DeferredStart {
                    local_cached: cached,
                    local_external: external_tokens,
                    queue_time,
                });
            } else {
                report_start(&self.metrics, seq, cached, external_tokens, queue_time);
            }
            // Blocks this request will compute: a peer asking for them now gets PENDING.
            self.cpu.mark_pending(&pending);
        }
        if let Some((pull, first, blocks)) = window {
            seq.window = Some(PulledWindow {
                pull,
                first,
                blocks,
                deferred_start,
            });
        }
        let start = seq.num_computed;
        let remaining = seq.tokens.len() - start;
        let n = remaining.min(budget);
        if !self.ensure_blocks(id, start + n) {
            // Cannot happen after the capacity check above; undo to stay consistent.
            self.release_blocks(id);
            return None;
        }
        Some(n)
    }

    /// Blocks a restore ahead leaves allocatable: one full step of new tokens
    /// (`max_num_batched_tokens`) plus one block per running sequence, so the sequences already
    /// here can take their next step without preemption.
    fn restore_reserve(&self) -> usize {
        self.cfg.max_num_batched_tokens.div_ceil(self.block_size()) + self.running.len()
    }

    /// Restore ahead of a request: the CPU-tier run of `hashes` right after their GPU-tier
    /// prefix is copied into the GPU tier now, as an admission would copy it, and left cached
    /// (evictable, most recently used) for the request that is expected next. Bounded so it never
    /// costs the work already here: nothing while sequences wait (they need the blocks first),
    /// only blocks that are free or cached-unreferenced (never a running sequence's), and never
    /// below [`Core::restore_reserve`]. The host-to-device copy is charged like an on-demand
    /// restore (to the next step), or spent now when the loop is idle.
    fn restore_ahead(&mut self, tokens: &[TokenId], hashes: &[BlockHash]) -> RestoreReport {
        let bs = self.block_size();
        let n_full = hashes.len().min(tokens.len() / bs);
        let hashes = &hashes[..n_full];
        let gpu_hit = self.pool.lookup_prefix(hashes);
        let wanted = self.cpu.lookup_prefix(&hashes[gpu_hit..]);
        let mut report = RestoreReport {
            blocks: n_full,
            gpu_blocks: gpu_hit,
            wanted_blocks: wanted,
            restored_blocks: 0,
            stopped: None,
            modelled_ms: 0.0,
        };
        if wanted == 0 {
            return report;
        }
        if !self.waiting.is_empty() {
            report.stopped = Some("requests_waiting");
            return report;
        }
        // The GPU-tier prefix is held during the copy so the copy's own allocations cannot
        // evict it (it would turn the restore into a shuffle).
        let evictable_hits = self.pool.count_evictable(&hashes[..gpu_hit]);
        let room = self
            .pool
            .num_allocatable()
            .saturating_sub(evictable_hits)
            .saturating_sub(self.restore_reserve());
        let take = wanted.min(room);
        if take < wanted {
            report.stopped = Some("gpu_short");
        }
        if take == 0 {
            return report;
        }
        let mut held: Vec<BlockId> = hashes[..gpu_hit]
            .iter()
            .filter_map(|h| self.pool.acquire_cached(*h))
            .collect();
        let mut restored = 0;
        let mut copied: Vec<BlockHash> = Vec::new();
        let mut stored_run: Option<BlockStored> = None;
        for (i, h) in hashes.iter().enumerate().skip(gpu_hit).take(take) {
            if let Some(b) = self.pool.acquire_cached(*h) {
                // Already in the GPU tier past a gap in the prefix: nothing to copy.
                held.push(b);
                if let Some(run) = stored_run.take() {
                    self.outbox.push(KvEvent::BlockStored(run));
                }
                continue;
            }
            let Some(payload) = self.cpu.get(*h) else {
                break;
            };
            if payload.len() > self.bytes_per_block {
                break;
            }
            let Some(b) = self.pool.allocate(&mut self.outbox) else {
                report.stopped = Some("gpu_short");
                break;
            };
            self.arena.block_mut(b)[..payload.len()].copy_from_slice(&payload);
            held.push(b);
            copied.push(*h);
            if self.pool.register(b, *h) {
                let parent = if i == 0 { None } else { Some(hashes[i - 1]) };
                // A restore ahead names bare token ids: the unsalted space.
                let run = stored_run.get_or_insert_with(|| gpu_stored(parent, bs, None));
                run.block_hashes.push(*h);
                run.token_ids
                    .extend_from_slice(&tokens[i * bs..(i + 1) * bs]);
            }
            restored += 1;
        }
        if let Some(run) = stored_run {
            self.outbox.push(KvEvent::BlockStored(run));
        }
        // Tail first, as a finished sequence releases: under pressure the LRU takes the end of
        // the history before its beginning, and a shorter prefix hit stays usable.
        for &b in held.iter().rev() {
            self.pool.release(b);
        }
        self.flush_events();
        report.restored_blocks = restored;
        if restored > 0 {
            self.metrics.cpu_restored_blocks.inc_by(restored as u64);
            self.metrics
                .prefetch
                .restored_blocks
                .inc_by(restored as u64);
            let cost = self.charge_host_restore(copied, CopyClass::Ahead);
            report.modelled_ms = cost.modelled().as_secs_f64() * 1000.0;
            self.metrics
                .prefetch
                .restore_modelled_seconds
                .inc_by(cost.modelled().as_secs_f64());
            if matches!(cost, HostRestoreCost::NextStep { .. })
                && self.running.is_empty()
                && self.waiting.is_empty()
            {
                // No step to charge it to: the copy runs now, while nothing else would.
                self.backend.run_pending_restore();
            }
        }
        report
    }

    /// Prices the host-to-device copy of the `copied` blocks and, when the backend overlaps it
    /// with compute, queues it on the copy engine in its `class`.
    fn charge_host_restore(&mut self, copied: Vec<BlockHash>, class: CopyClass) -> HostRestoreCost {
        let cost = self
            .backend
            .on_host_restore(copied.len() * self.block_size());
        self.metrics
            .cpu_restore_modelled_seconds
            .inc_by(cost.modelled().as_secs_f64());
        if let HostRestoreCost::CopyEngine { wall, .. } = cost {
            self.copies.enqueue(Instant::now(), wall, copied, class);
        }
        cost
    }

    /// True while `id` waits for its restored blocks to land; clears the wait once they have.
    fn still_landing(&mut self, id: u64, now: Instant) -> bool {
        let Some(seq) = self.seqs.get_mut(&id) else {
            return false;
        };
        match seq.kv_ready_at {
            Some(t) if t > now => true,
            Some(_) => {
                seq.kv_ready_at = None;
                false
            }
            None => false,
        }
    }

    /// When the first admitted request still waiting for its blocks gets them.
    fn next_landing(&self) -> Option<Instant> {
        self.running
            .iter()
            .filter_map(|id| self.seqs.get(id).and_then(|s| s.kv_ready_at))
            .min()
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
            // The salt is block 0's extra key: a prompt shorter than a block still gets it when
            // generated tokens fill that block.
            let d = self.hasher.hash_block_with(
                &parent,
                &seq.tokens[i * bs..(i + 1) * bs],
                &kvmesh_core::TenantKeys::salted(seq.req.cache_salt.as_deref()),
                i,
            );
            seq.digests.push(d);
        }
    }

    /// Plans and runs one step. Returns false when nothing could be scheduled.
    fn step(&mut self) -> bool {
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut plan: Vec<Planned> = Vec::new();
        let mut preempted = false;
        let now = Instant::now();
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let Some(seq) = self.seqs.get(&id) else {
                self.running.remove(i);
                continue;
            };
            let start = seq.num_computed;
            let n = (seq.tokens.len() - start).min(budget);
            if n == 0 || self.still_landing(id, now) {
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
                if self.still_landing(id, now) {
                    // Holds its blocks until they land; the budget goes to the next in line.
                    continue;
                }
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
        // Prefixes arriving layer by layer: each layer lands right before the step uses it.
        let feeds: Vec<(Arc<LayeredPull>, Vec<BlockId>)> = plan
            .iter()
            .filter_map(|p| {
                let seq = self.seqs.get(&p.id)?;
                let w = seq.window.as_ref()?;
                let blocks = seq.blocks.get(w.first..w.first + w.blocks)?.to_vec();
                Some((Arc::clone(&w.pull), blocks))
            })
            .collect();
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
            if feeds.is_empty() {
                self.backend.step(&steps, &mut self.arena)
            } else {
                let mut load = |layer: usize, arena: &mut KvArena| {
                    for (pull, blocks) in &feeds {
                        pull.load_layer(layer, blocks, arena);
                    }
                };
                self.backend
                    .step_layered(&steps, &mut self.arena, &mut load)
            }
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
        let mut pulled_offloads: Vec<Vec<(BlockId, OffloadBlock)>> = Vec::new();
        let mut discarded: HashSet<u64> = HashSet::new();
        for p in plan {
            let short = !feeds.is_empty() && self.close_window(p.id);
            if let Some(seq) = self.seqs.get_mut(&p.id) {
                if short {
                    // Computed over layers that never arrived: the step's output for this
                    // sequence is void, and what it needs is computed from the last block that
                    // arrived whole (`close_window` moved `num_computed` there).
                    discarded.insert(p.id);
                } else {
                    seq.num_computed = p.start + p.n;
                }
            } else {
                continue;
            }
            if let Some((computed, pulled)) = self.finalize_full_blocks(p.id) {
                if !computed.is_empty() {
                    offloads.push(self.with_payloads(computed));
                }
                pulled_offloads.push(pulled);
            }
        }
        // GPU stores and removals first, then the CPU tier's own events; both before any
        // sequence finishes, so a finished request's blocks are already servable to peers.
        self.flush_events();
        for off in offloads {
            self.cpu.insert_run(&off);
        }
        for (p, tok) in plan.iter().zip(sampled) {
            if let Some(t) = tok
                && !discarded.contains(&p.id)
            {
                self.on_token(p.id, t);
            }
        }
        // Blocks a layer-wise pull brought go to the CPU tier after the token: copying a long
        // prefix out of the arena would otherwise sit between the step and the first token.
        // The arena still holds them (nothing is allocated before this), even for a request
        // that just finished.
        for pulled in pulled_offloads {
            let off = self.with_payloads(pulled);
            if !off.is_empty() {
                self.cpu.insert_run(&off);
            }
        }
    }

    /// Copies each block's KV out of the arena for the CPU tier.
    fn with_payloads(&self, blocks: Vec<(BlockId, OffloadBlock)>) -> Vec<OffloadBlock> {
        blocks
            .into_iter()
            .map(|(id, mut off)| {
                off.payload = Bytes::copy_from_slice(self.arena.block(id));
                off
            })
            .collect()
    }

    /// After the step that loaded `id`'s layer-wise pull: keeps the pulled blocks that arrived
    /// on every layer, reports the first scheduling with them, and frees the staging. True
    /// when the pull fell short, so the step's output for `id` must be dropped (its KV from
    /// the first missing block on is recomputed from there).
    fn close_window(&mut self, id: u64) -> bool {
        let bs = self.block_size();
        let Some(seq) = self.seqs.get_mut(&id) else {
            return false;
        };
        let Some(w) = seq.window.take() else {
            return false;
        };
        let complete = w.pull.complete_blocks().min(w.blocks);
        w.pull.release();
        let short = complete < w.blocks;
        if short {
            seq.num_computed = (w.first + complete) * bs;
            seq.pulled_until = w.first + complete;
            self.metrics.p2p_layerwise_short.inc();
            tracing::info!(
                request_id = %seq.req.request_id,
                pulled_blocks = w.blocks,
                arrived_whole = complete,
                report = ?w.pull.report().map(|r| r.outcome),
                "layer-wise pull ended short; recomputing the rest"
            );
        }
        if let Some(d) = w.deferred_start {
            let pulled = complete * bs;
            let cached = (d.local_cached + pulled).min(seq.prompt_len);
            seq.cached_tokens = Some(cached);
            report_start(
                &self.metrics,
                seq,
                cached,
                d.local_external + pulled,
                d.queue_time,
            );
        }
        short
    }

    /// Hashes, publishes and prepares for offload every block that became full: the blocks
    /// computed here, and apart those a layer-wise pull brought (each with its arena block; the
    /// payloads are copied by the caller).
    #[allow(clippy::type_complexity)]
    fn finalize_full_blocks(
        &mut self,
        id: u64,
    ) -> Option<(Vec<(BlockId, OffloadBlock)>, Vec<(BlockId, OffloadBlock)>)> {
        let bs = self.block_size();
        let full = self.seqs.get(&id)?.num_computed / bs;
        let done = self.seqs.get(&id)?.num_finalized;
        if full <= done {
            return None;
        }
        self.extend_digests(id, full);
        let seq = self.seqs.get_mut(&id)?;
        let mut run: Option<BlockStored> = None;
        let (mut off, mut pulled) = (Vec::new(), Vec::new());
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
                let salt = seq.req.cache_salt.as_deref();
                let r = run.get_or_insert_with(|| gpu_stored(parent, bs, salt));
                r.block_hashes.push(hash);
                r.token_ids.extend_from_slice(tokens);
                if (i + 1) * bs <= seq.prompt_len && i >= seq.pulled_until {
                    seq.created_cache_tokens += bs;
                }
                let pending = OffloadBlock {
                    hash,
                    parent,
                    tokens: tokens.to_vec(),
                    payload: Bytes::new(),
                    cache_salt: if i == 0 {
                        seq.req.cache_salt.clone()
                    } else {
                        None
                    },
                };
                if i < seq.pulled_until {
                    pulled.push((block, pending));
                } else {
                    off.push((block, pending));
                }
            } else if let Some(r) = run.take() {
                self.outbox.push(KvEvent::BlockStored(r));
            }
            seq.num_finalized = i + 1;
        }
        if let Some(r) = run {
            self.outbox.push(KvEvent::BlockStored(r));
        }
        (!off.is_empty() || !pulled.is_empty()).then_some((off, pulled))
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
        // A layer-wise pull it never used: stop it and give its staging back.
        if let Some(pull) = seq
            .layered_pull
            .as_ref()
            .or(seq.window.as_ref().map(|w| &w.pull))
        {
            pull.release();
        }
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

/// Blocks of a layer-wise pull an admission can use: the pull must start where the local
/// prefix (`hit_blocks` of `hashes`, the prompt's hit-eligible blocks) ends and carry the same
/// blocks; it is cut at the last hit-eligible block.
fn layered_blocks(pull: Option<&LayeredPull>, hashes: &[BlockHash], hit_blocks: usize) -> usize {
    let Some(pull) = pull.filter(|p| p.first_block() == hit_blocks) else {
        return 0;
    };
    let rest = hashes.get(hit_blocks..).unwrap_or_default();
    pull.hashes()
        .iter()
        .take(pull.served())
        .zip(rest)
        .take_while(|(a, b)| a == b)
        .count()
}

/// A sequence's first scheduling: the prefix-cache metrics and `Started`.
fn report_start(
    m: &EngineMetrics,
    seq: &Seq,
    cached: usize,
    external_tokens: usize,
    queue_time: Duration,
) {
    let prompt_len = seq.prompt_len;
    let local = cached - external_tokens.min(cached);
    m.prefix_cache_queries.inc_by(prompt_len as u64);
    m.prefix_cache_hits.inc_by(local as u64);
    m.prompt_tokens.inc_by(prompt_len as u64);
    if seq.req.external_query_tokens > 0 {
        m.external_prefix_cache_queries
            .inc_by(seq.req.external_query_tokens as u64);
    }
    m.external_prefix_cache_hits
        .inc_by(external_tokens.min(cached) as u64);
    for (source, tokens) in [
        ("local_cache_hit", local),
        ("external_kv_transfer", external_tokens.min(cached)),
        ("local_compute", prompt_len - cached),
    ] {
        m.prompt_tokens_by_source
            .get_or_create(&SourceLabel { source })
            .inc_by(tokens as u64);
    }
    m.request_queue_time.observe(queue_time.as_secs_f64());
    let _ = seq.tx.send(SeqOutput::Started {
        cached_tokens: cached,
        queue_time,
    });
}

/// A GPU-tier run starting after `parent`; one starting a chain (no parent) names the request's
/// salt, as vLLM's events do, so an index puts it in the salt's key space.
fn gpu_stored(parent: Option<BlockHash>, bs: usize, cache_salt: Option<&str>) -> BlockStored {
    BlockStored::run(Medium::Gpu, parent, bs as u32, Vec::new(), Vec::new())
        .in_full_attention_group()
        .with_cache_salt(cache_salt.filter(|_| parent.is_none()))
}
