//! The KV-event subscriber: a SUB socket in background tasks that decode, check sequence numbers
//! and report what they see as [`SubscriberItem`]s.
//!
//! Nothing a peer sends can stop it or grow it past [`crate::limits`]: a frame, message or
//! handshake beyond a bound drops that connection (an `Error` item, counted in
//! [`SubscriberStats`]), undecodable messages become `Malformed` items, a sequence that jumps
//! forward becomes `Gap` (filled from the replay endpoint first, if one is configured), one that
//! goes backwards becomes `Restart` (a new publisher incarnation). Sequence numbers are tracked per
//! topic, so several publishers may connect to one bound subscriber as long as their topics differ
//! (llm-d's `kv@<pod>@<model>` topics do). A connected subscriber reconnects by itself (at most
//! 1 s apart) when its publisher goes away. A bound subscriber admits publishers from its
//! allow-list only, when it has one ([`SubscriberConfig::allowed_peers`]): otherwise anyone who
//! reaches the port can inject events that are credited to the endpoint (issue 37).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use kvmesh_core::events::{EventBatch, EventFrame, decode_batch, parse_seq};
use tokio::io::AsyncWriteExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_util::sync::CancellationToken;

use crate::admission::{Admission, AllowedPeers, Refused};
use crate::endpoint::{EndpointMode, subscriber_mode};
use crate::limits::{
    MAX_EVENT_FRAME, MAX_EVENT_MESSAGE, MAX_EVENT_PARTS, MAX_PEERS, MAX_PEERS_PER_SOURCE,
    MAX_SUBSCRIBER_BUFFERED,
};
use crate::replay::request_replay_raw;
use crate::transport::{Addr, BoxStream, Listener, connect, timed_handshake};
use crate::zmtp::{Inbound, Limits, SocketType, ZmtpError, read_inbound, subscribe_message};

/// What to subscribe to.
#[derive(Debug, Clone)]
pub struct SubscriberConfig {
    /// The publisher's endpoint (connect), or our own (bind).
    pub endpoint: String,
    /// Bind instead of connect: needed when the engine was given a non-wildcard endpoint, which
    /// it connects to. A `*` host always binds.
    pub bind: bool,
    /// Topic prefix to subscribe to (`""` = everything), ZMQ prefix semantics.
    pub topic: String,
    /// Topics of side messages (e.g. load reports) to subscribe to as well: a message whose
    /// topic is exactly one of these is handed over undecoded as [`SubscriberItem::Side`],
    /// outside the KV events' sequence checks.
    pub side_topics: Vec<String>,
    /// The publisher's replay endpoint; when set, gaps are filled from it before being reported.
    pub replay_endpoint: Option<String>,
    /// When bound: the source networks publishers may connect from (`None`: any address, within
    /// the connection caps). Connecting subscribers ignore it.
    pub allowed_peers: Option<AllowedPeers>,
}

impl SubscriberConfig {
    /// Connect to `endpoint`, all topics, no replay.
    pub fn connect(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            bind: false,
            topic: String::new(),
            side_topics: Vec::new(),
            replay_endpoint: None,
            allowed_peers: None,
        }
    }

    /// Bind `endpoint`, all topics, no replay.
    pub fn bind(endpoint: impl Into<String>) -> Self {
        Self {
            bind: true,
            ..Self::connect(endpoint)
        }
    }
}

/// One observation of the subscriber task, in arrival order.
#[derive(Debug, Clone, PartialEq)]
pub enum SubscriberItem {
    /// The socket is bound/connected; `endpoint` is the resolved address (the real port when
    /// binding port 0).
    Listening { endpoint: String },
    /// A decoded batch.
    Batch {
        topic: String,
        seq: u64,
        batch: EventBatch,
    },
    /// Batches `expected..got` were lost (not replayable); `got` follows as a `Batch`.
    Gap {
        topic: String,
        expected: u64,
        got: u64,
    },
    /// The sequence went backwards: the publisher restarted. Its state must be rebuilt.
    Restart {
        topic: String,
        last_seq: u64,
        new_seq: u64,
    },
    /// A message on one of [`SubscriberConfig::side_topics`], as sent (bounded by the frame
    /// limits of every message).
    Side { topic: String, payload: Bytes },
    /// A message that could not be parsed or decoded; skipped.
    Malformed { seq: Option<u64>, error: String },
    /// A socket-level problem; the task keeps retrying.
    Error { error: String },
}

/// How one sequence number relates to the previous one of the same topic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqVerdict {
    /// First message seen on this topic (earlier ones were before we subscribed).
    First,
    InOrder,
    Gap {
        expected: u64,
        got: u64,
    },
    Restart {
        last_seq: u64,
        new_seq: u64,
    },
    /// The same sequence number again (e.g. overlap with a replay); drop it.
    Duplicate,
}

/// Per-topic sequence bookkeeping (pure; unit-tested without sockets).
#[derive(Debug, Default)]
pub struct SeqTracker {
    last: HashMap<String, u64>,
}

impl SeqTracker {
    pub fn observe(&mut self, topic: &str, seq: u64) -> SeqVerdict {
        let verdict = match self.last.get(topic) {
            None => SeqVerdict::First,
            Some(&last) if seq == last.wrapping_add(1) => SeqVerdict::InOrder,
            Some(&last) if seq > last => SeqVerdict::Gap {
                expected: last + 1,
                got: seq,
            },
            Some(&last) if seq == last => SeqVerdict::Duplicate,
            Some(&last) => SeqVerdict::Restart {
                last_seq: last,
                new_seq: seq,
            },
        };
        if verdict != SeqVerdict::Duplicate {
            self.last.insert(topic.to_owned(), seq);
        }
        verdict
    }

    /// Last sequence number seen on `topic`.
    pub fn last(&self, topic: &str) -> Option<u64> {
        self.last.get(topic).copied()
    }
}

/// Counters of one subscriber (shared, cheap to clone), for callers that export metrics.
#[derive(Debug, Clone, Default)]
pub struct SubscriberStats {
    inner: Arc<SubscriberCounters>,
}

#[derive(Debug, Default)]
struct SubscriberCounters {
    messages: AtomicU64,
    malformed: AtomicU64,
    protocol_errors: AtomicU64,
    peers_refused: AtomicU64,
    peers_not_allowed: AtomicU64,
    filtered: AtomicU64,
    replay_failures: AtomicU64,
    replay_malformed: AtomicU64,
}

impl SubscriberStats {
    /// Messages received (well-formed or not).
    pub fn messages(&self) -> u64 {
        self.inner.messages.load(Ordering::Relaxed)
    }
    /// Messages reported as `Malformed` (bad framing, seq or payload).
    pub fn malformed(&self) -> u64 {
        self.inner.malformed.load(Ordering::Relaxed)
    }
    /// Connections dropped for a bad handshake or for exceeding a bound.
    pub fn protocol_errors(&self) -> u64 {
        self.inner.protocol_errors.load(Ordering::Relaxed)
    }
    /// Connections refused because every slot, or the source's share, was taken (bind mode).
    pub fn peers_refused(&self) -> u64 {
        self.inner.peers_refused.load(Ordering::Relaxed)
    }
    /// Connections refused because their address is not on the allow-list (bind mode).
    pub fn peers_not_allowed(&self) -> u64 {
        self.inner.peers_not_allowed.load(Ordering::Relaxed)
    }
    /// Messages on a topic we did not subscribe to (a peer ignoring its subscription).
    pub fn filtered(&self) -> u64 {
        self.inner.filtered.load(Ordering::Relaxed)
    }
    /// Gap or catch-up replays that failed (only with `replay_endpoint` set).
    pub fn replay_failures(&self) -> u64 {
        self.inner.replay_failures.load(Ordering::Relaxed)
    }
    /// Replayed replies skipped as malformed.
    pub fn replay_malformed(&self) -> u64 {
        self.inner.replay_malformed.load(Ordering::Relaxed)
    }
}

/// Starts a subscriber; items arrive on the returned channel until `cancel` fires or the
/// receiver is dropped. Must be called inside a tokio runtime. Never blocks: binding, connecting
/// and reconnecting happen in background tasks (failures are reported as `Error` items and
/// retried).
pub fn subscribe(
    config: SubscriberConfig,
    cancel: CancellationToken,
) -> mpsc::Receiver<SubscriberItem> {
    subscribe_with_stats(config, cancel).0
}

/// [`subscribe`], plus the subscriber's counters.
pub fn subscribe_with_stats(
    config: SubscriberConfig,
    cancel: CancellationToken,
) -> (mpsc::Receiver<SubscriberItem>, SubscriberStats) {
    let (tx, rx) = mpsc::channel(1024);
    let stats = SubscriberStats::default();
    let task_stats = stats.clone();
    tokio::spawn(async move {
        let socket = cancel.child_token();
        tokio::select! {
            _ = cancel.cancelled() => {}
            _ = run(config, tx, task_stats, socket.clone()) => {}
        }
        socket.cancel();
    });
    (rx, stats)
}

/// What the socket tasks hand to the decoding task.
enum Incoming {
    Listening(String),
    /// A message and the buffer budget it holds until decoded.
    Message(Vec<Bytes>, Option<OwnedSemaphorePermit>),
    Error(String),
}

async fn run(
    config: SubscriberConfig,
    tx: mpsc::Sender<SubscriberItem>,
    stats: SubscriberStats,
    socket: CancellationToken,
) {
    let (in_tx, mut in_rx) = mpsc::channel::<Incoming>(256);
    tokio::spawn(run_socket(config.clone(), in_tx, stats.clone(), socket));
    // Kept across reconnects so a restarted publisher shows up as `Restart`.
    let mut tracker = SeqTracker::default();
    while let Some(incoming) = in_rx.recv().await {
        let items = match incoming {
            Incoming::Listening(endpoint) => vec![SubscriberItem::Listening { endpoint }],
            Incoming::Error(error) => vec![SubscriberItem::Error { error }],
            Incoming::Message(parts, _permit) => {
                stats.inner.messages.fetch_add(1, Ordering::Relaxed);
                if let Some(side) = side_item(&config, &parts) {
                    vec![side]
                } else if !parts
                    .first()
                    .is_some_and(|t| t.starts_with(config.topic.as_bytes()))
                {
                    stats.inner.filtered.fetch_add(1, Ordering::Relaxed);
                    continue;
                } else {
                    handle_message(parts, &config, &mut tracker, &stats).await
                }
            }
        };
        for item in items {
            if matches!(item, SubscriberItem::Malformed { .. }) {
                stats.inner.malformed.fetch_add(1, Ordering::Relaxed);
            }
            if tx.send(item).await.is_err() {
                return;
            }
        }
    }
}

/// The message as a [`SubscriberItem::Side`] if its topic is one of the side topics: `[topic,
/// seq, payload]` (a message of another shape is malformed).
fn side_item(config: &SubscriberConfig, parts: &[Bytes]) -> Option<SubscriberItem> {
    let topic = parts.first()?;
    let name = config
        .side_topics
        .iter()
        .find(|t| t.as_bytes() == topic.as_ref())?;
    Some(match parts {
        [_, seq, payload] if seq.len() == 8 => SubscriberItem::Side {
            topic: name.clone(),
            payload: payload.clone(),
        },
        _ => SubscriberItem::Malformed {
            seq: None,
            error: format!("{name} message of {} parts", parts.len()),
        },
    })
}

/// Owns the socket: binds and accepts publishers, or connects and reconnects.
async fn run_socket(
    config: SubscriberConfig,
    tx: mpsc::Sender<Incoming>,
    stats: SubscriberStats,
    cancel: CancellationToken,
) {
    let budget = Arc::new(Semaphore::new(MAX_SUBSCRIBER_BUFFERED));
    let mut backoff = Duration::from_millis(50);
    let resolved = subscriber_mode(&config.endpoint).and_then(|(ep, mode)| {
        let addr = Addr::parse(&ep).ok_or_else(|| crate::EventsError::InvalidEndpoint {
            endpoint: config.endpoint.clone(),
            reason: "unsupported transport".into(),
        })?;
        Ok((ep, mode, addr))
    });
    let (endpoint, mode, addr) = match resolved {
        Ok(r) => r,
        Err(e) => {
            let _ = tx.send(Incoming::Error(e.to_string())).await;
            return;
        }
    };
    loop {
        if config.bind || mode == EndpointMode::Bind {
            match Listener::bind(&addr).await {
                Ok((listener, bound)) => {
                    if tx.send(Incoming::Listening(bound)).await.is_err() {
                        return;
                    }
                    accept_publishers(listener, &config, &tx, &stats, &budget, &cancel).await;
                    return;
                }
                Err(e) => {
                    let error = format!("bind {endpoint}: {e}");
                    if tx.send(Incoming::Error(error)).await.is_err() {
                        return;
                    }
                }
            }
        } else {
            match connect_publisher(&addr).await {
                Ok(stream) => {
                    backoff = Duration::from_millis(50);
                    if tx
                        .send(Incoming::Listening(endpoint.clone()))
                        .await
                        .is_err()
                    {
                        return;
                    }
                    let ended = tokio::select! {
                        _ = cancel.cancelled() => return,
                        e = read_publisher(stream, &config, &tx, &stats, &budget) => e,
                    };
                    let error = match ended {
                        Ended::ReceiverGone => return,
                        Ended::Closed => "publisher disconnected; reconnecting".to_owned(),
                        Ended::Refused(e) => format!("publisher dropped: {e}; reconnecting"),
                    };
                    if tx.send(Incoming::Error(error)).await.is_err() {
                        return;
                    }
                }
                Err(e) => {
                    let error = format!("connect {endpoint}: {e}");
                    if tx.send(Incoming::Error(error)).await.is_err() {
                        return;
                    }
                }
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

/// How long one connect attempt (TCP + ZMTP handshake) may take before it is retried.
const CONNECT_ATTEMPT: Duration = Duration::from_secs(5);

async fn connect_publisher(addr: &Addr) -> Result<BoxStream, String> {
    let attempt = async {
        let mut stream = connect(addr).await.map_err(|e| e.to_string())?;
        timed_handshake(&mut stream, SocketType::Sub)
            .await
            .map_err(|e| e.to_string())?;
        Ok(stream)
    };
    match tokio::time::timeout(CONNECT_ATTEMPT, attempt).await {
        Ok(r) => r,
        Err(_) => Err("timed out".into()),
    }
}

async fn accept_publishers(
    listener: Listener,
    config: &SubscriberConfig,
    tx: &mpsc::Sender<Incoming>,
    stats: &SubscriberStats,
    budget: &Arc<Semaphore>,
    cancel: &CancellationToken,
) {
    let admission = Admission::new(
        MAX_PEERS,
        MAX_PEERS_PER_SOURCE,
        config.allowed_peers.clone(),
    );
    loop {
        let stream = tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tx.closed() => return,
            s = listener.accept() => s,
        };
        let Ok((mut stream, source)) = stream else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let slot = match admission.admit(source) {
            Ok(slot) => slot,
            Err(why) => {
                tracing::debug!(?source, ?why, "kv-event publisher refused at accept");
                let counter = match why {
                    Refused::NotAllowed => &stats.inner.peers_not_allowed,
                    Refused::Full(_) => &stats.inner.peers_refused,
                };
                counter.fetch_add(1, Ordering::Relaxed);
                continue;
            }
        };
        let (config, tx, stats, budget, cancel) = (
            config.clone(),
            tx.clone(),
            stats.clone(),
            budget.clone(),
            cancel.clone(),
        );
        tokio::spawn(async move {
            let _slot = slot;
            if let Err(e) = timed_handshake(&mut stream, SocketType::Sub).await {
                tracing::debug!(error = %e, "kv-event publisher handshake failed");
                stats.inner.protocol_errors.fetch_add(1, Ordering::Relaxed);
                return;
            }
            tokio::select! {
                _ = cancel.cancelled() => {}
                ended = read_publisher(stream, &config, &tx, &stats, &budget) => {
                    // A bound subscriber outlives its publishers: a leaving peer is normal, a
                    // misbehaving one is reported.
                    if let Ended::Refused(e) = ended {
                        let _ = tx.send(Incoming::Error(format!("publisher dropped: {e}"))).await;
                    }
                }
            }
        });
    }
}

enum Ended {
    ReceiverGone,
    Closed,
    /// The peer broke the protocol or a bound; its connection was dropped.
    Refused(ZmtpError),
}

/// Subscribes on a handshaken connection and forwards its messages until it ends.
async fn read_publisher(
    mut stream: BoxStream,
    config: &SubscriberConfig,
    tx: &mpsc::Sender<Incoming>,
    stats: &SubscriberStats,
    budget: &Arc<Semaphore>,
) -> Ended {
    if let Err(e) = stream
        .write_all(&subscribe_message(config.topic.as_bytes()))
        .await
    {
        return Ended::Refused(e.into());
    }
    // A side topic the main subscription already covers (a prefix of it) needs no subscription.
    for side in config
        .side_topics
        .iter()
        .filter(|t| !t.starts_with(config.topic.as_str()))
    {
        if let Err(e) = stream.write_all(&subscribe_message(side.as_bytes())).await {
            return Ended::Refused(e.into());
        }
    }
    let limits = Limits {
        max_frame: MAX_EVENT_FRAME,
        max_parts: MAX_EVENT_PARTS,
        max_message: MAX_EVENT_MESSAGE,
    };
    loop {
        match read_inbound(&mut stream, &limits, Some(budget)).await {
            Ok(Inbound::Message(parts, permit)) => {
                if tx.send(Incoming::Message(parts, permit)).await.is_err() {
                    return Ended::ReceiverGone;
                }
            }
            // PING and other commands need no answer from a SUB without heartbeats.
            Ok(Inbound::Command { .. }) => {}
            Err(ZmtpError::Io(_)) => return Ended::Closed,
            Err(e) => {
                stats.inner.protocol_errors.fetch_add(1, Ordering::Relaxed);
                return Ended::Refused(e);
            }
        }
    }
}

/// Turns one raw message into items, consulting the replay endpoint on a gap.
async fn handle_message(
    parts: Vec<Bytes>,
    config: &SubscriberConfig,
    tracker: &mut SeqTracker,
    stats: &SubscriberStats,
) -> Vec<SubscriberItem> {
    let seq_hint = parts.get(1).and_then(|p| parse_seq(p).ok());
    let frame = match EventFrame::from_owned_parts(parts) {
        Ok(f) => f,
        Err(e) => {
            return vec![SubscriberItem::Malformed {
                seq: seq_hint,
                error: e.to_string(),
            }];
        }
    };
    let mut items = Vec::with_capacity(1);
    let topic = frame.topic.as_str();
    match tracker.observe(topic, frame.seq) {
        SeqVerdict::InOrder => {}
        SeqVerdict::Duplicate => return items,
        // A late joiner catches up on whatever the replay ring still holds; history before
        // that is unknown, not lost, so no gap is reported for it.
        SeqVerdict::First => {
            if frame.seq > 0 && config.replay_endpoint.is_some() {
                fill(topic, 0, frame.seq, false, config, stats, &mut items).await;
            }
        }
        SeqVerdict::Restart { last_seq, new_seq } => {
            items.push(SubscriberItem::Restart {
                topic: topic.to_owned(),
                last_seq,
                new_seq,
            });
            if new_seq > 0 {
                fill(topic, 0, new_seq, true, config, stats, &mut items).await;
            }
        }
        SeqVerdict::Gap { expected, got } => {
            fill(topic, expected, got, true, config, stats, &mut items).await;
        }
    }
    items.push(decode_item(topic, frame.seq, &frame.payload));
    items
}

/// Emits batches `from..got` from the replay endpoint (if any), and `Gap`s for what it could
/// not supply. A hole before the first replayed batch is reported only if `report_leading`.
async fn fill(
    topic: &str,
    from: u64,
    got: u64,
    report_leading: bool,
    config: &SubscriberConfig,
    stats: &SubscriberStats,
    items: &mut Vec<SubscriberItem>,
) {
    let mut next = from;
    let mut leading = true;
    let gap = |expected: u64, got: u64| SubscriberItem::Gap {
        topic: topic.to_owned(),
        expected,
        got,
    };
    if let Some(ep) = &config.replay_endpoint {
        match request_replay_raw(ep, from).await {
            Ok((replayed, malformed)) => {
                stats
                    .inner
                    .replay_malformed
                    .fetch_add(malformed, Ordering::Relaxed);
                for (seq, payload) in replayed {
                    if seq < next || seq >= got {
                        continue;
                    }
                    if seq > next && (report_leading || !leading) {
                        items.push(gap(next, seq));
                    }
                    leading = false;
                    items.push(decode_item(topic, seq, &payload));
                    next = seq + 1;
                }
            }
            Err(e) => {
                stats.inner.replay_failures.fetch_add(1, Ordering::Relaxed);
                items.push(SubscriberItem::Error {
                    error: format!("replay: {e}"),
                });
            }
        }
    }
    if next < got && (report_leading || !leading) {
        items.push(gap(next, got));
    }
}

fn decode_item(topic: &str, seq: u64, payload: &[u8]) -> SubscriberItem {
    match decode_batch(payload) {
        Ok(batch) => SubscriberItem::Batch {
            topic: topic.to_owned(),
            seq,
            batch,
        },
        Err(e) => SubscriberItem::Malformed {
            seq: Some(seq),
            error: e.to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracker_classifies_sequences_per_topic() {
        let mut t = SeqTracker::default();
        assert_eq!(t.observe("a", 5), SeqVerdict::First);
        assert_eq!(t.observe("a", 6), SeqVerdict::InOrder);
        assert_eq!(t.observe("b", 0), SeqVerdict::First);
        assert_eq!(
            t.observe("a", 9),
            SeqVerdict::Gap {
                expected: 7,
                got: 9
            }
        );
        assert_eq!(t.observe("a", 9), SeqVerdict::Duplicate);
        assert_eq!(
            t.observe("a", 0),
            SeqVerdict::Restart {
                last_seq: 9,
                new_seq: 0
            }
        );
        assert_eq!(t.observe("a", 1), SeqVerdict::InOrder);
        assert_eq!(t.last("b"), Some(0));
    }
}
