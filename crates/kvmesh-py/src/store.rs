//! A bounded CPU block tier: whole KV blocks as opaque bytes keyed by vLLM's block hash (the
//! event-hash `u64`), under a byte budget with LRU eviction. Pinned blocks (a peer's lookup lease)
//! are never evicted. Implements kvmesh-transfer's [`BlockSource`], so the P2P producer serves it
//! as it serves a kvmesh engine's CPU tier.
//!
//! Bookkeeping is O(log n) per operation: a map of entries and an ordered map from a monotonic
//! "last used" tick to the hash, whose first entry is the least recently used block.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use kvmesh_core::{BlockHash, Fingerprint};
use kvmesh_transfer::{BlockSource, BlockStatus};
use parking_lot::Mutex;
use tokio::time::Instant;

/// What an insert did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inserted {
    /// Stored; `evicted` older blocks made room.
    Stored { evicted: usize },
    /// Already held (refreshed as recently used).
    Present,
    /// Larger than the budget left after evicting every unpinned block.
    NoRoom,
}

#[derive(Debug)]
struct Entry {
    payload: Bytes,
    crc: u32,
    tick: u64,
    /// Lease expiries of live pins (one per pin).
    pins: Vec<Instant>,
}

impl Entry {
    fn pinned(&mut self, now: Instant) -> bool {
        self.pins.retain(|&t| t > now);
        !self.pins.is_empty()
    }
}

#[derive(Debug, Default)]
struct Inner {
    entries: HashMap<BlockHash, Entry>,
    lru: BTreeMap<u64, BlockHash>,
    next_tick: u64,
    bytes: u64,
    evictions: u64,
    /// Hashes evicted since the last [`CpuStore::take_removed`] (for `BlockRemoved` events).
    removed: Vec<BlockHash>,
}

impl Inner {
    fn touch(&mut self, hash: BlockHash) {
        let tick = self.next_tick;
        if let Some(e) = self.entries.get_mut(&hash) {
            self.lru.remove(&e.tick);
            e.tick = tick;
            self.lru.insert(tick, hash);
            self.next_tick += 1;
        }
    }

    /// Evict least recently used unpinned blocks until `need` more bytes fit in `budget`.
    fn make_room(&mut self, need: u64, budget: u64, now: Instant) -> Option<usize> {
        let mut evicted = 0;
        let mut skip = Vec::new();
        while self.bytes + need > budget {
            let (&tick, &hash) = self.lru.iter().find(|(t, _)| !skip.contains(*t))?;
            let pinned = self.entries.get_mut(&hash).is_some_and(|e| e.pinned(now));
            if pinned {
                skip.push(tick);
                continue;
            }
            self.lru.remove(&tick);
            if let Some(e) = self.entries.remove(&hash) {
                self.bytes -= e.payload.len() as u64;
            }
            self.evictions += 1;
            self.removed.push(hash);
            evicted += 1;
        }
        Some(evicted)
    }
}

/// Counters of a [`CpuStore`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreStats {
    pub blocks: usize,
    pub bytes: u64,
    pub budget: u64,
    pub evictions: u64,
    pub pinned_blocks: usize,
}

/// The bounded CPU tier. Cheap to clone (shared state).
#[derive(Debug, Clone)]
pub struct CpuStore {
    fingerprint: Fingerprint,
    budget: u64,
    inner: Arc<Mutex<Inner>>,
}

impl CpuStore {
    pub fn new(fingerprint: Fingerprint, budget: u64) -> Self {
        Self {
            fingerprint,
            budget,
            inner: Arc::default(),
        }
    }

    /// Store one block, evicting least recently used unpinned blocks to make room. Computes the
    /// CRC32 once, here, so the producer never checksums on the send path.
    pub fn insert(&self, hash: BlockHash, payload: Bytes) -> Inserted {
        let size = payload.len() as u64;
        // Outside the lock: the producer's serves wait on it.
        let crc = crc32fast::hash(&payload);
        let mut g = self.inner.lock();
        if g.entries.contains_key(&hash) {
            g.touch(hash);
            return Inserted::Present;
        }
        if size > self.budget {
            return Inserted::NoRoom;
        }
        let Some(evicted) = g.make_room(size, self.budget, Instant::now()) else {
            return Inserted::NoRoom;
        };
        let tick = g.next_tick;
        g.next_tick += 1;
        g.lru.insert(tick, hash);
        g.bytes += size;
        g.entries.insert(
            hash,
            Entry {
                payload,
                crc,
                tick,
                pins: Vec::new(),
            },
        );
        Inserted::Stored { evicted }
    }

    pub fn contains(&self, hash: BlockHash) -> bool {
        self.inner.lock().entries.contains_key(&hash)
    }

    /// The number of leading `hashes` held.
    pub fn leading_hits(&self, hashes: &[BlockHash]) -> usize {
        let g = self.inner.lock();
        hashes
            .iter()
            .take_while(|h| g.entries.contains_key(h))
            .count()
    }

    /// Payloads of the leading run of held `hashes` (refreshing them as recently used).
    pub fn read_leading(&self, hashes: &[BlockHash]) -> Vec<Bytes> {
        let mut g = self.inner.lock();
        let mut out = Vec::new();
        for h in hashes {
            let Some(e) = g.entries.get(h) else { break };
            out.push(e.payload.clone());
            g.touch(*h);
        }
        out
    }

    /// The mean size of a held block (0 when empty). One node's tier holds blocks of one
    /// layout, so this is the size of every block.
    pub fn block_bytes(&self) -> u64 {
        let g = self.inner.lock();
        g.bytes.checked_div(g.entries.len() as u64).unwrap_or(0)
    }

    /// Hashes evicted since the last call.
    pub fn take_removed(&self) -> Vec<BlockHash> {
        std::mem::take(&mut self.inner.lock().removed)
    }

    pub fn stats(&self) -> StoreStats {
        let now = Instant::now();
        let mut g = self.inner.lock();
        let pinned_blocks = g
            .entries
            .values_mut()
            .map(|e| e.pinned(now))
            .filter(|p| *p)
            .count();
        StoreStats {
            blocks: g.entries.len(),
            bytes: g.bytes,
            budget: self.budget,
            evictions: g.evictions,
            pinned_blocks,
        }
    }
}

impl BlockSource for CpuStore {
    fn fingerprint(&self) -> Fingerprint {
        self.fingerprint.clone()
    }

    fn lookup_and_pin(&self, hashes: &[BlockHash], lease: Duration) -> Vec<BlockStatus> {
        let now = Instant::now();
        let mut g = self.inner.lock();
        let mut leading = true;
        let mut statuses = Vec::with_capacity(hashes.len());
        for h in hashes {
            let hit = match g.entries.get_mut(h) {
                Some(e) => {
                    if leading {
                        e.pins.push(now + lease);
                    }
                    true
                }
                None => false,
            };
            if hit && leading {
                g.touch(*h);
            } else {
                leading = false;
            }
            statuses.push(if hit {
                BlockStatus::Hit
            } else {
                BlockStatus::Miss
            });
        }
        statuses
    }

    fn read(&self, hash: BlockHash) -> Option<Bytes> {
        self.inner
            .lock()
            .entries
            .get(&hash)
            .map(|e| e.payload.clone())
    }

    fn read_with_checksum(&self, hash: BlockHash) -> Option<(Bytes, u32)> {
        self.inner
            .lock()
            .entries
            .get(&hash)
            .map(|e| (e.payload.clone(), e.crc))
    }

    fn unpin(&self, hashes: &[BlockHash]) {
        let now = Instant::now();
        let mut g = self.inner.lock();
        for h in hashes {
            if let Some(e) = g.entries.get_mut(h)
                && e.pinned(now)
            {
                e.pins.pop();
            }
        }
    }

    fn wait_ready(&self, _hash: BlockHash, _deadline: Instant) -> BoxFuture<'static, bool> {
        // This tier never reports `Pending`: a block is stored whole after its step, or absent.
        Box::pin(async { false })
    }
}

#[cfg(test)]
mod tests {
    use kvmesh_core::HashAlgo;

    use super::*;

    fn store(budget: u64) -> CpuStore {
        CpuStore::new(
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
            budget,
        )
    }

    fn block(n: u8) -> Bytes {
        Bytes::from(vec![n; 10])
    }

    #[test]
    fn evicts_least_recently_used_within_the_budget() {
        let s = store(30);
        for h in 1..=3 {
            assert_eq!(
                s.insert(BlockHash(h), block(h as u8)),
                Inserted::Stored { evicted: 0 }
            );
        }
        // Touch 1 so 2 is now the oldest.
        assert_eq!(s.read_leading(&[BlockHash(1)]).len(), 1);
        assert_eq!(
            s.insert(BlockHash(4), block(4)),
            Inserted::Stored { evicted: 1 }
        );
        assert!(!s.contains(BlockHash(2)));
        assert!(s.contains(BlockHash(1)) && s.contains(BlockHash(3)));
        assert_eq!(s.take_removed(), vec![BlockHash(2)]);
        assert_eq!(s.insert(BlockHash(4), block(4)), Inserted::Present);
        let st = s.stats();
        assert_eq!((st.blocks, st.bytes, st.evictions), (3, 30, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn pinned_blocks_survive_eviction_until_the_lease_ends() {
        let s = store(20);
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
        assert_eq!(
            s.insert(BlockHash(3), block(3)),
            Inserted::Stored { evicted: 1 }
        );
        assert!(s.contains(BlockHash(1)) && !s.contains(BlockHash(2)));
        // Everything left is pinned or new: 3 goes, then nothing more can.
        s.lookup_and_pin(&[BlockHash(3)], Duration::from_secs(5));
        assert_eq!(s.insert(BlockHash(4), block(4)), Inserted::NoRoom);
        tokio::time::advance(Duration::from_secs(6)).await;
        assert_eq!(
            s.insert(BlockHash(4), block(4)),
            Inserted::Stored { evicted: 1 }
        );
    }

    #[test]
    fn unpin_releases_and_oversized_blocks_are_refused() {
        let s = store(10);
        s.insert(BlockHash(1), block(1));
        s.lookup_and_pin(&[BlockHash(1)], Duration::from_secs(60));
        assert_eq!(s.stats().pinned_blocks, 1);
        s.unpin(&[BlockHash(1)]);
        assert_eq!(s.stats().pinned_blocks, 0);
        assert_eq!(
            s.insert(BlockHash(2), Bytes::from(vec![0; 11])),
            Inserted::NoRoom
        );
        let (payload, crc) = s.read_with_checksum(BlockHash(1)).expect("held");
        assert_eq!(crc, crc32fast::hash(&payload));
        assert_eq!(s.leading_hits(&[BlockHash(1), BlockHash(2)]), 1);
    }
}
