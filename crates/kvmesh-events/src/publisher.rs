//! The KV-event publisher: a PUB socket that numbers batches and keeps a replay ring.
//!
//! Like vLLM's `ZmqEventPublisher`: bind when the endpoint has a `*` host (see
//! [`resolve_endpoint`]), connect otherwise; each batch is sent as `[topic, seq, payload]` with
//! `seq` from 0, +1 per batch. Publishing never waits on a peer: each subscriber has a bounded
//! queue (ZMQ's SNDHWM) drained by its own task, and a full queue drops the message for that peer.
//! In connect mode the socket reconnects in the background (at most 1 s apart) and, while no
//! subscriber is there, keeps the newest batches in a bounded buffer that it delivers as soon as
//! one subscribes, so an engine that starts before its router loses nothing.
//! What a subscriber may send is bounded by [`crate::limits`]. A bound PUB socket admits peers
//! through an optional allow-list and per-source caps, and drops a peer that holds no
//! subscription to the topic for [`SUBSCRIBE_TIMEOUT`] (it would never be written to, so nothing
//! else would ever free its slot).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use kvmesh_core::events::{EventBatch, EventEncoding, encode_batch};
use parking_lot::Mutex;
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use tokio::time::Instant;

use crate::EventsError;
use crate::admission::{Admission, AllowedPeers};
use crate::endpoint::{EndpointMode, resolve_endpoint};
use crate::limits::{
    CONNECT_BUFFER_BYTES, CONNECT_BUFFER_MESSAGES, MAX_EVENT_MESSAGE, MAX_PEERS,
    MAX_PEERS_PER_SOURCE, MAX_SUBSCRIPTION_FRAME, MAX_SUBSCRIPTIONS_PER_PEER, PUB_PEER_QUEUE,
    SUBSCRIBE_TIMEOUT, WRITE_TIMEOUT,
};
use crate::replay::{ReplayBuffer, bind_replay_server};
use crate::stats::PublisherStats;
use crate::transport::{Addr, BoxStream, Listener, connect, timed_handshake};
use crate::zmtp::{Limits, SocketType, encode_message, read_inbound, subscription};

/// Where and how to publish.
#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// `tcp://*:5557` binds on all interfaces; `tcp://host:port` connects (the subscriber binds).
    /// `tcp://*:0` binds an ephemeral port (see [`Publisher::local_endpoint`]).
    pub endpoint: String,
    /// Bind `endpoint` even though its host is concrete (e.g. `tcp://127.0.0.1:5557` to listen on
    /// loopback only). vLLM itself has no such switch: it binds only `*` hosts.
    pub bind: bool,
    /// First frame of every message (vLLM default `""`, commonly `"kv-events"`).
    pub topic: String,
    /// Optional ROUTER endpoint answering replay requests (always bound).
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay (vLLM's default `buffer_steps` is 10 000).
    pub replay_buffer: usize,
    /// Event encoding of the payload (vLLM 0.32 emits the map form).
    pub encoding: EventEncoding,
    /// Batches a [`PublisherHandle`] may queue before `send` starts refusing (and counting) them.
    pub queue_capacity: usize,
    /// Source networks allowed to connect to the bound PUB socket and the replay socket; `None`
    /// admits every address (vLLM's behaviour), within the connection caps.
    pub allowed_peers: Option<AllowedPeers>,
}

impl PublisherConfig {
    /// Defaults matching vLLM for everything but the endpoint and topic.
    pub fn new(endpoint: impl Into<String>, topic: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            bind: false,
            topic: topic.into(),
            replay_endpoint: None,
            replay_buffer: 10_000,
            encoding: EventEncoding::Map,
            queue_capacity: 4096,
            allowed_peers: None,
        }
    }
}

/// One connected subscriber.
struct Peer {
    id: u64,
    subscriptions: Vec<Bytes>,
    tx: mpsc::Sender<Bytes>,
    /// Since when it has held no subscription matching the publisher's topic (`None` while it
    /// does).
    idle_since: Option<Instant>,
}

impl Peer {
    fn wants(&self, topic: &[u8]) -> bool {
        self.subscriptions.iter().any(|s| topic.starts_with(s))
    }
}

/// The PUB socket's shared state: peers with their subscriptions, and the connect-mode buffer.
struct Hub {
    /// The topic every batch is published on.
    topic: Bytes,
    peers: Vec<Peer>,
    next_id: u64,
    /// Connect mode: messages published while no peer wanted them, `(topic, wire)`.
    pending: VecDeque<(Bytes, Bytes)>,
    pending_bytes: usize,
    buffer_when_alone: bool,
    stats: PublisherStats,
}

impl Hub {
    /// Hands `wire` to every peer subscribed to `topic`; with no such peer, a connect-mode
    /// publisher keeps it for the first subscriber if `buffer` (KV events), or drops it (side
    /// messages, stale by then).
    fn deliver(&mut self, topic: &Bytes, wire: Bytes, buffer: bool) {
        let mut wanted = false;
        for peer in self.peers.iter().filter(|p| p.wants(topic)) {
            wanted = true;
            if peer.tx.try_send(wire.clone()).is_err() {
                self.stats
                    .inner
                    .peer_queue_drops
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
        if !wanted && self.buffer_when_alone && buffer {
            self.pending_bytes += wire.len();
            self.pending.push_back((topic.clone(), wire));
            while self.pending.len() > CONNECT_BUFFER_MESSAGES
                || self.pending_bytes > CONNECT_BUFFER_BYTES
            {
                if let Some((_, old)) = self.pending.pop_front() {
                    self.pending_bytes -= old.len();
                    self.stats
                        .inner
                        .buffered_drops
                        .fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// Applies a subscription change; `false` when the peer exceeded its subscription bound.
    fn subscribe(&mut self, id: u64, add: bool, topic: Bytes) -> bool {
        let ours = self.topic.clone();
        let Some(peer) = self.peers.iter_mut().find(|p| p.id == id) else {
            return false;
        };
        if !add {
            if let Some(i) = peer.subscriptions.iter().position(|s| *s == topic) {
                peer.subscriptions.swap_remove(i);
            }
            if !peer.wants(&ours) && peer.idle_since.is_none() {
                peer.idle_since = Some(Instant::now());
            }
            return true;
        }
        if peer.subscriptions.len() >= MAX_SUBSCRIPTIONS_PER_PEER {
            return false;
        }
        peer.subscriptions.push(topic);
        if peer.wants(&ours) {
            peer.idle_since = None;
        }
        // Hand the buffered backlog to the first peer that wants it, oldest first.
        let mut keep = VecDeque::new();
        while let Some((t, wire)) = self.pending.pop_front() {
            if peer.wants(&t) {
                self.pending_bytes -= wire.len();
                if peer.tx.try_send(wire).is_err() {
                    self.stats
                        .inner
                        .peer_queue_drops
                        .fetch_add(1, Ordering::Relaxed);
                }
            } else {
                keep.push_back((t, wire));
            }
        }
        self.pending = keep;
        true
    }

    fn remove(&mut self, id: u64) {
        self.peers.retain(|p| p.id != id);
    }

    /// Whether peer `id` has gone [`SUBSCRIBE_TIMEOUT`] without a subscription to the topic.
    fn idle_too_long(&self, id: u64, now: Instant) -> bool {
        self.peers
            .iter()
            .find(|p| p.id == id)
            .and_then(|p| p.idle_since)
            .is_some_and(|since| now.duration_since(since) >= SUBSCRIBE_TIMEOUT)
    }
}

/// A PUB socket plus sequence numbering and a replay ring.
pub struct Publisher {
    hub: Arc<Mutex<Hub>>,
    config: PublisherConfig,
    topic: Bytes,
    next_seq: u64,
    ring: ReplayBuffer,
    /// Resolved endpoint we bound (bind mode) or connect to (connect mode).
    local_endpoint: String,
    mode: EndpointMode,
    replay_endpoint: Option<String>,
    /// Stops the socket tasks (listener/connector, peers, replay server) with the publisher.
    cancel: CancellationToken,
    /// Batches a handle refused; added to the sequence so subscribers see the loss as a gap.
    skipped: Arc<AtomicU64>,
    stats: PublisherStats,
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// Reconnect delays in connect mode: short, so events flow soon after a subscriber appears.
const MIN_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(1);
const CONNECT_ATTEMPT: Duration = Duration::from_secs(2);
/// How long [`Publisher::start`] waits for its first connect attempt in connect mode.
const FIRST_ATTEMPT_WAIT: Duration = Duration::from_millis(500);

impl Publisher {
    /// Binds (or starts connecting) the PUB socket and binds the replay socket if configured.
    /// Must be called inside a tokio runtime.
    pub async fn start(config: PublisherConfig) -> Result<Publisher, EventsError> {
        let (endpoint, mode) = resolve_endpoint(&config.endpoint)?;
        let mode = if config.bind {
            EndpointMode::Bind
        } else {
            mode
        };
        let addr = Addr::parse(&endpoint).ok_or_else(|| EventsError::InvalidEndpoint {
            endpoint: config.endpoint.clone(),
            reason: "unsupported transport".into(),
        })?;
        let stats = PublisherStats::default();
        let hub = Arc::new(Mutex::new(Hub {
            topic: Bytes::copy_from_slice(config.topic.as_bytes()),
            peers: Vec::new(),
            next_id: 0,
            pending: VecDeque::new(),
            pending_bytes: 0,
            buffer_when_alone: mode == EndpointMode::Connect,
            stats: stats.clone(),
        }));
        let cancel = CancellationToken::new();
        let local_endpoint = match mode {
            EndpointMode::Bind => {
                let (listener, bound) =
                    Listener::bind(&addr)
                        .await
                        .map_err(|source| EventsError::Zmq {
                            endpoint: config.endpoint.clone(),
                            source: source.into(),
                        })?;
                let admission = Admission::new(
                    MAX_PEERS,
                    MAX_PEERS_PER_SOURCE,
                    config.allowed_peers.clone(),
                );
                tokio::spawn(accept_loop(
                    listener,
                    hub.clone(),
                    admission,
                    cancel.clone(),
                ));
                bound
            }
            EndpointMode::Connect => {
                // Like a ZMQ connect, starting waits for the first attempt (briefly), so a
                // subscriber that is already there gets the very first batch.
                let (first_tx, first_rx) = tokio::sync::oneshot::channel();
                tokio::spawn(connect_loop(
                    addr,
                    endpoint.clone(),
                    hub.clone(),
                    cancel.clone(),
                    first_tx,
                ));
                let _ = tokio::time::timeout(FIRST_ATTEMPT_WAIT, first_rx).await;
                endpoint
            }
        };
        let ring = ReplayBuffer::new(config.replay_buffer);
        let replay_endpoint = match &config.replay_endpoint {
            Some(ep) => Some(
                bind_replay_server(
                    ep,
                    ring.clone(),
                    Bytes::copy_from_slice(config.topic.as_bytes()),
                    config.allowed_peers.clone(),
                    stats.clone(),
                    cancel.clone(),
                )
                .await?,
            ),
            None => None,
        };
        Ok(Publisher {
            hub,
            topic: Bytes::copy_from_slice(config.topic.as_bytes()),
            config,
            next_seq: 0,
            ring,
            local_endpoint,
            mode,
            replay_endpoint,
            cancel,
            skipped: Arc::new(AtomicU64::new(0)),
            stats,
        })
    }

    /// The bound endpoint with the real port (bind mode), or the endpoint connected to.
    pub fn local_endpoint(&self) -> &str {
        &self.local_endpoint
    }

    /// Whether the PUB socket bound [`Self::local_endpoint`] or connects to it.
    pub fn mode(&self) -> EndpointMode {
        self.mode
    }

    /// The bound replay endpoint with the real port, if replay is on.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// Counters of peer misbehaviour and drops.
    pub fn stats(&self) -> PublisherStats {
        self.stats.clone()
    }

    /// The sequence number the next batch will carry.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Starts numbering at `seq` (tests use it to simulate loss or a restarted engine).
    pub fn set_next_seq(&mut self, seq: u64) {
        self.next_seq = seq;
    }

    /// Whether a connect-mode publisher currently has its subscriber (always true when bound).
    pub fn is_connected(&self) -> bool {
        self.mode == EndpointMode::Bind || !self.hub.lock().peers.is_empty()
    }

    /// Encodes and publishes one batch; returns its sequence number.
    pub async fn publish(&mut self, batch: &EventBatch) -> Result<u64, EventsError> {
        let payload = Bytes::from(encode_batch(batch, self.config.encoding));
        self.publish_payload(payload).await
    }

    /// Publishes an already-encoded payload under the next sequence number. Never waits for a
    /// peer; a payload beyond [`MAX_EVENT_MESSAGE`] is not sent (its number is used, so
    /// subscribers see a gap) because every subscriber would drop it.
    pub async fn publish_payload(&mut self, payload: Bytes) -> Result<u64, EventsError> {
        self.next_seq += self.skipped.swap(0, Ordering::Relaxed);
        let seq = self.next_seq;
        self.next_seq += 1;
        if payload.len() + self.topic.len() + 8 > MAX_EVENT_MESSAGE {
            self.stats
                .inner
                .oversized_batches
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                seq,
                bytes = payload.len(),
                "kv-event batch larger than the message bound; not sent"
            );
            return Ok(seq);
        }
        self.ring.push(seq, payload.clone());
        let wire = encode_message(&[
            self.topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload,
        ]);
        self.hub.lock().deliver(&self.topic, wire, true);
        Ok(seq)
    }

    /// Sends arbitrary message parts as they are, without numbering or buffering (tests use it
    /// to inject garbage frames).
    pub async fn send_raw_parts(&mut self, parts: Vec<Bytes>) -> Result<(), EventsError> {
        let Some(topic) = parts.first().cloned() else {
            return Err(EventsError::InvalidEndpoint {
                endpoint: self.config.endpoint.clone(),
                reason: "a message needs at least one part".into(),
            });
        };
        let wire = encode_message(&parts);
        self.hub.lock().deliver(&topic, wire, true);
        Ok(())
    }

    /// Moves the publisher into a task fed by the returned handle. The task publishes queued
    /// batches in order and stops on `cancel` or when every handle is dropped.
    pub fn spawn(mut self, cancel: CancellationToken) -> PublisherHandle {
        let (tx, mut rx) = mpsc::channel::<EventBatch>(self.config.queue_capacity.max(1));
        let handle = PublisherHandle {
            tx,
            skipped: self.skipped.clone(),
            refused: Arc::new(AtomicU64::new(0)),
            hub: self.hub.clone(),
            side_seq: Arc::new(AtomicU64::new(0)),
        };
        let errors = handle.refused.clone();
        tokio::spawn(async move {
            let mut held: Option<EventBatch> = None;
            loop {
                let first = match held.take() {
                    Some(b) => b,
                    None => tokio::select! {
                        _ = cancel.cancelled() => break,
                        b = rx.recv() => match b {
                            Some(b) => b,
                            None => break,
                        },
                    },
                };
                let (batch, rest) = coalesce(first, &mut rx);
                held = rest;
                for part in split_batch(batch, MAX_COALESCED_EVENTS) {
                    if let Err(e) = self.publish(&part).await {
                        errors.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(error = %e, "kv-event publish failed");
                    }
                }
            }
        });
        handle
    }
}

/// Bind mode: accepts subscribers up to [`MAX_PEERS`] (and [`MAX_PEERS_PER_SOURCE`] per source),
/// from allowed addresses only.
async fn accept_loop(
    listener: Listener,
    hub: Arc<Mutex<Hub>>,
    admission: Admission,
    cancel: CancellationToken,
) {
    loop {
        let stream = tokio::select! {
            _ = cancel.cancelled() => return,
            s = listener.accept() => s,
        };
        let (stream, source) = match stream {
            Ok(s) => s,
            Err(e) => {
                // E.g. out of file descriptors: back off instead of spinning.
                tracing::debug!(error = %e, "kv-event accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let slot = match admission.admit(source) {
            Ok(slot) => slot,
            Err(why) => {
                tracing::debug!(?source, ?why, "kv-event subscriber refused at accept");
                hub.lock().stats.refused(why);
                continue;
            }
        };
        let (hub, cancel) = (hub.clone(), cancel.clone());
        tokio::spawn(async move {
            let _slot = slot;
            serve_peer(stream, hub, cancel, None).await;
        });
    }
}

/// Connect mode: keeps one connection to the subscriber, reconnecting after failures.
async fn connect_loop(
    addr: Addr,
    endpoint: String,
    hub: Arc<Mutex<Hub>>,
    cancel: CancellationToken,
    first: tokio::sync::oneshot::Sender<()>,
) {
    let mut backoff = MIN_BACKOFF;
    let mut first = Some(first);
    loop {
        let attempt = tokio::time::timeout(CONNECT_ATTEMPT, connect(&addr));
        let stream = tokio::select! {
            _ = cancel.cancelled() => return,
            s = attempt => s,
        };
        match stream {
            Ok(Ok(stream)) => {
                let served = serve_subscriber(stream, &endpoint, &hub, &cancel, first.take()).await;
                if cancel.is_cancelled() {
                    return;
                }
                if served {
                    backoff = MIN_BACKOFF;
                }
            }
            Ok(Err(e)) => log_connect_failure(&endpoint, Some(&e)),
            Err(_) => log_connect_failure(&endpoint, None),
        }
        if let Some(first) = first.take() {
            let _ = first.send(());
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Connect mode: serves the subscriber just connected to until it goes; returns whether the
/// handshake succeeded.
async fn serve_subscriber(
    stream: BoxStream,
    endpoint: &str,
    hub: &Arc<Mutex<Hub>>,
    cancel: &CancellationToken,
    first: Option<tokio::sync::oneshot::Sender<()>>,
) -> bool {
    tracing::info!(endpoint = %endpoint, "kv-event publisher connected");
    let served = serve_peer(stream, hub.clone(), cancel.clone(), first).await;
    if !cancel.is_cancelled() {
        tracing::info!(endpoint = %endpoint, "kv-event subscriber gone; reconnecting");
    }
    served
}

/// A failed connect attempt (`None`: it timed out); the loop retries with backoff.
fn log_connect_failure(endpoint: &str, error: Option<&dyn std::fmt::Display>) {
    match error {
        Some(e) => tracing::debug!(endpoint = %endpoint, error = %e, "kv-event connect failed"),
        None => tracing::debug!(endpoint = %endpoint, "kv-event connect timed out"),
    }
}

/// Runs one subscriber connection until it ends; returns whether the handshake succeeded.
async fn serve_peer(
    mut stream: BoxStream,
    hub: Arc<Mutex<Hub>>,
    cancel: CancellationToken,
    registered: Option<tokio::sync::oneshot::Sender<()>>,
) -> bool {
    let stats = hub.lock().stats.clone();
    if let Err(e) = timed_handshake(&mut stream, SocketType::Pub).await {
        tracing::debug!(error = %e, "kv-event subscriber handshake failed");
        stats.protocol_error();
        return false;
    }
    let (tx, rx) = mpsc::channel::<Bytes>(PUB_PEER_QUEUE);
    let id = register_peer(&hub, tx);
    if let Some(registered) = registered {
        let _ = registered.send(());
    }
    let (reader, writer) = tokio::io::split(stream);
    let mut reading = spawn_subscription_reader(reader, hub.clone(), stats.clone(), id);
    feed_peer(writer, rx, &mut reading, &hub, id, &stats, &cancel).await;
    reading.abort();
    hub.lock().remove(id);
    true
}

/// Writes peer `id`'s queued messages until it goes (its reader ended), a write stalls, it has
/// held no subscription to the topic for [`SUBSCRIBE_TIMEOUT`], or `cancel` fires.
async fn feed_peer(
    mut writer: tokio::io::WriteHalf<BoxStream>,
    mut rx: mpsc::Receiver<Bytes>,
    reading: &mut tokio::task::JoinHandle<()>,
    hub: &Mutex<Hub>,
    id: u64,
    stats: &PublisherStats,
    cancel: &CancellationToken,
) {
    let mut idle_check = tokio::time::interval(IDLE_CHECK);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = &mut *reading => return,
            now = idle_check.tick() => {
                if hub.lock().idle_too_long(id, now) {
                    tracing::debug!("kv-event subscriber dropped: no subscription to the topic");
                    stats.idle_peer_dropped();
                    return;
                }
            }
            wire = rx.recv() => {
                let Some(wire) = wire else { return };
                if !matches!(
                    tokio::time::timeout(WRITE_TIMEOUT, writer.write_all(&wire)).await,
                    Ok(Ok(()))
                ) {
                    return;
                }
            }
        }
    }
}

/// How often a peer's subscription state is checked against [`SUBSCRIBE_TIMEOUT`].
const IDLE_CHECK: Duration = Duration::from_secs(1);

/// Adds a subscriber that has completed its handshake; returns its id in the hub. It starts idle:
/// its subscription must follow within [`SUBSCRIBE_TIMEOUT`].
fn register_peer(hub: &Mutex<Hub>, tx: mpsc::Sender<Bytes>) -> u64 {
    let mut h = hub.lock();
    let id = h.next_id;
    h.next_id += 1;
    h.peers.push(Peer {
        id,
        subscriptions: Vec::new(),
        tx,
        idle_since: Some(Instant::now()),
    });
    id
}

/// Reads a subscriber's (un)subscriptions in a task of its own (a frame read is not cancel-safe);
/// the task ends when the peer closes, misbehaves or exceeds its subscription bound.
fn spawn_subscription_reader(
    mut reader: tokio::io::ReadHalf<BoxStream>,
    reader_hub: Arc<Mutex<Hub>>,
    reader_stats: PublisherStats,
    id: u64,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let limits = Limits {
            max_frame: MAX_SUBSCRIPTION_FRAME,
            max_parts: 1,
            max_message: MAX_SUBSCRIPTION_FRAME,
        };
        loop {
            match read_inbound(&mut reader, &limits, None).await {
                Ok(inbound) => {
                    if let Some((add, topic)) = subscription(&inbound)
                        && !reader_hub.lock().subscribe(id, add, topic)
                    {
                        tracing::debug!("kv-event subscriber exceeded its subscription bound");
                        reader_stats.protocol_error();
                        return;
                    }
                }
                Err(crate::zmtp::ZmtpError::Io(_)) => return,
                Err(e) => {
                    tracing::debug!(error = %e, "kv-event subscriber dropped");
                    reader_stats.protocol_error();
                    return;
                }
            }
        }
    })
}

/// Most events in one published message: [`coalesce`] never merges past it and
/// [`split_batch`] cuts a larger batch. Subscribers bound what they accept (vllm-router 0.1.17
/// drops any message of more than 4096 events and suspends the engine's index entries), and an
/// engine restoring a 100K-token history evicts ~6K blocks in one step.
pub const MAX_COALESCED_EVENTS: usize = 4096;

/// Appends the batches already queued behind `first` (same data-parallel rank, up to
/// [`MAX_COALESCED_EVENTS`] events in all) to it, in order, so a backlog leaves as a few large
/// messages instead of one message each. Engines emit a batch per step and per CPU-tier change (a
/// pull lands its blocks one by one); under load, per-message cost on both ends of the socket
/// made subscribers fall seconds behind. The merged batch keeps the first one's timestamp (its
/// oldest event), so subscribers' lag figures stay honest. Returns the merged batch and, if one
/// stopped the merge (another rank, or it would overshoot the cap), that batch (it leads the
/// next message).
pub fn coalesce(
    mut first: EventBatch,
    rx: &mut mpsc::Receiver<EventBatch>,
) -> (EventBatch, Option<EventBatch>) {
    while first.events.len() < MAX_COALESCED_EVENTS {
        let Ok(next) = rx.try_recv() else {
            break;
        };
        if next.data_parallel_rank != first.data_parallel_rank
            || first.events.len() + next.events.len() > MAX_COALESCED_EVENTS
        {
            return (first, Some(next));
        }
        first.events.extend(next.events);
    }
    (first, None)
}

/// `batch` as consecutive batches of at most `max` events each (same timestamp and rank, events
/// in order); each is published as its own numbered message.
pub fn split_batch(mut batch: EventBatch, max: usize) -> Vec<EventBatch> {
    let max = max.max(1);
    if batch.events.len() <= max {
        return vec![batch];
    }
    let mut parts = Vec::with_capacity(batch.events.len().div_ceil(max));
    let mut events = std::mem::take(&mut batch.events).into_iter().peekable();
    while events.peek().is_some() {
        parts.push(EventBatch {
            ts: batch.ts,
            events: events.by_ref().take(max).collect(),
            data_parallel_rank: batch.data_parallel_rank,
        });
    }
    parts
}

/// Why [`PublisherHandle::send`] refused a batch.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PublishError {
    #[error("kv-event queue full; batch dropped (subscribers will see a sequence gap)")]
    QueueFull,
    #[error("kv-event publisher stopped")]
    Closed,
}

/// A cheap, cloneable sender into a spawned [`Publisher`]; `send` never blocks or awaits, so
/// the engine's scheduler can call it from synchronous code.
#[derive(Clone)]
pub struct PublisherHandle {
    tx: mpsc::Sender<EventBatch>,
    skipped: Arc<AtomicU64>,
    refused: Arc<AtomicU64>,
    /// Side messages go straight to the peers' queues (see [`Self::send_side`]).
    hub: Arc<Mutex<Hub>>,
    side_seq: Arc<AtomicU64>,
}

impl PublisherHandle {
    /// Queues a batch for publishing. When the queue is full the batch is dropped and its
    /// sequence number is skipped, so subscribers detect the loss as a gap.
    pub fn send(&self, batch: EventBatch) -> Result<(), PublishError> {
        match self.tx.try_send(batch) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.skipped.fetch_add(1, Ordering::Relaxed);
                self.refused.fetch_add(1, Ordering::Relaxed);
                Err(PublishError::QueueFull)
            }
            Err(mpsc::error::TrySendError::Closed(_)) => Err(PublishError::Closed),
        }
    }

    /// Batches dropped because the queue was full or the socket failed.
    pub fn dropped(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Sends `[topic, seq, payload]` now to the subscribers of `topic` connected now, with its
    /// own sequence numbers (from 0, shared by every side topic of this publisher). A side
    /// message is state that the next one replaces (a load report), so it is never kept for
    /// replay nor buffered for a subscriber that is not there yet, and it never takes a KV-event
    /// sequence number. False when it was not sent (larger than the message bound).
    pub fn send_side(&self, topic: &str, payload: Bytes) -> bool {
        if payload.len() + topic.len() + 8 > MAX_EVENT_MESSAGE {
            return false;
        }
        let seq = self.side_seq.fetch_add(1, Ordering::Relaxed);
        let topic = Bytes::copy_from_slice(topic.as_bytes());
        let wire = encode_message(&[
            topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload,
        ]);
        self.hub.lock().deliver(&topic, wire, false);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_core::events::{BlockRemoved, KvEvent, Medium};
    use kvmesh_core::hashing::BlockHash;

    fn removed(tag: u64, rank: Option<i64>) -> EventBatch {
        EventBatch {
            ts: tag as f64,
            events: vec![KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![BlockHash(tag)],
                medium: Medium::Cpu,
                group_idx: None,
            })],
            data_parallel_rank: rank,
        }
    }

    fn tags(b: &EventBatch) -> Vec<u64> {
        b.events
            .iter()
            .map(|e| match e {
                KvEvent::BlockRemoved(r) => r.block_hashes[0].0,
                _ => u64::MAX,
            })
            .collect()
    }

    #[test]
    fn a_backlog_leaves_as_one_batch_per_rank_run_in_order() {
        let (tx, mut rx) = mpsc::channel(16);
        for (tag, rank) in [(2, Some(0)), (3, Some(0)), (4, Some(1)), (5, Some(1))] {
            tx.try_send(removed(tag, rank)).unwrap();
        }
        let (merged, held) = coalesce(removed(1, Some(0)), &mut rx);
        assert_eq!(tags(&merged), vec![1, 2, 3]);
        assert_eq!(merged.ts, 1.0, "the oldest event's time");
        let held = held.expect("the rank-1 batch is kept for the next message");
        let (merged, held) = coalesce(held, &mut rx);
        assert_eq!(tags(&merged), vec![4, 5]);
        assert_eq!(merged.data_parallel_rank, Some(1));
        assert!(held.is_none());
    }

    #[test]
    fn merging_stops_at_the_event_cap() {
        let (tx, mut rx) = mpsc::channel(MAX_COALESCED_EVENTS + 8);
        for tag in 1..=MAX_COALESCED_EVENTS as u64 + 4 {
            tx.try_send(removed(tag, None)).unwrap();
        }
        let (merged, _) = coalesce(removed(0, None), &mut rx);
        assert_eq!(merged.events.len(), MAX_COALESCED_EVENTS);
        let (rest, _) = coalesce(rx.try_recv().unwrap(), &mut rx);
        assert_eq!(rest.events.len(), 5, "the 5 batches left behind the cap");
    }

    #[test]
    fn a_batch_that_would_overshoot_the_cap_leads_the_next_message() {
        let (tx, mut rx) = mpsc::channel(4);
        let big = EventBatch {
            events: (0..MAX_COALESCED_EVENTS as u64 - 1)
                .flat_map(|t| removed(t, None).events)
                .collect(),
            ..removed(1, None)
        };
        tx.try_send(EventBatch {
            events: (0..2).flat_map(|t| removed(t, None).events).collect(),
            ..removed(2, None)
        })
        .unwrap();
        let (merged, held) = coalesce(big, &mut rx);
        assert_eq!(merged.events.len(), MAX_COALESCED_EVENTS - 1);
        assert_eq!(held.map(|b| b.events.len()), Some(2));
    }

    #[test]
    fn a_step_with_more_events_than_the_cap_is_cut_in_order() {
        let events: Vec<KvEvent> = (0..10u64)
            .flat_map(|tag| removed(tag, None).events)
            .collect();
        let batch = EventBatch {
            ts: 7.5,
            events: events.clone(),
            data_parallel_rank: Some(1),
        };
        let parts = split_batch(batch, 4);
        assert_eq!(
            parts.iter().map(|p| p.events.len()).collect::<Vec<_>>(),
            [4, 4, 2]
        );
        assert!(
            parts
                .iter()
                .all(|p| p.ts == 7.5 && p.data_parallel_rank == Some(1))
        );
        let rejoined: Vec<KvEvent> = parts.into_iter().flat_map(|p| p.events).collect();
        assert_eq!(rejoined, events);
        assert_eq!(split_batch(removed(1, None), 4).len(), 1);
    }
}
