//! The node's CPU tier: `kvmesh-tier`'s [`CpuStore`] (byte budget, LRU, counted leased pins,
//! checksums; its README states the rules) behind one mutex, shared by the connector's calls
//! and the P2P producer, which serves it through [`BlockSource`] as it serves a kvmesh engine's
//! CPU tier. Blocks are whole KV blocks as opaque bytes keyed by vLLM's block hash (the
//! event-hash `u64`).
//!
//! What this adds around the store: the hashes evicted since vLLM last asked (they become its
//! `BlockRemoved` events), the clock (tokio's, so paused-time tests control it), and P/D
//! hand-offs: [`NodeTier::retain`] keeps a request's blocks (`Retain` pins, evicted after
//! unprotected blocks, with a TTL) for the reader named by its `remote_request_id`, and only that
//! reader's fetch releases them (kvmesh-transfer's [`Handoffs`], as in the kvmesh engine). Other
//! pins are peers' lookup leases (`Use`); nothing is ever `Pending`.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use kvmesh_core::{BlockHash, Fingerprint};
use kvmesh_tier::{Block, CpuStore, PinKind};
pub use kvmesh_tier::{CpuTierStats, Inserted};
use kvmesh_transfer::{BlockSource, BlockStatus, Handoffs};
use parking_lot::Mutex;

#[derive(Debug)]
struct Shared {
    store: CpuStore,
    /// Hashes evicted since the last [`NodeTier::take_removed`].
    removed: Vec<BlockHash>,
    /// Blocks retained for a P/D reader, and of those released by that reader's fetch.
    retained_blocks: u64,
    handed_off_blocks: u64,
}

/// The node's CPU tier. Cheap to clone (shared state).
#[derive(Debug, Clone)]
pub struct NodeTier {
    fingerprint: Fingerprint,
    inner: Arc<Mutex<Shared>>,
    handoffs: Arc<Handoffs>,
}

/// Now, on tokio's clock (paused in tests) as the store's `std` instant.
fn now() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}

impl NodeTier {
    pub fn new(fingerprint: Fingerprint, capacity_bytes: u64) -> Self {
        Self {
            fingerprint,
            inner: Arc::new(Mutex::new(Shared {
                store: CpuStore::new(capacity_bytes),
                removed: Vec::new(),
                retained_blocks: 0,
                handed_off_blocks: 0,
            })),
            handoffs: Arc::default(),
        }
    }

    /// Store one block, evicting least recently used unpinned blocks to make room. The CRC32 is
    /// taken once, here, outside the lock (the producer's serves wait on it), so the producer
    /// never checksums on the send path.
    pub fn insert(&self, hash: BlockHash, payload: Bytes) -> Inserted {
        let block = Block::new(hash, payload);
        let mut g = self.inner.lock();
        let Shared { store, removed, .. } = &mut *g;
        store.insert(block, now(), removed)
    }

    /// Keeps the leading run of held `hashes` for `ttl` for the P/D reader `request_id` (a
    /// `Retain` pin each: evicted only after unprotected blocks, released by that reader's
    /// fetch or at the TTL). Returns how many were retained.
    pub fn retain(&self, request_id: &str, hashes: &[BlockHash], ttl: Duration) -> usize {
        let now = now();
        let until = now + ttl;
        let n = {
            let mut g = self.inner.lock();
            let n = g.store.pin(PinKind::Retain, hashes, until, now);
            g.retained_blocks += n as u64;
            n
        };
        self.handoffs.record(request_id, &hashes[..n], until);
        n
    }

    /// Blocks retained for P/D readers so far, and of those released by their reader's fetch.
    pub fn handoff_counts(&self) -> (u64, u64) {
        let g = self.inner.lock();
        (g.retained_blocks, g.handed_off_blocks)
    }

    pub fn contains(&self, hash: BlockHash) -> bool {
        self.inner.lock().store.contains(hash)
    }

    /// Payloads of the leading run of held `hashes` (marking them recently used).
    pub fn get_prefix(&self, hashes: &[BlockHash]) -> Vec<Bytes> {
        self.inner.lock().store.get_prefix(hashes)
    }

    /// The size of a held block (0 when empty): one node's tier holds blocks of one layout.
    pub fn block_bytes(&self) -> u64 {
        self.inner.lock().store.block_bytes()
    }

    /// Hashes evicted since the last call.
    pub fn take_removed(&self) -> Vec<BlockHash> {
        std::mem::take(&mut self.inner.lock().removed)
    }

    pub fn stats(&self) -> CpuTierStats {
        self.inner.lock().store.stats()
    }
}

impl BlockSource for NodeTier {
    fn fingerprint(&self) -> Fingerprint {
        self.fingerprint.clone()
    }

    fn lookup_and_pin(&self, hashes: &[BlockHash], lease: Duration) -> Vec<BlockStatus> {
        let now = now();
        let mut g = self.inner.lock();
        let leading = g.store.lookup_prefix(hashes);
        g.store
            .pin(PinKind::Use, &hashes[..leading], now + lease, now);
        // A peer is about to read these: they are in use.
        g.store.touch_prefix(&hashes[..leading]);
        hashes
            .iter()
            .map(|h| {
                if g.store.contains(*h) {
                    BlockStatus::Hit
                } else {
                    BlockStatus::Miss
                }
            })
            .collect()
    }

    fn read(&self, hash: BlockHash) -> Option<Bytes> {
        self.inner.lock().store.get(hash)
    }

    fn read_with_checksum(&self, hash: BlockHash) -> Option<(Bytes, u32)> {
        self.inner.lock().store.get_with_checksum(hash)
    }

    fn unpin(&self, hashes: &[BlockHash]) {
        self.inner.lock().store.unpin(PinKind::Use, hashes, now());
    }

    fn served(&self, kv_request_id: &str, hash: BlockHash) {
        // The reader a retention was kept for has its block: release that one retention.
        if self.handoffs.take(kv_request_id, hash) {
            let mut g = self.inner.lock();
            g.store.unpin(PinKind::Retain, &[hash], now());
            g.handed_off_blocks += 1;
        }
    }

    fn wait_ready(
        &self,
        _hash: BlockHash,
        _deadline: tokio::time::Instant,
    ) -> BoxFuture<'static, bool> {
        // This tier never reports `Pending`: a block is stored whole after its step, or absent.
        Box::pin(async { false })
    }
}

#[cfg(test)]
mod tests {
    use kvmesh_core::HashAlgo;

    use super::*;

    fn tier(capacity: u64) -> NodeTier {
        NodeTier::new(
            Fingerprint {
                model_id: "m".into(),
                kv_dtype: "bf16".into(),
                block_size: 32,
                num_layers: 2,
                num_kv_heads: 2,
                head_dim: 64,
                hash_algo: HashAlgo::Sha256Cbor,
                none_hash: "00".into(),
            },
            capacity,
        )
    }

    fn block(n: u8) -> Bytes {
        Bytes::from(vec![n; 10])
    }

    #[test]
    fn evicts_least_recently_used_within_the_budget_and_reports_it() {
        let s = tier(30);
        for h in 1..=3 {
            assert_eq!(s.insert(BlockHash(h), block(h as u8)), Inserted::Stored);
        }
        // Read 1 so 2 is now the oldest.
        assert_eq!(s.get_prefix(&[BlockHash(1)]).len(), 1);
        assert_eq!(s.insert(BlockHash(4), block(4)), Inserted::Stored);
        assert!(!s.contains(BlockHash(2)));
        assert!(s.contains(BlockHash(1)) && s.contains(BlockHash(3)));
        assert_eq!(s.take_removed(), vec![BlockHash(2)]);
        assert!(s.take_removed().is_empty());
        assert_eq!(s.insert(BlockHash(4), block(4)), Inserted::Present);
        let st = s.stats();
        assert_eq!((st.blocks, st.used_bytes, st.evicted_blocks), (3, 30, 1));
        assert_eq!(s.block_bytes(), 10);
    }

    #[tokio::test(start_paused = true)]
    async fn blocks_a_peer_looked_up_survive_eviction_until_the_lease_ends() {
        let s = tier(20);
        s.insert(BlockHash(1), block(1));
        s.insert(BlockHash(2), block(2));
        let st = s.lookup_and_pin(
            &[BlockHash(1), BlockHash(9), BlockHash(2)],
            Duration::from_secs(5),
        );
        assert_eq!(
            st,
            vec![BlockStatus::Hit, BlockStatus::Miss, BlockStatus::Hit]
        );
        // 1 is pinned (leading hit), 2 is not (after a miss): 2 goes.
        assert_eq!(s.insert(BlockHash(3), block(3)), Inserted::Stored);
        assert!(s.contains(BlockHash(1)) && !s.contains(BlockHash(2)));
        // Everything left is pinned or new: 3 goes, then nothing more can.
        s.lookup_and_pin(&[BlockHash(3)], Duration::from_secs(5));
        assert_eq!(s.insert(BlockHash(4), block(4)), Inserted::Rejected);
        tokio::time::advance(Duration::from_secs(6)).await;
        assert_eq!(s.insert(BlockHash(4), block(4)), Inserted::Stored);
        assert_eq!(s.take_removed().len(), 2);
    }

    #[test]
    fn unpin_releases_and_oversized_blocks_are_refused() {
        let s = tier(10);
        s.insert(BlockHash(1), block(1));
        s.lookup_and_pin(&[BlockHash(1)], Duration::from_secs(60));
        assert_eq!(
            s.insert(BlockHash(2), block(2)),
            Inserted::Rejected,
            "pinned"
        );
        s.unpin(&[BlockHash(1)]);
        assert_eq!(
            s.insert(BlockHash(3), Bytes::from(vec![0; 11])),
            Inserted::Rejected
        );
        let (payload, crc) = s.read_with_checksum(BlockHash(1)).expect("held");
        assert_eq!(crc, crc32fast::hash(&payload));
        assert_eq!(
            s.insert(BlockHash(2), block(2)),
            Inserted::Stored,
            "unpinned"
        );
    }
}
