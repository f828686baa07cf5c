//! KV-event transport over ZMQ: publisher with replay, subscriber with gap detection.
//!
//! Speaks vLLM's `ZmqEventPublisher` protocol (`docs/protocols.md#kv-events`) with the pure-Rust
//! `zeromq` crate: three-part messages `[topic, seq (u64 BE), msgpack payload]` on a PUB socket,
//! and an optional ROUTER socket that replays recent batches by sequence number. The codec lives
//! in `kvmesh_core::events`; this crate only moves frames.
//!
//! - [`Publisher`] binds when the endpoint contains `*` (`tcp://*:5557`) and connects otherwise,
//!   like vLLM. [`Publisher::spawn`] turns it into a task fed by a cheap, cloneable, sync-callable
//!   [`PublisherHandle`].
//! - [`subscribe`] runs a background task that decodes every message and reports sequence gaps,
//!   publisher restarts and malformed frames as [`SubscriberItem`]s; it never panics on input.
//! - [`request_replay`] asks a replay endpoint for every buffered batch from a sequence number.

mod endpoint;
mod publisher;
mod replay;
mod subscriber;

pub use endpoint::{EndpointMode, resolve_endpoint};
pub use publisher::{PublishError, Publisher, PublisherConfig, PublisherHandle};
pub use replay::{REPLAY_END_SEQ, ReplayBuffer, request_replay};
pub use subscriber::{SeqTracker, SeqVerdict, SubscriberConfig, SubscriberItem, subscribe};

/// Errors of the ZMQ transport.
#[derive(Debug, thiserror::Error)]
pub enum EventsError {
    #[error("invalid endpoint `{endpoint}`: {reason}")]
    InvalidEndpoint { endpoint: String, reason: String },
    #[error("zmq error on `{endpoint}`: {source}")]
    Zmq {
        endpoint: String,
        #[source]
        source: zeromq::ZmqError,
    },
    #[error("replay from `{endpoint}` failed: {reason}")]
    Replay { endpoint: String, reason: String },
    #[error("timed out after {millis} ms waiting for `{endpoint}`")]
    Timeout { endpoint: String, millis: u64 },
}
