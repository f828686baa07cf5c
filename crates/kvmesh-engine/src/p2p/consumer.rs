//! The consumer: [`P2pConsumer`] owns the engine's one shared [`PullClient`] (pooled connections;
//! allow-list from `--p2p-allowed-peers`, since `remote_host` is untrusted input), the pulls in
//! flight ([`super::inflight`]) and the one remote-read path, [`P2pConsumer::read`], that llm-d's
//! `remote_kv_source`, P/D reads and prefetches all take: hash the prompt's cacheable blocks,
//! keep the leading run the peer may serve, take the local prefix (GPU, then CPU tier) first,
//! pull the rest into the CPU tier ([`super::landing`]), mark what landed as external hits and,
//! on a backend that models transfer time, hold the request until the modelled pull has passed
//! (the modelled link's pacers, or the profile's ladder in `--sim-link ladder` mode).
//!
//! A read never fails the request: whatever did not arrive is computed. Every pull is counted by
//! outcome and reason in `kvmesh_p2p_pulls_total` (the engine's
//! [`crate::metrics::EngineMetrics::p2p`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_core::{BlockHash, PullFeedback, PullFeedbackOutcome, RemoteKvSource, TokenId};
use kvmesh_transfer::{
    AllowList, ClientConfig, LayerPullReport, ModelledDuration, PeerAddr, PullClass, PullClient,
    PullOutcome, SegmentLayout, TrafficClass,
};

use super::error::P2pConfigError;
use super::inflight::{Inflight, InflightClaim, PullsInFlight};
use super::landing::TierSink;
use super::remote_read::{PrefixPull, ReadOptions, ReadOutcome, RemoteRead};
use crate::cpu_tier::PinKind;
use crate::engine::{EngineHandle, EngineRequest};
use crate::layered_pull::{LayeredPull, StagingBudget};

/// How long blocks a pull landed stay pinned in our CPU tier if the request never finishes
/// normally (client gone before scheduling); normally they are unpinned at finish.
const LANDED_LEASE: Duration = Duration::from_secs(60);

/// Least staging layer-wise pulls get, whatever the CPU tier's size.
const MIN_STAGING_BYTES: usize = 64 << 20;

/// How long to wait for the compute loop to report the GPU-tier prefix before using the CPU
/// tier's alone (a long step can hold the loop; a stale answer only costs a redundant pull).
const GPU_LOOKUP_WAIT: Duration = Duration::from_millis(50);

/// The engine's P2P consumer (see the module docs).
#[derive(Debug)]
pub struct P2pConsumer {
    client: Arc<PullClient>,
    /// Staging of layer-wise pulls (`--p2p-load-mode layerwise`), bounded like the CPU tier.
    staging: Arc<StagingBudget>,
    timeout: Duration,
    pending_deadline: Duration,
    deadline_factor: f64,
    deadline_floor: Duration,
    inflight: PullsInFlight,
}

/// When a pull must end, and how it ranks on the modelled links (a prefetch: background).
struct PullTerms {
    deadline: tokio::time::Instant,
    class: PullClass,
}

impl P2pConsumer {
    /// From the engine's `p2p` config: allow-list, timeout, pending deadline, secret; counters
    /// go to the engine's `kvmesh_p2p_*` metrics.
    pub fn new(engine: &EngineHandle) -> Result<Self, P2pConfigError> {
        let cfg = &engine.config().p2p;
        let allowed = AllowList::parse(cfg.allowed_peers.iter().filter(|s| !s.trim().is_empty()))?;
        let client = Arc::new(PullClient::new(
            engine.fingerprint(),
            ClientConfig {
                allowed_peers: allowed,
                timeout: cfg.timeout,
                pending_deadline: cfg.pending_deadline,
                secret: cfg.secret.clone(),
                encrypt: cfg.encrypt,
                stripes: cfg.stripes,
                metrics: engine.metrics().p2p.clone(),
                // A modelled link paces the pull itself (its wall time is then the modelled
                // time, contention included); the ladder only gives a duration to report.
                modelled_duration: engine
                    .link_pacer()
                    .is_none()
                    .then(|| ModelledDuration(engine.modelled_block_pull_time())),
                ingress: engine.link_pacer(),
                ..ClientConfig::default()
            },
        ));
        Ok(Self {
            client,
            staging: StagingBudget::new(
                usize::try_from(engine.config().cpu_offload_bytes)
                    .unwrap_or(usize::MAX)
                    .max(MIN_STAGING_BYTES),
            ),
            timeout: cfg.timeout,
            pending_deadline: cfg.pending_deadline,
            deadline_factor: cfg.deadline_factor,
            deadline_floor: cfg.deadline_floor,
            inflight: PullsInFlight::default(),
        })
    }

    /// Blocks being pulled right now (for tests and debugging): 0 when no pull is in flight.
    pub fn inflight_pulls(&self) -> usize {
        self.inflight.len()
    }

    /// The budget of one read whose pull the router predicted at `predicted_ms`:
    /// `--p2p-deadline-factor` × the prediction, at least `--p2p-deadline-floor-ms`, at most the
    /// flat budget (timeout + pending deadline), which is also what an unpriced read gets. The
    /// prediction is untrusted input: anything not a finite positive number is ignored.
    pub fn read_budget(&self, predicted_ms: Option<f64>) -> Duration {
        let flat = self.timeout + self.pending_deadline;
        budget(
            flat,
            self.deadline_factor,
            self.deadline_floor,
            predicted_ms,
        )
    }

    /// Waits (until `deadline` at most) while any of `hashes` belongs to a pull in flight, which
    /// a request waiting for it makes demand traffic (a prefetch's pull is promoted).
    ///
    /// For the sim backend: a pull's blocks land in the CPU tier at loopback speed, but the
    /// pull holds its claim until the modelled transfer is done (the modelled link, or the
    /// profile's ladder in `--sim-link ladder` mode). A request that would use those blocks
    /// meanwhile (routed here as a local hit, say) must not get them sooner than the modelled
    /// link delivers them, or P2P arms would win time no real link gives.
    pub(crate) async fn wait_for_pulls_in_flight(
        &self,
        hashes: &[BlockHash],
        deadline: tokio::time::Instant,
    ) {
        self.inflight.wait_for(hashes, deadline).await;
    }

    /// The llm-d read for one request whose prefix may be held by `source`:
    /// [`P2pConsumer::read`], sharing pulls in flight. Returns the pull (None when nothing was
    /// missing locally or the budget went on waiting for another pull).
    pub async fn prepare_request(
        &self,
        engine: &EngineHandle,
        req: &mut EngineRequest,
        source: &RemoteKvSource,
        predicted_pull_ms: Option<f64>,
    ) -> Option<PrefixPull> {
        let opts = ReadOptions {
            threshold_tokens: 0,
            share_inflight: true,
            background: false,
        };
        let read = RemoteRead {
            predicted_pull_ms,
            ..RemoteRead::from_source(source)
        };
        match self.read(engine, req, &read, opts).await {
            ReadOutcome::Pulled { pull, .. } => Some(pull),
            _ => None,
        }
    }

    /// `--p2p-load-mode layerwise` on a backend with layered blocks: starts a layer-major pull
    /// of the prompt's missing prefix from `source` into staging and attaches it to `req`
    /// ([`crate::layered_pull`]), so the request is scheduled at once and its first step takes
    /// each layer as it arrives. False when nothing was started (nothing missing, an expired
    /// read, no staging room, a layout that cannot be cut by layer): take
    /// [`P2pConsumer::prepare_request`] then.
    pub async fn start_layered_read(
        &self,
        engine: &EngineHandle,
        req: &mut EngineRequest,
        source: &RemoteKvSource,
        predicted_pull_ms: Option<f64>,
    ) -> bool {
        let read = RemoteRead {
            predicted_pull_ms,
            ..RemoteRead::from_source(source)
        };
        let kv = engine.kv_layout();
        let layers = kv.num_layers as usize;
        if read.expired_ago().is_some() || layers == 0 || !kv.bytes_per_block.is_multiple_of(layers)
        {
            return false;
        }
        let segment_len = kv.bytes_per_block / layers;
        let Ok(layout) = u32::try_from(segment_len)
            .map_err(|_| ())
            .and_then(|len| SegmentLayout::new(vec![len; layers]).map_err(|_| ()))
        else {
            return false;
        };
        let (hashes, _) = read.readable_hashes(engine, req);
        let local = local_prefix_blocks(engine, &hashes).await;
        if local >= hashes.len() {
            return false;
        }
        let started = tokio::time::Instant::now();
        let budget = self.read_budget(predicted_pull_ms);
        let Some(pull) = LayeredPull::new(
            local,
            hashes[local..].to_vec(),
            layers,
            segment_len,
            &self.staging,
            Instant::now() + budget,
        ) else {
            engine.metrics().p2p_layerwise_no_staging.inc();
            return false;
        };
        req.external_query_tokens = req.prompt.len();
        let client = Arc::clone(&self.client);
        let peer = PeerAddr::from(source);
        let kv_request_id = source.kv_request_id.clone();
        let (bs, readable) = (kv.block_size.max(1), hashes.len());
        let task_pull = Arc::clone(&pull);
        tokio::spawn(async move {
            let pull = task_pull;
            let mut sink = pull.sink();
            let report = client
                .pull_layers(
                    peer,
                    &kv_request_id,
                    pull.hashes(),
                    &layout,
                    &mut sink,
                    Some(started + budget),
                )
                .await;
            let fb = layered_feedback(&report, local, readable, bs, started.elapsed(), budget);
            pull.end(report, fb);
        });
        // Scheduled once the producer's served prefix is known (with layer 0): the rest of the
        // layers overlap the step. Nothing served: the read is over, and the prompt computes.
        if pull.served_blocks().await > 0 {
            req.layered_pull = Some(pull);
        } else {
            pull.release();
            req.pull_feedback = pull.feedback().await;
        }
        true
    }

    /// The one remote-read path (see the module docs). Sets `req.external_hashes`,
    /// `req.pull_pinned_hashes`, `req.external_query_tokens` and `req.pull_feedback` for what it
    /// read; never fails.
    pub async fn read(
        &self,
        engine: &EngineHandle,
        req: &mut EngineRequest,
        read: &RemoteRead,
        opts: ReadOptions,
    ) -> ReadOutcome {
        let started = tokio::time::Instant::now();
        let budget = self.read_budget(read.predicted_pull_ms);
        let bs = engine.kv_layout().block_size.max(1);
        let outcome = self
            .read_within(engine, req, read, opts, started + budget)
            .await;
        req.pull_feedback = Some(feedback(&outcome, bs, started.elapsed(), budget));
        outcome.0
    }

    /// [`P2pConsumer::read`] by `deadline`; with the outcome, the prefix blocks held locally
    /// after it and the blocks it could have read at most.
    async fn read_within(
        &self,
        engine: &EngineHandle,
        req: &mut EngineRequest,
        read: &RemoteRead,
        opts: ReadOptions,
        deadline: tokio::time::Instant,
    ) -> (ReadOutcome, usize, usize) {
        let peer = PeerAddr::from(&read.source);
        if let Some(ago) = read.expired_ago() {
            tracing::info!(
                request_id = %req.request_id,
                peer = %peer,
                expired_s_ago = ago,
                "Declining expired remote read"
            );
            return (ReadOutcome::Expired, 0, 0);
        }
        let bs = engine.kv_layout().block_size.max(1);
        let (hashes, mismatch) = read.readable_hashes(engine, req);
        let mut local = local_prefix_blocks(engine, &hashes).await;
        let readable = hashes.len();
        if local >= readable {
            return (ReadOutcome::NothingMissing { mismatch }, local, readable);
        }
        if (readable - local) * bs < opts.threshold_tokens {
            return (ReadOutcome::BelowThreshold, local, readable);
        }
        req.external_query_tokens = req.prompt.len();
        // One budget (`deadline`: the prediction's multiple or the flat budget) for waiting on
        // another pull and pulling, so waits never compound.
        let claim = if opts.share_inflight {
            match self
                .join_inflight(engine, req, &hashes, &mut local, deadline, opts.class())
                .await
            {
                Some(claim) => claim,
                None if local >= readable => {
                    return (ReadOutcome::NothingMissing { mismatch }, local, readable);
                }
                None => return (ReadOutcome::WaitedOut, local, readable),
            }
        } else {
            None
        };
        let wanted = hashes.len() - local;
        // A claimed prefetch can be promoted by a request joining it; an unshared one cannot.
        // The claim itself lives to the end of the read: a ladder-mode hold below counts as part
        // of the pull for the requests waiting on it.
        let class = match (&claim, opts.background) {
            (_, false) => PullClass::Demand,
            (Some(claim), true) => claim.pull_class(),
            // Nobody can join it: its signal's sender is gone at once, so it stays background.
            (None, true) => PullClass::Background {
                promote: tokio::sync::watch::channel(false).1,
            },
        };
        let pull = self
            .pull_prefix_until(
                engine,
                &read.source,
                (&req.prompt, req.cache_salt.as_deref()),
                &hashes,
                local,
                PullTerms { deadline, class },
            )
            .await;
        tracing::debug!(
            request_id = %req.request_id,
            peer = %peer,
            local_blocks = local,
            wanted,
            pulled = pull.report.blocks,
            outcome = %pull.report.outcome.label(),
            reason = ?pull.report.outcome.reason(),
            "remote read"
        );
        req.external_hashes.extend_from_slice(&pull.external);
        req.pull_pinned_hashes.extend_from_slice(&pull.pinned);
        // A modelled link (sim) already held the pull until both ends' modelled transfers were
        // done (the pacers in the pull client and the peer's producer). `--sim-link ladder`:
        // the transfer costs what the profile's ladder says, however fast loopback was.
        if pull.report.blocks > 0
            && engine.link_pacer().is_none()
            && let Some(modelled) = engine.modelled_pull_time(pull.report.blocks * bs)
        {
            tokio::time::sleep_until(pull.started + modelled).await;
        }
        let reached = local + pull.report.blocks;
        let outcome = ReadOutcome::Pulled {
            pull,
            wanted,
            mismatch,
        };
        (outcome, reached, readable)
    }

    /// One pull per prefix at a time: claims `hashes[*local..]` for this request's pull, or,
    /// while another request's pull holds the first missing block, waits for it, takes what it
    /// landed as local (pinned until we are scheduled, counted as external once) and tries again
    /// for the rest. `Some(claim)` to pull; `None` when nothing is missing any more (`*local`
    /// reached the end) or the budget went on waiting (compute the rest: a fresh pull now would
    /// double the wait).
    async fn join_inflight<'s>(
        &'s self,
        engine: &EngineHandle,
        req: &mut EngineRequest,
        hashes: &[BlockHash],
        local: &mut usize,
        deadline: tokio::time::Instant,
        class: TrafficClass,
    ) -> Option<Option<InflightClaim<'s>>> {
        loop {
            let mut rx = match self.inflight.claim(&hashes[*local..], class) {
                Inflight::Claimed(c) => return Some(Some(c)),
                Inflight::Busy(rx) => rx,
            };
            if tokio::time::timeout_at(deadline, rx.changed())
                .await
                .is_err()
            {
                return None;
            }
            let before = *local;
            *local = local_prefix_blocks(engine, hashes).await;
            if *local > before {
                // Landed by the other pull: keep them until we are scheduled, and count them as
                // what they are (KV moved from a peer, once).
                let n = engine.cpu_tier().pin(
                    PinKind::Pull,
                    &hashes[before..*local],
                    Instant::now() + LANDED_LEASE,
                );
                req.external_hashes
                    .extend_from_slice(&hashes[before..before + n]);
                req.pull_pinned_hashes
                    .extend_from_slice(&hashes[before..before + n]);
            }
            if *local >= hashes.len() {
                return None;
            }
        }
    }

    /// Pulls blocks `hashes[first..]` of `prompt` (whose full-block hashes are `hashes`) from
    /// `source` into the CPU tier, within `terms.deadline` (a request that already spent part of
    /// its budget waiting for another pull does not get a fresh one). Each block is verified and
    /// landed as it arrives ([`TierSink`]), pinned for [`LANDED_LEASE`]. Never fails: see the
    /// report; blocks `first..first + report.blocks` are in the tier afterwards.
    async fn pull_prefix_until(
        &self,
        engine: &EngineHandle,
        source: &RemoteKvSource,
        (prompt, cache_salt): (&[TokenId], Option<&str>),
        hashes: &[BlockHash],
        first: usize,
        terms: PullTerms,
    ) -> PrefixPull {
        let PullTerms { deadline, class } = terms;
        let started = tokio::time::Instant::now();
        let want = hashes.get(first..).unwrap_or_default();
        let mut sink = TierSink {
            tier: engine.cpu_tier(),
            prompt,
            cache_salt,
            hashes,
            first,
            block_size: engine.kv_layout().block_size,
            bytes_per_block: engine.kv_layout().bytes_per_block,
            verify_sim: engine.capabilities().hash_derived_payloads,
            lease_until: Instant::now() + LANDED_LEASE,
            external: Vec::new(),
            pinned: Vec::new(),
            rejected: None,
        };
        // The whole pull is bounded too (per-step timeouts alone could add up on a long prefix).
        let report = self
            .client
            .pull_with_class(
                PeerAddr::from(source),
                &source.kv_request_id,
                want,
                &mut sink,
                Some(deadline),
                class,
            )
            .await;
        if let Some(reason) = sink.rejected {
            let stats = engine.cpu_tier().stats();
            tracing::warn!(
                peer = %PeerAddr::from(source),
                reason,
                landed = sink.external.len(),
                cpu_used_bytes = stats.used_bytes,
                cpu_capacity_bytes = stats.capacity_bytes,
                "p2p pull stopped: our sink refused a block"
            );
            engine.metrics().p2p_sink_rejected(reason);
        }
        PrefixPull {
            report,
            external: sink.external,
            pinned: sink.pinned,
            started,
            rejected: sink.rejected,
        }
    }
}

/// Leading blocks of `hashes` this engine holds: the GPU tier's prefix (asked of the compute
/// loop, briefly) continued by the CPU tier's, or the CPU tier's alone if longer.
async fn local_prefix_blocks(engine: &EngineHandle, hashes: &[BlockHash]) -> usize {
    let tier = engine.cpu_tier();
    let cpu_only = tier.lookup_prefix(hashes);
    if cpu_only == hashes.len() {
        return cpu_only;
    }
    let owned = hashes.to_vec();
    let gpu = tokio::time::timeout(
        GPU_LOOKUP_WAIT,
        engine.inspect_pool(move |p| p.lookup_prefix(&owned)),
    )
    .await
    .ok()
    .flatten()
    .unwrap_or(0)
    .min(hashes.len());
    (gpu + tier.lookup_prefix(&hashes[gpu..])).max(cpu_only)
}

/// [`P2pConsumer::read_budget`] with its settings as arguments.
fn budget(flat: Duration, factor: f64, floor: Duration, predicted_ms: Option<f64>) -> Duration {
    match predicted_ms.filter(|ms| ms.is_finite() && *ms > 0.0) {
        Some(ms) => {
            // Capped before the conversion: a hostile 1e300 must not overflow a Duration.
            let scaled = (ms * factor / 1000.0).min(flat.as_secs_f64());
            Duration::from_secs_f64(scaled.max(0.0))
                .max(floor)
                .min(flat)
        }
        None => flat,
    }
}

/// What a read did, as the router is told (`x-kvmesh-pull`): `reached` and `readable` are
/// blocks of `block_size` tokens (the prefix held after the read, and the most it could hold).
fn feedback(
    (outcome, reached, readable): &(ReadOutcome, usize, usize),
    block_size: usize,
    elapsed: Duration,
    budget: Duration,
) -> PullFeedback {
    let (kind, reason) = match outcome {
        ReadOutcome::Pulled { pull, .. } => {
            let kind = feedback_kind(&pull.report.outcome);
            // Our own full tier is no fault of the source's: say so apart.
            let reason = match pull.rejected {
                Some("cpu_tier_hard_pinned") => Some("sink_full"),
                _ => pull.report.outcome.reason().map(|r| r.label()),
            };
            (kind, reason)
        }
        ReadOutcome::WaitedOut => (PullFeedbackOutcome::WaitedOut, Some("timeout")),
        ReadOutcome::Expired => (PullFeedbackOutcome::NotNeeded, Some("expired")),
        ReadOutcome::NothingMissing { .. } | ReadOutcome::BelowThreshold => {
            (PullFeedbackOutcome::NotNeeded, None)
        }
    };
    let tokens = |blocks: usize| (blocks * block_size) as u64;
    PullFeedback {
        outcome: kind,
        reason: reason.map(str::to_owned),
        reached_tokens: tokens(*reached),
        readable_tokens: tokens(*readable),
        block_size: block_size as u64,
        elapsed_ms: elapsed.as_secs_f64() * 1000.0,
        deadline_ms: budget.as_secs_f64() * 1000.0,
    }
}

fn feedback_kind(outcome: &PullOutcome) -> PullFeedbackOutcome {
    match outcome {
        PullOutcome::Complete => PullFeedbackOutcome::Complete,
        PullOutcome::Partial { .. } => PullFeedbackOutcome::Partial,
        PullOutcome::Failed { .. } => PullFeedbackOutcome::Failed,
    }
}

/// What a layer-wise pull did, as the router is told: `local` blocks were held before it, of
/// `readable`.
fn layered_feedback(
    report: &LayerPullReport,
    local: usize,
    readable: usize,
    block_size: usize,
    elapsed: Duration,
    budget: Duration,
) -> PullFeedback {
    let tokens = |blocks: usize| (blocks * block_size) as u64;
    PullFeedback {
        outcome: feedback_kind(&report.outcome),
        reason: report.outcome.reason().map(|r| r.label().to_owned()),
        reached_tokens: tokens(local + report.blocks),
        readable_tokens: tokens(readable),
        block_size: block_size as u64,
        elapsed_ms: elapsed.as_secs_f64() * 1000.0,
        deadline_ms: budget.as_secs_f64() * 1000.0,
    }
}

/// Releases the pins a pull took on the blocks it landed for `req` (its
/// `pull_pinned_hashes`: not the blocks that landed unpinned at the pull-pin cap, whose release
/// would drop another request's pin on the same block). Call when the request finished
/// (requests that never finish lose them at lease expiry).
pub fn release_pulled(engine: &EngineHandle, req: &EngineRequest) {
    if let Some(pull) = &req.layered_pull {
        // Its staging, if the compute loop never took it (a request refused before it ran).
        pull.release();
    }
    if !req.pull_pinned_hashes.is_empty() {
        engine
            .cpu_tier()
            .unpin(PinKind::Pull, &req.pull_pinned_hashes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_priced_read_gets_a_multiple_of_the_prediction_within_floor_and_flat_budget() {
        let flat = Duration::from_millis(7000);
        let floor = Duration::from_millis(200);
        let b = |p| budget(flat, 4.0, floor, p);
        assert_eq!(b(None), flat);
        assert_eq!(b(Some(150.0)), Duration::from_millis(600));
        assert_eq!(b(Some(10.0)), floor, "never under the floor");
        assert_eq!(b(Some(60_000.0)), flat, "never over the flat budget");
        for hostile in [f64::NAN, f64::INFINITY, -5.0, 0.0, 1e300] {
            let got = b(Some(hostile));
            assert!(got == flat || got == floor, "{hostile}: {got:?}");
        }
        assert_eq!(b(Some(1e300)), flat);
    }
}
