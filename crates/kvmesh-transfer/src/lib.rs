//! kvmesh P2P KV transfer: an engine pulls prompt-prefix KV blocks from a peer's CPU tier instead
//! of recomputing them (`docs/architecture.md#p2p-pull`;
//! wire format: `docs/protocols.md#p2p-transfer-protocol`).
//!
//! Layers, innermost first (the mini-redis shape):
//! - [`frame`]: bytes ⇄ length-prefixed frames, two-phase parse, bounded size;
//! - [`message`]: frames ⇄ protocol messages (`Hello`, `Lookup`, `Fetch`, block frames, `Done`…);
//! - [`connection`]: messages over one TCP stream (payloads read straight into their
//!   destination, vectored block writes, protected records once authenticated: [`auth`] for the
//!   handshake, [`mac`] for the keys and tags, [`record`] for the record layout);
//! - [`server`] ([`ProducerServer`]) and [`client`] ([`PullClient`]): the service, talking to a
//!   block store only through the [`BlockSource`] / [`BlockSink`] seams in [`source`]; the
//!   consumer's per-connection conversation is in `session`, and a pull striped over several
//!   connections delivers in order through [`reorder`].
//!
//! A time-modelled engine paces both ends by a model of its link through the [`pacing`] seams.
//!
//! A pull never fails a request: [`PullClient::pull`] returns a [`PullReport`] whose outcome says
//! why it stopped and how many leading blocks arrived.

pub mod auth;
pub mod client;
pub mod connection;
pub mod frame;
pub mod handoffs;
pub mod layers;
pub mod limits;
pub mod mac;
pub mod message;
pub mod metrics;
pub mod pacing;
pub mod record;
pub mod reorder;
pub mod report;
pub mod server;
mod session;
pub mod source;

pub use auth::Secret;
pub use client::{
    AllowList, AllowListError, ClientConfig, DEFAULT_STRIPES, ModelledDuration, PeerAddr,
    PullClass, PullClient,
};
pub use handoffs::Handoffs;
pub use layers::{LayoutError, SegmentLayout, SegmentSink};
pub use limits::{IpNet, IpNetError};
pub use mac::Protection;
pub use metrics::{Direction, TransferMetrics};
pub use pacing::{LinkPacer, PacedTransfer, TrafficClass};
pub use report::{LayerPullReport, PullOutcome, PullReason, PullReport};
pub use server::{BindError, ProducerServer, ServerConfig};
pub use source::{BlockSink, BlockSource, BlockStatus, MemorySource, SinkError, VecSink};
