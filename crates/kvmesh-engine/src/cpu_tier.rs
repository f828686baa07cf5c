//! The engine's CPU tier: the shared store of `kvmesh-tier` ([`CpuStore`]: byte budget, LRU,
//! counted leased pins of three kinds, checksums, external flags; its README states the rules)
//! behind one `parking_lot` mutex that is never held across `.await`, so the compute loop
//! offloads and restores while the P2P producer serves the same blocks to peers.
//!
//! What the engine adds around the store:
//! - **KV events**: every store and eviction publishes `BlockStored` / `BlockRemoved` with medium
//!   CPU, under the lock (so in order), evictions before the stores that caused them;
//! - the **pending registry**: blocks a running request is computing right now, which a peer
//!   may wait for ([`CpuTier::wait_ready`]; the `PENDING` status of the P2P protocol);
//! - the clock: every call reads `Instant::now()` here and passes it to the store.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use hashbrown::HashSet;
use kvmesh_core::events::{BlockRemoved, BlockStored};
use kvmesh_core::{BlockHash, KvEvent, Medium, TokenId};
use kvmesh_tier::{Block, CpuStore, Inserted};
pub use kvmesh_tier::{CpuTierStats, DEFAULT_PULL_PIN_FRACTION, Landed, PinKind};
pub use kvmesh_transfer::BlockStatus;
use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::outbox::KvEventSink;

/// One block to store: its hash, its parent's hash (None for the first block), its tokens and
/// the KV payload bytes (the tokens and parent go into the `BlockStored` event).
#[derive(Debug, Clone)]
pub struct OffloadBlock {
    pub hash: BlockHash,
    pub parent: Option<BlockHash>,
    pub tokens: Vec<TokenId>,
    pub payload: Bytes,
    /// The request's `cache_salt` when this is its block 0 (`parent` None): the CPU-tier event
    /// names it so an index keys the block in the salt's space.
    pub cache_salt: Option<String>,
}

impl OffloadBlock {
    /// The store's block (its CRC32 taken here, outside the tier's lock).
    fn to_store(&self) -> Block {
        Block::new(self.hash, self.payload.clone())
    }
}

#[derive(Debug)]
struct Shared {
    store: CpuStore,
    pending: HashSet<BlockHash>,
}

/// The shared CPU tier (see the module docs). Shared as `Arc<CpuTier>`.
pub struct CpuTier {
    inner: Mutex<Shared>,
    sink: Arc<dyn KvEventSink>,
    block_size: u32,
    /// Woken whenever a block is stored or leaves the pending set.
    changed: Notify,
}

impl std::fmt::Debug for CpuTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuTier")
            .field("stats", &self.stats())
            .finish()
    }
}

/// The events of one change: evictions first, then the runs of newly stored blocks.
fn tier_events(evicted: Vec<BlockHash>, stored: Vec<BlockStored>) -> Vec<KvEvent> {
    let mut events = Vec::with_capacity(stored.len() + 1);
    if !evicted.is_empty() {
        events.push(KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: evicted,
            medium: Medium::Cpu,
            group_idx: Some(0),
        }));
    }
    events.extend(stored.into_iter().map(KvEvent::BlockStored));
    events
}

/// Builds `BlockStored` events for runs of consecutive blocks that were newly stored.
struct StoredRuns {
    block_size: u32,
    run: Option<BlockStored>,
    done: Vec<BlockStored>,
}

impl StoredRuns {
    fn new(block_size: u32) -> Self {
        Self {
            block_size,
            run: None,
            done: Vec::new(),
        }
    }

    /// `b` was newly stored (`true`, extends the current run) or not (ends it).
    fn push(&mut self, b: &OffloadBlock, stored: bool) {
        if !stored {
            self.done.extend(self.run.take());
            return;
        }
        let bs = self.block_size;
        let run = self.run.get_or_insert_with(|| {
            BlockStored::run(Medium::Cpu, b.parent, bs, Vec::new(), Vec::new())
                .in_full_attention_group()
                .with_cache_salt(b.cache_salt.as_deref().filter(|_| b.parent.is_none()))
        });
        run.block_hashes.push(b.hash);
        run.token_ids.extend_from_slice(&b.tokens);
    }

    fn finish(mut self) -> Vec<BlockStored> {
        self.done.extend(self.run.take());
        self.done
    }
}

impl CpuTier {
    pub fn new(capacity_bytes: u64, block_size: usize, sink: Arc<dyn KvEventSink>) -> Self {
        Self {
            inner: Mutex::new(Shared {
                store: CpuStore::new(capacity_bytes),
                pending: HashSet::new(),
            }),
            sink,
            block_size: u32::try_from(block_size).unwrap_or(u32::MAX),
            changed: Notify::new(),
        }
    }

    /// The payload of a stored block (a cheap `Bytes` clone; stays valid after eviction).
    pub fn get(&self, hash: BlockHash) -> Option<Bytes> {
        self.inner.lock().store.get(hash)
    }

    /// The payload with the CRC32 taken when it was stored.
    pub fn get_with_checksum(&self, hash: BlockHash) -> Option<(Bytes, u32)> {
        self.inner.lock().store.get_with_checksum(hash)
    }

    /// Marks the stored ones of `hashes` (a prefix) recently used: a request hitting these
    /// blocks in the GPU tier is using them, so their CPU copies (the ones peers pull) must not
    /// age out meanwhile (vLLM's offloading manager `touch`).
    pub fn touch_prefix(&self, hashes: &[BlockHash]) {
        if !hashes.is_empty() {
            self.inner.lock().store.touch_prefix(hashes);
        }
    }

    pub fn contains(&self, hash: BlockHash) -> bool {
        self.inner.lock().store.contains(hash)
    }

    /// Length of the leading run of `hashes` stored here.
    pub fn lookup_prefix(&self, hashes: &[BlockHash]) -> usize {
        self.inner.lock().store.lookup_prefix(hashes)
    }

    /// Adds one pin of `kind` (a lease until `lease_until`) to the leading run of stored
    /// `hashes`; returns its length.
    pub fn pin(&self, kind: PinKind, hashes: &[BlockHash], lease_until: Instant) -> usize {
        self.inner
            .lock()
            .store
            .pin(kind, hashes, lease_until, Instant::now())
    }

    /// Releases one pin of `kind` per hash.
    pub fn unpin(&self, kind: PinKind, hashes: &[BlockHash]) {
        self.inner.lock().store.unpin(kind, hashes, Instant::now());
    }

    /// Live pins of every kind on a block.
    pub fn pin_count(&self, hash: BlockHash) -> usize {
        self.inner.lock().store.pin_count(hash, Instant::now())
    }

    /// Sets the share (0..=1) of the capacity that `Pull` pins may hold (default
    /// [`DEFAULT_PULL_PIN_FRACTION`]).
    pub fn set_pull_pin_fraction(&self, fraction: f64) {
        self.inner.lock().store.set_pull_pin_fraction(fraction);
    }

    /// Clears the external flag of those of `hashes` that carry it (blocks a pull landed, not
    /// yet counted); returns how many did. Called once per request at its first scheduling, with
    /// the hit blocks it pulled or waited for: the first such request counts them as external
    /// hits, later ones as local hits.
    pub fn take_external(&self, hashes: &[BlockHash]) -> usize {
        if hashes.is_empty() {
            return 0;
        }
        self.inner.lock().store.take_external(hashes)
    }

    /// A peer's lookup, atomically: status per block, and one `Use` pin (lease until
    /// `lease_until`) on each block of the leading run of hits — under one lock, so nothing can
    /// evict a block between "it is here" and "it is pinned".
    pub fn lookup_and_pin(&self, hashes: &[BlockHash], lease_until: Instant) -> Vec<BlockStatus> {
        let mut g = self.inner.lock();
        let statuses: Vec<BlockStatus> = hashes
            .iter()
            .map(|h| {
                if g.store.contains(*h) {
                    BlockStatus::Hit
                } else if g.pending.contains(h) {
                    BlockStatus::Pending
                } else {
                    BlockStatus::Miss
                }
            })
            .collect();
        let leading = statuses
            .iter()
            .take_while(|s| **s == BlockStatus::Hit)
            .count();
        g.store.pin(
            PinKind::Use,
            &hashes[..leading],
            lease_until,
            Instant::now(),
        );
        statuses
    }

    /// Test hook: replaces a stored payload *without* updating its checksum, as bit rot or a
    /// buggy writer would. Returns whether the block was present.
    #[doc(hidden)]
    pub fn corrupt_for_test(&self, hash: BlockHash, payload: Bytes) -> bool {
        self.inner.lock().store.corrupt_for_test(hash, payload)
    }

    /// Stores `blocks` (consecutive) under the lock, flagging them external if asked; returns
    /// how many were newly stored and the events to publish.
    fn store_run(
        g: &mut Shared,
        blocks: &[OffloadBlock],
        prepared: Vec<Block>,
        external: bool,
        block_size: u32,
    ) -> (usize, Vec<KvEvent>) {
        let now = Instant::now();
        let mut evicted = Vec::new();
        let mut runs = StoredRuns::new(block_size);
        let mut n = 0;
        for (b, block) in blocks.iter().zip(prepared) {
            g.pending.remove(&b.hash);
            let stored = g.store.insert(block, now, &mut evicted) == Inserted::Stored;
            if stored {
                n += 1;
                if external {
                    g.store.mark_external(b.hash);
                }
            }
            runs.push(b, stored);
        }
        (n, tier_events(evicted, runs.finish()))
    }

    /// Stores computed blocks (offload from the GPU tier) and publishes their CPU events.
    /// Stored blocks leave the pending set. Returns how many were newly stored.
    pub fn insert_run(&self, blocks: &[OffloadBlock]) -> usize {
        self.insert(blocks, false)
    }

    /// Stores one block a peer sent (flagged external, not pinned; publishes `BlockStored` CPU).
    /// Returns false if it was already present or could not fit.
    pub fn insert_external(
        &self,
        hash: BlockHash,
        parent: Option<BlockHash>,
        tokens: Vec<TokenId>,
        payload: Bytes,
    ) -> bool {
        let block = OffloadBlock {
            hash,
            parent,
            tokens,
            payload,
            cache_salt: None,
        };
        self.insert(std::slice::from_ref(&block), true) == 1
    }

    fn insert(&self, blocks: &[OffloadBlock], external: bool) -> usize {
        let prepared = blocks.iter().map(OffloadBlock::to_store).collect();
        let n = {
            let mut g = self.inner.lock();
            let (n, events) = Self::store_run(&mut g, blocks, prepared, external, self.block_size);
            // Published under the lock so concurrent inserts keep event order.
            self.sink.publish(events);
            n
        };
        self.changed.notify_waiters();
        n
    }

    /// Lands one block a pull brought (publishes `BlockStored` CPU): stored, flagged external and
    /// pinned (`Pull`, lease until `lease_until`) under one lock, so nothing evicts it before the
    /// request that pulled it is scheduled — unless `Pull` pins already hold their share of the
    /// tier, then it lands unpinned. See [`Landed`].
    pub fn land(&self, block: OffloadBlock, lease_until: Instant) -> Landed {
        let prepared = block.to_store();
        let landed = {
            let mut g = self.inner.lock();
            let mut evicted = Vec::new();
            let landed = g
                .store
                .land(prepared, lease_until, Instant::now(), &mut evicted);
            let stored = matches!(landed, Landed::Pinned | Landed::Unpinned);
            if stored {
                g.pending.remove(&block.hash);
            }
            let mut runs = StoredRuns::new(self.block_size);
            runs.push(&block, stored);
            self.sink.publish(tier_events(evicted, runs.finish()));
            landed
        };
        if matches!(landed, Landed::Pinned | Landed::Unpinned) {
            self.changed.notify_waiters();
        }
        landed
    }

    /// Marks blocks a running request is about to compute (peers see them as `Pending`).
    pub fn mark_pending(&self, hashes: &[BlockHash]) {
        let mut g = self.inner.lock();
        for h in hashes {
            if !g.store.contains(*h) {
                g.pending.insert(*h);
            }
        }
    }

    /// Withdraws pending marks (the computing request was cancelled or failed); waiters wake and
    /// see a miss.
    pub fn clear_pending(&self, hashes: &[BlockHash]) {
        {
            let mut g = self.inner.lock();
            for h in hashes {
                g.pending.remove(h);
            }
        }
        self.changed.notify_waiters();
    }

    pub fn is_pending(&self, hash: BlockHash) -> bool {
        self.inner.lock().pending.contains(&hash)
    }

    /// Waits until `hash` is stored (true), is no longer pending without being stored (false), or
    /// `deadline` passes (false unless stored by then).
    pub async fn wait_ready(&self, hash: BlockHash, deadline: tokio::time::Instant) -> bool {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let g = self.inner.lock();
                if g.store.contains(hash) {
                    return true;
                }
                if !g.pending.contains(&hash) {
                    return false;
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.contains(hash);
            }
        }
    }

    /// Drops every stored block and pending mark (reset; publishes nothing: the pool's
    /// `AllBlocksCleared` covers all tiers).
    pub fn clear(&self) {
        {
            let mut g = self.inner.lock();
            g.store.clear();
            g.pending.clear();
        }
        self.changed.notify_waiters();
    }

    pub fn stats(&self) -> CpuTierStats {
        self.inner.lock().store.stats()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::outbox::CollectingSink;

    fn blk(h: u64, parent: Option<u64>, len: usize) -> OffloadBlock {
        OffloadBlock {
            hash: BlockHash(h),
            parent: parent.map(BlockHash),
            tokens: vec![h as u32; 2],
            payload: Bytes::from(vec![h as u8; len]),
            cache_salt: None,
        }
    }

    fn tier(capacity: u64) -> (CpuTier, CollectingSink) {
        let sink = CollectingSink::default();
        (CpuTier::new(capacity, 2, Arc::new(sink.clone())), sink)
    }

    #[test]
    fn a_run_is_one_cpu_stored_event_with_tokens() {
        let (tier, sink) = tier(1000);
        assert_eq!(tier.insert_run(&[blk(1, None, 10), blk(2, Some(1), 10)]), 2);
        let ev = sink.take();
        assert_eq!(ev.len(), 1);
        let KvEvent::BlockStored(st) = &ev[0] else {
            panic!("expected stored")
        };
        assert_eq!(st.block_hashes, vec![BlockHash(1), BlockHash(2)]);
        assert_eq!(st.parent_block_hash, None);
        assert_eq!(st.token_ids, vec![1, 1, 2, 2]);
        assert_eq!(st.medium, Medium::Cpu);
        assert_eq!(st.block_size, 2);
        // A block already held splits the run: the next run names its parent.
        assert_eq!(
            tier.insert_run(&[blk(3, Some(2), 10), blk(1, None, 10), blk(4, Some(1), 10)]),
            2
        );
        let ev = sink.take();
        assert_eq!(ev.len(), 2);
        assert!(
            matches!(&ev[1], KvEvent::BlockStored(st) if st.parent_block_hash == Some(BlockHash(1)))
        );
    }

    #[test]
    fn evictions_are_published_before_the_stores_that_caused_them() {
        let (tier, sink) = tier(30);
        tier.insert_run(&[blk(1, None, 10), blk(2, Some(1), 10), blk(3, Some(2), 10)]);
        assert!(tier.get(BlockHash(1)).is_some()); // 1 is now most recent; 2 is the LRU
        sink.take();
        tier.insert_run(&[blk(4, None, 10)]);
        let ev = sink.take();
        assert!(
            matches!(&ev[0], KvEvent::BlockRemoved(r) if r.block_hashes == vec![BlockHash(2)] && r.medium == Medium::Cpu)
        );
        assert!(
            matches!(&ev[1], KvEvent::BlockStored(st) if st.block_hashes == vec![BlockHash(4)])
        );
        assert_eq!(tier.stats().evicted_blocks, 1);
        // A landed block is announced as a stored CPU block too.
        let lease = Instant::now() + Duration::from_secs(60);
        assert_eq!(tier.land(blk(5, Some(4), 10), lease), Landed::Pinned);
        let ev = sink.take();
        assert!(matches!(&ev[0], KvEvent::BlockRemoved(_)));
        assert!(
            matches!(&ev[1], KvEvent::BlockStored(st) if st.block_hashes == vec![BlockHash(5)] && st.parent_block_hash == Some(BlockHash(4)))
        );
    }

    #[test]
    fn lookup_and_pin_pins_only_the_leading_hits() {
        let (tier, _) = tier(1000);
        tier.insert_run(&[blk(1, None, 8), blk(2, Some(1), 8), blk(4, None, 8)]);
        tier.mark_pending(&[BlockHash(3)]);
        let until = Instant::now() + Duration::from_secs(10);
        let st = tier.lookup_and_pin(&[1, 2, 3, 4].map(BlockHash), until);
        assert_eq!(
            st,
            vec![
                BlockStatus::Hit,
                BlockStatus::Hit,
                BlockStatus::Pending,
                BlockStatus::Hit
            ]
        );
        assert_eq!(tier.pin_count(BlockHash(1)), 1);
        assert_eq!(tier.pin_count(BlockHash(2)), 1);
        assert_eq!(tier.pin_count(BlockHash(4)), 0);
        tier.unpin(PinKind::Use, &[BlockHash(1)]);
        assert_eq!(tier.pin_count(BlockHash(1)), 0);
    }

    #[test]
    fn external_inserts_count_once_and_landings_leave_pending() {
        let (tier, _) = tier(1000);
        tier.mark_pending(&[BlockHash(1), BlockHash(2)]);
        assert!(tier.insert_external(BlockHash(1), None, vec![1, 2], Bytes::from_static(b"xx")));
        assert!(!tier.insert_external(BlockHash(1), None, vec![1, 2], Bytes::from_static(b"xx")));
        let lease = Instant::now() + Duration::from_secs(60);
        assert_eq!(tier.land(blk(2, Some(1), 2), lease), Landed::Pinned);
        assert!(!tier.is_pending(BlockHash(1)) && !tier.is_pending(BlockHash(2)));
        assert_eq!(tier.take_external(&[BlockHash(1), BlockHash(2)]), 2);
        assert_eq!(tier.take_external(&[BlockHash(1), BlockHash(2)]), 0);
    }

    #[tokio::test]
    async fn pending_blocks_become_ready_or_fail_for_waiters() {
        let (tier, sink) = tier(1000);
        let tier = Arc::new(tier);
        tier.mark_pending(&[BlockHash(7), BlockHash(8)]);
        assert_eq!(
            tier.lookup_and_pin(&[BlockHash(7), BlockHash(1)], Instant::now()),
            vec![BlockStatus::Pending, BlockStatus::Miss]
        );
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        let t2 = tier.clone();
        let waiter = tokio::spawn(async move { t2.wait_ready(BlockHash(7), deadline).await });
        let t3 = tier.clone();
        let waiter_fail = tokio::spawn(async move { t3.wait_ready(BlockHash(8), deadline).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        tier.insert_run(&[blk(7, None, 4)]);
        tier.clear_pending(&[BlockHash(8)]);
        assert!(waiter.await.unwrap());
        assert!(!waiter_fail.await.unwrap());
        // Deadline passes for a block that stays pending.
        tier.mark_pending(&[BlockHash(9)]);
        let short = tokio::time::Instant::now() + Duration::from_millis(30);
        assert!(!tier.wait_ready(BlockHash(9), short).await);
        assert!(tier.insert_external(BlockHash(9), None, vec![1, 2], Bytes::from_static(b"xx")));
        assert_eq!(tier.get(BlockHash(9)).unwrap(), Bytes::from_static(b"xx"));
        assert_eq!(sink.take().len(), 2);
    }
}
