//! A cap on the bytes per second the producer serves (`serve_bytes_per_sec`): the operator's way
//! to keep P2P serving from taking a shared NIC (or the cores that copy for it) away from the
//! engine's own traffic.
//!
//! Implemented on kvmesh-transfer's egress [`LinkPacer`] hook, block by block: every block a fetch
//! sends reserves the next `block_bytes / rate` seconds of one node-wide clock and leaves when its
//! slot ends, so all consumers together never get more than the cap, concurrent fetches
//! interleave, and no block waits for more than its own slot behind the ones already queued.
//! Blocks of one node's tier all have one size (one layout); the pacer reads it from the tier.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use kvmesh_transfer::{LinkPacer, PacedTransfer, TrafficClass};
use parking_lot::Mutex;
use tokio::time::Instant;

use crate::tier::NodeTier;

/// The node-wide serve-bandwidth cap.
#[derive(Debug)]
pub struct ServeCap {
    bytes_per_sec: u64,
    tier: NodeTier,
    /// When the last reserved slot ends.
    next_free: Arc<Mutex<Instant>>,
}

impl ServeCap {
    /// `None` for a rate of 0 (no cap).
    pub fn new(bytes_per_sec: u64, tier: NodeTier) -> Option<Self> {
        (bytes_per_sec > 0).then(|| Self {
            bytes_per_sec,
            tier,
            next_free: Arc::new(Mutex::new(Instant::now())),
        })
    }

    /// How long one block of `bytes` occupies the capped link.
    fn slot(&self, bytes: u64) -> Duration {
        Duration::from_secs_f64(bytes as f64 / self.bytes_per_sec as f64)
    }
}

impl LinkPacer for ServeCap {
    /// A cap, not a priority scheduler: a prefetch's fetch is capped like any other.
    fn begin(&self, _blocks: usize, _class: TrafficClass) -> Box<dyn PacedTransfer> {
        Box::new(CappedFetch {
            slot: self.slot(self.tier.block_bytes()),
            next_free: Arc::clone(&self.next_free),
            granted: 0,
        })
    }

    /// Real bytes, not a model: nothing for `kvmesh_p2p_modelled_bytes_total`.
    fn modelled_bytes_per_block(&self) -> u64 {
        0
    }

    fn chunk_blocks(&self) -> usize {
        1
    }
}

/// One fetch on the capped link.
struct CappedFetch {
    slot: Duration,
    next_free: Arc<Mutex<Instant>>,
    /// Blocks already given a slot.
    granted: usize,
}

impl PacedTransfer for CappedFetch {
    fn reached(&mut self, blocks: usize) -> BoxFuture<'_, ()> {
        let want = blocks.saturating_sub(self.granted);
        self.granted = self.granted.max(blocks);
        let until = if want == 0 {
            None
        } else {
            let mut next = self.next_free.lock();
            let start = (*next).max(Instant::now());
            let n = u32::try_from(want).unwrap_or(u32::MAX);
            *next = start + self.slot.saturating_mul(n);
            Some(*next)
        };
        Box::pin(async move {
            if let Some(until) = until {
                tokio::time::sleep_until(until).await;
            }
        })
    }

    fn truncate(&mut self, _blocks: usize) {}
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use kvmesh_core::{BlockHash, BlockHasher, Fingerprint, HashAlgo};

    use super::*;

    fn tier_with_blocks(block_bytes: usize) -> NodeTier {
        let hasher = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0"), 32);
        let fp = Fingerprint::new("tiny", "bf16:vllm-cpu", 2, 2, 64, &hasher);
        let tier = NodeTier::new(fp, 1 << 20);
        for h in 1..=4u64 {
            tier.insert(BlockHash(h), Bytes::from(vec![0u8; block_bytes]));
        }
        tier
    }

    #[test]
    fn zero_is_no_cap() {
        assert!(ServeCap::new(0, tier_with_blocks(8)).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn blocks_leave_at_the_capped_rate_across_fetches() {
        // 1000-byte blocks at 10 kB/s: 100 ms per block, shared by every fetch.
        let cap = ServeCap::new(10_000, tier_with_blocks(1000)).expect("capped");
        assert_eq!(cap.chunk_blocks(), 1);
        let t0 = Instant::now();
        let mut a = cap.begin(3, TrafficClass::Demand);
        let mut b = cap.begin(2, TrafficClass::Demand);
        a.reached(1).await;
        assert_eq!(t0.elapsed(), Duration::from_millis(100));
        b.reached(1).await;
        assert_eq!(t0.elapsed(), Duration::from_millis(200));
        // Asking again for blocks already granted does not wait.
        a.reached(1).await;
        assert_eq!(t0.elapsed(), Duration::from_millis(200));
        a.reached(3).await;
        assert_eq!(t0.elapsed(), Duration::from_millis(400));
        // An idle link does not bank credit: a later fetch starts from now.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let t1 = Instant::now();
        b.reached(2).await;
        assert_eq!(t1.elapsed(), Duration::from_millis(100));
    }
}
