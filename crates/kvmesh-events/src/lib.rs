//! KV-event transport over ZMQ: publisher with replay, subscriber with gap detection.
//!
//! Speaks vLLM's `ZmqEventPublisher` protocol (`docs/protocols.md#kv-events`) over its own ZMTP 3.0
//! implementation ([`zmtp`]), which bounds everything a peer can make it buffer
//! ([`limits`]: 64 MiB per event frame and message, 128 MiB buffered per SUB socket, 1 KiB per
//! subscription or replay-request frame, 64 connections per socket and 8 per source address, 5 s
//! handshakes, 5 s to subscribe or to ask for a replay). Bound sockets can take an allow-list of
//! source networks ([`AllowedPeers`]). Messages are
//! `[topic, seq (u64 BE), msgpack payload]` on a PUB socket, plus an optional ROUTER socket that
//! replays recent batches by sequence number in vLLM 0.32's exact framing. The codec lives in
//! `kvmesh_core::events`; this crate only moves frames.
//!
//! - [`Publisher`] binds when the endpoint contains `*` or `::` or is `ipc://` (vLLM 0.32's rule)
//!   and connects otherwise, buffering boundedly until its subscriber is there.
//!   [`Publisher::spawn`] turns it into a task fed by a cheap, cloneable, sync-callable
//!   [`PublisherHandle`].
//! - [`subscribe`] runs background tasks that decode every message and report sequence gaps,
//!   publisher restarts and malformed frames as [`SubscriberItem`]s; it never panics on input.
//! - [`request_replay`] asks a replay endpoint for every buffered batch from a sequence number.

mod admission;
mod endpoint;
pub mod limits;
mod publisher;
mod replay;
mod stats;
mod subscriber;
mod transport;
pub mod zmtp;

pub use admission::AllowedPeers;
pub use endpoint::{EndpointMode, resolve_endpoint, subscriber_mode};
pub use publisher::{PublishError, Publisher, PublisherConfig, PublisherHandle};
pub use replay::{
    REPLAY_END_SEQ, ReplayBuffer, ReplayOutcome, replay_failures_total, replay_malformed_total,
    request_replay, request_replay_outcome,
};
pub use stats::PublisherStats;
pub use subscriber::{
    SeqTracker, SeqVerdict, SubscriberConfig, SubscriberItem, SubscriberStats, subscribe,
    subscribe_with_stats,
};
pub use zmtp::ZmtpError;

/// Errors of the ZMQ transport.
#[derive(Debug, thiserror::Error)]
pub enum EventsError {
    #[error("invalid endpoint `{endpoint}`: {reason}")]
    InvalidEndpoint { endpoint: String, reason: String },
    #[error("zmq error on `{endpoint}`: {source}")]
    Zmq {
        endpoint: String,
        #[source]
        source: ZmtpError,
    },
    #[error("replay from `{endpoint}` failed: {reason}")]
    Replay { endpoint: String, reason: String },
    #[error("timed out after {millis} ms waiting for `{endpoint}`")]
    Timeout { endpoint: String, millis: u64 },
    #[error(
        "allowed peer `{entry}` is not an IP address or network (e.g. 10.0.0.7, 10.0.0.0/8, fd00::/8)"
    )]
    InvalidAllowedPeer { entry: String },
}
