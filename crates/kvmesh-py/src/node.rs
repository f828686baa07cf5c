//! One mesh member inside a vLLM process: a CPU tier ([`NodeTier`]), the kvmesh P2P producer
//! serving it, and a [`PullClient`], all on a private tokio runtime so Python callers never need
//! an event loop.
//!
//! A pull lands in a buffer sized for exactly the requested blocks (vLLM's worker copies them
//! into vLLM's blocks); a lookup only asks a peer what it holds (vLLM's scheduler, deciding).
//! Pulls and lookups run in the background, keyed by the caller (vLLM's request id), and are
//! polled; nothing here blocks on Python.
//!
//! A layer-major pull ([`Node::start_layer_pull`]) instead lands straight in vLLM's KV tensors
//! ([`crate::kv_memory`]) and can be waited for one layer at a time ([`Node::wait_layer`]),
//! which is what vLLM's `wait_for_layer_load` needs; [`Node::end_layer_pull`] makes sure it no
//! longer writes before its blocks are handed back to vLLM.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Condvar;

use bytes::Bytes;
use kvmesh_core::{BlockHash, Fingerprint};
use kvmesh_transfer::{
    AllowList, BlockSink, ClientConfig, IpNet, LayerPullReport, PeerAddr, ProducerServer,
    PullClient, PullOutcome, PullReason, PullReport, Secret, ServerConfig, SinkError,
    TransferMetrics,
};
use parking_lot::Mutex;
use prometheus_client::registry::Registry;
use tokio::runtime::Runtime;
use tokio_util::sync::CancellationToken;

use crate::kv_memory::{KvDestination, KvSink};
use crate::pacer::ServeCap;
use crate::tier::NodeTier;

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
    /// The blocks that arrived, in order, each `block_bytes` long (the transport's own buffers,
    /// not copied here: the bindings copy them once, straight into the Python object); empty
    /// for lookups.
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

/// A CPU tier, producer and pull client on a private runtime.
pub struct Node {
    rt: Runtime,
    tier: NodeTier,
    client: Arc<PullClient>,
    metrics: TransferMetrics,
    listen_addr: Option<SocketAddr>,
    cancel: CancellationToken,
    pulls: Arc<Mutex<HashMap<String, Option<PullDone>>>>,
    layer_pulls: Mutex<HashMap<String, Arc<LayerPull>>>,
    max_pull: Duration,
}

/// What [`Node::wait_layer`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerWait {
    /// The layer is in (for the blocks the producer served: fewer than asked after a miss,
    /// which the pull's end reports).
    Ready,
    /// The pull ended without it (or there is no such pull).
    Failed,
    /// Still on the wire at the timeout.
    Pending,
}

/// A layer-major pull in flight: layers complete so far, and its report once it ended.
#[derive(Debug, Default)]
struct LayerPull {
    state: Mutex<LayerPullState>,
    changed: Condvar,
    cancel: CancellationToken,
}

#[derive(Debug, Default)]
struct LayerPullState {
    layers: usize,
    /// `None` while the pull may still write into its destination.
    report: Option<LayerPullReport>,
}

impl LayerPull {
    fn update(&self, f: impl FnOnce(&mut LayerPullState)) {
        f(&mut self.state.lock());
        self.changed.notify_all();
    }

    /// Waits until `done` holds of the state or `timeout` passes; the state then.
    fn wait_for<T>(
        &self,
        timeout: Duration,
        mut done: impl FnMut(&LayerPullState) -> Option<T>,
    ) -> Option<T> {
        let deadline = std::time::Instant::now() + timeout;
        let mut g = self.state.lock();
        loop {
            if let Some(v) = done(&g) {
                return Some(v);
            }
            if self.changed.wait_until(&mut g, deadline).timed_out() {
                return done(&g);
            }
        }
    }
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("listen_addr", &self.listen_addr)
            .field("tier", &self.tier.stats())
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
        let tier = NodeTier::new(config.fingerprint.clone(), config.cpu_bytes);
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
                let egress = ServeCap::new(config.serve_bytes_per_sec, tier.clone())
                    .map(|cap| Arc::new(cap) as Arc<dyn kvmesh_transfer::LinkPacer>);
                let server_config = ServerConfig {
                    secret,
                    allowed_ips,
                    metrics: metrics.clone(),
                    egress,
                    ..ServerConfig::default()
                };
                let source: Arc<dyn kvmesh_transfer::BlockSource> = Arc::new(tier.clone());
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
            tier,
            client: Arc::new(client),
            metrics,
            listen_addr,
            cancel,
            pulls: Arc::default(),
            layer_pulls: Mutex::default(),
            max_pull: config.max_pull,
        })
    }

    pub fn tier(&self) -> &NodeTier {
        &self.tier
    }

    pub fn listen_addr(&self) -> Option<SocketAddr> {
        self.listen_addr
    }

    #[cfg(test)]
    fn metrics(&self) -> &TransferMetrics {
        &self.metrics
    }

    /// Start a pull of `hashes` (each `block_bytes` long) from `host:port` in the background
    /// under `key` (replacing a finished one of that key).
    pub fn start_pull(
        &self,
        key: &str,
        host: &str,
        port: u16,
        kv_request_id: &str,
        hashes: Vec<BlockHash>,
        block_bytes: usize,
    ) {
        let client = Arc::clone(&self.client);
        let peer = PeerAddr::new(host, port);
        let kv_request_id = kv_request_id.to_owned();
        self.spawn_job(key, async move {
            let mut sink = BufSink {
                block_bytes,
                data: Vec::with_capacity(hashes.len()),
            };
            let report = client.pull(peer, &kv_request_id, &hashes, &mut sink).await;
            PullDone {
                report,
                data: sink.data,
            }
        });
    }

    /// Start a layer-major pull of `hashes` from `host:port` under `key`, straight into
    /// `destination` (vLLM's KV tensors): the producer sends every block's layer 0, then layer
    /// 1, …; [`Node::wait_layer`] waits for one layer. Bounded by the node's pull deadline. The
    /// destination's memory is written until [`Node::end_layer_pull`] returns.
    pub fn start_layer_pull(
        &self,
        key: &str,
        host: &str,
        port: u16,
        kv_request_id: &str,
        hashes: Vec<BlockHash>,
        destination: KvDestination,
    ) {
        let pull = Arc::new(LayerPull::default());
        if let Some(old) = self
            .layer_pulls
            .lock()
            .insert(key.to_owned(), Arc::clone(&pull))
        {
            old.cancel.cancel();
        }
        let client = Arc::clone(&self.client);
        let peer = PeerAddr::new(host, port);
        let kv_request_id = kv_request_id.to_owned();
        let deadline = tokio::time::Instant::now() + self.max_pull;
        let started = std::time::Instant::now();
        self.rt.spawn(async move {
            let layout = destination.layout().clone();
            let progress = Arc::clone(&pull);
            let mut sink = KvSink {
                destination,
                on_layer: move |layers, _blocks| progress.update(|s| s.layers = layers),
            };
            let work = client.pull_layers(
                peer,
                &kv_request_id,
                &hashes,
                &layout,
                &mut sink,
                Some(deadline),
            );
            // Cancelled: the pull (and with it every write into the destination) is dropped here.
            let report = tokio::select! {
                r = work => r,
                () = pull.cancel.cancelled() => LayerPullReport {
                    outcome: PullOutcome::Failed { reason: PullReason::Timeout },
                    blocks: 0,
                    segments: 0,
                    segment_blocks: 0,
                    bytes: 0,
                    duration: started.elapsed(),
                },
            };
            drop(sink);
            pull.update(|s| s.report = Some(report));
        });
    }

    /// Waits (sleeping) up to `timeout` for layer `layer` of the layer-major pull under `key`.
    pub fn wait_layer(&self, key: &str, layer: usize, timeout: Duration) -> LayerWait {
        let Some(pull) = self.layer_pulls.lock().get(key).cloned() else {
            return LayerWait::Failed;
        };
        pull.wait_for(timeout, |s| {
            if s.layers > layer {
                Some(LayerWait::Ready)
            } else if s.report.is_some() {
                Some(LayerWait::Failed)
            } else {
                None
            }
        })
        .unwrap_or(LayerWait::Pending)
    }

    /// Ends the layer-major pull under `key`: waits up to `grace` for it to finish, then
    /// cancels it, and returns only once it can no longer write into its destination. `None`
    /// for an unknown key.
    pub fn end_layer_pull(&self, key: &str, grace: Duration) -> Option<LayerPullReport> {
        let pull = self.layer_pulls.lock().remove(key)?;
        let report = |s: &LayerPullState| s.report.clone();
        if let Some(r) = pull.wait_for(grace, report) {
            return Some(r);
        }
        pull.cancel.cancel();
        // The task drops the pull at its next poll; bounded so a wedged runtime cannot hang
        // vLLM's step forever.
        pull.wait_for(Duration::from_secs(30), report)
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
        let st = self.tier.stats();
        let (retained, handed_off) = self.tier.handoff_counts();
        // `encode` ends with "# EOF"; the tier's gauges go before it.
        if let Some(stripped) = out.strip_suffix("# EOF\n") {
            out.truncate(stripped.len());
        }
        // The tier's nouns, as a kvmesh engine exports them (`kvmesh_engine_cpu_*`).
        for (name, help, v) in [
            ("kvmesh_cpu_tier_blocks", "Blocks held", st.blocks),
            ("kvmesh_cpu_tier_used_bytes", "Bytes held", st.used_bytes),
            (
                "kvmesh_cpu_tier_capacity_bytes",
                "Byte budget (cpu_bytes)",
                st.capacity_bytes,
            ),
            (
                "kvmesh_cpu_tier_evicted_blocks_total",
                "Blocks evicted to make room",
                st.evicted_blocks,
            ),
            (
                "kvmesh_cpu_tier_retained_blocks_total",
                "Blocks retained for a P/D reader (prefill leg, or a decoder's history)",
                retained,
            ),
            (
                "kvmesh_cpu_tier_handed_off_blocks_total",
                "Retained blocks released by the fetch of the reader they were kept for",
                handed_off,
            ),
            (
                "kvmesh_cpu_tier_retained_evicted_blocks_total",
                "Retained blocks evicted under pressure before their retention ended",
                st.retained_evicted_blocks,
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

#[cfg(test)]
mod tests {
    use kvmesh_core::{BlockHasher, HashAlgo};
    use kvmesh_transfer::{PullOutcome, PullReason};

    use super::*;
    use crate::kv_memory::LayerTarget;
    use crate::tier::Inserted;

    fn fp(block_size: usize) -> Fingerprint {
        let hasher = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0"), block_size);
        Fingerprint::new("tiny", "bf16:vllm-cpu:LBHNC", 2, 2, 64, &hasher)
    }

    fn config(fp: Fingerprint, listen: bool, peers: &[&str]) -> NodeConfig {
        NodeConfig {
            fingerprint: fp,
            cpu_bytes: 1 << 20,
            listen: listen.then(|| ("127.0.0.1".to_owned(), 0)),
            allowed_peers: peers.iter().map(|s| (*s).to_owned()).collect(),
            allowed_consumers: None,
            secret: Some(b"s3cret".to_vec()),
            timeout: Duration::from_secs(2),
            max_pull: Duration::from_secs(5),
            serve_bytes_per_sec: 0,
        }
    }

    fn node(fp: Fingerprint, listen: bool, peers: &[&str]) -> Node {
        Node::start(config(fp, listen, peers)).expect("node starts")
    }

    /// Pulls `hashes` from `127.0.0.1:port` and waits for the pull to end.
    fn pulled(
        node: &Node,
        port: u16,
        id: &str,
        hashes: &[BlockHash],
        block_bytes: usize,
    ) -> PullDone {
        node.start_pull("pull", "127.0.0.1", port, id, hashes.to_vec(), block_bytes);
        finished(node, "pull")
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
            a.tier().insert(BlockHash(h), Bytes::from(vec![h as u8; 8]));
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
        let done = pulled(&worker, port, "r1", &hashes[..3], 8);
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
    fn pulls_a_prefix_into_a_buffer() {
        let a = node(fp(32), true, &[]);
        let port = a.listen_addr().expect("listening").port();
        for h in 1..=3u64 {
            a.tier().insert(BlockHash(h), Bytes::from(vec![h as u8; 8]));
        }
        let b = node(fp(32), false, &["127.0.0.1"]);
        let hashes: Vec<_> = (1..=4).map(BlockHash).collect();
        let done = pulled(&b, port, "r1", &hashes, 8);
        assert_eq!(done.report.blocks, 3);
        assert_eq!(
            done.report.outcome,
            PullOutcome::Partial {
                reason: PullReason::Miss
            }
        );
        assert_eq!(done.data_len(), 24);
        assert_eq!(&done.data.concat()[8..16], &[2u8; 8]);
        assert!(b.metrics_text().contains("kvmesh_p2p_pulls_total"));
        let served = a.metrics_text();
        assert!(served.contains("kvmesh_cpu_tier_blocks 3"), "{served}");
        assert!(served.contains("kvmesh_cpu_tier_used_bytes 24"), "{served}");
        assert!(
            served.contains("kvmesh_cpu_tier_capacity_bytes 1048576"),
            "{served}"
        );
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
            a.tier()
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
        let done = pulled(&b, port, "r", &hashes, 1000);
        let took = t0.elapsed();
        assert_eq!(done.report.outcome, PullOutcome::Complete);
        assert_eq!(done.data_len(), 4000);
        assert!(took >= Duration::from_millis(380), "4 blocks in {took:?}");
        assert!(took < Duration::from_secs(3), "4 blocks in {took:?}");
    }

    /// A layer-major pull lands each block's layers in their own tensors at the block ids
    /// given, layer by layer; a miss leaves a shorter prefix on every layer; an unreachable peer
    /// fails every layer at once.
    #[test]
    #[allow(unsafe_code)]
    fn a_layer_pull_writes_straight_into_kv_tensors() {
        let a = node(fp(32), true, &[]);
        let port = a.listen_addr().expect("listening").port();
        // Blocks of 2 layers × 16 bytes: layer l of block h is bytes 16h + l.
        for h in 1..=3u64 {
            let block: Vec<u8> = (0..2).flat_map(|l| [(16 * h + l) as u8; 16]).collect();
            a.tier().insert(BlockHash(h), Bytes::from(block));
        }
        let b = node(fp(32), false, &["127.0.0.1"]);
        let mut tensors = vec![vec![0u8; 4 * 16]; 2];
        let targets = |tensors: &mut Vec<Vec<u8>>| -> Vec<LayerTarget> {
            tensors
                .iter_mut()
                .map(|t| LayerTarget {
                    base: t.as_mut_ptr() as usize,
                    len: t.len(),
                    block_stride: 16,
                    chunks: vec![(0, 16)],
                })
                .collect()
        };
        let hashes: Vec<_> = (1..=4).map(BlockHash).collect();
        // SAFETY: `tensors` outlives the pull (ended below) and is not touched meanwhile.
        let dest = unsafe { KvDestination::new(targets(&mut tensors), vec![2, 0, 3, 1]) }
            .expect("in bounds");
        b.start_layer_pull("r", "127.0.0.1", port, "r1", hashes.clone(), dest);
        for layer in 0..2 {
            assert_eq!(
                b.wait_layer("r", layer, Duration::from_secs(5)),
                LayerWait::Ready
            );
        }
        let report = b
            .end_layer_pull("r", Duration::from_secs(5))
            .expect("known");
        assert_eq!(
            report.outcome,
            PullOutcome::Partial {
                reason: PullReason::Miss
            }
        );
        assert_eq!((report.blocks, report.segments), (3, 2));
        for (l, t) in tensors.iter().enumerate() {
            // Block ids 2, 0, 3 hold hashes 1, 2, 3; id 1 (hash 4, missed) is untouched.
            for (id, h) in [(2usize, 1u8), (0, 2), (3, 3)] {
                assert_eq!(&t[16 * id..16 * id + 16], &[16 * h + l as u8; 16]);
            }
            assert_eq!(&t[16..32], &[0; 16]);
        }
        assert_eq!(b.end_layer_pull("r", Duration::ZERO), None, "ended once");

        let stranger = node(fp(32), false, &["10.1.2.3"]);
        // SAFETY: as above.
        let dest = unsafe { KvDestination::new(targets(&mut tensors), vec![0]) }.expect("ok");
        stranger.start_layer_pull("r", "127.0.0.1", port, "r2", hashes, dest);
        assert_eq!(
            stranger.wait_layer("r", 0, Duration::from_secs(5)),
            LayerWait::Failed
        );
        let report = stranger.end_layer_pull("r", Duration::from_secs(5));
        assert_eq!(
            report.map(|r| r.outcome),
            Some(PullOutcome::Failed {
                reason: PullReason::NotAllowed
            })
        );
    }

    /// A P/D hand-off: blocks retained for a reader are evicted after unretained ones, a read
    /// by another request leaves them retained, and the reader's own pull releases them.
    #[test]
    fn retained_blocks_stay_until_their_reader_pulls_them() {
        let a = Node::start(NodeConfig {
            cpu_bytes: 24,
            ..config(fp(32), true, &[])
        })
        .expect("node starts");
        let port = a.listen_addr().expect("listening").port();
        let block = |h: u64| Bytes::from(vec![h as u8; 8]);
        for h in 1..=2u64 {
            a.tier().insert(BlockHash(h), block(h));
        }
        let kept = [BlockHash(1), BlockHash(2)];
        let ttl = Duration::from_secs(60);
        assert_eq!(a.tier().retain("prefill-1", &kept, ttl), 2);
        // Full: the newer, unretained block goes first, though the retained ones are older.
        a.tier().insert(BlockHash(4), block(4));
        assert_eq!(a.tier().insert(BlockHash(3), block(3)), Inserted::Stored);
        assert!(!a.tier().contains(BlockHash(4)));
        assert!(kept.iter().all(|h| a.tier().contains(*h)));

        let b = node(fp(32), false, &["127.0.0.1"]);
        let other = pulled(&b, port, "someone-else", &kept, 8);
        assert_eq!(other.report.outcome, PullOutcome::Complete);
        assert_eq!(
            a.tier().handoff_counts(),
            (2, 0),
            "another reader releases nothing"
        );
        let reader = pulled(&b, port, "prefill-1", &kept, 8);
        assert_eq!(reader.report.outcome, PullOutcome::Complete);
        assert_eq!(reader.data.concat(), [[1u8; 8], [2u8; 8]].concat());
        assert_eq!(a.tier().handoff_counts(), (2, 2));
        let text = a.metrics_text();
        assert!(
            text.contains("kvmesh_cpu_tier_retained_blocks_total 2"),
            "{text}"
        );
        assert!(
            text.contains("kvmesh_cpu_tier_handed_off_blocks_total 2"),
            "{text}"
        );
    }

    #[test]
    fn refuses_peers_not_allowed_and_other_fingerprints() {
        let a = node(fp(32), true, &[]);
        let port = a.listen_addr().expect("listening").port();
        a.tier().insert(BlockHash(1), Bytes::from(vec![1u8; 8]));
        let stranger = node(fp(32), false, &["10.1.2.3"]);
        let done = pulled(&stranger, port, "r", &[BlockHash(1)], 8);
        assert_eq!(
            done.report.outcome,
            PullOutcome::Failed {
                reason: PullReason::NotAllowed
            }
        );
        let other = node(fp(16), false, &["127.0.0.1"]);
        let done = pulled(&other, port, "r", &[BlockHash(1)], 8);
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
