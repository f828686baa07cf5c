//! The KV-event publisher: a PUB socket that numbers batches and keeps a replay ring.
//!
//! Like vLLM's `ZmqEventPublisher`: bind when the endpoint has a `*` host, connect otherwise; each
//! batch is sent as `[topic, seq, payload]` with `seq` from 0, +1 per batch. In connect mode the
//! publisher (re)connects in the background of `publish` calls, so an engine never waits on an
//! absent subscriber — PUB drops what nobody listens to, the replay ring keeps it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use kvmesh_core::events::{EventBatch, EventEncoding, encode_batch};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use zeromq::{PubSocket, Socket, SocketEvent, SocketOptions, SocketSend, ZmqMessage};

use crate::EventsError;
use crate::endpoint::{EndpointMode, resolve_endpoint};
use crate::replay::{ReplayBuffer, bind_replay_server, serve_replay};

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
        }
    }
}

/// A PUB socket plus sequence numbering and a replay ring.
pub struct Publisher {
    socket: PubSocket,
    monitor: futures::channel::mpsc::Receiver<SocketEvent>,
    config: PublisherConfig,
    topic: Bytes,
    next_seq: u64,
    ring: ReplayBuffer,
    /// Resolved endpoint we bound (bind mode) or connect to (connect mode).
    local_endpoint: String,
    mode: EndpointMode,
    connected: bool,
    next_connect_attempt: Instant,
    connect_backoff: Duration,
    replay_endpoint: Option<String>,
    /// Cancels the replay server task when the publisher goes away.
    replay_cancel: CancellationToken,
    /// Batches a handle refused; added to the sequence so subscribers see the loss as a gap.
    skipped: Arc<AtomicU64>,
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.replay_cancel.cancel();
    }
}

/// Per-attempt connect timeout in connect mode: short, so a missing subscriber never stalls us.
const CONNECT_ATTEMPT: Duration = Duration::from_millis(250);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

impl Publisher {
    /// Binds (or prepares to connect) the PUB socket and binds the replay socket if configured.
    /// Must be called inside a tokio runtime.
    pub async fn start(config: PublisherConfig) -> Result<Publisher, EventsError> {
        let (endpoint, mode) = resolve_endpoint(&config.endpoint)?;
        let mode = if config.bind {
            EndpointMode::Bind
        } else {
            mode
        };
        let mut options = SocketOptions::default();
        options.connect_timeout(CONNECT_ATTEMPT);
        let mut socket = PubSocket::with_options(options);
        let monitor = socket.monitor();
        let local_endpoint = match mode {
            EndpointMode::Bind => socket
                .bind(&endpoint)
                .await
                .map_err(|source| EventsError::Zmq {
                    endpoint: config.endpoint.clone(),
                    source,
                })?
                .to_string(),
            EndpointMode::Connect => endpoint,
        };
        let ring = ReplayBuffer::new(config.replay_buffer);
        let replay_cancel = CancellationToken::new();
        let replay_endpoint = match &config.replay_endpoint {
            Some(ep) => {
                let (router, bound) = bind_replay_server(ep).await?;
                tokio::spawn(serve_replay(router, ring.clone(), replay_cancel.clone()));
                Some(bound)
            }
            None => None,
        };
        let mut publisher = Publisher {
            socket,
            monitor,
            topic: Bytes::copy_from_slice(config.topic.as_bytes()),
            config,
            next_seq: 0,
            ring,
            local_endpoint,
            mode,
            connected: false,
            next_connect_attempt: Instant::now(),
            connect_backoff: Duration::from_millis(100),
            replay_endpoint,
            replay_cancel,
            skipped: Arc::new(AtomicU64::new(0)),
        };
        publisher.ensure_connected().await;
        Ok(publisher)
    }

    /// The bound endpoint with the real port (bind mode), or the endpoint connected to.
    pub fn local_endpoint(&self) -> &str {
        &self.local_endpoint
    }

    /// The bound replay endpoint with the real port, if replay is on.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
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
        self.mode == EndpointMode::Bind || self.connected
    }

    /// Encodes and publishes one batch; returns its sequence number.
    pub async fn publish(&mut self, batch: &EventBatch) -> Result<u64, EventsError> {
        let payload = Bytes::from(encode_batch(batch, self.config.encoding));
        self.publish_payload(payload).await
    }

    /// Publishes an already-encoded payload under the next sequence number.
    pub async fn publish_payload(&mut self, payload: Bytes) -> Result<u64, EventsError> {
        self.next_seq += self.skipped.swap(0, Ordering::Relaxed);
        let seq = self.next_seq;
        self.next_seq += 1;
        self.ring.push(seq, payload.clone());
        self.ensure_connected().await;
        let mut msg = ZmqMessage::from(self.topic.clone());
        msg.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
        msg.push_back(payload);
        self.socket
            .send(msg)
            .await
            .map_err(|source| EventsError::Zmq {
                endpoint: self.config.endpoint.clone(),
                source,
            })?;
        Ok(seq)
    }

    /// Sends arbitrary message parts as they are, without numbering or buffering (tests use it
    /// to inject garbage frames).
    pub async fn send_raw_parts(&mut self, parts: Vec<Bytes>) -> Result<(), EventsError> {
        self.ensure_connected().await;
        let msg = ZmqMessage::try_from(parts).map_err(|_| EventsError::InvalidEndpoint {
            endpoint: self.config.endpoint.clone(),
            reason: "a message needs at least one part".into(),
        })?;
        self.socket
            .send(msg)
            .await
            .map_err(|source| EventsError::Zmq {
                endpoint: self.config.endpoint.clone(),
                source,
            })
    }

    /// In connect mode, tracks disconnects and retries the connection with backoff. Each attempt
    /// waits at most [`CONNECT_ATTEMPT`].
    async fn ensure_connected(&mut self) {
        if self.mode == EndpointMode::Bind {
            return;
        }
        while let Ok(ev) = self.monitor.try_recv() {
            if matches!(ev, SocketEvent::Disconnected(_)) {
                tracing::info!(endpoint = %self.local_endpoint, "kv-event subscriber disconnected");
                self.connected = false;
            }
        }
        if self.connected || Instant::now() < self.next_connect_attempt {
            return;
        }
        match self.socket.connect(&self.local_endpoint).await {
            Ok(()) => {
                tracing::info!(endpoint = %self.local_endpoint, "kv-event publisher connected");
                self.connected = true;
                self.connect_backoff = Duration::from_millis(100);
            }
            Err(e) => {
                tracing::debug!(endpoint = %self.local_endpoint, error = %e, "kv-event connect failed");
                self.next_connect_attempt = Instant::now() + self.connect_backoff;
                self.connect_backoff = (self.connect_backoff * 2).min(MAX_BACKOFF);
            }
        }
    }

    /// Moves the publisher into a task fed by the returned handle. The task publishes queued
    /// batches in order, keeps reconnecting in connect mode, and stops on `cancel` or when every
    /// handle is dropped.
    pub fn spawn(mut self, cancel: CancellationToken) -> PublisherHandle {
        let (tx, mut rx) = mpsc::channel::<EventBatch>(self.config.queue_capacity.max(1));
        let handle = PublisherHandle {
            tx,
            skipped: self.skipped.clone(),
            refused: Arc::new(AtomicU64::new(0)),
        };
        let errors = handle.refused.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(250));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut held: Option<EventBatch> = None;
            loop {
                let next = match held.take() {
                    Some(b) => Some(b),
                    None => tokio::select! {
                        _ = cancel.cancelled() => break,
                        b = rx.recv() => match b {
                            Some(b) => Some(b),
                            None => break,
                        },
                        _ = tick.tick() => {
                            self.ensure_connected().await;
                            None
                        }
                    },
                };
                let Some(first) = next else {
                    continue;
                };
                let (batch, rest) = coalesce(first, &mut rx);
                held = rest;
                if let Err(e) = self.publish(&batch).await {
                    errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(error = %e, "kv-event publish failed");
                }
            }
        });
        handle
    }
}

/// Most events merged into one message by [`coalesce`].
pub const MAX_COALESCED_EVENTS: usize = 4096;

/// Appends the batches already queued behind `first` (same data-parallel rank, up to
/// [`MAX_COALESCED_EVENTS`] events) to it, in order, so a backlog leaves as a few large messages
/// instead of one message each. Engines emit a batch per step and per CPU-tier change (a pull
/// lands its blocks one by one); under load, per-message cost on both ends of the socket made
/// subscribers fall seconds behind. The merged batch keeps the first one's timestamp (its
/// oldest event), so subscribers' lag figures stay honest; vLLM subscribers read any number of
/// events per batch. Returns the merged batch and, if one of another rank stopped the merge,
/// that batch (it leads the next message).
pub fn coalesce(
    mut first: EventBatch,
    rx: &mut mpsc::Receiver<EventBatch>,
) -> (EventBatch, Option<EventBatch>) {
    while first.events.len() < MAX_COALESCED_EVENTS {
        let Ok(next) = rx.try_recv() else {
            break;
        };
        if next.data_parallel_rank != first.data_parallel_rank {
            return (first, Some(next));
        }
        first.events.extend(next.events);
    }
    (first, None)
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
}
