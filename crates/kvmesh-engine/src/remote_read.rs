//! The one remote-read path: a request's missing prefix read from a peer's CPU tier before the
//! request is submitted, whichever parameters named the peer.
//!
//! - llm-d P2P: `kv_transfer_params.remote_kv_source` ([`RemoteRead::from_source`]), handled by
//!   [`P2pAdmission`] (the [`AdmissionHook`] for it);
//! - P/D: a decode leg's prefiller or a prefill leg's decoder history, named by
//!   `remote_host`/`remote_port` and friends ([`RemoteRead::from_pd_params`]), handled by
//!   [`crate::pd::PdAdmission`].
//!
//! Both go through [`P2pConsumer::read`]: hash the prompt's cacheable blocks, keep the leading
//! run the peer may serve, take the local prefix (GPU, then CPU tier) first, pull the rest with
//! the engine's one pull client ([`crate::p2p`]), mark what landed as external hits and, on a
//! backend that models transfer time, hold the request until the modelled pull has passed (the
//! modelled link's pacers, or the profile's ladder in `--sim-link ladder` mode).
//! A read never fails the request: whatever did not arrive is computed.

use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use futures::future::BoxFuture;
use kvmesh_core::{BlockHash, KvTransferParams, RemoteKvSource};
use kvmesh_transfer::{PeerAddr, PullClass, TrafficClass};

use crate::admission::AdmissionHook;
use crate::cpu_tier::PinKind;
use crate::engine::{EngineHandle, EngineRequest, FinishInfo};
use crate::p2p::{
    Inflight, InflightClaim, LANDED_LEASE, P2pConsumer, PrefixPull, PullTerms, local_prefix_blocks,
    release_pulled,
};

/// A remote block set a request may read: where it is, and which of the prompt's blocks it covers.
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteRead {
    pub source: RemoteKvSource,
    /// Only the leading run of the prompt's block hashes equal to these is read (P/D
    /// `remote_block_ids`: the blocks the peer kept, by hash).
    pub block_ids: Option<Vec<BlockHash>>,
    /// At most this many prompt tokens are read (P/D `remote_num_tokens`).
    pub num_tokens: Option<u64>,
    /// Unix time after which the peer no longer keeps the blocks (P/D
    /// `remote_blocks_expiry_time`): the read is declined.
    pub expiry_unix: Option<f64>,
}

impl RemoteRead {
    /// llm-d P2P: the peer may hold any prefix of the prompt.
    pub fn from_source(source: &RemoteKvSource) -> Self {
        Self {
            source: source.clone(),
            block_ids: None,
            num_tokens: None,
            expiry_unix: None,
        }
    }

    /// The remote set P/D params name (needs a string host and a port).
    pub fn from_pd_params(p: &KvTransferParams) -> Option<Self> {
        let host = p.remote_host_str()?;
        let port = p.remote_port_u16()?;
        let block_ids = p.remote_block_ids.as_ref().and_then(|v| {
            v.as_array().map(|a| {
                a.iter()
                    .map_while(|x| x.as_u64().map(BlockHash))
                    .collect::<Vec<_>>()
            })
        });
        Some(Self {
            source: RemoteKvSource {
                kv_request_id: p.remote_request_id.clone().unwrap_or_default(),
                remote_host: host.to_owned(),
                remote_port: port,
            },
            block_ids,
            num_tokens: p.remote_num_tokens,
            expiry_unix: p.remote_blocks_expiry_time,
        })
    }

    /// The prompt's block hashes this read may take: the cacheable blocks, at most
    /// `num_tokens`, and only the leading run equal to `block_ids`. The flag is set when the
    /// peer's hashes diverge from the prompt's before either ends.
    fn readable_hashes(
        &self,
        engine: &EngineHandle,
        req: &EngineRequest,
    ) -> (Vec<BlockHash>, bool) {
        let bs = engine.kv_layout().block_size.max(1);
        let mut hashes = engine.cacheable_block_hashes(&req.prompt);
        if let Some(n) = self.num_tokens {
            let n = usize::try_from(n).unwrap_or(usize::MAX);
            hashes.truncate(n.min(req.prompt.len()) / bs);
        }
        let mut mismatch = false;
        if let Some(theirs) = &self.block_ids {
            let same = matching_prefix(&hashes, theirs);
            if same < hashes.len() && same < theirs.len() {
                tracing::debug!(
                    request_id = %req.request_id,
                    first_differing_block = same,
                    "remote block hashes differ from the prompt's: reading the matching prefix only"
                );
                mismatch = true;
            }
            hashes.truncate(same);
        }
        (hashes, mismatch)
    }
}

/// How a read treats the blocks it would pull.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReadOptions {
    /// Skip the read when fewer tokens than this are missing locally (compute them instead).
    pub threshold_tokens: usize,
    /// Join a pull already in flight for the same blocks instead of moving them again (the llm-d
    /// path, where a burst of requests names one popular prefix).
    pub share_inflight: bool,
    /// No request waits for these blocks (a prefetch): the pull is background traffic on both
    /// ends' modelled links until a request joins it, and joining a pull in flight does not
    /// promote it.
    pub background: bool,
}

impl ReadOptions {
    fn class(&self) -> TrafficClass {
        if self.background {
            TrafficClass::Background
        } else {
            TrafficClass::Demand
        }
    }
}

/// What [`P2pConsumer::read`] did.
#[derive(Debug)]
pub enum ReadOutcome {
    /// The peer's blocks had expired: nothing was read.
    Expired,
    /// Every block the peer could serve is local already. `mismatch`: the peer's block hashes
    /// diverge from the prompt's, so only their common prefix was considered.
    NothingMissing { mismatch: bool },
    /// Fewer tokens than the threshold were missing.
    BelowThreshold,
    /// Waited for another request's pull of the same blocks until the budget was spent.
    WaitedOut,
    /// A pull ran (it may have moved nothing: see `pull.report`); `wanted` blocks were missing.
    Pulled {
        pull: PrefixPull,
        wanted: usize,
        mismatch: bool,
    },
}

/// Seconds since the Unix epoch (P/D expiry times are in it).
pub(crate) fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Leading blocks of `ours` equal to `theirs` (prefix equality by chained block hash).
pub fn matching_prefix(ours: &[BlockHash], theirs: &[BlockHash]) -> usize {
    ours.iter().zip(theirs).take_while(|(a, b)| a == b).count()
}

impl P2pConsumer {
    /// The one remote-read path (see the module docs). Sets `req.external_hashes`,
    /// `req.pull_pinned_hashes` and `req.external_query_tokens` for what it read; never fails.
    pub async fn read(
        &self,
        engine: &EngineHandle,
        req: &mut EngineRequest,
        read: &RemoteRead,
        opts: ReadOptions,
    ) -> ReadOutcome {
        let peer = PeerAddr::from(&read.source);
        if let Some(exp) = read.expiry_unix
            && exp <= unix_now()
        {
            tracing::info!(
                request_id = %req.request_id,
                peer = %peer,
                expired_s_ago = unix_now() - exp,
                "Declining expired remote read"
            );
            return ReadOutcome::Expired;
        }
        let bs = engine.kv_layout().block_size.max(1);
        let (hashes, mismatch) = read.readable_hashes(engine, req);
        let mut local = local_prefix_blocks(engine, &hashes).await;
        if local >= hashes.len() {
            return ReadOutcome::NothingMissing { mismatch };
        }
        if (hashes.len() - local) * bs < opts.threshold_tokens {
            return ReadOutcome::BelowThreshold;
        }
        req.external_query_tokens = req.prompt.len();
        // One budget (timeout + pending deadline) for waiting on another pull and pulling, so
        // waits never compound.
        let deadline = self.read_deadline();
        let claim = if opts.share_inflight {
            match self
                .join_inflight(engine, req, &hashes, &mut local, deadline, opts.class())
                .await
            {
                Some(claim) => claim,
                None if local >= hashes.len() => return ReadOutcome::NothingMissing { mismatch },
                None => return ReadOutcome::WaitedOut,
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
                &req.prompt,
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
        ReadOutcome::Pulled {
            pull,
            wanted,
            mismatch,
        }
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
            let mut rx = match self.claim(&hashes[*local..], class) {
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

    /// The llm-d admission step for one request whose prefix may be held by `source`:
    /// [`P2pConsumer::read`], sharing pulls in flight. Returns the pull (None when nothing was
    /// missing locally or the budget went on waiting for another pull).
    pub async fn prepare_request(
        &self,
        engine: &EngineHandle,
        req: &mut EngineRequest,
        source: &RemoteKvSource,
    ) -> Option<PrefixPull> {
        let opts = ReadOptions {
            threshold_tokens: 0,
            share_inflight: true,
            background: false,
        };
        match self
            .read(engine, req, &RemoteRead::from_source(source), opts)
            .await
        {
            ReadOutcome::Pulled { pull, .. } => Some(pull),
            _ => None,
        }
    }
}

/// The admission hook: requests with `kv_transfer_params.remote_kv_source` pull their missing
/// prefix before submission; finished requests release the pins their pull took.
#[derive(Debug, Clone)]
pub struct P2pAdmission {
    pub consumer: Arc<P2pConsumer>,
}

impl AdmissionHook for P2pAdmission {
    fn before_submit<'a>(
        &'a self,
        engine: &'a EngineHandle,
        req: &'a mut EngineRequest,
    ) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            if engine.capabilities().models_pull_time && self.consumer.inflight_pulls() > 0 {
                let hashes = engine.cacheable_block_hashes(&req.prompt);
                self.consumer
                    .wait_for_pulls_in_flight(&hashes, self.consumer.read_deadline())
                    .await;
            }
            let Some(source) = req
                .kv_transfer_params
                .as_ref()
                .and_then(|p| p.remote_kv_source.clone())
            else {
                return;
            };
            self.consumer.prepare_request(engine, req, &source).await;
        })
    }

    fn on_finish(&self, engine: &EngineHandle, req: &EngineRequest, _info: &mut FinishInfo) {
        // The request has been scheduled: what its pull landed may be evicted normally now.
        release_pulled(engine, req);
    }

    fn on_not_submitted(&self, engine: &EngineHandle, req: &EngineRequest) {
        release_pulled(engine, req);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_equality_is_by_hash() {
        let a = [BlockHash(1), BlockHash(2), BlockHash(3)];
        assert_eq!(matching_prefix(&a, &[BlockHash(1), BlockHash(2)]), 2);
        assert_eq!(
            matching_prefix(&a, &[BlockHash(1), BlockHash(9), BlockHash(3)]),
            1
        );
        assert_eq!(matching_prefix(&a, &[]), 0);
    }
}
