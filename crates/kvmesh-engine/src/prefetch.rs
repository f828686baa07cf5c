//! Prefetch ahead of arrival: a router that expects a session's next turn here asks this engine
//! to pull the session's history from a peer's CPU tier now, during the client's tool gap, so the
//! transfer is off the next request's critical path (`docs/architecture.md#prefetch`).
//!
//! A prefetch is the request path's remote read ([`P2pConsumer::read`], sharing pulls in flight)
//! without a request behind it: the blocks land in the CPU tier as ordinary cached blocks
//! (announced with `BlockStored`, so the router sees the new holder), unpinned once landed —
//! memory pressure may evict them like any other block. A request that arrives while the
//! prefetch is still running waits for those blocks instead of pulling them again.
//!
//! Without `remote_kv_source` the prefetch is a *restore ahead*: the router expects the next turn
//! back here, on the history's owner, and the history has left the GPU tier but is still in this
//! engine's CPU tier. Its blocks are copied up into the GPU tier now (the compute loop's
//! `restore_ahead`: nothing while requests wait, only free or unreferenced cached blocks, a
//! reserve of one step's blocks kept), so the next turn finds GPU hits. The host-to-device copy is
//! charged as an on-demand restore is (to the next step, or on the copy engine), except that on
//! the copy engine it runs only while no request waits for a copy of its own: the cost moves off
//! the request's critical path, it does not disappear, and it does not land on another's. Outcomes `restored`,
//! `nothing_missing` (all in the GPU tier already), `not_cached` (not in the CPU tier either),
//! `gpu_short` (the bound stopped it before any block moved).
//!
//! A pull prefetch is background traffic on the modelled links (`docs/architecture.md#sim-link-model`):
//! it moves only while no on-demand pull moves bytes on this engine's link (ingress) or the
//! holder's (egress), so it never delays a request's pull. A request that arrives while it runs
//! and needs its blocks promotes it to demand for what is left ([`crate::p2p`]).
//!
//! Bounds: at most [`MAX_RUNNING`] prefetches at once per engine (more are refused as `busy`, a
//! prefetch never queues behind another), each cancellable by id; the router budgets in-flight
//! bytes per engine on top.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use kvmesh_core::{RemoteKvSource, TokenId};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::task::AbortHandle;

use crate::compute::SamplingParams;
use crate::engine::{EngineHandle, EngineRequest};
use crate::p2p::{P2pConsumer, ReadOptions, ReadOutcome, RemoteRead, release_pulled};

/// Prefetches one engine runs at once; the router's byte budget is the finer bound.
pub const MAX_RUNNING: usize = 8;
/// Longest prefetch id accepted (ids are the router's, echoed in logs and cancels).
pub const MAX_ID_BYTES: usize = 128;

/// `POST /kvmesh/prefetch` body.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct PrefetchRequest {
    pub prefetch_id: String,
    /// The history whose full blocks to bring here (the engine hashes them as it would a prompt).
    pub prompt_token_ids: Vec<TokenId>,
    /// The peer whose CPU tier holds them (same shape as `kv_transfer_params.remote_kv_source`).
    /// Absent: restore them from this engine's own CPU tier into its GPU tier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_kv_source: Option<RemoteKvSource>,
}

/// What a prefetch did (the response body).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrefetchReport {
    pub prefetch_id: String,
    /// `pulled`, `nothing_missing`, `failed`, `cancelled`, `busy`, `waited_out`, `expired`; a
    /// restore: `restored`, `nothing_missing`, `not_cached`, `gpu_short`, `failed`.
    pub outcome: String,
    /// Blocks that were missing here when the prefetch started (a restore: in the CPU tier, not
    /// in the GPU tier).
    pub wanted_blocks: usize,
    /// Blocks that landed (a restore: copied into the GPU tier).
    pub blocks: usize,
    /// Tokens per block on this engine.
    pub block_size: usize,
    /// Why a pull moved less than it wanted (the pull's failure reason), if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// A restore: the modelled host-to-device time charged for it (unscaled ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub modelled_restore_ms: Option<f64>,
}

impl PrefetchReport {
    fn new(id: &str, outcome: &str) -> Self {
        Self {
            prefetch_id: id.to_owned(),
            outcome: outcome.to_owned(),
            wanted_blocks: 0,
            blocks: 0,
            block_size: 0,
            reason: None,
            modelled_restore_ms: None,
        }
    }
}

/// Why a prefetch request was refused before it ran.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PrefetchRefused {
    #[error("prefetch_id must be 1..={MAX_ID_BYTES} bytes")]
    BadId,
    #[error("prompt_token_ids has {0} tokens, more than max_model_len {1}")]
    TooLong(usize, usize),
    #[error("a prefetch with id {0:?} is already running")]
    Duplicate(String),
}

/// The prefetches running on this engine, by id (abortable).
#[derive(Debug)]
pub struct Prefetcher {
    consumer: Arc<P2pConsumer>,
    running: Mutex<HashMap<String, AbortHandle>>,
}

/// Removes a finished prefetch from the running table, however its task ended.
struct Deregister<'a> {
    running: &'a Mutex<HashMap<String, AbortHandle>>,
    id: String,
}

impl Drop for Deregister<'_> {
    fn drop(&mut self) {
        self.running.lock().remove(&self.id);
    }
}

impl Prefetcher {
    pub fn new(consumer: Arc<P2pConsumer>) -> Self {
        Self {
            consumer,
            running: Mutex::default(),
        }
    }

    /// Prefetches running now.
    pub fn running(&self) -> usize {
        self.running.lock().len()
    }

    /// Runs one prefetch to its end (or its cancellation) and reports it; counted in
    /// `kvmesh_engine_prefetches_total{outcome}`. Refuses malformed requests before any work.
    pub async fn run(
        self: &Arc<Self>,
        engine: &EngineHandle,
        req: PrefetchRequest,
    ) -> Result<PrefetchReport, PrefetchRefused> {
        let id = req.prefetch_id.clone();
        if id.is_empty() || id.len() > MAX_ID_BYTES {
            return Err(PrefetchRefused::BadId);
        }
        let max = engine.config().max_model_len;
        if req.prompt_token_ids.len() > max {
            return Err(PrefetchRefused::TooLong(req.prompt_token_ids.len(), max));
        }
        let task = {
            let mut running = self.running.lock();
            if running.contains_key(&id) {
                return Err(PrefetchRefused::Duplicate(id));
            }
            if running.len() >= MAX_RUNNING {
                drop(running);
                let report = PrefetchReport::new(&id, "busy");
                engine
                    .metrics()
                    .prefetch
                    .finished(&report.outcome, report.blocks);
                return Ok(report);
            }
            let (this, engine2, id2) = (Arc::clone(self), engine.clone(), id.clone());
            let task = tokio::spawn(async move {
                let _deregister = Deregister {
                    running: &this.running,
                    id: id2,
                };
                if req.remote_kv_source.is_some() {
                    this.pull(&engine2, req).await
                } else {
                    restore(&engine2, req).await
                }
            });
            running.insert(id.clone(), task.abort_handle());
            task
        };
        let report = match task.await {
            Ok(report) => report,
            // Aborted by `cancel` (a panic would be a bug; it is reported as a failure).
            Err(e) if e.is_cancelled() => PrefetchReport::new(&id, "cancelled"),
            Err(_) => PrefetchReport::new(&id, "failed"),
        };
        // Restored blocks are counted by the compute loop (they did not land in the CPU tier).
        let landed = if report.modelled_restore_ms.is_some() {
            0
        } else {
            report.blocks
        };
        engine.metrics().prefetch.finished(&report.outcome, landed);
        Ok(report)
    }

    /// Stops a running prefetch (blocks that landed stay cached). False when none runs with `id`.
    pub fn cancel(&self, id: &str) -> bool {
        match self.running.lock().remove(id) {
            Some(handle) => {
                handle.abort();
                true
            }
            None => false,
        }
    }

    async fn pull(&self, engine: &EngineHandle, req: PrefetchRequest) -> PrefetchReport {
        let id = req.prefetch_id;
        let Some(source) = req.remote_kv_source else {
            return PrefetchReport::new(&id, "failed");
        };
        let mut carrier = EngineRequest {
            request_id: format!("prefetch-{id}"),
            prompt: req.prompt_token_ids,
            // Never sampled: the carrier only names the blocks to read.
            sampling: SamplingParams {
                temperature: 0.0,
                top_p: 1.0,
                seed: None,
            },
            max_tokens: 0,
            ignore_eos: false,
            stop_token_ids: Vec::new(),
            kv_transfer_params: None,
            cache_salt: None,
            arrival: Instant::now(),
            external_hashes: Vec::new(),
            pull_pinned_hashes: Vec::new(),
            external_query_tokens: 0,
            pull_feedback: None,
            layered_pull: None,
        };
        let opts = ReadOptions {
            threshold_tokens: 0,
            share_inflight: true,
            // Nobody waits for it yet: it yields both links to demand pulls until a request
            // joins it (which promotes it for what is left).
            background: true,
        };
        let read = RemoteRead::from_source(&source);
        let outcome = self.consumer.read(engine, &mut carrier, &read, opts).await;
        // Nothing is waiting for these blocks: leave them to the tier's LRU like any cached block.
        release_pulled(engine, &carrier);
        let mut report = PrefetchReport::new(&id, "");
        report.block_size = engine.kv_layout().block_size;
        report.outcome = match outcome {
            ReadOutcome::Expired => "expired",
            ReadOutcome::NothingMissing { .. } | ReadOutcome::BelowThreshold => "nothing_missing",
            ReadOutcome::WaitedOut => "waited_out",
            ReadOutcome::Pulled { pull, wanted, .. } => {
                report.wanted_blocks = wanted;
                report.blocks = pull.report.blocks;
                report.reason = pull.report.outcome.reason().map(|r| r.to_string());
                if pull.report.blocks > 0 {
                    "pulled"
                } else {
                    "failed"
                }
            }
        }
        .to_owned();
        report
    }
}

/// A restore ahead (no `remote_kv_source`): see the module docs.
async fn restore(engine: &EngineHandle, req: PrefetchRequest) -> PrefetchReport {
    let mut report = PrefetchReport::new(&req.prefetch_id, "failed");
    report.block_size = engine.kv_layout().block_size;
    let Some(r) = engine.restore_ahead(req.prompt_token_ids).await else {
        report.reason = Some("engine compute loop stopped".to_owned());
        return report;
    };
    report.wanted_blocks = r.wanted_blocks;
    report.blocks = r.restored_blocks;
    report.reason = r.stopped.map(str::to_owned);
    report.modelled_restore_ms = Some(r.modelled_ms);
    report.outcome = if r.restored_blocks > 0 {
        "restored"
    } else if r.wanted_blocks > 0 {
        "gpu_short"
    } else if r.gpu_blocks >= r.blocks {
        "nothing_missing"
    } else {
        "not_cached"
    }
    .to_owned();
    report
}
