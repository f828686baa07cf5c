//! [`EngineHandle`]: cloneable access to a running engine, and [`build_engine`], which starts
//! one. Handlers talk to the compute loop only through the channel it holds; the handle also
//! says whether the loop is still alive (`/health` reports it).

use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use kvmesh_core::{BlockHash, BlockHasher, TenantKeys, TokenId};
use kvmesh_text::Tokenizer;
use tokio::sync::{mpsc, oneshot};

use crate::compute::{BackendCapabilities, ComputeBackend, KvLayout};
use crate::config::EngineConfig;
use crate::cpu_tier::CpuTier;
use crate::link_pacer::{BlockPacer, LinkHandle};
use crate::metrics::{EngineMetrics, ReasonLabel};
use crate::outbox::KvEventSink;
use crate::pool::BlockPool;

use super::compute_loop::Core;
use super::types::{
    Command, EngineRequest, FinishReason, NewSeq, RestoreAhead, RestoreReport, SeqOutput,
    SharedCounters, SubmitError,
};

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
    capabilities: BackendCapabilities,
    modelled_pull: Arc<dyn Fn(usize) -> Option<Duration> + Send + Sync>,
    /// The modelled link P2P transfers are paced by (sim in link mode), shared by the producer
    /// (egress) and the consumer (ingress): one node, one link.
    link: Option<Arc<BlockPacer>>,
    next_id: std::sync::atomic::AtomicU64,
    /// Why the compute loop ended (set by its thread on the way out, panic included).
    stopped: Arc<OnceLock<String>>,
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

    /// What the backend's timings and payloads mean (modelled or real).
    pub fn capabilities(&self) -> BackendCapabilities {
        self.inner.capabilities
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

    /// The modelled link this engine's P2P producer and consumer pace themselves by (the sim
    /// backend outside `--sim-link ladder`); `None` when transfers are real or ladder-priced.
    pub fn link_pacer(&self) -> Option<Arc<dyn kvmesh_transfer::LinkPacer>> {
        self.inner
            .link
            .clone()
            .map(|p| p as Arc<dyn kvmesh_transfer::LinkPacer>)
    }

    /// The modelled link itself (tests, debugging).
    pub fn link(&self) -> Option<&LinkHandle> {
        self.inner.link.as_deref().map(|p| &p.link)
    }

    /// [`EngineHandle::modelled_pull_time`] of `blocks` full blocks, as a shareable function
    /// (for the P2P client's duration metric).
    pub fn modelled_block_pull_time(&self) -> Arc<dyn Fn(usize) -> Option<Duration> + Send + Sync> {
        let per_token = Arc::clone(&self.inner.modelled_pull);
        let block_size = self.inner.config.block_size;
        Arc::new(move |blocks| per_token(blocks * block_size))
    }

    /// Event hashes of every full block of `tokens` (unsalted).
    pub fn block_hashes(&self, tokens: &[TokenId]) -> Vec<BlockHash> {
        self.salted_block_hashes(tokens, None)
    }

    /// Event hashes of every full block of `tokens` for a request with `cache_salt` (vLLM's
    /// extra key in block 0; `None` or empty gives [`EngineHandle::block_hashes`]).
    pub fn salted_block_hashes(
        &self,
        tokens: &[TokenId],
        cache_salt: Option<&str>,
    ) -> Vec<BlockHash> {
        self.inner
            .hasher
            .clone()
            .hash_prompt_with(tokens, &TenantKeys::salted(cache_salt))
            .iter()
            .map(|d| d.event_hash())
            .collect()
    }

    /// Event hashes of the blocks of `req`'s prompt it may take from cache (in its salt's key
    /// space): every full block but the one holding the last prompt token (vLLM never serves
    /// that token from cache).
    pub fn cacheable_block_hashes(&self, req: &EngineRequest) -> Vec<BlockHash> {
        let prompt = &req.prompt;
        let bs = self.inner.layout.block_size.max(1);
        let mut hashes = self.salted_block_hashes(prompt, req.cache_salt.as_deref());
        hashes.truncate(prompt.len().saturating_sub(1) / bs);
        hashes
    }

    /// Queues a request. Fails fast when `--max-waiting` requests already wait.
    /// `Some(waiting)` when the waiting queue is full: [`EngineHandle::submit`] would refuse.
    pub fn waiting_at_capacity(&self) -> Option<usize> {
        let queued = self.inner.counters.queued.load(Ordering::Relaxed);
        (queued >= self.inner.config.max_waiting).then_some(queued)
    }

    /// `Some(reason)` once the compute loop has ended (it panicked, or was shut down): nothing
    /// submitted can be computed any more.
    pub fn loop_stopped(&self) -> Option<String> {
        if let Some(why) = self.inner.stopped.get() {
            return Some(why.clone());
        }
        // The loop's receiver is dropped while its thread unwinds, a moment before the reason
        // is recorded: a closed channel is already a dead loop.
        self.tx
            .is_closed()
            .then(|| "engine compute loop stopped".to_owned())
    }

    pub fn submit(&self, req: EngineRequest) -> Result<SeqStream, SubmitError> {
        let c = &self.inner.counters;
        let queued = c.queued.load(Ordering::Relaxed);
        if queued >= self.inner.config.max_waiting {
            return Err(SubmitError::Overloaded(queued));
        }
        let digests = self
            .inner
            .hasher
            .clone()
            .hash_prompt_with(&req.prompt, &TenantKeys::salted(req.cache_salt.as_deref()));
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

    /// Copies the history's full blocks that the CPU tier holds but the GPU tier does not into
    /// the GPU tier now, ahead of the request expected to use them (bounded and charged as the
    /// compute loop's `restore_ahead` says). None when the loop has stopped.
    pub async fn restore_ahead(&self, tokens: Vec<TokenId>) -> Option<RestoreReport> {
        let hashes = self.block_hashes(&tokens);
        let (reply, rx) = oneshot::channel();
        let cmd = Command::Restore(Box::new(RestoreAhead {
            tokens,
            hashes,
            reply,
        }));
        self.tx.send(cmd).ok()?;
        rx.await.ok()
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
    // The KV arena is zeroed lazily (its pages are taken as it fills), so an oversized tier
    // would not fail at its allocation but later, under load: check it against memory first.
    crate::config::check_gpu_tier_fits(
        config.num_gpu_blocks,
        layout.bytes_per_block,
        crate::config::available_memory_bytes(),
    )?;
    let hasher = BlockHasher::new(
        config.hash_algo,
        config.hash_seed.as_deref(),
        config.block_size,
    );
    let metrics = Arc::new(EngineMetrics::new(
        &config.served_model_name,
        &config.engine_label,
    ));
    metrics.describe_cache(config.block_size, config.num_gpu_blocks);
    let cpu = Arc::new(CpuTier::new(
        config.cpu_offload_bytes,
        config.block_size,
        sink.clone(),
    ));
    cpu.set_pull_pin_fraction(config.p2p.pull_pin_fraction);
    let counters = Arc::new(SharedCounters::default());
    let (tx, rx) = mpsc::unbounded_channel();
    let capabilities = backend.capabilities();
    // The backend lives on the compute thread, but the P2P consumer asks for modelled pull
    // times from async tasks: sample the backend's curve once (every 256 tokens up to 128K,
    // linear beyond) and interpolate.
    let pull_table: Vec<(usize, Option<Duration>)> = (0..=512usize)
        .map(|i| i * 256)
        .map(|t| (t, backend.modelled_pull_time(t)))
        .collect();
    let modelled_pull: Arc<dyn Fn(usize) -> Option<Duration> + Send + Sync> =
        Arc::new(move |tokens| interpolate_pull(&pull_table, tokens));
    let link = backend.modelled_link().map(|m| {
        Arc::new(BlockPacer {
            link: LinkHandle::new(m.params, m.time_scale),
            bytes_per_block: m.bytes_per_block,
        })
    });
    let inner = Arc::new(HandleInner {
        config: config.clone(),
        tokenizer,
        hasher: hasher.clone(),
        cpu: cpu.clone(),
        metrics: metrics.clone(),
        counters: counters.clone(),
        layout: layout.clone(),
        capabilities,
        modelled_pull,
        link,
        next_id: std::sync::atomic::AtomicU64::new(1),
        stopped: Arc::new(OnceLock::new()),
    });
    metrics
        .cpu_capacity_bytes
        .set(config.cpu_offload_bytes as f64);
    let core = Core::new(config, backend, cpu, sink, hasher, metrics, counters)?;
    let stopped = Arc::clone(&inner.stopped);
    let thread = std::thread::Builder::new()
        .name("kvmesh-compute".into())
        .spawn(move || {
            let (mut core, mut rx) = (core, rx);
            // A panicking backend or scheduler bug ends the loop; catch it so the reason reaches
            // `/health` (and the requests it drops) instead of the engine answering 200 while
            // every request fails. The state is only dropped after the reason is recorded.
            let ended =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| core.run(&mut rx)));
            let why = match ended {
                Ok(()) => "engine compute loop stopped".to_owned(),
                Err(payload) => {
                    let why = format!("engine compute loop panicked: {}", panic_message(&*payload));
                    tracing::error!("{why}; the engine answers 503 from now on");
                    why
                }
            };
            let _ = stopped.set(why);
            drop(rx);
            drop(core);
        })
        .map_err(|e| {
            crate::config::ConfigError::Invalid(format!("cannot start compute thread: {e}"))
        })?;
    let handle = EngineHandle { tx, inner };
    handle
        .inner
        .metrics
        .describe_fingerprint(&handle.fingerprint());
    Ok(Engine {
        handle,
        thread: Some(thread),
    })
}

/// The text of a panic payload (`panic!` with a literal or a formatted message).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_owned())
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
