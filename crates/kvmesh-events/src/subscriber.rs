//! The KV-event subscriber: a SUB socket in a background task that decodes, checks sequence
//! numbers and reports what it sees as [`SubscriberItem`]s.
//!
//! Nothing a peer sends can stop the task: undecodable messages become `Malformed` items, a
//! sequence that jumps forward becomes `Gap` (filled from the replay endpoint first, if one is
//! configured), one that goes backwards becomes `Restart` (a new publisher incarnation). Sequence
//! numbers are tracked per topic, so several publishers may connect to one bound subscriber as long
//! as their topics differ (llm-d's `kv@<pod>@<model>` topics do).

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use kvmesh_core::events::{EventBatch, EventFrame, decode_batch, parse_seq};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketEvent, SocketOptions, SocketRecv, SubSocket};

use crate::endpoint::{EndpointMode, resolve_endpoint};
use crate::replay::request_replay_raw;

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
    /// The publisher's replay endpoint; when set, gaps are filled from it before being reported.
    pub replay_endpoint: Option<String>,
}

impl SubscriberConfig {
    /// Connect to `endpoint`, all topics, no replay.
    pub fn connect(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            bind: false,
            topic: String::new(),
            replay_endpoint: None,
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

/// Starts a subscriber task; items arrive on the returned channel until `cancel` fires or the
/// receiver is dropped. Must be called inside a tokio runtime. Never blocks: binding, connecting
/// and reconnecting happen in the task (failures are reported as `Error` items and retried).
pub fn subscribe(
    config: SubscriberConfig,
    cancel: CancellationToken,
) -> mpsc::Receiver<SubscriberItem> {
    let (tx, rx) = mpsc::channel(1024);
    tokio::spawn(async move {
        tokio::select! {
            _ = cancel.cancelled() => {}
            _ = run(config, tx) => {}
        }
    });
    rx
}

/// How long one connect attempt (TCP + ZMTP handshake) may take before it is retried.
const CONNECT_ATTEMPT: Duration = Duration::from_secs(5);

async fn run(config: SubscriberConfig, tx: mpsc::Sender<SubscriberItem>) {
    // Kept across reconnects so a restarted publisher shows up as `Restart`.
    let mut tracker = SeqTracker::default();
    let mut backoff = Duration::from_millis(100);
    loop {
        match open(&config).await {
            Ok(opened) => {
                backoff = Duration::from_millis(100);
                let endpoint = opened.endpoint.clone();
                if tx
                    .send(SubscriberItem::Listening { endpoint })
                    .await
                    .is_err()
                {
                    return;
                }
                match receive(opened, &config, &tx, &mut tracker).await {
                    Ended::ReceiverGone => return,
                    Ended::Disconnected => {
                        let error = "publisher disconnected; reconnecting".to_owned();
                        if tx.send(SubscriberItem::Error { error }).await.is_err() {
                            return;
                        }
                    }
                }
            }
            Err(error) => {
                if tx.send(SubscriberItem::Error { error }).await.is_err() {
                    return;
                }
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

struct Opened {
    socket: SubSocket,
    monitor: futures::channel::mpsc::Receiver<SocketEvent>,
    endpoint: String,
    connected: bool,
}

async fn open(config: &SubscriberConfig) -> Result<Opened, String> {
    let (endpoint, mode) = resolve_endpoint(&config.endpoint).map_err(|e| e.to_string())?;
    let mut options = SocketOptions::default();
    // Bounded, so a connection that hangs in the handshake (e.g. into a dying listener's
    // backlog) is abandoned and retried instead of blocking forever.
    options.connect_timeout(CONNECT_ATTEMPT);
    let mut socket = SubSocket::with_options(options);
    let monitor = socket.monitor();
    socket
        .subscribe(&config.topic)
        .await
        .map_err(|e| format!("subscribe: {e}"))?;
    if config.bind || mode == EndpointMode::Bind {
        let bound = socket
            .bind(&endpoint)
            .await
            .map_err(|e| format!("bind {endpoint}: {e}"))?;
        Ok(Opened {
            socket,
            monitor,
            endpoint: bound.to_string(),
            connected: false,
        })
    } else {
        socket
            .connect(&endpoint)
            .await
            .map_err(|e| format!("connect {endpoint}: {e}"))?;
        Ok(Opened {
            socket,
            monitor,
            endpoint,
            connected: true,
        })
    }
}

enum Ended {
    ReceiverGone,
    /// The publisher we connected to went away. The `zeromq` crate would try to reconnect by
    /// itself, but its attempt can hang in the handshake forever, so we reopen the socket.
    Disconnected,
}

async fn receive(
    opened: Opened,
    config: &SubscriberConfig,
    tx: &mpsc::Sender<SubscriberItem>,
    tracker: &mut SeqTracker,
) -> Ended {
    let Opened {
        mut socket,
        mut monitor,
        connected,
        ..
    } = opened;
    loop {
        let msg = tokio::select! {
            m = socket.recv() => m,
            ev = next_event(&mut monitor, connected) => {
                if matches!(ev, Some(SocketEvent::Disconnected(_)) | None) {
                    return Ended::Disconnected;
                }
                continue;
            }
        };
        let msg = match msg {
            Ok(m) => m,
            Err(e) => {
                // A peer's broken stream; the socket stays usable.
                if tx
                    .send(SubscriberItem::Error {
                        error: e.to_string(),
                    })
                    .await
                    .is_err()
                {
                    return Ended::ReceiverGone;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        for item in handle_message(msg.into_vec(), config, tracker).await {
            if tx.send(item).await.is_err() {
                return Ended::ReceiverGone;
            }
        }
    }
}

/// The next socket event when connected; never resolves for a bound socket, where a peer
/// leaving is normal and the peer's reconnect is its own business.
async fn next_event(
    monitor: &mut futures::channel::mpsc::Receiver<SocketEvent>,
    active: bool,
) -> Option<SocketEvent> {
    if active {
        monitor.next().await
    } else {
        std::future::pending().await
    }
}

/// Turns one raw message into items, consulting the replay endpoint on a gap.
async fn handle_message(
    parts: Vec<Bytes>,
    config: &SubscriberConfig,
    tracker: &mut SeqTracker,
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
                fill(topic, 0, frame.seq, false, config, &mut items).await;
            }
        }
        SeqVerdict::Restart { last_seq, new_seq } => {
            items.push(SubscriberItem::Restart {
                topic: topic.to_owned(),
                last_seq,
                new_seq,
            });
            if new_seq > 0 {
                fill(topic, 0, new_seq, true, config, &mut items).await;
            }
        }
        SeqVerdict::Gap { expected, got } => {
            fill(topic, expected, got, true, config, &mut items).await;
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
            Ok(replayed) => {
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
            Err(e) => items.push(SubscriberItem::Error {
                error: e.to_string(),
            }),
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
