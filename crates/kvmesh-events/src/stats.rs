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
    pub(crate) peers_not_allowed: AtomicU64,
    pub(crate) idle_peers_dropped: AtomicU64,
    pub(crate) protocol_errors: AtomicU64,
    pub(crate) peer_queue_drops: AtomicU64,
    pub(crate) buffered_drops: AtomicU64,
    pub(crate) oversized_batches: AtomicU64,
}

impl PublisherStats {
    /// Connections closed at accept because every slot, or the source's share of them, was
    /// taken ([`crate::limits::MAX_PEERS`], [`crate::limits::MAX_PEERS_PER_SOURCE`]).
    pub fn peers_refused(&self) -> u64 {
        self.inner.peers_refused.load(Ordering::Relaxed)
    }
    /// Connections closed at accept because their address is not on the allow-list.
    pub fn peers_not_allowed(&self) -> u64 {
        self.inner.peers_not_allowed.load(Ordering::Relaxed)
    }
    /// Peers dropped for holding a slot without using it: a PUB peer with no subscription to the
    /// topic after [`crate::limits::SUBSCRIBE_TIMEOUT`], a replay peer that asked nothing for
    /// [`crate::limits::REPLAY_IDLE_TIMEOUT`].
    pub fn idle_peers_dropped(&self) -> u64 {
        self.inner.idle_peers_dropped.load(Ordering::Relaxed)
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
    /// Counts a connection closed at accept.
    pub(crate) fn refused(&self, why: crate::admission::Refused) {
        let counter = match why {
            crate::admission::Refused::NotAllowed => &self.inner.peers_not_allowed,
            crate::admission::Refused::Full(_) => &self.inner.peers_refused,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn idle_peer_dropped(&self) {
        self.inner
            .idle_peers_dropped
            .fetch_add(1, Ordering::Relaxed);
    }
}
