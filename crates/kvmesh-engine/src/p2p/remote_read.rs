//! What a remote read names and what it did: [`RemoteRead`] (a peer's block set a request may
//! read: from llm-d's `remote_kv_source` or from P/D params), [`ReadOptions`] (threshold,
//! sharing, traffic class) and [`ReadOutcome`]. The read itself is
//! [`super::consumer::P2pConsumer::read`], the one path every caller takes.

use std::time::{SystemTime, UNIX_EPOCH};

use kvmesh_core::{BlockHash, KvTransferParams, RemoteKvSource};
use kvmesh_transfer::{PullReport, TrafficClass};

use crate::engine::{EngineHandle, EngineRequest};

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
    /// The router's predicted pull time (ms, `kvmesh_predicted_pull_ms`), from which the read's
    /// deadline derives ([`super::P2pConsumer::read_budget`]); None: the flat budget.
    pub predicted_pull_ms: Option<f64>,
}

impl RemoteRead {
    /// llm-d P2P: the peer may hold any prefix of the prompt.
    pub fn from_source(source: &RemoteKvSource) -> Self {
        Self {
            source: source.clone(),
            block_ids: None,
            num_tokens: None,
            expiry_unix: None,
            predicted_pull_ms: None,
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
            predicted_pull_ms: None,
        })
    }

    /// How many seconds ago the peer's blocks expired (`remote_blocks_expiry_time`), if they did.
    pub(crate) fn expired_ago(&self) -> Option<f64> {
        let now = unix_now();
        self.expiry_unix
            .filter(|&exp| exp <= now)
            .map(|exp| now - exp)
    }

    /// The prompt's block hashes this read may take: the cacheable blocks, at most
    /// `num_tokens`, and only the leading run equal to `block_ids`. The flag is set when the
    /// peer's hashes diverge from the prompt's before either ends.
    pub(crate) fn readable_hashes(
        &self,
        engine: &EngineHandle,
        req: &EngineRequest,
    ) -> (Vec<BlockHash>, bool) {
        let bs = engine.kv_layout().block_size.max(1);
        let mut hashes = engine.cacheable_block_hashes(req);
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
    pub(crate) fn class(&self) -> TrafficClass {
        if self.background {
            TrafficClass::Background
        } else {
            TrafficClass::Demand
        }
    }
}

/// What one pull did ([`ReadOutcome::Pulled`]).
#[derive(Debug, Clone)]
pub struct PrefixPull {
    pub report: PullReport,
    /// Blocks this pull newly stored in the CPU tier, in order: they count as external hits.
    pub external: Vec<BlockHash>,
    /// Those of `external` it also pinned (`Pull`): released by
    /// [`super::consumer::release_pulled`] once the request finished.
    pub pinned: Vec<BlockHash>,
    /// When the pull started (a modelled pull time runs from here).
    pub started: tokio::time::Instant,
    /// Why our sink refused a block, if it did (`cpu_tier_hard_pinned` is our tier's fault,
    /// the others the peer's blocks').
    pub rejected: Option<&'static str>,
}

/// What a read did.
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
fn matching_prefix(ours: &[BlockHash], theirs: &[BlockHash]) -> usize {
    ours.iter().zip(theirs).take_while(|(a, b)| a == b).count()
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

    #[test]
    fn only_a_passed_expiry_declines_a_read() {
        let source = RemoteKvSource {
            kv_request_id: "r".into(),
            remote_host: "127.0.0.1".into(),
            remote_port: 1,
        };
        let mut read = RemoteRead::from_source(&source);
        assert_eq!(read.expired_ago(), None);
        read.expiry_unix = Some(unix_now() + 60.0);
        assert_eq!(read.expired_ago(), None);
        read.expiry_unix = Some(unix_now() - 60.0);
        assert!(read.expired_ago().is_some_and(|ago| ago >= 60.0));
    }
}
