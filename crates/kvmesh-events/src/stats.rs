//! Counters of what peers did to a publisher's sockets — its PUB socket and its replay ROUTER
//! share one set, so an operator sees every refusal in one place.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Counters of what peers did to a publisher's sockets (shared, cheap to clone).
#[derive(Debug, Clone, Default)]
pub struct PublisherStats {
    pub(crate) inner: Arc<PublisherCounters>,
}

#[derive(Debug, Default)]
pub(crate) struct PublisherCounters {
    pub(crate) peers_refused: AtomicU64,
    pub(crate) protocol_errors: AtomicU64,
    pub(crate) peer_queue_drops: AtomicU64,
    pub(crate) buffered_drops: AtomicU64,
    pub(crate) oversized_batches: AtomicU64,
}

impl PublisherStats {
    /// Connections closed because every slot was taken ([`crate::limits::MAX_PEERS`]).
    pub fn peers_refused(&self) -> u64 {
        self.inner.peers_refused.load(Ordering::Relaxed)
    }
    /// Peers dropped for a bad handshake or for exceeding a bound (PUB and replay sockets).
    pub fn protocol_errors(&self) -> u64 {
        self.inner.protocol_errors.load(Ordering::Relaxed)
    }
    /// Messages a slow subscriber's full queue did not take.
    pub fn peer_queue_drops(&self) -> u64 {
        self.inner.peer_queue_drops.load(Ordering::Relaxed)
    }
    /// Messages the connect-mode buffer let go (oldest first) while no subscriber was there.
    pub fn buffered_drops(&self) -> u64 {
        self.inner.buffered_drops.load(Ordering::Relaxed)
    }
    /// Batches not sent because they exceeded [`crate::limits::MAX_EVENT_MESSAGE`] (subscribers would drop them).
    pub fn oversized_batches(&self) -> u64 {
        self.inner.oversized_batches.load(Ordering::Relaxed)
    }
    pub(crate) fn protocol_error(&self) {
        self.inner.protocol_errors.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn peer_refused(&self) {
        self.inner.peers_refused.fetch_add(1, Ordering::Relaxed);
    }
}
