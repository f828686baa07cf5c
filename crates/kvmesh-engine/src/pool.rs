//! The GPU-tier block pool: a fixed number of KV blocks, reference-counted, prefix-cached by
//! chained block hash, with LRU eviction of free cached blocks.
//!
//! Invariants (checked by [`BlockPool::check_invariants`] in tests):
//! - every block is in exactly one [`BlockState`]: `Free` (no hash, in the free list), `Active`
//!   (ref > 0), `Pinned` (ref 0, pin > 0, never evicted), `Cached` (ref 0, hashed, in the LRU);
//! - a hash maps to at most one block and that block carries the hash;
//! - `BlockRemoved` (medium GPU) is pushed *before* a cached block is handed out again; the
//!   matching `BlockStored` is the caller's job, after the block's KV is valid ([`BlockPool::register`]).
//!
//! Pure data structure: no clock, no I/O; events go to the caller's outbox.

use std::collections::{BTreeMap, VecDeque};

use hashbrown::HashMap;
use kvmesh_core::events::BlockRemoved;
use kvmesh_core::{BlockHash, KvEvent, Medium};

use crate::compute::BlockId;

/// The state a block is in; derived from its counters so it can never be two things at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockState {
    Free,
    Active,
    Cached,
    Pinned,
}

#[derive(Debug, Clone, Default)]
struct BlockMeta {
    ref_cnt: u32,
    pins: u32,
    hash: Option<BlockHash>,
    /// Key in `lru` while the block is `Cached`.
    lru_tick: Option<u64>,
}

/// Bytes the pool keeps per block besides its KV (its state and its place in the free list).
pub const BOOKKEEPING_BYTES_PER_BLOCK: usize =
    std::mem::size_of::<BlockMeta>() + std::mem::size_of::<BlockId>();

/// Fixed-size, prefix-cached pool of GPU-tier KV blocks.
#[derive(Debug)]
pub struct BlockPool {
    blocks: Vec<BlockMeta>,
    free: VecDeque<BlockId>,
    /// Free cached blocks by last release; the smallest tick is evicted first.
    lru: BTreeMap<u64, BlockId>,
    by_hash: HashMap<BlockHash, BlockId>,
    tick: u64,
    evictions: u64,
}

impl BlockPool {
    #[cfg(test)]
    pub fn new(num_blocks: usize) -> Self {
        Self::try_new(num_blocks).expect("a test pool fits in memory")
    }

    /// A pool of `num_blocks` free blocks, or an error when its bookkeeping cannot be allocated
    /// (instead of an abort). `num_blocks` must fit a [`BlockId`] (`EngineConfig::validate`).
    pub fn try_new(num_blocks: usize) -> Result<Self, std::collections::TryReserveError> {
        let ids = BlockId::try_from(num_blocks).unwrap_or(BlockId::MAX);
        let mut blocks = Vec::new();
        blocks.try_reserve_exact(num_blocks)?;
        let mut free = VecDeque::new();
        free.try_reserve_exact(num_blocks)?;
        blocks.resize(num_blocks, BlockMeta::default());
        free.extend(0..ids);
        Ok(Self {
            blocks,
            free,
            lru: BTreeMap::new(),
            by_hash: HashMap::new(),
            tick: 0,
            evictions: 0,
        })
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks that can be handed out now (free + evictable cached).
    pub fn num_allocatable(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    /// Fraction of blocks held by requests or pins (vLLM's `kv_cache_usage_perc`, 0..1).
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            return 0.0;
        }
        1.0 - self.num_allocatable() as f64 / self.blocks.len() as f64
    }

    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    pub fn state(&self, id: BlockId) -> BlockState {
        let m = &self.blocks[id as usize];
        if m.ref_cnt > 0 {
            BlockState::Active
        } else if m.pins > 0 {
            BlockState::Pinned
        } else if m.hash.is_some() {
            BlockState::Cached
        } else {
            BlockState::Free
        }
    }

    /// The block holding `hash`, if cached (any state).
    pub fn get(&self, hash: BlockHash) -> Option<BlockId> {
        self.by_hash.get(&hash).copied()
    }

    /// How many of `hashes` are held by evictable blocks (cached, unreferenced): the blocks a
    /// caller stops being able to allocate once it takes those hashes as a hit.
    pub fn count_evictable(&self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .filter(|h| {
                self.get(**h)
                    .is_some_and(|b| self.state(b) == BlockState::Cached)
            })
            .count()
    }

    pub fn contains(&self, hash: BlockHash) -> bool {
        self.by_hash.contains_key(&hash)
    }

    /// Length of the leading run of `hashes` cached here (no side effects).
    pub fn lookup_prefix(&self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.by_hash.contains_key(*h))
            .count()
    }

    /// Takes a reference on the cached block holding `hash` (a prefix hit).
    pub fn acquire_cached(&mut self, hash: BlockHash) -> Option<BlockId> {
        let id = *self.by_hash.get(&hash)?;
        self.take_ref(id);
        Some(id)
    }

    fn take_ref(&mut self, id: BlockId) {
        let m = &mut self.blocks[id as usize];
        if let Some(t) = m.lru_tick.take() {
            self.lru.remove(&t);
        }
        m.ref_cnt += 1;
    }

    /// Hands out a block with ref 1: a never-hashed free block first, else the least recently
    /// released cached block, whose `BlockRemoved` is pushed to `events` before it is reused.
    pub fn allocate(&mut self, events: &mut Vec<KvEvent>) -> Option<BlockId> {
        let id = if let Some(id) = self.free.pop_front() {
            id
        } else {
            let (_, id) = self.lru.pop_first()?;
            let m = &mut self.blocks[id as usize];
            m.lru_tick = None;
            if let Some(h) = m.hash.take() {
                self.by_hash.remove(&h);
                self.evictions += 1;
                events.push(KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: vec![h],
                    medium: Medium::Gpu,
                    group_idx: Some(0),
                }));
            }
            id
        };
        self.blocks[id as usize].ref_cnt = 1;
        Some(id)
    }

    /// Makes `id`'s now-valid KV findable under `hash`. Returns false when another block already
    /// holds that hash (two requests computed the same block); `id` then stays unhashed and goes
    /// back to the free list when released. The caller publishes `BlockStored` only on `true`.
    pub fn register(&mut self, id: BlockId, hash: BlockHash) -> bool {
        if self.by_hash.contains_key(&hash) || self.blocks[id as usize].hash.is_some() {
            return false;
        }
        self.blocks[id as usize].hash = Some(hash);
        self.by_hash.insert(hash, id);
        true
    }

    /// Drops one reference. A block reaching ref 0 becomes `Cached` (hashed) or `Free`. Release a
    /// request's blocks tail first so its prefix outlives its suffix in the LRU (vLLM's order).
    pub fn release(&mut self, id: BlockId) {
        let m = &mut self.blocks[id as usize];
        debug_assert!(m.ref_cnt > 0, "release of unreferenced block {id}");
        m.ref_cnt = m.ref_cnt.saturating_sub(1);
        if m.ref_cnt == 0 {
            self.park(id);
        }
    }

    /// Puts a block with ref 0 where its state says it belongs.
    fn park(&mut self, id: BlockId) {
        let m = &mut self.blocks[id as usize];
        if m.ref_cnt > 0 || m.pins > 0 {
            return;
        }
        if m.hash.is_some() {
            self.tick += 1;
            m.lru_tick = Some(self.tick);
            self.lru.insert(self.tick, id);
        } else {
            self.free.push_back(id);
        }
    }

    /// Pins the cached block holding `hash` so eviction cannot take it (e.g. while a peer reads it).
    pub fn pin(&mut self, hash: BlockHash) -> bool {
        let Some(&id) = self.by_hash.get(&hash) else {
            return false;
        };
        let m = &mut self.blocks[id as usize];
        if let Some(t) = m.lru_tick.take() {
            self.lru.remove(&t);
        }
        m.pins += 1;
        true
    }

    pub fn unpin(&mut self, hash: BlockHash) {
        let Some(&id) = self.by_hash.get(&hash) else {
            return;
        };
        let m = &mut self.blocks[id as usize];
        if m.pins > 0 {
            m.pins -= 1;
            if m.pins == 0 {
                self.park(id);
            }
        }
    }

    /// Forgets every hash (vLLM `reset_prefix_cache`): cached blocks become free; blocks in use
    /// keep their data but will not be found again. Pushes one `AllBlocksCleared`.
    pub fn reset(&mut self, events: &mut Vec<KvEvent>) {
        for (_, id) in std::mem::take(&mut self.lru) {
            let m = &mut self.blocks[id as usize];
            m.lru_tick = None;
            m.hash = None;
            self.free.push_back(id);
        }
        for m in &mut self.blocks {
            m.hash = None;
        }
        self.by_hash.clear();
        events.push(KvEvent::AllBlocksCleared);
    }

    /// Verifies the invariants listed in the module docs; returns a description of the first
    /// violation. Used by tests.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut in_free = vec![false; self.blocks.len()];
        for &id in &self.free {
            if in_free[id as usize] {
                return Err(format!("block {id} twice in free list"));
            }
            in_free[id as usize] = true;
        }
        for (&tick, &id) in &self.lru {
            if self.blocks[id as usize].lru_tick != Some(tick) {
                return Err(format!("block {id} lru tick mismatch"));
            }
        }
        for (&h, &id) in &self.by_hash {
            if self.blocks[id as usize].hash != Some(h) {
                return Err(format!(
                    "hash {h} maps to block {id} which does not carry it"
                ));
            }
        }
        for (i, m) in self.blocks.iter().enumerate() {
            let id = i as BlockId;
            let in_lru = m.lru_tick.is_some();
            match self.state(id) {
                BlockState::Free if !in_free[i] || in_lru => {
                    return Err(format!("free block {id} misplaced"));
                }
                BlockState::Cached if in_free[i] || !in_lru => {
                    return Err(format!("cached block {id} misplaced"));
                }
                BlockState::Active | BlockState::Pinned if in_free[i] || in_lru => {
                    return Err(format!("in-use block {id} is also allocatable"));
                }
                _ => {}
            }
            if let Some(h) = m.hash
                && self.by_hash.get(&h) != Some(&id)
            {
                return Err(format!("block {id} hash {h} not indexed"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: u64) -> BlockHash {
        BlockHash(x)
    }

    #[test]
    fn allocated_blocks_are_active_and_released_hashed_blocks_are_cached() {
        let mut p = BlockPool::new(4);
        let mut ev = Vec::new();
        let a = p.allocate(&mut ev).unwrap();
        assert_eq!(p.state(a), BlockState::Active);
        assert!(p.register(a, h(1)));
        p.release(a);
        assert_eq!(p.state(a), BlockState::Cached);
        assert_eq!(p.lookup_prefix(&[h(1), h(2)]), 1);
        assert_eq!(p.acquire_cached(h(1)), Some(a));
        assert_eq!(p.state(a), BlockState::Active);
        assert!(ev.is_empty());
        p.check_invariants().unwrap();
    }

    #[test]
    fn eviction_is_lru_and_emits_removed_before_reuse() {
        let mut p = BlockPool::new(2);
        let mut ev = Vec::new();
        let a = p.allocate(&mut ev).unwrap();
        let b = p.allocate(&mut ev).unwrap();
        p.register(a, h(10));
        p.register(b, h(20));
        p.release(b); // b released first -> older
        p.release(a);
        assert!(p.allocate(&mut ev).is_some());
        assert_eq!(
            ev,
            vec![KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![h(20)],
                medium: Medium::Gpu,
                group_idx: Some(0)
            })]
        );
        assert!(!p.contains(h(20)));
        assert!(p.contains(h(10)));
        assert_eq!(p.evictions(), 1);
        p.check_invariants().unwrap();
    }

    #[test]
    fn pinned_and_active_blocks_are_never_evicted() {
        let mut p = BlockPool::new(2);
        let mut ev = Vec::new();
        let a = p.allocate(&mut ev).unwrap();
        let b = p.allocate(&mut ev).unwrap();
        p.register(a, h(1));
        p.release(a);
        assert!(p.pin(h(1)));
        assert_eq!(p.state(a), BlockState::Pinned);
        assert!(
            p.allocate(&mut ev).is_none(),
            "b active, a pinned: nothing allocatable"
        );
        p.unpin(h(1));
        assert_eq!(p.state(a), BlockState::Cached);
        assert_eq!(p.allocate(&mut ev), Some(a));
        assert_eq!(p.state(b), BlockState::Active);
        p.check_invariants().unwrap();
    }

    #[test]
    fn duplicate_hash_is_not_registered_twice() {
        let mut p = BlockPool::new(3);
        let mut ev = Vec::new();
        let a = p.allocate(&mut ev).unwrap();
        let b = p.allocate(&mut ev).unwrap();
        assert!(p.register(a, h(5)));
        assert!(!p.register(b, h(5)));
        p.release(b);
        assert_eq!(p.state(b), BlockState::Free);
        p.check_invariants().unwrap();
    }

    #[test]
    fn reset_forgets_hashes_and_emits_all_cleared() {
        let mut p = BlockPool::new(3);
        let mut ev = Vec::new();
        let a = p.allocate(&mut ev).unwrap();
        let b = p.allocate(&mut ev).unwrap();
        p.register(a, h(1));
        p.register(b, h(2));
        p.release(a);
        p.reset(&mut ev);
        assert_eq!(ev, vec![KvEvent::AllBlocksCleared]);
        assert!(!p.contains(h(1)) && !p.contains(h(2)));
        assert_eq!(p.state(a), BlockState::Free);
        p.release(b);
        assert_eq!(p.state(b), BlockState::Free);
        assert_eq!(p.num_allocatable(), 3);
        p.check_invariants().unwrap();
    }

    /// Random operation sequences keep every invariant and never evict a referenced block.
    #[test]
    fn random_operations_keep_invariants() {
        use rand::{Rng, SeedableRng};
        let seed = std::env::var("KVMESH_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(7u64);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut p = BlockPool::new(16);
        let mut held: Vec<BlockId> = Vec::new();
        let mut ev = Vec::new();
        for step in 0..5000 {
            match rng.random_range(0..5) {
                0 | 1 => {
                    if let Some(id) = p.allocate(&mut ev) {
                        held.push(id);
                    }
                }
                2 if !held.is_empty() => {
                    let i = rng.random_range(0..held.len());
                    p.register(held[i], h(rng.random_range(0..40)));
                }
                3 if !held.is_empty() => {
                    let i = rng.random_range(0..held.len());
                    p.release(held.swap_remove(i));
                }
                _ => {
                    let hh = h(rng.random_range(0..40));
                    if let Some(id) = p.acquire_cached(hh) {
                        held.push(id);
                    }
                }
            }
            for &id in &held {
                assert_eq!(
                    p.state(id),
                    BlockState::Active,
                    "step {step}: held block {id} not active"
                );
            }
            p.check_invariants()
                .unwrap_or_else(|e| panic!("seed {seed} step {step}: {e}"));
        }
    }
}
