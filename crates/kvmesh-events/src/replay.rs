//! vLLM's replay protocol: a ROUTER socket that resends recent batches from a sequence number.
//!
//! Checked against vLLM 0.32's `vllm/distributed/kv_events.py` (`ZmqEventPublisher._service_replay`):
//! a request is `[identity, "", start_seq]` at the ROUTER (what a REQ, or a DEALER that sends the
//! empty delimiter itself, puts on the wire as `["", start_seq]`), `start_seq` a big-endian
//! integer; each buffered batch with `seq >= start_seq` is answered as
//! `[identity, "", topic, seq (8 B BE), payload]`, then the end marker
//! `[identity, "", "", -1 (8 B BE signed), ""]`. The client therefore receives
//! `["", topic, seq, payload]`. kvmesh's server answers exactly so; the client also accepts the
//! 3-part `["", seq, payload]` that kvmesh servers sent before.
//!
//! A ROUTER's routing reduces to "answer on the connection that asked", so each connection is
//! served by its own task; requests are bounded by [`crate::limits`]. Connections are admitted
//! like the PUB socket's (allow-list, caps in total and per source), and a peer that asks nothing
//! for [`REPLAY_IDLE_TIMEOUT`] is dropped (16 silent peers used to fill the port for good).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use kvmesh_core::events::{EventBatch, decode_batch};
use parking_lot::Mutex;
use tokio::io::AsyncWriteExt;
use tokio_util::sync::CancellationToken;

use crate::EventsError;
use crate::admission::{Admission, AllowedPeers};
use crate::limits::{
    MAX_EVENT_FRAME, MAX_EVENT_MESSAGE, MAX_EVENT_PARTS, MAX_REPLAY_ANSWER,
    MAX_REPLAY_BUFFER_BYTES, MAX_REPLAY_PEERS, MAX_REPLAY_PEERS_PER_SOURCE,
    MAX_REPLAY_REQUEST_FRAME, MAX_REPLAY_REQUEST_PARTS, REPLAY_IDLE_TIMEOUT, REPLAY_TIMEOUT,
    WRITE_TIMEOUT,
};
use crate::stats::PublisherStats;
use crate::transport::{Addr, BoxStream, Listener, connect, timed_handshake};
use crate::zmtp::{Inbound, Limits, SocketType, ZmtpError, encode_message, read_inbound};

/// The end-of-replay marker: `-1` as a signed 64-bit big-endian integer.
pub const REPLAY_END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// A bounded ring of the most recent `(seq, payload)` batches, shared by the publisher (writer)
/// and the replay server (reader). The lock is held only to push or copy out handles.
#[derive(Clone)]
pub struct ReplayBuffer {
    inner: Arc<Mutex<Ring>>,
    capacity: usize,
    max_bytes: usize,
}

#[derive(Default)]
struct Ring {
    batches: VecDeque<(u64, Bytes)>,
    bytes: usize,
}

impl ReplayBuffer {
    /// A ring holding at most `capacity` batches (vLLM's default buffer is 10 000 steps) and
    /// [`MAX_REPLAY_BUFFER_BYTES`] of payload.
    pub fn new(capacity: usize) -> Self {
        Self::with_max_bytes(capacity, MAX_REPLAY_BUFFER_BYTES)
    }

    /// A ring holding at most `capacity` batches and `max_bytes` of payload.
    pub fn with_max_bytes(capacity: usize, max_bytes: usize) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Ring {
                batches: VecDeque::with_capacity(capacity.min(1024)),
                bytes: 0,
            })),
            capacity,
            max_bytes,
        }
    }

    /// Appends a batch, dropping the oldest while it holds too many batches or bytes (a batch
    /// larger than the byte bound on its own is not kept).
    pub fn push(&self, seq: u64, payload: Bytes) {
        if self.capacity == 0 || payload.len() > self.max_bytes {
            return;
        }
        let mut ring = self.inner.lock();
        ring.bytes += payload.len();
        ring.batches.push_back((seq, payload));
        while ring.batches.len() > self.capacity || ring.bytes > self.max_bytes {
            match ring.batches.pop_front() {
                Some((_, old)) => ring.bytes -= old.len(),
                None => break,
            }
        }
    }

    /// Payload bytes held.
    pub fn bytes(&self) -> usize {
        self.inner.lock().bytes
    }

    /// Every buffered batch with `seq >= start_seq`, oldest first (payloads are shared, not copied).
    pub fn since(&self, start_seq: u64) -> Vec<(u64, Bytes)> {
        let ring = self.inner.lock();
        ring.batches
            .iter()
            .filter(|(s, _)| *s >= start_seq)
            .cloned()
            .collect()
    }

    pub fn len(&self) -> usize {
        self.inner.lock().batches.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Binds the ROUTER socket and serves it until `cancel`; returns the bound endpoint.
pub(crate) async fn bind_replay_server(
    endpoint: &str,
    buffer: ReplayBuffer,
    topic: Bytes,
    allowed: Option<AllowedPeers>,
    stats: PublisherStats,
    cancel: CancellationToken,
) -> Result<String, EventsError> {
    let (ep, _) = crate::endpoint::resolve_endpoint(endpoint)?;
    let addr = Addr::parse(&ep).ok_or_else(|| EventsError::InvalidEndpoint {
        endpoint: endpoint.to_owned(),
        reason: "unsupported transport".into(),
    })?;
    let (listener, bound) = Listener::bind(&addr)
        .await
        .map_err(|source| EventsError::Zmq {
            endpoint: endpoint.to_owned(),
            source: source.into(),
        })?;
    tokio::spawn(async move {
        let admission = Admission::new(MAX_REPLAY_PEERS, MAX_REPLAY_PEERS_PER_SOURCE, allowed);
        loop {
            let stream = tokio::select! {
                _ = cancel.cancelled() => return,
                s = listener.accept() => s,
            };
            let Ok((stream, source)) = stream else {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            };
            let slot = match admission.admit(source) {
                Ok(slot) => slot,
                Err(why) => {
                    tracing::debug!(?source, ?why, "replay client refused at accept");
                    stats.refused(why);
                    continue;
                }
            };
            let (buffer, topic, stats, cancel) =
                (buffer.clone(), topic.clone(), stats.clone(), cancel.clone());
            tokio::spawn(async move {
                let _slot = slot;
                tokio::select! {
                    _ = cancel.cancelled() => {}
                    r = serve_replay_peer(stream, &buffer, &topic) => match r {
                        Ok(()) | Err(ReplayPeerEnd::Zmtp(ZmtpError::Io(_))) => {}
                        Err(ReplayPeerEnd::Idle) => {
                            tracing::debug!("replay client dropped: asked nothing in time");
                            stats.idle_peer_dropped();
                        }
                        Err(ReplayPeerEnd::Zmtp(e)) => {
                            tracing::debug!(error = %e, "replay client dropped");
                            stats.protocol_error();
                        }
                    },
                }
            });
        }
    });
    Ok(bound)
}

/// The start sequence of a request as it arrives on the wire: `["", start]` (REQ, or a DEALER
/// sending the delimiter, as vLLM expects) or `[start]` (a bare DEALER). `start` is read as a
/// big-endian integer of up to 8 bytes, as vLLM's `int.from_bytes(…, "big")` reads it.
pub(crate) fn parse_request(parts: &[Bytes]) -> Option<u64> {
    let start = match parts {
        [delim, start] if delim.is_empty() => start,
        [start] => start,
        _ => return None,
    };
    if start.is_empty() || start.len() > 8 {
        return None;
    }
    Some(start.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
}

/// One replayed batch as vLLM frames it after the ROUTER strips the identity.
pub(crate) fn reply_parts(topic: &Bytes, seq: u64, payload: Bytes) -> [Bytes; 4] {
    [
        Bytes::new(),
        topic.clone(),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        payload,
    ]
}

/// The end marker as vLLM frames it: empty delimiter, empty topic, -1, empty payload.
pub(crate) fn end_parts() -> [Bytes; 4] {
    [
        Bytes::new(),
        Bytes::new(),
        Bytes::from_static(&REPLAY_END_SEQ),
        Bytes::new(),
    ]
}

/// Why a replay connection ended early.
enum ReplayPeerEnd {
    /// No request within [`REPLAY_IDLE_TIMEOUT`] of the handshake or of the previous answer.
    Idle,
    Zmtp(ZmtpError),
}

impl From<ZmtpError> for ReplayPeerEnd {
    fn from(e: ZmtpError) -> Self {
        ReplayPeerEnd::Zmtp(e)
    }
}

async fn serve_replay_peer(
    mut stream: BoxStream,
    buffer: &ReplayBuffer,
    topic: &Bytes,
) -> Result<(), ReplayPeerEnd> {
    timed_handshake(&mut stream, SocketType::Router).await?;
    let limits = Limits {
        max_frame: MAX_REPLAY_REQUEST_FRAME,
        max_parts: MAX_REPLAY_REQUEST_PARTS,
        max_message: MAX_REPLAY_REQUEST_FRAME * MAX_REPLAY_REQUEST_PARTS,
    };
    // Only an answered request earns more time: commands and invalid requests do not.
    let mut ask_by = tokio::time::Instant::now() + REPLAY_IDLE_TIMEOUT;
    loop {
        // Requests are answered one at a time on this connection, so reading here (not in a
        // `select!`) is safe; a timed-out read ends the connection, never resumes.
        let request = tokio::time::timeout_at(ask_by, read_inbound(&mut stream, &limits, None));
        let parts = match request.await.map_err(|_| ReplayPeerEnd::Idle)?? {
            Inbound::Message(parts, _) => parts,
            Inbound::Command { .. } => continue,
        };
        let Some(start_seq) = parse_request(&parts) else {
            tracing::warn!(parts = parts.len(), "invalid replay request ignored");
            continue;
        };
        for (seq, payload) in buffer.since(start_seq) {
            write_timed(
                &mut stream,
                &encode_message(&reply_parts(topic, seq, payload)),
            )
            .await?;
        }
        write_timed(&mut stream, &encode_message(&end_parts())).await?;
        ask_by = tokio::time::Instant::now() + REPLAY_IDLE_TIMEOUT;
    }
}

async fn write_timed(stream: &mut BoxStream, wire: &[u8]) -> Result<(), ZmtpError> {
    match tokio::time::timeout(WRITE_TIMEOUT, stream.write_all(wire)).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(ZmtpError::Timeout),
    }
}

/// What a replay answer held.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ReplayOutcome {
    /// Decoded batches in the order sent.
    pub batches: Vec<(u64, EventBatch)>,
    /// Replies skipped: unreadable framing or sequence number, or a payload that did not decode.
    pub malformed: u64,
}

/// Process-wide replay counters, for callers that do not keep their own.
static REPLAY_FAILURES: AtomicU64 = AtomicU64::new(0);
static REPLAY_MALFORMED: AtomicU64 = AtomicU64::new(0);

/// Replay requests of this process that failed (connection, handshake, bound or timeout).
pub fn replay_failures_total() -> u64 {
    REPLAY_FAILURES.load(Ordering::Relaxed)
}

/// Replies skipped as malformed by replay requests of this process.
pub fn replay_malformed_total() -> u64 {
    REPLAY_MALFORMED.load(Ordering::Relaxed)
}

/// Asks a replay endpoint for every buffered batch with `seq >= start_seq`.
///
/// Returns the decoded batches in order. A reply that cannot be read is skipped (and logged)
/// rather than failing the whole replay; [`request_replay_outcome`] also counts them.
/// Times out after [`REPLAY_TIMEOUT`].
pub async fn request_replay(
    replay_endpoint: &str,
    start_seq: u64,
) -> Result<Vec<(u64, EventBatch)>, EventsError> {
    Ok(request_replay_outcome(replay_endpoint, start_seq)
        .await?
        .batches)
}

/// [`request_replay`] with the count of malformed replies.
pub async fn request_replay_outcome(
    replay_endpoint: &str,
    start_seq: u64,
) -> Result<ReplayOutcome, EventsError> {
    let (raw, mut malformed) = match request_replay_raw(replay_endpoint, start_seq).await {
        Ok(r) => r,
        Err(e) => {
            REPLAY_FAILURES.fetch_add(1, Ordering::Relaxed);
            return Err(e);
        }
    };
    let mut batches = Vec::with_capacity(raw.len());
    for (seq, payload) in raw {
        match decode_batch(&payload) {
            Ok(b) => batches.push((seq, b)),
            Err(e) => {
                malformed += 1;
                tracing::warn!(seq, error = %e, "replayed batch does not decode; skipped");
            }
        }
    }
    REPLAY_MALFORMED.fetch_add(malformed, Ordering::Relaxed);
    Ok(ReplayOutcome { batches, malformed })
}

/// A reply as the client sees it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Reply {
    Batch(u64, Bytes),
    End,
    Malformed(String),
}

/// Reads one reply in either framing: vLLM's `["", topic, seq, payload]` or kvmesh's older
/// `["", seq, payload]` (a DEALER that did not strip the delimiter sees both; `[seq, payload]`
/// is taken too). The end marker is `-1` in the seq position.
pub(crate) fn parse_reply(parts: &[Bytes]) -> Reply {
    let (seq, payload) = match parts {
        [delim, _topic, seq, payload] if delim.is_empty() => (seq, payload),
        [_, seq, payload] => (seq, payload),
        [seq, payload] => (seq, payload),
        _ => return Reply::Malformed(format!("reply with {} parts", parts.len())),
    };
    if seq.as_ref() == REPLAY_END_SEQ {
        return Reply::End;
    }
    match <[u8; 8]>::try_from(seq.as_ref()) {
        Ok(b) => Reply::Batch(u64::from_be_bytes(b), payload.clone()),
        Err(_) => Reply::Malformed(format!("seq of {} bytes", seq.len())),
    }
}

/// [`request_replay`] without decoding: `(seq, payload)` pairs as sent, and how many replies
/// were skipped as unreadable.
pub(crate) async fn request_replay_raw(
    replay_endpoint: &str,
    start_seq: u64,
) -> Result<(Vec<(u64, Bytes)>, u64), EventsError> {
    let err = |reason: String| EventsError::Replay {
        endpoint: replay_endpoint.to_owned(),
        reason,
    };
    let (ep, _) = crate::endpoint::resolve_endpoint(replay_endpoint)?;
    let ep = crate::endpoint::connectable(&ep);
    let addr = Addr::parse(&ep).ok_or_else(|| err("unsupported transport".into()))?;
    let work = async {
        let mut stream = connect(&addr).await.map_err(|e| err(e.to_string()))?;
        timed_handshake(&mut stream, SocketType::Dealer)
            .await
            .map_err(|e| err(e.to_string()))?;
        // A DEALER mimics REQ's envelope with an empty delimiter frame (vLLM requires it).
        let req = encode_message(&[
            Bytes::new(),
            Bytes::copy_from_slice(&start_seq.to_be_bytes()),
        ]);
        stream
            .write_all(&req)
            .await
            .map_err(|e| err(e.to_string()))?;
        let limits = Limits {
            max_frame: MAX_EVENT_FRAME,
            max_parts: MAX_EVENT_PARTS,
            max_message: MAX_EVENT_MESSAGE,
        };
        let mut out = Vec::new();
        let mut malformed = 0u64;
        let mut total = 0usize;
        loop {
            let parts = match read_inbound(&mut stream, &limits, None)
                .await
                .map_err(|e| err(e.to_string()))?
            {
                Inbound::Message(parts, _) => parts,
                Inbound::Command { .. } => continue,
            };
            total += parts.iter().map(Bytes::len).sum::<usize>();
            if total > MAX_REPLAY_ANSWER {
                return Err(err(format!("answer exceeds {MAX_REPLAY_ANSWER} bytes")));
            }
            match parse_reply(&parts) {
                Reply::End => return Ok((out, malformed)),
                Reply::Batch(seq, payload) => out.push((seq, payload)),
                Reply::Malformed(why) => {
                    malformed += 1;
                    tracing::warn!(reason = %why, "malformed replay reply skipped");
                }
            }
        }
    };
    match tokio::time::timeout(REPLAY_TIMEOUT, work).await {
        Ok(r) => r,
        Err(_) => Err(EventsError::Timeout {
            endpoint: replay_endpoint.to_owned(),
            millis: REPLAY_TIMEOUT.as_millis() as u64,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(s: &'static [u8]) -> Bytes {
        Bytes::from_static(s)
    }

    #[test]
    fn the_ring_is_bounded_in_batches_and_in_bytes() {
        let ring = ReplayBuffer::with_max_bytes(4, 100);
        for seq in 0..6 {
            ring.push(seq, Bytes::from(vec![0u8; 10]));
        }
        assert_eq!(ring.len(), 4, "count bound");
        assert_eq!(ring.since(0)[0].0, 2, "oldest first out");
        ring.push(6, Bytes::from(vec![0u8; 90]));
        assert_eq!(
            (ring.len(), ring.bytes()),
            (2, 100),
            "byte bound drops the oldest"
        );
        ring.push(7, Bytes::from(vec![0u8; 101]));
        assert_eq!(
            ring.since(7).len(),
            0,
            "a batch above the bound alone is not kept"
        );
        assert_eq!(ring.bytes(), 100);
    }

    #[test]
    fn requests_as_vllm_reads_them() {
        assert_eq!(
            parse_request(&[b(b""), Bytes::copy_from_slice(&7u64.to_be_bytes())]),
            Some(7)
        );
        assert_eq!(parse_request(&[b(b""), b(b"\x01\x00")]), Some(256));
        assert_eq!(
            parse_request(&[Bytes::copy_from_slice(&3u64.to_be_bytes())]),
            Some(3)
        );
        assert_eq!(parse_request(&[b(b"x"), b(b"\x01")]), None);
        assert_eq!(parse_request(&[b(b""), Bytes::from(vec![1u8; 9])]), None);
        assert_eq!(parse_request(&[]), None);
    }

    #[test]
    fn replies_in_both_framings() {
        let seq = Bytes::copy_from_slice(&5u64.to_be_bytes());
        let vllm = reply_parts(&b(b"kv-events"), 5, b(b"p"));
        assert_eq!(parse_reply(&vllm), Reply::Batch(5, b(b"p")));
        assert_eq!(
            parse_reply(&[b(b""), seq.clone(), b(b"p")]),
            Reply::Batch(5, b(b"p"))
        );
        assert_eq!(parse_reply(&end_parts()), Reply::End);
        assert_eq!(
            parse_reply(&[b(b""), Bytes::from_static(&REPLAY_END_SEQ), b(b"")]),
            Reply::End
        );
        assert!(matches!(
            parse_reply(&[b(b""), b(b"t"), b(b"123"), b(b"p")]),
            Reply::Malformed(_)
        ));
        assert!(matches!(parse_reply(&[b(b"only")]), Reply::Malformed(_)));
    }
}
