//! [`CpuStore`]: the byte-capped LRU of block payloads with counted, leased pins of three kinds.
//!
//! Bookkeeping: a map of entries; `lru`, an ordered map from a monotonic tick (last use) to the
//! hash, whose first entry is the least recently used unretained block; `retained`, the same for
//! retained blocks by when they were (re)retained; `retention_ends`, retained blocks by when their
//! last retention lease ends, so an expired retention is found in O(log n) wherever it sits.
//!
//! Memory per block (issue 37): the map's slots hold a hash and a `Box<Entry>`, 16 bytes, not the
//! 152-byte entry. A full tier evicts one block per insert, and the tombstones that churn leaves
//! make hashbrown grow its table until the live blocks fill at most 7/16 of it: 2.3 to 4.6 slots
//! per block (4 for a tier of 2^21 512-byte blocks, the engine's default 1 GiB of sim blocks).
//! With the entry inline that was 640 B of table per block, more than the payload, and a 1 GiB
//! tier's engine jumped from 1.9 to 2.5 GiB of RSS once churn forced the last doubling.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use bytes::Bytes;
use hashbrown::HashMap;
use kvmesh_core::BlockHash;

/// One block to store: its hash, its payload and the payload's CRC32.
#[derive(Debug, Clone)]
pub struct Block {
    pub hash: BlockHash,
    pub payload: Bytes,
    /// CRC32 of `payload` (`crc32fast`), kept for the block's life and sent as is: a peer that
    /// receives a block corrupted at rest sees the mismatch.
    pub crc: u32,
}

impl Block {
    /// Takes the payload's CRC32: a pass over the bytes, so build blocks outside any lock.
    pub fn new(hash: BlockHash, payload: Bytes) -> Self {
        let crc = crc32fast::hash(&payload);
        Self { hash, payload, crc }
    }
}

/// Why a block is pinned (see the crate README).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PinKind {
    /// A peer's fetch (or a request waiting for it) uses the block: hard, never evicted.
    Use,
    /// Landed by a pull for a request not yet scheduled: hard, capped at a share of the tier.
    Pull,
    /// Kept for a P/D remote reader: soft, evicted only after every unprotected block.
    Retain,
}

/// Default share of the capacity that `Pull` pins may hold.
pub const DEFAULT_PULL_PIN_FRACTION: f64 = 0.5;

/// What [`CpuStore::insert`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inserted {
    Stored,
    /// Already held: marked recently used.
    Present,
    /// Larger than the capacity, or hard pins fill the tier: not stored.
    Rejected,
}

/// What [`CpuStore::land`] did with a pulled block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Landed {
    /// Stored and pinned (`Pull`) until the request is scheduled.
    Pinned,
    /// Stored without a pin: `Pull` pins already hold their share of the tier.
    Unpinned,
    /// Already here (computed or landed meanwhile): a local hit, not pinned.
    Present,
    /// Not stored: hard pins fill the tier.
    Rejected,
}

/// Counters of the tier (the engine exports them as `kvmesh_engine_cpu_*`, the connector as
/// `kvmesh_cpu_tier_*`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpuTierStats {
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub blocks: u64,
    pub stored_blocks: u64,
    pub evicted_blocks: u64,
    /// Inserts refused because hard pins filled the tier (or a payload exceeded the capacity).
    pub rejected_blocks: u64,
    /// Reads of a stored payload ([`CpuStore::get`] and its variants).
    pub hits: u64,
    /// Retained blocks evicted under pressure before their retention ended.
    pub retained_evicted_blocks: u64,
    /// Pulled blocks stored without a pin because `Pull` pins held their share of the tier.
    pub pull_pin_capped_blocks: u64,
}

/// Hard-pinned blocks one eviction steps over before evicting a retained block instead.
const MAX_PINNED_STEPS: usize = 64;

#[derive(Debug)]
struct Entry {
    payload: Bytes,
    crc: u32,
    /// Last use; the key in `lru` while the block is not retained.
    tick: u64,
    /// Expiry of each `Use` pin (one per pin; expired ones are dropped lazily).
    use_leases: Vec<Instant>,
    /// Expiry of each `Pull` pin.
    pull_leases: Vec<Instant>,
    /// Expiry of each `Retain` pin.
    retain_leases: Vec<Instant>,
    /// Key in `retained` while retained (then the block is not in `lru`).
    retained_key: Option<u64>,
    /// When the block's last retention ends; with the hash, its key in `retention_ends`.
    retained_until: Option<Instant>,
    /// Counted in `pull_pinned_bytes`.
    pull_counted: bool,
    /// Landed by a pull and not yet counted as an external hit.
    external: bool,
}

impl Entry {
    fn new(block: Block, tick: u64) -> Self {
        Self {
            payload: block.payload,
            crc: block.crc,
            tick,
            use_leases: Vec::new(),
            pull_leases: Vec::new(),
            retain_leases: Vec::new(),
            retained_key: None,
            retained_until: None,
            pull_counted: false,
            external: false,
        }
    }

    /// Earliest expiry among live hard (`Use`, `Pull`) pins; None when no hard pin is live.
    fn hard_expiry(&self, now: Instant) -> Option<Instant> {
        self.use_leases
            .iter()
            .chain(&self.pull_leases)
            .copied()
            .filter(|&t| t > now)
            .min()
    }

    fn leases_mut(&mut self, kind: PinKind) -> &mut Vec<Instant> {
        match kind {
            PinKind::Use => &mut self.use_leases,
            PinKind::Pull => &mut self.pull_leases,
            PinKind::Retain => &mut self.retain_leases,
        }
    }

    fn live_pins(&self, now: Instant) -> usize {
        self.use_leases
            .iter()
            .chain(&self.pull_leases)
            .chain(&self.retain_leases)
            .filter(|&&t| t > now)
            .count()
    }
}

/// Byte-capped LRU store of block payloads with counted, leased pins (pure data structure).
///
/// Invariants: `used_bytes` = sum of stored payload lengths ≤ capacity; a block holding an
/// unexpired hard pin is never evicted; each pin is one lease, released by one `unpin` of its
/// kind or by its expiry; an eviction that meets a hard-pinned block counts as a use of it (it
/// moves to the recent end, so a pass steps over each pinned block once, not once per eviction).
#[derive(Debug)]
pub struct CpuStore {
    capacity: u64,
    used: u64,
    /// Boxed: see the module header (slots, not entries, are what churn multiplies).
    entries: HashMap<BlockHash, Box<Entry>>,
    lru: BTreeMap<u64, BlockHash>,
    retained: BTreeMap<u64, BlockHash>,
    retention_ends: BTreeSet<(Instant, BlockHash)>,
    tick: u64,
    stats: CpuTierStats,
    /// Bytes of blocks holding a `Pull` pin (expired pins counted until the next recount).
    pull_pinned_bytes: u64,
    /// Cap on `pull_pinned_bytes`.
    pull_pin_cap: u64,
    /// No `Pull` pin can have expired before this (the earliest expiry seen since the last
    /// recount), so no recount of `pull_pinned_bytes` is useful before it.
    pull_recount_after: Option<Instant>,
    /// Set when an eviction found every block hard-pinned: until this instant (the earliest
    /// lease expiry seen) or the next unpin/insert/clear, evictions fail at once instead of
    /// rescanning the whole tier for every block offered (that rescan, under the tier's lock,
    /// stalled the engine's compute loop and its producer when pulled blocks filled the tier).
    all_pinned_until: Option<Instant>,
}

impl CpuStore {
    pub fn new(capacity_bytes: u64) -> Self {
        Self {
            capacity: capacity_bytes,
            used: 0,
            entries: HashMap::new(),
            lru: BTreeMap::new(),
            retained: BTreeMap::new(),
            retention_ends: BTreeSet::new(),
            tick: 0,
            stats: CpuTierStats {
                capacity_bytes,
                ..CpuTierStats::default()
            },
            pull_pinned_bytes: 0,
            pull_pin_cap: (capacity_bytes as f64 * DEFAULT_PULL_PIN_FRACTION) as u64,
            pull_recount_after: None,
            all_pinned_until: None,
        }
    }

    /// Sets the share (0..=1) of the capacity that `Pull` pins may hold.
    pub fn set_pull_pin_fraction(&mut self, fraction: f64) {
        self.pull_pin_cap = (self.capacity as f64 * fraction.clamp(0.0, 1.0)) as u64;
    }

    pub fn contains(&self, hash: BlockHash) -> bool {
        self.entries.contains_key(&hash)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The mean payload size (0 when empty): the size of every block in a tier of one layout.
    pub fn block_bytes(&self) -> u64 {
        self.used
            .checked_div(self.entries.len() as u64)
            .unwrap_or(0)
    }

    pub fn stats(&self) -> CpuTierStats {
        CpuTierStats {
            used_bytes: self.used,
            blocks: self.entries.len() as u64,
            ..self.stats
        }
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    fn touch(&mut self, hash: BlockHash) {
        let tick = self.tick + 1;
        let Some(e) = self.entries.get_mut(&hash) else {
            return;
        };
        self.tick = tick;
        if e.retained_key.is_none() {
            self.lru.remove(&e.tick);
            self.lru.insert(tick, hash);
        }
        // A retained block keeps its retention order; `tick` is where it rejoins `lru`.
        e.tick = tick;
    }

    /// Marks the stored ones of `hashes` (a prefix, in order) recently used without reading
    /// them, tail first so the head ends most recent: LRU then evicts a prefix from its tail,
    /// and what stays is still a usable prefix (a lost first block makes the rest unreachable).
    pub fn touch_prefix(&mut self, hashes: &[BlockHash]) {
        for &hash in hashes.iter().rev() {
            self.touch(hash);
        }
    }

    /// The payload (a cheap clone); marks the block recently used.
    pub fn get(&mut self, hash: BlockHash) -> Option<Bytes> {
        self.get_with_checksum(hash).map(|(payload, _)| payload)
    }

    /// The payload and the CRC32 taken when it was stored; marks the block recently used.
    pub fn get_with_checksum(&mut self, hash: BlockHash) -> Option<(Bytes, u32)> {
        let e = self.entries.get(&hash)?;
        let out = (e.payload.clone(), e.crc);
        self.touch(hash);
        self.stats.hits += 1;
        Some(out)
    }

    /// Payloads of the leading run of stored `hashes`, marked recently used as a prefix
    /// ([`CpuStore::touch_prefix`]).
    pub fn get_prefix(&mut self, hashes: &[BlockHash]) -> Vec<Bytes> {
        let run = &hashes[..self.lookup_prefix(hashes)];
        let payloads: Vec<Bytes> = run
            .iter()
            .filter_map(|h| self.entries.get(h).map(|e| e.payload.clone()))
            .collect();
        self.stats.hits += payloads.len() as u64;
        self.touch_prefix(run);
        payloads
    }

    /// Length of the leading run of `hashes` stored here.
    pub fn lookup_prefix(&self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.entries.contains_key(*h))
            .count()
    }

    /// Stores a block, evicting to make room (least recently used unprotected blocks first,
    /// then the oldest retentions); each evicted hash is pushed to `evicted`, in order (also
    /// when the block then does not fit).
    pub fn insert(&mut self, block: Block, now: Instant, evicted: &mut Vec<BlockHash>) -> Inserted {
        if self.entries.contains_key(&block.hash) {
            self.touch(block.hash);
            return Inserted::Present;
        }
        let need = block.payload.len() as u64;
        if need > self.capacity {
            self.stats.rejected_blocks += 1;
            return Inserted::Rejected;
        }
        while self.used + need > self.capacity {
            if !self.evict_one(now, evicted) {
                self.stats.rejected_blocks += 1;
                return Inserted::Rejected;
            }
        }
        let tick = self.next_tick();
        let hash = block.hash;
        self.lru.insert(tick, hash);
        self.entries.insert(hash, Box::new(Entry::new(block, tick)));
        self.used += need;
        self.all_pinned_until = None;
        self.stats.stored_blocks += 1;
        Inserted::Stored
    }

    /// Stores a block pulled from a peer, flags it external (see [`CpuStore::take_external`])
    /// and pins it (`Pull`, until `until`) when `Pull` pins have room for it. See [`Landed`].
    pub fn land(
        &mut self,
        block: Block,
        until: Instant,
        now: Instant,
        evicted: &mut Vec<BlockHash>,
    ) -> Landed {
        let (hash, size) = (block.hash, block.payload.len() as u64);
        match self.insert(block, now, evicted) {
            Inserted::Stored => {}
            Inserted::Present => return Landed::Present,
            Inserted::Rejected => return Landed::Rejected,
        }
        self.mark_external(hash);
        if self.pull_pin_room(size, now) {
            self.pin(PinKind::Pull, &[hash], until, now);
            Landed::Pinned
        } else {
            self.stats.pull_pin_capped_blocks += 1;
            Landed::Unpinned
        }
    }

    /// Flags a stored block as landed by a pull (external, not yet counted).
    pub fn mark_external(&mut self, hash: BlockHash) {
        if let Some(e) = self.entries.get_mut(&hash) {
            e.external = true;
        }
    }

    /// Clears the external flag of each of `hashes` that has it; returns how many had it (the
    /// caller counts those as external hits, once).
    pub fn take_external(&mut self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .filter(|h| {
                self.entries
                    .get_mut(*h)
                    .is_some_and(|e| std::mem::take(&mut e.external))
            })
            .count()
    }

    /// Adds one pin of `kind` (a lease until `until`) to each block of the leading run of stored
    /// `hashes`; returns the run's length. Each pin needs its own [`CpuStore::unpin`] (or
    /// expires). `Pull` pins are not capped here (they protect blocks already stored); the cap
    /// applies when a pull lands a new block.
    pub fn pin(
        &mut self,
        kind: PinKind,
        hashes: &[BlockHash],
        until: Instant,
        now: Instant,
    ) -> usize {
        let mut n = 0;
        for &hash in hashes {
            let tick = self.tick + 1;
            let Some(e) = self.entries.get_mut(&hash) else {
                break;
            };
            let leases = e.leases_mut(kind);
            leases.retain(|&t| t > now);
            leases.push(until);
            match kind {
                PinKind::Use => {}
                PinKind::Pull => {
                    if !e.pull_counted {
                        e.pull_counted = true;
                        self.pull_pinned_bytes += e.payload.len() as u64;
                    }
                    self.pull_recount_after = self.pull_recount_after.map(|t| t.min(until));
                }
                PinKind::Retain => {
                    // (Re)retained: joins the retention order at its recent end.
                    self.tick = tick;
                    match e.retained_key.replace(tick) {
                        Some(key) => self.retained.remove(&key),
                        None => self.lru.remove(&e.tick),
                    };
                    self.retained.insert(tick, hash);
                    let ends = e.retained_until.map_or(until, |t| t.max(until));
                    if let Some(old) = e.retained_until.replace(ends) {
                        self.retention_ends.remove(&(old, hash));
                    }
                    self.retention_ends.insert((ends, hash));
                }
            }
            n += 1;
        }
        n
    }

    /// Releases one pin of `kind` per hash (the one expiring soonest; expired pins are ignored).
    pub fn unpin(&mut self, kind: PinKind, hashes: &[BlockHash], now: Instant) {
        self.all_pinned_until = None;
        for &hash in hashes {
            let Some(e) = self.entries.get_mut(&hash) else {
                continue;
            };
            let leases = e.leases_mut(kind);
            leases.retain(|&t| t > now);
            if let Some((i, _)) = leases.iter().enumerate().min_by_key(|(_, t)| **t) {
                leases.swap_remove(i);
            }
            match kind {
                PinKind::Use => {}
                PinKind::Pull => {
                    if e.pull_counted && e.pull_leases.is_empty() {
                        e.pull_counted = false;
                        self.pull_pinned_bytes -= e.payload.len() as u64;
                    }
                }
                PinKind::Retain => {
                    if e.retain_leases.is_empty() {
                        Self::end_retention(
                            &mut self.lru,
                            &mut self.retained,
                            &mut self.retention_ends,
                            hash,
                            e,
                        );
                    }
                }
            }
        }
    }

    /// Moves a block whose last retention ended back into `lru`, at its last use.
    fn end_retention(
        lru: &mut BTreeMap<u64, BlockHash>,
        retained: &mut BTreeMap<u64, BlockHash>,
        retention_ends: &mut BTreeSet<(Instant, BlockHash)>,
        hash: BlockHash,
        e: &mut Entry,
    ) {
        let Some(key) = e.retained_key.take() else {
            return;
        };
        retained.remove(&key);
        if let Some(until) = e.retained_until.take() {
            retention_ends.remove(&(until, hash));
        }
        e.retain_leases.clear();
        lru.insert(e.tick, hash);
    }

    /// Live (unexpired) pins of every kind on a block.
    pub fn pin_count(&self, hash: BlockHash, now: Instant) -> usize {
        self.entries.get(&hash).map_or(0, |e| e.live_pins(now))
    }

    /// Retentions whose last lease ended by `now` end: those blocks rejoin `lru` at their last use.
    fn expire_retentions(&mut self, now: Instant) {
        while let Some(&(until, hash)) = self.retention_ends.first() {
            if until > now {
                break;
            }
            self.retention_ends.pop_first();
            if let Some(e) = self.entries.get_mut(&hash) {
                e.retained_until = None;
                Self::end_retention(
                    &mut self.lru,
                    &mut self.retained,
                    &mut self.retention_ends,
                    hash,
                    e,
                );
            }
        }
    }

    /// Evicts the least recently used block without a hard pin, else the oldest retained block
    /// without one. Hard-pinned blocks met on the way move to the recent end of their order.
    fn evict_one(&mut self, now: Instant, evicted: &mut Vec<BlockHash>) -> bool {
        if self.all_pinned_until.is_some_and(|t| now < t) {
            return false;
        }
        self.expire_retentions(now);
        let mut earliest_expiry: Option<Instant> = None;
        // With retained blocks as a fallback, step over at most a few hard-pinned blocks of `lru`
        // per eviction: a pull landing thousands of blocks pins each as it lands, and a full pass
        // over them for every later block of the same pull cost O(pinned) per block (seconds per
        // history read, under the tier's lock). The stepped-over ones move to the recent end, so
        // later evictions reach the unpinned blocks behind them.
        let bounded = if self.retained.is_empty() {
            usize::MAX
        } else {
            MAX_PINNED_STEPS
        };
        if self.evict_from(false, bounded, now, evicted, &mut earliest_expiry)
            || self.evict_from(true, usize::MAX, now, evicted, &mut earliest_expiry)
            || (bounded != usize::MAX
                && self.evict_from(false, usize::MAX, now, evicted, &mut earliest_expiry))
        {
            return true;
        }
        // Everything is hard-pinned: fail fast until a lease expires or something changes.
        self.all_pinned_until = earliest_expiry;
        false
    }

    /// Evicts the first block of `lru` (or of `retained`) without a hard pin, looking at most at
    /// `max_steps` blocks; hard-pinned ones met on the way move to the recent end.
    fn evict_from(
        &mut self,
        from_retained: bool,
        max_steps: usize,
        now: Instant,
        evicted: &mut Vec<BlockHash>,
        earliest_expiry: &mut Option<Instant>,
    ) -> bool {
        let len = if from_retained {
            self.retained.len()
        } else {
            self.lru.len()
        };
        for _ in 0..len.min(max_steps) {
            let order = if from_retained {
                &mut self.retained
            } else {
                &mut self.lru
            };
            let Some((_, hash)) = order.pop_first() else {
                break;
            };
            let tick = self.tick + 1;
            let Some(e) = self.entries.get_mut(&hash) else {
                continue;
            };
            if let Some(expiry) = e.hard_expiry(now) {
                *earliest_expiry = Some(earliest_expiry.map_or(expiry, |x| x.min(expiry)));
                self.tick = tick;
                if from_retained {
                    e.retained_key = Some(tick);
                    self.retained.insert(tick, hash);
                } else {
                    e.tick = tick;
                    self.lru.insert(tick, hash);
                }
                continue;
            }
            if from_retained {
                self.stats.retained_evicted_blocks += 1;
            }
            self.remove(hash);
            self.stats.evicted_blocks += 1;
            evicted.push(hash);
            return true;
        }
        false
    }

    /// Drops an entry already taken out of its order (`lru` or `retained`).
    fn remove(&mut self, hash: BlockHash) {
        let Some(e) = self.entries.remove(&hash) else {
            return;
        };
        let size = e.payload.len() as u64;
        self.used -= size;
        if e.pull_counted {
            self.pull_pinned_bytes -= size;
        }
        if let Some(until) = e.retained_until {
            self.retention_ends.remove(&(until, hash));
        }
    }

    /// Whether `Pull` pins may hold `more` more bytes. At the cap, recounts once (dropping
    /// expired pull pins) unless no pull pin can have expired since the last recount.
    fn pull_pin_room(&mut self, more: u64, now: Instant) -> bool {
        if self.pull_pinned_bytes + more <= self.pull_pin_cap {
            return true;
        }
        // Never fits (a zero share): no recount can help.
        if more > self.pull_pin_cap || self.pull_recount_after.is_some_and(|t| now < t) {
            return false;
        }
        let mut bytes = 0;
        let mut earliest: Option<Instant> = None;
        for e in self.entries.values_mut() {
            e.pull_leases.retain(|&t| t > now);
            e.pull_counted = !e.pull_leases.is_empty();
            if let Some(&first) = e.pull_leases.iter().min() {
                bytes += e.payload.len() as u64;
                earliest = Some(earliest.map_or(first, |x| x.min(first)));
            }
        }
        self.pull_pinned_bytes = bytes;
        self.pull_recount_after = earliest;
        bytes + more <= self.pull_pin_cap
    }

    /// Drops everything (a reset).
    pub fn clear(&mut self) {
        self.entries.clear();
        self.lru.clear();
        self.retained.clear();
        self.retention_ends.clear();
        self.used = 0;
        self.pull_pinned_bytes = 0;
        self.pull_recount_after = None;
        self.all_pinned_until = None;
    }

    /// Test hook: replaces a stored payload (same length) *without* updating its checksum, as
    /// bit rot or a buggy writer would. Returns whether the block was replaced.
    #[doc(hidden)]
    pub fn corrupt_for_test(&mut self, hash: BlockHash, payload: Bytes) -> bool {
        match self.entries.get_mut(&hash) {
            Some(e) if e.payload.len() == payload.len() => {
                e.payload = payload;
                true
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn blk(h: u64, len: usize) -> Block {
        Block::new(BlockHash(h), Bytes::from(vec![h as u8; len]))
    }

    fn hs(v: &[u64]) -> Vec<BlockHash> {
        v.iter().copied().map(BlockHash).collect()
    }

    /// A full tier under churn (one eviction per insert) grows its map to several slots per live
    /// block (tombstones), so the bookkeeping per block is the slot size times that: it must stay
    /// well under the payload. Issue 37: with the entry inline (161-byte slots) a 1 GiB tier of
    /// 512-byte sim blocks held 640 B of table per block and its engine's RSS jumped 1.9 -> 2.5
    /// GiB when churn forced the last doubling. A power-of-two block count, as there.
    #[test]
    fn a_full_churning_tier_keeps_its_table_under_64_bytes_per_block() {
        let blocks: u64 = 1 << 12;
        let mut s = CpuStore::new(blocks * 8);
        let now = Instant::now();
        let mut evicted = Vec::new();
        for h in 0..20 * blocks {
            s.insert(blk(h, 8), now, &mut evicted);
            evicted.clear();
        }
        assert_eq!(s.len() as u64, blocks);
        let slot = std::mem::size_of::<(BlockHash, Box<Entry>)>();
        let table_per_block = s.entries.capacity() * slot / s.len();
        assert!(
            table_per_block <= 64,
            "{table_per_block} B of table per block ({} slots of {slot} B for {} blocks)",
            s.entries.capacity(),
            s.len()
        );
    }

    /// Inserts each block; returns the hashes evicted.
    fn insert_all(s: &mut CpuStore, blocks: Vec<Block>, now: Instant) -> Vec<BlockHash> {
        let mut evicted = Vec::new();
        for b in blocks {
            s.insert(b, now, &mut evicted);
        }
        evicted
    }

    #[test]
    fn the_byte_cap_evicts_the_least_recently_used() {
        let mut s = CpuStore::new(30);
        let now = Instant::now();
        insert_all(&mut s, vec![blk(1, 10), blk(2, 10), blk(3, 10)], now);
        assert!(s.get(BlockHash(1)).is_some()); // 1 is now most recent; 2 is the LRU
        assert_eq!(insert_all(&mut s, vec![blk(4, 10)], now), hs(&[2]));
        assert!(s.contains(BlockHash(1)) && s.contains(BlockHash(3)) && s.contains(BlockHash(4)));
        assert_eq!(s.stats().used_bytes, 30);
        let st = s.stats();
        assert_eq!(
            (st.blocks, st.stored_blocks, st.evicted_blocks, st.hits),
            (3, 4, 1, 1)
        );
        let mut none = Vec::new();
        assert_eq!(s.insert(blk(4, 10), now, &mut none), Inserted::Present);
        assert_eq!(s.block_bytes(), 10);
    }

    #[test]
    fn oversized_blocks_are_rejected() {
        let mut s = CpuStore::new(10);
        let mut ev = Vec::new();
        assert_eq!(
            s.insert(blk(1, 11), Instant::now(), &mut ev),
            Inserted::Rejected
        );
        assert_eq!(s.stats().rejected_blocks, 1);
        assert!(s.is_empty() && ev.is_empty());
    }

    #[test]
    fn leased_blocks_survive_pressure_until_the_lease_expires() {
        let mut s = CpuStore::new(20);
        let t0 = Instant::now();
        insert_all(&mut s, vec![blk(1, 10), blk(2, 10)], t0);
        let until = t0 + Duration::from_secs(5);
        assert_eq!(s.pin(PinKind::Use, &hs(&[1, 2, 9]), until, t0), 2);
        let mut ev = Vec::new();
        assert_eq!(
            s.insert(blk(3, 10), t0, &mut ev),
            Inserted::Rejected,
            "all pinned"
        );
        assert_eq!(s.stats().rejected_blocks, 1);
        // After the lease, eviction may proceed.
        let later = t0 + Duration::from_secs(6);
        assert_eq!(s.insert(blk(3, 10), later, &mut ev), Inserted::Stored);
        s.unpin(PinKind::Use, &hs(&[2]), t0);
        assert_eq!(s.insert(blk(4, 10), t0, &mut ev), Inserted::Stored);
        assert!(s.stats().used_bytes <= 20);
    }

    #[test]
    fn pins_are_counted_per_lease() {
        let mut s = CpuStore::new(20);
        let t0 = Instant::now();
        insert_all(&mut s, vec![blk(1, 10), blk(2, 10)], t0);
        let far = t0 + Duration::from_secs(60);
        // Two consumers pin block 1; one finishes: the other's pin still protects it.
        assert_eq!(s.pin(PinKind::Use, &hs(&[1]), far, t0), 1);
        assert_eq!(
            s.pin(PinKind::Use, &hs(&[1]), t0 + Duration::from_secs(30), t0),
            1
        );
        s.unpin(PinKind::Use, &hs(&[1]), t0);
        assert_eq!(s.pin_count(BlockHash(1), t0), 1);
        assert_eq!(insert_all(&mut s, vec![blk(3, 10)], t0), hs(&[2]));
        assert!(s.contains(BlockHash(1)), "still pinned by the second lease");
        s.unpin(PinKind::Use, &hs(&[1]), t0);
        s.unpin(PinKind::Use, &hs(&[1]), t0); // an extra unpin is harmless
        assert_eq!(s.pin_count(BlockHash(1), t0), 0);
        // An expired lease no longer protects, even without unpin.
        s.pin(PinKind::Use, &hs(&[3]), t0 + Duration::from_millis(1), t0);
        assert_eq!(s.pin_count(BlockHash(3), t0 + Duration::from_secs(1)), 0);
    }

    #[test]
    fn unpin_releases_the_lease_expiring_soonest() {
        // Consumer A pinned first (ends sooner), B later: A's unpin must leave B's lease.
        let mut s = CpuStore::new(10);
        let t0 = Instant::now();
        insert_all(&mut s, vec![blk(1, 10)], t0);
        s.pin(PinKind::Use, &hs(&[1]), t0 + Duration::from_secs(10), t0);
        s.pin(PinKind::Use, &hs(&[1]), t0 + Duration::from_secs(20), t0);
        s.unpin(PinKind::Use, &hs(&[1]), t0);
        assert_eq!(s.pin_count(BlockHash(1), t0 + Duration::from_secs(15)), 1);
    }

    #[test]
    fn a_touched_prefix_is_evicted_from_its_tail() {
        // A 3-block prefix stored head first is touched as a whole; two new blocks then evict
        // its last two blocks, and its head stays usable.
        let mut s = CpuStore::new(3);
        let t0 = Instant::now();
        insert_all(&mut s, vec![blk(1, 1), blk(2, 1), blk(3, 1)], t0);
        s.touch_prefix(&hs(&[1, 2, 3]));
        insert_all(&mut s, vec![blk(10, 1), blk(11, 1)], t0);
        assert_eq!(s.lookup_prefix(&hs(&[1, 2, 3])), 1);
        // Reading a prefix touches it the same way.
        let mut s = CpuStore::new(3);
        insert_all(&mut s, vec![blk(1, 1), blk(2, 1), blk(3, 1)], t0);
        assert_eq!(s.get_prefix(&hs(&[1, 2, 9])).len(), 2);
        assert_eq!(insert_all(&mut s, vec![blk(4, 1)], t0), hs(&[3]));
        assert_eq!(insert_all(&mut s, vec![blk(5, 1)], t0), hs(&[2]));
        assert_eq!(s.stats().hits, 2);
    }

    #[test]
    fn checksums_are_kept_from_store_time() {
        let mut s = CpuStore::new(100);
        insert_all(&mut s, vec![blk(2, 8)], Instant::now());
        let (p, crc) = s.get_with_checksum(BlockHash(2)).unwrap();
        assert_eq!(crc, crc32fast::hash(&p));
        assert!(s.corrupt_for_test(BlockHash(2), Bytes::from(vec![0u8; 8])));
        let (p2, crc2) = s.get_with_checksum(BlockHash(2)).unwrap();
        assert_eq!(
            crc2, crc,
            "the checksum from store time survives corruption"
        );
        assert_ne!(crc32fast::hash(&p2), crc2);
    }

    #[test]
    fn a_pull_lands_in_a_tier_full_of_retained_blocks() {
        // A prefiller: every prompt block retained for its decoder (480 s), the tier full.
        // A history pull must still land: the oldest retention gives way, never the pull.
        let mut s = CpuStore::new(40);
        let t0 = Instant::now();
        insert_all(
            &mut s,
            vec![blk(1, 10), blk(2, 10), blk(3, 10), blk(4, 10)],
            t0,
        );
        let ttl = t0 + Duration::from_secs(480);
        assert_eq!(s.pin(PinKind::Retain, &hs(&[1, 2]), ttl, t0), 2);
        assert_eq!(s.pin(PinKind::Retain, &hs(&[3, 4]), ttl, t0), 2);
        let lease = t0 + Duration::from_secs(60);
        let mut ev = Vec::new();
        assert_eq!(s.land(blk(10, 10), lease, t0, &mut ev), Landed::Pinned);
        assert_eq!(ev, hs(&[1]), "the oldest retention evicted");
        assert_eq!(s.stats().retained_evicted_blocks, 1);
        // Unprotected blocks go before retained ones.
        s.unpin(PinKind::Pull, &hs(&[10]), t0);
        ev.clear();
        assert_eq!(s.land(blk(11, 10), lease, t0, &mut ev), Landed::Pinned);
        assert_eq!(ev, hs(&[10]));
        // Hard pins everywhere: rejected (the only rejection left).
        s.pin(PinKind::Use, &hs(&[2, 3, 4]), lease, t0);
        assert_eq!(s.land(blk(12, 10), lease, t0, &mut ev), Landed::Rejected);
    }

    #[test]
    fn ended_retentions_rejoin_the_lru_at_their_last_use() {
        let mut s = CpuStore::new(30);
        let t0 = Instant::now();
        insert_all(&mut s, vec![blk(1, 10), blk(2, 10), blk(3, 10)], t0);
        s.pin(
            PinKind::Retain,
            &hs(&[1]),
            t0 + Duration::from_millis(1),
            t0,
        );
        // Retention over: 1 is the least recently used again and goes first.
        let later = t0 + Duration::from_secs(1);
        assert_eq!(insert_all(&mut s, vec![blk(4, 10)], later), hs(&[1]));
        assert_eq!(s.stats().retained_evicted_blocks, 0);
        // Also when a longer retention retained before it still runs.
        let mut s = CpuStore::new(30);
        insert_all(&mut s, vec![blk(1, 10), blk(2, 10), blk(3, 10)], t0);
        s.pin(PinKind::Retain, &hs(&[2]), t0 + Duration::from_secs(60), t0);
        s.pin(
            PinKind::Retain,
            &hs(&[1]),
            t0 + Duration::from_millis(1),
            t0,
        );
        assert_eq!(insert_all(&mut s, vec![blk(4, 10)], later), hs(&[1]));
        // Released by its reader: at its last use too.
        s.pin(PinKind::Retain, &hs(&[3]), t0 + Duration::from_secs(60), t0);
        s.unpin(PinKind::Retain, &hs(&[3]), later);
        assert_eq!(insert_all(&mut s, vec![blk(5, 10)], later), hs(&[3]));
    }

    #[test]
    fn pull_pins_hold_at_most_their_share_of_the_tier() {
        let mut s = CpuStore::new(100);
        let t0 = Instant::now();
        let lease = t0 + Duration::from_secs(60);
        let mut ev = Vec::new();
        // Default: half of 10 blocks may be pinned by pulls; the rest land unpinned.
        let landed: Vec<Landed> = (1..=10)
            .map(|h| s.land(blk(h, 10), lease, t0, &mut ev))
            .collect();
        assert_eq!(&landed[..5], &[Landed::Pinned; 5]);
        assert_eq!(&landed[5..], &[Landed::Unpinned; 5]);
        assert_eq!(s.stats().pull_pin_capped_blocks, 5);
        // The tier keeps taking new blocks (evicting the unpinned half), never refusing.
        for h in 11..=20 {
            assert_eq!(s.land(blk(h, 10), lease, t0, &mut ev), Landed::Unpinned);
        }
        assert_eq!(s.stats().rejected_blocks, 0);
        assert!((1..=5).all(|h| s.contains(BlockHash(h))), "pinned kept");
        // A released pull pin frees its share.
        s.unpin(PinKind::Pull, &hs(&[1]), t0);
        assert_eq!(s.land(blk(21, 10), lease, t0, &mut ev), Landed::Pinned);
        // Expired pull pins are recounted at the cap, also ones taken after the last recount.
        let mut s = CpuStore::new(100);
        for h in 1..=5 {
            assert_eq!(s.land(blk(h, 10), lease, t0, &mut ev), Landed::Pinned);
        }
        assert_eq!(
            s.land(blk(6, 10), lease, t0, &mut ev),
            Landed::Unpinned,
            "recounted"
        );
        s.unpin(PinKind::Pull, &hs(&[5]), t0);
        let short = t0 + Duration::from_millis(1);
        assert_eq!(s.land(blk(7, 10), short, t0, &mut ev), Landed::Pinned);
        let later = t0 + Duration::from_secs(1);
        assert_eq!(s.land(blk(8, 10), lease, later, &mut ev), Landed::Pinned);
        // A zero share: every pulled block lands unpinned.
        s.set_pull_pin_fraction(0.0);
        assert_eq!(s.land(blk(9, 10), lease, later, &mut ev), Landed::Unpinned);
        assert_eq!(s.land(blk(9, 10), lease, later, &mut ev), Landed::Present);
    }

    #[test]
    fn pulled_blocks_count_as_external_once() {
        let mut s = CpuStore::new(100);
        let t0 = Instant::now();
        let lease = t0 + Duration::from_secs(60);
        let mut ev = Vec::new();
        s.land(blk(1, 10), lease, t0, &mut ev);
        s.land(blk(2, 10), lease, t0, &mut ev);
        s.insert(blk(3, 10), t0, &mut ev);
        let all = hs(&[1, 2, 3]);
        // Whichever request is scheduled first takes the flag; the next sees local blocks.
        assert_eq!(s.take_external(&all), 2);
        assert_eq!(s.take_external(&all), 0);
        // Present already when the pull lands: a local hit, not flagged.
        assert_eq!(s.land(blk(3, 10), lease, t0, &mut ev), Landed::Present);
        assert_eq!(s.take_external(&all), 0);
    }

    #[test]
    fn a_pull_landing_among_retained_blocks_does_not_rescan_its_own_pins() {
        // A P/D prefiller: its tier is full of retained prompts; a history read lands 10,000
        // blocks, each hard-pinned (Pull) as it lands. Each landing evicts one retained block;
        // it must not first step over every block the same pull already pinned (that was
        // 50 M steps here, seconds per real history read, under the tier's lock).
        let n = 10_000u64;
        let mut s = CpuStore::new(n);
        s.set_pull_pin_fraction(1.0);
        let t0 = Instant::now();
        let far = t0 + Duration::from_secs(600);
        insert_all(&mut s, (0..n).map(|h| blk(h, 1)).collect(), t0);
        let kept: Vec<BlockHash> = (0..n).map(BlockHash).collect();
        assert_eq!(s.pin(PinKind::Retain, &kept, far, t0), n as usize);
        let started = Instant::now();
        let mut ev = Vec::new();
        for h in 0..n {
            assert_eq!(
                s.land(blk(1_000_000 + h, 1), far, t0, &mut ev),
                Landed::Pinned
            );
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "landing {n} pulled blocks took {:?}",
            started.elapsed()
        );
        assert_eq!(s.stats().retained_evicted_blocks, n);
        assert!((0..n).all(|h| s.contains(BlockHash(1_000_000 + h))));
    }

    #[test]
    fn eviction_steps_over_many_pinned_blocks_cheaply() {
        // 20,000 pinned blocks at the LRU end (pulled blocks of queued requests) and 1,000
        // evictable ones: storing 20,000 more blocks must not rescan the pinned ones per
        // eviction (that was 400M steps under the tier lock), and once everything is pinned,
        // offers are refused without a rescan each.
        let pinned = 20_000u64;
        let mut s = CpuStore::new(pinned + 1_000);
        let t0 = Instant::now();
        let far = t0 + Duration::from_secs(600);
        insert_all(&mut s, (0..pinned).map(|h| blk(h, 1)).collect(), t0);
        let hashes: Vec<BlockHash> = (0..pinned).map(BlockHash).collect();
        assert_eq!(s.pin(PinKind::Use, &hashes, far, t0), pinned as usize);
        insert_all(
            &mut s,
            (pinned..pinned + 1_000).map(|h| blk(h, 1)).collect(),
            t0,
        );
        let started = Instant::now();
        let mut ev = Vec::new();
        for h in 0..20_000u64 {
            assert_eq!(
                s.insert(blk(1_000_000 + h, 1), t0, &mut ev),
                Inserted::Stored
            );
        }
        assert!(
            hashes.iter().all(|h| s.contains(*h)),
            "a pinned block was evicted"
        );
        assert_eq!(s.len() as u64, pinned + 1_000);
        // Now pin the unpinned rest: every further offer is refused.
        let tail: Vec<BlockHash> = (1_019_000..1_020_000).map(BlockHash).collect();
        assert_eq!(s.pin(PinKind::Use, &tail, far, t0), 1_000);
        for h in 0..20_000u64 {
            assert_eq!(
                s.insert(blk(2_000_000 + h, 1), t0, &mut ev),
                Inserted::Rejected
            );
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "evictions past pinned blocks took {:?}",
            started.elapsed()
        );
        // A released pin makes room again at once.
        s.unpin(PinKind::Use, &hashes[..1], t0);
        assert_eq!(s.insert(blk(3_000_000, 1), t0, &mut ev), Inserted::Stored);
        assert!(!s.contains(hashes[0]));
    }

    #[test]
    fn eviction_through_a_tier_of_retained_blocks_stays_cheap() {
        // A prefiller's steady state: 20,000 retained blocks, new blocks keep coming.
        let n = 20_000u64;
        let mut s = CpuStore::new(n);
        let t0 = Instant::now();
        let ttl = t0 + Duration::from_secs(480);
        insert_all(&mut s, (0..n).map(|h| blk(h, 1)).collect(), t0);
        let hashes: Vec<BlockHash> = (0..n).map(BlockHash).collect();
        s.pin(PinKind::Retain, &hashes, ttl, t0);
        let started = Instant::now();
        let mut ev = Vec::new();
        for h in 0..n {
            assert_eq!(
                s.insert(blk(1_000_000 + h, 1), t0, &mut ev),
                Inserted::Stored
            );
            s.pin(PinKind::Retain, &[BlockHash(1_000_000 + h)], ttl, t0);
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "evictions through retained blocks took {:?}",
            started.elapsed()
        );
        assert_eq!(s.stats().retained_evicted_blocks, n);
        assert!(!s.contains(BlockHash(0)) && s.contains(BlockHash(1_000_000)));
    }

    #[test]
    fn clear_forgets_everything() {
        let mut s = CpuStore::new(100);
        let t0 = Instant::now();
        insert_all(&mut s, vec![blk(1, 10), blk(2, 10)], t0);
        s.pin(PinKind::Retain, &hs(&[1]), t0 + Duration::from_secs(9), t0);
        s.clear();
        assert!(s.is_empty());
        assert_eq!(s.stats().used_bytes, 0);
        insert_all(&mut s, vec![blk(1, 10)], t0);
        assert_eq!(s.pin_count(BlockHash(1), t0), 0);
    }
}
