//! Where the engine's KV events go: a [`KvEventSink`] receives one `Vec<KvEvent>` per engine step
//! (GPU tier) or per CPU-tier change, in the order they happened.
//!
//! The server wires a [`ChannelSink`] whose receiver is drained by the publisher task, which
//! batches whatever is queued into one ZMQ message. Tests use [`CollectingSink`].

use std::sync::Arc;

use kvmesh_core::KvEvent;
use parking_lot::Mutex;
use tokio::sync::mpsc;

/// Receives KV events in publication order. Must not block (called from the compute thread and
/// under the CPU tier's lock so that order is preserved).
pub trait KvEventSink: Send + Sync {
    fn publish(&self, events: Vec<KvEvent>);
}

/// Drops everything (events disabled).
#[derive(Debug, Default)]
pub struct NullSink;

impl KvEventSink for NullSink {
    fn publish(&self, _events: Vec<KvEvent>) {}
}

/// Forwards to an unbounded channel (non-blocking send from any thread).
#[derive(Debug, Clone)]
pub struct ChannelSink(pub mpsc::UnboundedSender<Vec<KvEvent>>);

impl KvEventSink for ChannelSink {
    fn publish(&self, events: Vec<KvEvent>) {
        if !events.is_empty() {
            // A closed receiver means the publisher stopped (shutdown); events are then moot.
            let _ = self.0.send(events);
        }
    }
}

/// Keeps every event (tests).
#[derive(Debug, Default, Clone)]
pub struct CollectingSink(pub Arc<Mutex<Vec<KvEvent>>>);

impl CollectingSink {
    pub fn take(&self) -> Vec<KvEvent> {
        std::mem::take(&mut *self.0.lock())
    }
}

impl KvEventSink for CollectingSink {
    fn publish(&self, events: Vec<KvEvent>) {
        self.0.lock().extend(events);
    }
}
