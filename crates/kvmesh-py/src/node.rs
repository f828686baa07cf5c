//! One mesh member inside a vLLM process: a [`CpuStore`], the kvmesh P2P producer serving it, and
//! a [`PullClient`], all on a private tokio runtime so Python callers never need an event loop.
//!
//! Pulls land either in the store or in a buffer sized for exactly the requested blocks (vLLM's
//! worker, which copies them into vLLM's blocks); a lookup only asks a peer what it holds (vLLM's
//! scheduler, deciding). Background pulls and lookups are keyed by the caller (vLLM's request
//! id) and polled; nothing here blocks on Python.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvmesh_core::{BlockHash, Fingerprint};
use kvmesh_transfer::{
    AllowList, BlockSink, ClientConfig, IpNet, PeerAddr, ProducerServer, PullClient, PullOutcome,
    PullReason, PullReport, Secret, ServerConfig, SinkError, TransferMetrics,
};
use parking_lot::Mutex;
use prometheus_client::registry::Registry;
use tokio::runtime::Runtime;
use tokio_util::sync::CancellationToken;

use crate::pacer::ServeCap;
use crate::store::{CpuStore, Inserted};

/// How a [`Node`] is set up.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub fingerprint: Fingerprint,
    /// Byte budget of the CPU tier.
    pub cpu_bytes: u64,
    /// Where the producer listens (`None`: no producer). Port 0 picks one.
    pub listen: Option<(String, u16)>,
    /// Peers this node may pull from (`ip`, `ip:port`, `host`, `host:port`, `*`, networks).
    pub allowed_peers: Vec<String>,
    /// Consumers the producer admits (IPs or networks); `None`: anyone who reaches the port.
    pub allowed_consumers: Option<Vec<String>>,
    pub secret: Option<Vec<u8>>,
    /// Per-step bound of a pull (connect, handshake, each frame).
    pub timeout: Duration,
    /// Overall bound of one pull.
    pub max_pull: Duration,
    /// Cap on the bytes per second the producer serves, all consumers together ([`ServeCap`]);
    /// 0: no cap.
    pub serve_bytes_per_sec: u64,
}

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("tokio runtime: {0}")]
    Runtime(std::io::Error),
    #[error("allowed_peers: {0}")]
    AllowedPeers(String),
    #[error("allowed_consumers: {0}")]
    AllowedConsumers(String),
    #[error("p2p producer: {0}")]
    Bind(#[from] kvmesh_transfer::BindError),
}

/// The end of a finished pull.
#[derive(Debug, Clone)]
pub struct PullDone {
    pub report: PullReport,
    /// The blocks that arrived, in order, each `block_bytes` long, for buffer pulls (the
    /// transport's own buffers, not copied here: the bindings copy them once, straight into the
    /// Python object); empty for pulls into the store.
    pub data: Vec<Bytes>,
}

impl PullDone {
    /// Bytes of all the blocks in [`PullDone::data`].
    pub fn data_len(&self) -> usize {
        self.data.iter().map(Bytes::len).sum()
    }
}

/// Sink collecting exactly the requested blocks; every block must have the same size.
struct BufSink {
    block_bytes: usize,
    data: Vec<Bytes>,
}

impl BlockSink for BufSink {
    fn accept(&mut self, index: usize, _hash: BlockHash, payload: Bytes) -> Result<(), SinkError> {
        if payload.len() != self.block_bytes {
            return Err(SinkError {
                index,
                reason: format!(
                    "block of {} bytes, expected {}",
                    payload.len(),
                    self.block_bytes
                ),
            });
        }
        self.data.push(payload);
        Ok(())
    }
}

/// Sink into the store (staging); a block that finds no room stops the pull.
struct StoreSink {
    store: CpuStore,
    block_bytes: usize,
}

impl BlockSink for StoreSink {
    fn accept(&mut self, index: usize, hash: BlockHash, payload: Bytes) -> Result<(), SinkError> {
        if self.block_bytes != 0 && payload.len() != self.block_bytes {
            return Err(SinkError {
                index,
                reason: format!(
                    "block of {} bytes, expected {}",
                    payload.len(),
                    self.block_bytes
                ),
            });
        }
        match self.store.insert(hash, payload) {
            Inserted::NoRoom => Err(SinkError {
                index,
                reason: "cpu tier full of pinned blocks".into(),
            }),
            Inserted::Stored { .. } | Inserted::Present => Ok(()),
        }
    }
}

/// A store, producer and pull client on a private runtime.
pub struct Node {
    rt: Runtime,
    store: CpuStore,
    client: Arc<PullClient>,
    metrics: TransferMetrics,
    listen_addr: Option<SocketAddr>,
    cancel: CancellationToken,
    pulls: Arc<Mutex<HashMap<String, Option<PullDone>>>>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("listen_addr", &self.listen_addr)
            .field("store", &self.store.stats())
            .finish()
    }
}

impl Node {
    pub fn start(config: NodeConfig) -> Result<Self, NodeError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kvmesh-p2p")
            .enable_all()
            .build()
            .map_err(NodeError::Runtime)?;
        let metrics = TransferMetrics::default();
        let store = CpuStore::new(config.fingerprint.clone(), config.cpu_bytes);
        let allowed_peers = AllowList::parse(config.allowed_peers.iter().map(String::as_str))
            .map_err(|e| NodeError::AllowedPeers(e.0))?;
        let secret = config.secret.clone().map(Secret::new);
        let client = PullClient::new(
            config.fingerprint.clone(),
            ClientConfig {
                allowed_peers,
                timeout: config.timeout,
                secret: secret.clone(),
                max_pull_duration: Some(config.max_pull),
                metrics: metrics.clone(),
                ..ClientConfig::default()
            },
        );
        let cancel = CancellationToken::new();
        let listen_addr = match &config.listen {
            None => None,
            Some((host, port)) => {
                let allowed_ips = config
                    .allowed_consumers
                    .as_ref()
                    .map(|v| {
                        v.iter()
                            .map(|s| s.parse::<IpNet>())
                            .collect::<Result<Vec<_>, _>>()
                    })
                    .transpose()
                    .map_err(|e| NodeError::AllowedConsumers(e.0))?;
                let egress = ServeCap::new(config.serve_bytes_per_sec, store.clone())
                    .map(|cap| Arc::new(cap) as Arc<dyn kvmesh_transfer::LinkPacer>);
                let server_config = ServerConfig {
                    secret,
                    allowed_ips,
                    metrics: metrics.clone(),
                    egress,
                    ..ServerConfig::default()
                };
                let source: Arc<dyn kvmesh_transfer::BlockSource> = Arc::new(store.clone());
                let (addr, _handle) = rt.block_on(ProducerServer::bind(
                    (host.as_str(), *port),
                    source,
                    server_config,
                    cancel.clone(),
                ))?;
                Some(addr)
            }
        };
        Ok(Self {
            rt,
            store,
            client: Arc::new(client),
            metrics,
            listen_addr,
            cancel,
            pulls: Arc::default(),
        })
    }

    pub fn store(&self) -> &CpuStore {
        &self.store
    }

    pub fn listen_addr(&self) -> Option<SocketAddr> {
        self.listen_addr
    }

    pub fn metrics(&self) -> &TransferMetrics {
        &self.metrics
    }

    /// Pull `hashes` from `host:port`, blocking the calling thread (never a Python thread holding
    /// the GIL: the bindings release it). `block_bytes` 0 with `into_store` accepts any size.
    pub fn pull_blocking(
        &self,
        host: &str,
        port: u16,
        kv_request_id: &str,
        hashes: &[BlockHash],
        block_bytes: usize,
        into_store: bool,
    ) -> PullDone {
        let fut = pull_task(
            Arc::clone(&self.client),
            self.store.clone(),
            PeerAddr::new(host, port),
            kv_request_id.to_owned(),
            hashes.to_vec(),
            block_bytes,
            into_store,
        );
        self.rt.block_on(fut)
    }

    /// Start a pull in the background under `key` (replacing a finished one of that key).
    #[allow(clippy::too_many_arguments)]
    pub fn start_pull(
        &self,
        key: &str,
        host: &str,
        port: u16,
        kv_request_id: &str,
        hashes: Vec<BlockHash>,
        block_bytes: usize,
        into_store: bool,
    ) {
        let fut = pull_task(
            Arc::clone(&self.client),
            self.store.clone(),
            PeerAddr::new(host, port),
            kv_request_id.to_owned(),
            hashes,
            block_bytes,
            into_store,
        );
        self.spawn_job(key, fut);
    }

    /// Start a lookup in the background under `key`, polled like a pull: `blocks` is the leading
    /// run `host:port` can serve now, and nothing is moved ([`PullClient::lookup`]). The outcome
    /// is `complete` when every block was found, `partial` (miss) for a shorter run, `failed`
    /// with the reason otherwise.
    pub fn start_lookup(
        &self,
        key: &str,
        host: &str,
        port: u16,
        kv_request_id: &str,
        hashes: Vec<BlockHash>,
    ) {
        let client = Arc::clone(&self.client);
        let peer = PeerAddr::new(host, port);
        let kv_request_id = kv_request_id.to_owned();
        self.spawn_job(key, async move {
            let start = std::time::Instant::now();
            let (outcome, blocks) = match client.lookup(peer, &kv_request_id, &hashes).await {
                Ok(n) if n == hashes.len() => (PullOutcome::Complete, n),
                Ok(n) => (
                    PullOutcome::Partial {
                        reason: PullReason::Miss,
                    },
                    n,
                ),
                Err(reason) => (PullOutcome::Failed { reason }, 0),
            };
            PullDone {
                report: PullReport {
                    outcome,
                    blocks,
                    bytes: 0,
                    duration: start.elapsed(),
                },
                data: Vec::new(),
            }
        });
    }

    /// Runs `job` on the runtime; its result waits under `key` (replacing a finished one) for
    /// [`Node::poll_pull`].
    fn spawn_job(&self, key: &str, job: impl Future<Output = PullDone> + Send + 'static) {
        self.pulls.lock().insert(key.to_owned(), None);
        let pulls = Arc::clone(&self.pulls);
        let key = key.to_owned();
        self.rt.spawn(async move {
            let done = job.await;
            let mut g = pulls.lock();
            // Dropped by `forget` meanwhile: the caller no longer wants it.
            if let Some(slot) = g.get_mut(&key) {
                *slot = Some(done);
            }
        });
    }

    /// `None`: unknown key; `Some(None)`: still running; `Some(Some(done))`: finished (removed).
    pub fn poll_pull(&self, key: &str) -> Option<Option<PullDone>> {
        let mut g = self.pulls.lock();
        match g.get(key) {
            None => None,
            Some(None) => Some(None),
            Some(Some(_)) => g.remove(key),
        }
    }

    /// `None`: unknown key; `Some(false)`: running; `Some(true)`: finished, not yet polled.
    pub fn poll_pull_peek(&self, key: &str) -> Option<bool> {
        self.pulls.lock().get(key).map(Option::is_some)
    }

    /// Wait (sleeping, not spinning) up to `timeout` for the pull under `key` to finish; whether
    /// it has (an unknown key counts as finished). Callers poll a vLLM step at a time: a short
    /// sleep here keeps an idle engine loop from spinning on the cores the pull needs.
    pub fn wait_pull(&self, key: &str, timeout: Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if self.poll_pull_peek(key) != Some(false) {
                return true;
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                return false;
            }
            std::thread::sleep((deadline - now).min(Duration::from_millis(1)));
        }
    }

    /// Forget a pull (finished or not).
    pub fn forget(&self, key: &str) {
        self.pulls.lock().remove(key);
    }

    /// Prometheus text: `kvmesh_p2p_*` and the tier's gauges.
    pub fn metrics_text(&self) -> String {
        let mut registry = Registry::default();
        self.metrics.register(&mut registry);
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
        let st = self.store.stats();
        // `encode` ends with "# EOF"; the tier's gauges go before it.
        if let Some(stripped) = out.strip_suffix("# EOF\n") {
            out.truncate(stripped.len());
        }
        for (name, help, v) in [
            ("kvmesh_cpu_tier_blocks", "Blocks held", st.blocks as u64),
            ("kvmesh_cpu_tier_bytes", "Bytes held", st.bytes),
            ("kvmesh_cpu_tier_budget_bytes", "Byte budget", st.budget),
            (
                "kvmesh_cpu_tier_evictions_total",
                "LRU evictions",
                st.evictions,
            ),
        ] {
            let kind = if name.ends_with("_total") {
                "counter"
            } else {
                "gauge"
            };
            out.push_str(&format!(
                "# HELP {name} {help}.\n# TYPE {name} {kind}\n{name} {v}\n"
            ));
        }
        out
    }

    /// Stop accepting peers; in-flight fetches finish on the runtime's threads.
    pub fn shutdown(&self) {
        self.cancel.cancel();
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

async fn pull_task(
    client: Arc<PullClient>,
    store: CpuStore,
    peer: PeerAddr,
    kv_request_id: String,
    hashes: Vec<BlockHash>,
    block_bytes: usize,
    into_store: bool,
) -> PullDone {
    if into_store {
        let mut sink = StoreSink { store, block_bytes };
        let report = client.pull(peer, &kv_request_id, &hashes, &mut sink).await;
        PullDone {
            report,
            data: Vec::new(),
        }
    } else {
        let mut sink = BufSink {
            block_bytes,
            data: Vec::with_capacity(hashes.len()),
        };
        let report = client.pull(peer, &kv_request_id, &hashes, &mut sink).await;
        PullDone {
            report,
            data: sink.data,
        }
    }
}

#[cfg(test)]
mod tests {
    use kvmesh_core::{BlockHasher, HashAlgo};
    use kvmesh_transfer::{PullOutcome, PullReason};

    use super::*;

    fn fp(block_size: usize) -> Fingerprint {
        let hasher = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0"), block_size);
        Fingerprint::new("tiny", "bf16:vllm-cpu:LBHNC", 2, 2, 64, &hasher)
    }

    fn node(fp: Fingerprint, listen: bool, peers: &[&str]) -> Node {
        Node::start(NodeConfig {
            fingerprint: fp,
            cpu_bytes: 1 << 20,
            listen: listen.then(|| ("127.0.0.1".to_owned(), 0)),
            allowed_peers: peers.iter().map(|s| (*s).to_owned()).collect(),
            allowed_consumers: None,
            secret: Some(b"s3cret".to_vec()),
            timeout: Duration::from_secs(2),
            max_pull: Duration::from_secs(5),
            serve_bytes_per_sec: 0,
        })
        .expect("node starts")
    }

    /// Polls the background job under `key` until it ends.
    fn finished(node: &Node, key: &str) -> PullDone {
        loop {
            match node.poll_pull(key) {
                Some(Some(d)) => return d,
                Some(None) => std::thread::sleep(Duration::from_millis(5)),
                None => panic!("job {key} lost"),
            }
        }
    }

    /// vLLM's split: the scheduler's node looks the prefix up (nothing moves), the worker's
    /// node pulls what was found straight from the peer.
    #[test]
    fn a_lookup_finds_the_leading_run_and_a_pull_then_fetches_it() {
        let a = node(fp(32), true, &[]);
        let port = a.listen_addr().expect("listening").port();
        for h in 1..=3u64 {
            a.store()
                .insert(BlockHash(h), Bytes::from(vec![h as u8; 8]));
        }
        let scheduler = node(fp(32), false, &["127.0.0.1"]);
        let hashes: Vec<_> = (1..=4).map(BlockHash).collect();
        scheduler.start_lookup("req", "127.0.0.1", port, "r1", hashes.clone());
        let found = finished(&scheduler, "req");
        assert_eq!(found.report.blocks, 3);
        assert_eq!(found.report.bytes, 0);
        assert!(found.data.is_empty());
        assert_eq!(
            found.report.outcome,
            PullOutcome::Partial {
                reason: PullReason::Miss
            }
        );
        assert_eq!(
            scheduler.metrics().blocks(kvmesh_transfer::Direction::In),
            0
        );

        let worker = node(fp(32), true, &["127.0.0.1"]);
        let done = worker.pull_blocking("127.0.0.1", port, "r1", &hashes[..3], 8, false);
        assert_eq!(done.report.outcome, PullOutcome::Complete);
        assert_eq!(done.data.concat(), [[1u8; 8], [2u8; 8], [3u8; 8]].concat());

        // A refused peer fails the lookup with its reason, counted where it was asked.
        let other = node(fp(16), false, &["127.0.0.1"]);
        other.start_lookup("req", "127.0.0.1", port, "r2", hashes);
        let refused = finished(&other, "req");
        assert_eq!(refused.report.blocks, 0);
        assert_eq!(
            refused.report.outcome.reason().map(PullReason::label),
            Some("fingerprint_mismatch")
        );
        assert!(
            other
                .metrics_text()
                .contains("reason=\"fingerprint_mismatch\"")
        );
    }

    #[test]
    fn pulls_a_prefix_into_a_buffer_and_into_the_store() {
        let a = node(fp(32), true, &[]);
        let port = a.listen_addr().expect("listening").port();
        for h in 1..=3u64 {
            a.store()
                .insert(BlockHash(h), Bytes::from(vec![h as u8; 8]));
        }
        let b = node(fp(32), false, &["127.0.0.1"]);
        let hashes: Vec<_> = (1..=4).map(BlockHash).collect();
        let done = b.pull_blocking("127.0.0.1", port, "r1", &hashes, 8, false);
        assert_eq!(done.report.blocks, 3);
        assert_eq!(
            done.report.outcome,
            PullOutcome::Partial {
                reason: PullReason::Miss
            }
        );
        assert_eq!(done.data_len(), 24);
        assert_eq!(&done.data.concat()[8..16], &[2u8; 8]);

        b.start_pull("k", "127.0.0.1", port, "r2", hashes[..2].to_vec(), 8, true);
        let done = finished(&b, "k");
        assert_eq!(done.report.outcome, PullOutcome::Complete);
        assert_eq!(b.store().leading_hits(&hashes), 2);
        assert!(b.metrics_text().contains("kvmesh_p2p_pulls_total"));
        assert!(b.metrics_text().contains("kvmesh_cpu_tier_blocks 2"));
    }

    #[test]
    fn a_capped_producer_serves_no_faster_than_its_cap() {
        let a = Node::start(NodeConfig {
            fingerprint: fp(32),
            cpu_bytes: 1 << 20,
            listen: Some(("127.0.0.1".to_owned(), 0)),
            allowed_peers: Vec::new(),
            allowed_consumers: None,
            secret: None,
            timeout: Duration::from_secs(2),
            max_pull: Duration::from_secs(5),
            // 1000-byte blocks: 100 ms each.
            serve_bytes_per_sec: 10_000,
        })
        .expect("node starts");
        let port = a.listen_addr().expect("listening").port();
        for h in 1..=4u64 {
            a.store()
                .insert(BlockHash(h), Bytes::from(vec![h as u8; 1000]));
        }
        let b = Node::start(NodeConfig {
            fingerprint: fp(32),
            cpu_bytes: 1 << 20,
            listen: None,
            allowed_peers: vec!["127.0.0.1".to_owned()],
            allowed_consumers: None,
            secret: None,
            timeout: Duration::from_secs(2),
            max_pull: Duration::from_secs(5),
            serve_bytes_per_sec: 0,
        })
        .expect("node starts");
        let hashes: Vec<_> = (1..=4).map(BlockHash).collect();
        let t0 = std::time::Instant::now();
        let done = b.pull_blocking("127.0.0.1", port, "r", &hashes, 1000, false);
        let took = t0.elapsed();
        assert_eq!(done.report.outcome, PullOutcome::Complete);
        assert_eq!(done.data_len(), 4000);
        assert!(took >= Duration::from_millis(380), "4 blocks in {took:?}");
        assert!(took < Duration::from_secs(3), "4 blocks in {took:?}");
    }

    #[test]
    fn refuses_peers_not_allowed_and_other_fingerprints() {
        let a = node(fp(32), true, &[]);
        let port = a.listen_addr().expect("listening").port();
        a.store().insert(BlockHash(1), Bytes::from(vec![1u8; 8]));
        let stranger = node(fp(32), false, &["10.1.2.3"]);
        let done = stranger.pull_blocking("127.0.0.1", port, "r", &[BlockHash(1)], 8, false);
        assert_eq!(
            done.report.outcome,
            PullOutcome::Failed {
                reason: PullReason::NotAllowed
            }
        );
        let other = node(fp(16), false, &["127.0.0.1"]);
        let done = other.pull_blocking("127.0.0.1", port, "r", &[BlockHash(1)], 8, false);
        assert_eq!(
            done.report.outcome.reason().map(PullReason::label),
            Some("fingerprint_mismatch")
        );
        assert!(
            other
                .metrics_text()
                .contains("reason=\"fingerprint_mismatch\"")
        );
    }
}
