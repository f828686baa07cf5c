//! The producer: this engine's CPU tier served to peers by a `kvmesh_transfer::ProducerServer`
//! on its own tasks (it never touches the compute loop), with the engine's secret, consumer
//! allow-list, per-IP connection cap and pin quotas, paced by the node's modelled link (sim).
//!
//! [`CpuTierSource`] adapts the [`CpuTier`] to the transfer crate's [`BlockSource`]: a lookup
//! pins its leading hits under the tier's one lock, the checksum is the one taken at store time,
//! `PENDING` blocks are the tier's pending registry, and a P/D retention is released only by the
//! reader it was kept for ([`Handoffs`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::BoxFuture;
use kvmesh_core::{BlockHash, Fingerprint};
use kvmesh_transfer::{
    BindError, BlockSource, BlockStatus, Handoffs, ProducerServer, ServerConfig,
};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::error::P2pConfigError;
use crate::cpu_tier::{CpuTier, PinKind};
use crate::engine::EngineHandle;

/// The CPU tier as a transfer [`BlockSource`].
#[derive(Debug, Clone)]
pub(crate) struct CpuTierSource {
    tier: Arc<CpuTier>,
    fingerprint: Fingerprint,
    handoffs: Arc<Handoffs>,
}

impl CpuTierSource {
    fn new(tier: Arc<CpuTier>, fingerprint: Fingerprint, handoffs: Arc<Handoffs>) -> Self {
        Self {
            tier,
            fingerprint,
            handoffs,
        }
    }
}

impl BlockSource for CpuTierSource {
    fn fingerprint(&self) -> Fingerprint {
        self.fingerprint.clone()
    }

    fn lookup_and_pin(&self, hashes: &[BlockHash], lease: Duration) -> Vec<BlockStatus> {
        self.tier.lookup_and_pin(hashes, Instant::now() + lease)
    }

    fn read(&self, hash: BlockHash) -> Option<Bytes> {
        self.tier.get(hash)
    }

    fn read_with_checksum(&self, hash: BlockHash) -> Option<(Bytes, u32)> {
        // Releases nothing: only the reader a retention is for may release it (`served`).
        self.tier.get_with_checksum(hash)
    }

    fn served(&self, kv_request_id: &str, hash: BlockHash) {
        // The reader a P/D retention was kept for has its block: release that one retention.
        if self.handoffs.take(kv_request_id, hash) {
            self.tier.unpin(PinKind::Retain, &[hash]);
        }
    }

    fn unpin(&self, hashes: &[BlockHash]) {
        self.tier.unpin(PinKind::Use, hashes);
    }

    fn wait_ready(
        &self,
        hash: BlockHash,
        deadline: tokio::time::Instant,
    ) -> BoxFuture<'static, bool> {
        let tier = Arc::clone(&self.tier);
        Box::pin(async move { tier.wait_ready(hash, deadline).await })
    }
}

/// A running producer: the bound address and the server task.
#[derive(Debug)]
pub struct P2pProducer {
    pub addr: SocketAddr,
    pub task: JoinHandle<()>,
}

/// The producer's settings from the engine's `p2p` config: secret, consumer allow-list
/// (`--p2p-allowed-consumers`; empty = none), per-IP connection cap and pin quotas.
fn producer_config(engine: &EngineHandle) -> Result<ServerConfig, P2pConfigError> {
    let cfg = &engine.config().p2p;
    let allowed = crate::config::parse_allowed_consumers(&cfg.allowed_consumers)?;
    Ok(ServerConfig {
        secret: cfg.secret.clone(),
        encrypt: cfg.encrypt,
        allowed_ips: (!allowed.is_empty()).then_some(allowed),
        max_connections_per_ip: cfg.max_connections_per_ip,
        max_transfers_per_peer: cfg.max_fetches_per_peer,
        max_pins_per_lookup: cfg.max_pins_per_lookup,
        max_pinned_per_peer: cfg.max_pinned_per_peer,
        metrics: engine.metrics().p2p.clone(),
        // Serving is paced by this node's modelled link (sim), shared with its own pulls.
        egress: engine.link_pacer(),
        ..ServerConfig::default()
    })
}

/// Binds the producer on `host:port` when `--p2p-port` is set (port 0 picks a free one).
/// `handoffs` is shared with the P/D hook ([`crate::pd::PdHook`]). Beyond loopback the engine's
/// config must set a secret or an allow-list ([`P2pConfigError::Unprotected`]).
pub async fn start_producer(
    engine: &EngineHandle,
    host: &str,
    port: u16,
    handoffs: Arc<Handoffs>,
    cancel: CancellationToken,
) -> Result<P2pProducer, P2pConfigError> {
    let server = producer_config(engine)?;
    let source = CpuTierSource::new(engine.cpu_tier().clone(), engine.fingerprint(), handoffs);
    // A bracketed IPv6 host (`[::1]`, as `--host` may be written) does not resolve as a tuple.
    let bare = host.trim().trim_start_matches('[').trim_end_matches(']');
    let (addr, task) = ProducerServer::bind((bare, port), Arc::new(source), server, cancel)
        .await
        .map_err(|e| match e {
            BindError::Io(source) => P2pConfigError::Bind {
                addr: crate::config::host_port(host, port),
                source,
            },
            // (Encryption without a secret is refused by the config first.)
            refused @ (BindError::Unprotected { .. } | BindError::EncryptionWithoutSecret) => {
                P2pConfigError::Unprotected(refused)
            }
        })?;
    Ok(P2pProducer { addr, task })
}
