//! vLLM's replay protocol: a ROUTER socket that resends recent batches from a sequence number.
//!
//! Request `[identity, "", start_seq (8 B BE)]` (what a REQ or DEALER client sends, the identity
//! being added by ROUTER); one reply `[identity, "", seq (8 B BE), payload]` per buffered batch
//! with `seq >= start_seq`, then the end marker `[identity, "", -1 (8 B BE signed), ""]`.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvmesh_core::events::{EventBatch, decode_batch, parse_seq};
use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;
use zeromq::{DealerSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::EventsError;

/// The end-of-replay marker: `-1` as a signed 64-bit big-endian integer.
pub const REPLAY_END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// A bounded ring of the most recent `(seq, payload)` batches, shared by the publisher (writer)
/// and the replay server (reader). The lock is held only to push or copy out handles.
#[derive(Clone)]
pub struct ReplayBuffer {
    inner: Arc<Mutex<VecDeque<(u64, Bytes)>>>,
    capacity: usize,
}

impl ReplayBuffer {
    /// A ring holding at most `capacity` batches (vLLM's default buffer is 10 000 steps).
    pub fn new(capacity: usize) -> Self {
        Self {
            inner: Arc::new(Mutex::new(VecDeque::with_capacity(capacity.min(1024)))),
            capacity,
        }
    }

    /// Appends a batch, dropping the oldest when full.
    pub fn push(&self, seq: u64, payload: Bytes) {
        if self.capacity == 0 {
            return;
        }
        let mut ring = self.inner.lock();
        if ring.len() >= self.capacity {
            ring.pop_front();
        }
        ring.push_back((seq, payload));
    }

    /// Every buffered batch with `seq >= start_seq`, oldest first (payloads are shared, not copied).
    pub fn since(&self, start_seq: u64) -> Vec<(u64, Bytes)> {
        let ring = self.inner.lock();
        ring.iter()
            .filter(|(s, _)| *s >= start_seq)
            .cloned()
            .collect()
    }

    pub fn len(&self) -> usize {
        self.inner.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Binds the ROUTER socket; returns the bound endpoint.
pub(crate) async fn bind_replay_server(
    endpoint: &str,
) -> Result<(RouterSocket, String), EventsError> {
    let (ep, _) = crate::endpoint::resolve_endpoint(endpoint)?;
    let mut socket = RouterSocket::new();
    let bound = socket.bind(&ep).await.map_err(|source| EventsError::Zmq {
        endpoint: endpoint.to_owned(),
        source,
    })?;
    Ok((socket, bound.to_string()))
}

/// Serves replay requests until cancelled. Malformed requests are logged and ignored.
pub(crate) async fn serve_replay(
    mut socket: RouterSocket,
    buffer: ReplayBuffer,
    cancel: CancellationToken,
) {
    loop {
        let msg = tokio::select! {
            _ = cancel.cancelled() => return,
            m = socket.recv() => m,
        };
        let msg = match msg {
            Ok(m) => m.into_vec(),
            Err(e) => {
                tracing::debug!(error = %e, "replay socket receive error");
                continue;
            }
        };
        // [identity, "", start_seq] from REQ/DEALER-with-delimiter, or [identity, start_seq].
        let (identity, start) = match msg.as_slice() {
            [id, delim, start] if delim.is_empty() => (id.clone(), start),
            [id, start] => (id.clone(), start),
            _ => {
                tracing::warn!(parts = msg.len(), "invalid replay request ignored");
                continue;
            }
        };
        let Ok(start_seq) = parse_seq(start) else {
            tracing::warn!(
                len = start.len(),
                "replay request with a malformed start_seq ignored"
            );
            continue;
        };
        for (seq, payload) in buffer.since(start_seq) {
            let reply = reply_message(&identity, &seq.to_be_bytes(), payload);
            if let Err(e) = socket.send(reply).await {
                tracing::debug!(error = %e, "replay reply failed");
                break;
            }
        }
        let end = reply_message(&identity, &REPLAY_END_SEQ, Bytes::new());
        if let Err(e) = socket.send(end).await {
            tracing::debug!(error = %e, "replay end marker failed");
        }
    }
}

fn reply_message(identity: &Bytes, seq: &[u8; 8], payload: Bytes) -> ZmqMessage {
    let mut m = ZmqMessage::from(identity.clone());
    m.push_back(Bytes::new());
    m.push_back(Bytes::copy_from_slice(seq));
    m.push_back(payload);
    m
}

/// How long [`request_replay`] waits for the whole answer.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);

/// Asks a replay endpoint for every buffered batch with `seq >= start_seq`.
///
/// Returns the decoded batches in order. A batch whose payload does not decode is skipped (and
/// logged) rather than failing the whole replay. Times out after 5 s.
pub async fn request_replay(
    replay_endpoint: &str,
    start_seq: u64,
) -> Result<Vec<(u64, EventBatch)>, EventsError> {
    let raw = request_replay_raw(replay_endpoint, start_seq).await?;
    let mut out = Vec::with_capacity(raw.len());
    for (seq, payload) in raw {
        match decode_batch(&payload) {
            Ok(b) => out.push((seq, b)),
            Err(e) => tracing::warn!(seq, error = %e, "replayed batch does not decode; skipped"),
        }
    }
    Ok(out)
}

/// [`request_replay`] without decoding: `(seq, payload)` pairs as sent.
pub(crate) async fn request_replay_raw(
    replay_endpoint: &str,
    start_seq: u64,
) -> Result<Vec<(u64, Bytes)>, EventsError> {
    let err = |reason: String| EventsError::Replay {
        endpoint: replay_endpoint.to_owned(),
        reason,
    };
    let (ep, _) = crate::endpoint::resolve_endpoint(replay_endpoint)?;
    let ep = crate::endpoint::connectable(&ep);
    let work = async {
        let mut socket = DealerSocket::new();
        socket
            .connect(&ep)
            .await
            .map_err(|source| EventsError::Zmq {
                endpoint: replay_endpoint.to_owned(),
                source,
            })?;
        // A DEALER mimics REQ's envelope with an empty delimiter frame.
        let mut req = ZmqMessage::from(Bytes::new());
        req.push_back(Bytes::copy_from_slice(&start_seq.to_be_bytes()));
        socket.send(req).await.map_err(|e| err(e.to_string()))?;
        let mut out = Vec::new();
        loop {
            let msg = socket
                .recv()
                .await
                .map_err(|e| err(e.to_string()))?
                .into_vec();
            let (seq, payload) = match msg.as_slice() {
                [delim, seq, payload] if delim.is_empty() => (seq, payload),
                [seq, payload] => (seq, payload),
                _ => return Err(err(format!("unexpected reply with {} parts", msg.len()))),
            };
            if seq.as_ref() == REPLAY_END_SEQ {
                return Ok(out);
            }
            let seq = parse_seq(seq).map_err(|e| err(e.to_string()))?;
            out.push((seq, payload.clone()));
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
