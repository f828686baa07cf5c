//! One shard of the block table: an open-addressing hash table of atomics that readers probe
//! without any lock, while writers are serialised by a per-shard mutex.
//!
//! Why: lookups sweep every shard (3,750 keys of a 240K-token prompt touch all of them), so with
//! reader/writer locks a lookup stalls whenever a writer thread is descheduled while holding any
//! shard — measured at 20–40 ms p99 on a busy host. Here a reader never waits: it loads the
//! current table (`arc-swap`), probes, copies the membership and re-checks the key.
//!
//! Memberships: most blocks are held by one to three endpoints, so a slot's membership is one
//! word (`mem`) holding up to [`INLINE`] `(endpoint slot, tiers)` entries. A block held by more
//! endpoints (or by an endpoint slot too large to encode) *overflows*: `mem` then holds the index
//! of a record of `2 × words` mask words in the table's `arena`. Why: with full per-slot masks
//! (16 B per 64 endpoints per tier pair) a block held by one of 96 endpoints cost 44 B of slot
//! before load factor; inline it costs 20 B.
//!
//! Slot protocol (the only unsynchronised sharing):
//! - keys: `EMPTY` (never used; ends a probe), `TOMB` (deleted; probes continue), else the key.
//! - insert: `mem` is written first (it is zero while free), then the key is published with
//!   `Release`; a reader that sees the key (`Acquire`) sees the membership.
//! - an inline change is one atomic store of `mem`; an overflow conversion fills a zeroed arena
//!   record and then publishes its index in `mem` (`Release`).
//! - delete: the key becomes `TOMB` first, then `mem` and the arena record are zeroed (the record
//!   goes back to the free list); a reader re-checks key and `mem` after an `Acquire` fence and
//!   retries if either changed.
//! - growth (more slots, more endpoint words or a larger arena) builds a new table under the
//!   writer mutex and swaps it in; readers still holding the old one see a consistent, slightly
//!   older snapshot.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};

use arc_swap::ArcSwap;
use kvmesh_core::ChainKey;
use parking_lot::Mutex;

use crate::Tier;

/// Live blocks compared per eviction (approximate LRU; 16 makes evicting a block younger than
/// the youngest 1/8 of the shard a (1/8)^15 event).
const EVICTION_SAMPLE: usize = 16;

const EMPTY: u64 = 0;
const TOMB: u64 = 1;

/// Inline entries per `mem` word: 21 bits each, `(endpoint slot + 1) << 2 | tiers`
/// (bit 0 GPU, bit 1 CPU); 0 is a free entry. Bit 63 marks an overflow (`mem` low 32 bits =
/// arena record).
const INLINE: usize = 3;
const ENTRY_BITS: u32 = 21;
const ENTRY_MASK: u64 = (1 << ENTRY_BITS) - 1;
/// Largest endpoint slot an inline entry can name.
const MAX_INLINE_SLOT: u32 = (1 << (ENTRY_BITS - 2)) - 2;
const OVERFLOW: u64 = 1 << 63;

/// The stored form of a key: 0 and 1 are reserved, so they fold onto 2 and 3 (a 2⁻⁶³ collision,
/// the same order as any 64-bit chain-key collision, and equally harmless).
fn stored(key: ChainKey) -> u64 {
    if key.0 < 2 { key.0 + 2 } else { key.0 }
}

fn tier_bit(tier: Tier) -> u64 {
    match tier {
        Tier::Gpu => 1,
        Tier::Cpu => 2,
    }
}

/// The inline entries of `mem` as `(endpoint slot, tiers)`; free entries are skipped.
fn entries(mem: u64) -> impl Iterator<Item = (u32, u64)> {
    (0..INLINE).filter_map(move |e| {
        let v = (mem >> (ENTRY_BITS * e as u32)) & ENTRY_MASK;
        (v != 0).then(|| ((v >> 2) as u32 - 1, v & 3))
    })
}

fn entry(slot: u32, tiers: u64) -> u64 {
    (u64::from(slot + 1) << 2) | tiers
}

/// Memberships (set tier bits) of an inline `mem`.
fn inline_count(mem: u64) -> u64 {
    entries(mem).map(|(_, t)| u64::from(t.count_ones())).sum()
}

/// Writes the inline entries of `mem` into `[gpu_w0, cpu_w0, gpu_w1, ...]` masks (ORed in;
/// slots beyond `out` are dropped).
fn inline_to_masks(mem: u64, out: &mut [u64]) {
    for (slot, tiers) in entries(mem) {
        let w = 2 * (slot as usize / 64);
        let bit = 1u64 << (slot % 64);
        if tiers & 1 != 0
            && let Some(o) = out.get_mut(w)
        {
            *o |= bit;
        }
        if tiers & 2 != 0
            && let Some(o) = out.get_mut(w + 1)
        {
            *o |= bit;
        }
    }
}

/// Encodes masks inline if they fit.
fn masks_to_inline(masks: &[u64]) -> Option<u64> {
    let mut mem = 0u64;
    let mut n = 0;
    for w in 0..masks.len() / 2 {
        let (g, c) = (masks[2 * w], masks[2 * w + 1]);
        let mut both = g | c;
        while both != 0 {
            let b = both.trailing_zeros();
            both &= both - 1;
            let slot = (w * 64) as u32 + b;
            if n == INLINE || slot > MAX_INLINE_SLOT {
                return None;
            }
            let tiers = (g >> b & 1) | ((c >> b & 1) << 1);
            mem |= entry(slot, tiers) << (ENTRY_BITS * n as u32);
            n += 1;
        }
    }
    Some(mem)
}

#[derive(Debug)]
struct Table {
    keys: Box<[AtomicU64]>,
    used: Box<[AtomicU32]>,
    /// Per slot: inline entries, or `OVERFLOW | record`.
    mem: Box<[AtomicU64]>,
    /// Overflow records of `2 × words` masks: `[gpu_w0, cpu_w0, gpu_w1, cpu_w1, ...]`.
    arena: Box<[AtomicU64]>,
    words: usize,
    /// Slot count; not a power of two, so growth can be 1.5× (tables are 50–75 % full) rather
    /// than 2× (37.5–75 %): the slots are most of the index's memory.
    cap: usize,
    /// Per-shard random value mixed into probe positions, so crafted prompts cannot build long
    /// probe chains.
    seed: u64,
}

impl Table {
    /// Home slot of `key`: a full 64-bit mix (the splitmix64 finaliser) then multiply-shift range
    /// reduction. The mix must not share structure with the shard selection (which uses the high
    /// bits of `key × φ`): a shard holds keys whose high product bits agree, and reusing them here
    /// piled every key of a shard into a few probe clusters.
    fn home(&self, key: u64) -> usize {
        let mut z = key ^ self.seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        ((u128::from(z) * self.cap as u128) >> 64) as usize
    }

    fn next(&self, i: usize) -> usize {
        if i + 1 == self.cap { 0 } else { i + 1 }
    }

    fn new(cap: usize, words: usize, records: usize, seed: u64) -> Table {
        let cap = cap.max(8);
        Table {
            keys: (0..cap).map(|_| AtomicU64::new(EMPTY)).collect(),
            used: (0..cap).map(|_| AtomicU32::new(0)).collect(),
            mem: (0..cap).map(|_| AtomicU64::new(0)).collect(),
            arena: (0..records * 2 * words)
                .map(|_| AtomicU64::new(0))
                .collect(),
            words,
            cap,
            seed,
        }
    }

    fn cap(&self) -> usize {
        self.cap
    }

    fn records(&self) -> usize {
        self.arena.len() / (2 * self.words)
    }

    fn bytes(&self) -> usize {
        self.cap() * (8 + 4 + 8) + self.arena.len() * 8
    }

    fn record(&self, r: usize) -> &[AtomicU64] {
        self.arena
            .get(r * 2 * self.words..(r + 1) * 2 * self.words)
            .unwrap_or(&[])
    }

    /// Slot holding `key`, if any (writer side: no concurrent mutation).
    fn find(&self, key: u64) -> Option<usize> {
        let mut i = self.home(key);
        loop {
            match self.keys[i].load(Ordering::Relaxed) {
                EMPTY => return None,
                k if k == key => return Some(i),
                _ => i = self.next(i),
            }
        }
    }

    /// First free slot (tombstone or empty) on `key`'s probe path.
    fn free_slot(&self, key: u64) -> usize {
        let mut i = self.home(key);
        while !matches!(self.keys[i].load(Ordering::Relaxed), EMPTY | TOMB) {
            i = self.next(i);
        }
        i
    }
}

#[derive(Debug, Default)]
struct Writer {
    live: usize,
    tombs: usize,
    memberships: u64,
    /// Arena records handed out so far in the current table (the rest are never used).
    next_record: usize,
    /// Records freed since (reused first).
    free_records: Vec<u32>,
    /// xorshift state for eviction sampling.
    rng: u64,
}

impl Writer {
    fn overflowed(&self) -> usize {
        self.next_record - self.free_records.len()
    }
}

/// One shard. Padded so neighbouring shards' mutexes do not share a cache line.
#[repr(align(128))]
#[derive(Debug)]
pub(crate) struct Shard {
    table: ArcSwap<Table>,
    writer: Mutex<Writer>,
}

/// What a write did to the shard's counters.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct WriteOutcome {
    pub(crate) evicted: u64,
}

impl Shard {
    pub(crate) fn new(seed: u64) -> Shard {
        Shard {
            table: ArcSwap::from_pointee(Table::new(8, 1, 0, seed)),
            writer: Mutex::new(Writer {
                rng: seed | 1,
                ..Writer::default()
            }),
        }
    }

    /// Copies `key`'s masks into `out` (`[gpu_w0, cpu_w0, ...]`, zero-filled) and marks it used.
    /// Returns false (and zeroes `out`) if absent. Never blocks.
    pub(crate) fn read(&self, key: ChainKey, out: &mut [u64], now: u32) -> bool {
        let key = stored(key);
        let t = self.table.load();
        'retry: for _ in 0..4 {
            let mut i = t.home(key);
            loop {
                let k = t.keys[i].load(Ordering::Acquire);
                if k == EMPTY {
                    break 'retry;
                }
                if k == key {
                    let m = t.mem[i].load(Ordering::Acquire);
                    out.fill(0);
                    if m & OVERFLOW == 0 {
                        inline_to_masks(m, out);
                    } else {
                        let rec = t.record((m & u64::from(u32::MAX)) as usize);
                        for (o, b) in out.iter_mut().zip(rec) {
                            *o = b.load(Ordering::Relaxed);
                        }
                    }
                    fence(Ordering::Acquire);
                    if t.keys[i].load(Ordering::Relaxed) != key
                        || t.mem[i].load(Ordering::Relaxed) != m
                    {
                        continue 'retry;
                    }
                    t.used[i].store(now, Ordering::Relaxed);
                    return true;
                }
                i = t.next(i);
            }
        }
        out.fill(0);
        false
    }

    /// When `key` was last stored or looked up (the index's logical clock), if it is held. Does
    /// not mark it used. Writer side: takes the shard's mutex briefly.
    pub(crate) fn last_used(&self, key: ChainKey) -> Option<u32> {
        let key = stored(key);
        let _w = self.writer.lock();
        let t = self.table.load();
        t.find(key).map(|i| t.used[i].load(Ordering::Relaxed))
    }

    /// Sets `slot` in `tier` for `key`, inserting the block if new. Keeps at most `cap` blocks by
    /// evicting the least recently used of a sample per insert beyond it.
    pub(crate) fn add(
        &self,
        key: ChainKey,
        slot: u32,
        tier: Tier,
        now: u32,
        cap: usize,
    ) -> WriteOutcome {
        let key = stored(key);
        let tb = tier_bit(tier);
        let mut w = self.writer.lock();
        let need_words = slot as usize / 64 + 1;
        let mut t = self.table.load_full();
        if t.find(key).is_none() && (w.live + w.tombs + 1) * 4 > t.cap() * 3 {
            let (grown, records) = ((w.live + 1) * 2, t.records());
            t = self.rebuild(&mut w, &t, grown, t.words, records);
        }
        // At most two passes: a rebuild for overflow room guarantees the second succeeds.
        loop {
            let found = t.find(key);
            let i = found.unwrap_or_else(|| t.free_slot(key));
            let m = if found.is_some() {
                t.mem[i].load(Ordering::Relaxed)
            } else {
                0
            };
            if m & OVERFLOW != 0 {
                if t.words < need_words {
                    let records = t.records();
                    t = self.rebuild(&mut w, &t, t.cap(), need_words, records);
                    continue;
                }
                let rec = t.record((m & u64::from(u32::MAX)) as usize);
                let word = 2 * (slot as usize / 64) + (tb as usize - 1);
                let bit = 1u64 << (slot % 64);
                if let Some(b) = rec.get(word)
                    && b.fetch_or(bit, Ordering::Relaxed) & bit == 0
                {
                    w.memberships += 1;
                }
                t.used[i].store(now, Ordering::Relaxed);
                return WriteOutcome::default();
            }
            // Inline: update the slot's entry or take a free one.
            let mut new = None;
            let mut free_pos = None;
            for e in 0..INLINE {
                let v = (m >> (ENTRY_BITS * e as u32)) & ENTRY_MASK;
                if v == 0 {
                    free_pos.get_or_insert(e);
                } else if (v >> 2) as u32 - 1 == slot {
                    if v & tb != 0 {
                        t.used[i].store(now, Ordering::Relaxed);
                        return WriteOutcome::default();
                    }
                    new = Some(m | (tb << (ENTRY_BITS * e as u32)));
                }
            }
            if new.is_none()
                && slot <= MAX_INLINE_SLOT
                && let Some(e) = free_pos
            {
                new = Some(m | (entry(slot, tb) << (ENTRY_BITS * e as u32)));
            }
            let publish = match new {
                Some(new) => new,
                None => {
                    // Overflow: needs a record wide enough for every member.
                    let words = entries(m)
                        .map(|(s, _)| s as usize / 64 + 1)
                        .fold(need_words.max(t.words), usize::max);
                    let room = !w.free_records.is_empty() || w.next_record < t.records();
                    if t.words < words || !room {
                        let records = (w.overflowed() + 1) * 2;
                        let records = records.max(t.cap() / 16).max(8);
                        t = self.rebuild(&mut w, &t, t.cap(), words, records);
                        continue;
                    }
                    let r = match w.free_records.pop() {
                        Some(r) => r as usize,
                        None => {
                            w.next_record += 1;
                            w.next_record - 1
                        }
                    };
                    // Free records are zeroed; readers cannot see this one until `mem` names it.
                    let rec = t.record(r);
                    let set = |slot: u32, tiers: u64| {
                        for off in 0..2 {
                            if tiers & (1 << off) != 0
                                && let Some(b) = rec.get(2 * (slot as usize / 64) + off)
                            {
                                b.fetch_or(1 << (slot % 64), Ordering::Relaxed);
                            }
                        }
                    };
                    entries(m).for_each(|(s, tiers)| set(s, tiers));
                    set(slot, tb);
                    OVERFLOW | r as u64
                }
            };
            w.memberships += 1;
            t.used[i].store(now, Ordering::Relaxed);
            t.mem[i].store(publish, Ordering::Release);
            if found.is_some() {
                return WriteOutcome::default();
            }
            if t.keys[i].load(Ordering::Relaxed) == TOMB {
                w.tombs -= 1;
            }
            w.live += 1;
            t.keys[i].store(key, Ordering::Release);
            let mut out = WriteOutcome::default();
            while w.live > cap.max(1) {
                if self.evict_one(&mut w, &t, now, i) {
                    out.evicted += 1;
                } else {
                    break;
                }
            }
            return out;
        }
    }

    /// Clears `slot` from `key` in `tier` (both if `None`), deleting the block once nobody holds
    /// it. Returns whether `slot` still holds `key` in some tier.
    pub(crate) fn remove(&self, key: ChainKey, slot: u32, tier: Option<Tier>) -> bool {
        let key = stored(key);
        let mut w = self.writer.lock();
        let t = self.table.load_full();
        let Some(i) = t.find(key) else { return false };
        let clear = tier.map_or(3, tier_bit);
        let m = t.mem[i].load(Ordering::Relaxed);
        if m & OVERFLOW == 0 {
            let mut new = m;
            let mut still = false;
            for e in 0..INLINE {
                let shift = ENTRY_BITS * e as u32;
                let v = (m >> shift) & ENTRY_MASK;
                if v == 0 || (v >> 2) as u32 - 1 != slot {
                    continue;
                }
                let left = v & 3 & !clear;
                w.memberships -= u64::from((v & 3 & clear).count_ones());
                still = left != 0;
                new &= !(ENTRY_MASK << shift);
                if still {
                    new |= entry(slot, left) << shift;
                }
            }
            if new == 0 {
                delete(&t, i, &mut w);
            } else if new != m {
                t.mem[i].store(new, Ordering::Release);
            }
            return still;
        }
        let rec = t.record((m & u64::from(u32::MAX)) as usize);
        let word = slot as usize / 64;
        if word >= t.words {
            return false;
        }
        let bit = 1u64 << (slot % 64);
        for off in 0..2 {
            if clear & (1 << off) != 0
                && let Some(b) = rec.get(2 * word + off)
                && b.fetch_and(!bit, Ordering::Relaxed) & bit != 0
            {
                w.memberships -= 1;
            }
        }
        let still = rec.get(2 * word..2 * word + 2).is_some_and(|b| {
            (b[0].load(Ordering::Relaxed) | b[1].load(Ordering::Relaxed)) & bit != 0
        });
        if rec.iter().all(|b| b.load(Ordering::Relaxed) == 0) {
            delete(&t, i, &mut w);
        }
        still
    }

    /// (blocks, memberships, bytes).
    pub(crate) fn stats(&self) -> (u64, u64, u64) {
        let w = self.writer.lock();
        let t = self.table.load();
        let bytes = t.bytes() + w.free_records.capacity() * 4;
        (w.live as u64, w.memberships, bytes as u64)
    }

    /// A new table of `cap` slots (at least 4/3 of the live blocks), `words` mask words and room
    /// for `records` overflow records (at least those in use), holding every live block; swapped
    /// in for readers. Overflowed blocks that fit inline again are moved back inline.
    fn rebuild(
        &self,
        w: &mut Writer,
        old: &Table,
        cap: usize,
        words: usize,
        records: usize,
    ) -> Arc<Table> {
        let records = records.max(w.overflowed());
        // Never above 3/4 full (probe chains must end).
        let new = Table::new(cap.max((w.live + 1) * 4 / 3 + 1), words, records, old.seed);
        let mut next = 0usize;
        let mut masks = vec![0u64; 2 * words];
        for i in 0..old.cap() {
            let k = old.keys[i].load(Ordering::Relaxed);
            if k == EMPTY || k == TOMB {
                continue;
            }
            let j = new.free_slot(k);
            new.used[j].store(old.used[i].load(Ordering::Relaxed), Ordering::Relaxed);
            let m = old.mem[i].load(Ordering::Relaxed);
            let m = if m & OVERFLOW == 0 {
                m
            } else {
                masks.fill(0);
                for (d, s) in masks
                    .iter_mut()
                    .zip(old.record((m & u64::from(u32::MAX)) as usize))
                {
                    *d = s.load(Ordering::Relaxed);
                }
                match masks_to_inline(&masks) {
                    Some(inline) => inline,
                    None => {
                        for (d, s) in new.record(next).iter().zip(&masks) {
                            d.store(*s, Ordering::Relaxed);
                        }
                        next += 1;
                        OVERFLOW | (next - 1) as u64
                    }
                }
            };
            new.mem[j].store(m, Ordering::Relaxed);
            new.keys[j].store(k, Ordering::Relaxed);
        }
        w.tombs = 0;
        w.next_record = next;
        w.free_records = Vec::new();
        let new = Arc::new(new);
        self.table.store(Arc::clone(&new));
        new
    }

    /// Deletes the oldest of the next [`EVICTION_SAMPLE`] live blocks from a random start (hash
    /// order is unrelated to age), never `keep`. Returns whether one was deleted.
    fn evict_one(&self, w: &mut Writer, t: &Table, now: u32, keep: usize) -> bool {
        w.rng ^= w.rng << 13;
        w.rng ^= w.rng >> 7;
        w.rng ^= w.rng << 17;
        let start = (w.rng % t.cap as u64) as usize;
        let mut victim: Option<(usize, u32)> = None;
        let mut sampled = 0;
        for n in 0..t.cap() {
            let i = (start + n) % t.cap;
            let k = t.keys[i].load(Ordering::Relaxed);
            if k == EMPTY || k == TOMB || i == keep {
                continue;
            }
            let age = now.wrapping_sub(t.used[i].load(Ordering::Relaxed));
            if victim.is_none_or(|(_, a)| age > a) {
                victim = Some((i, age));
            }
            sampled += 1;
            if sampled == EVICTION_SAMPLE {
                break;
            }
        }
        let Some((i, _)) = victim else { return false };
        let m = t.mem[i].load(Ordering::Relaxed);
        let lost = if m & OVERFLOW == 0 {
            inline_count(m)
        } else {
            t.record((m & u64::from(u32::MAX)) as usize)
                .iter()
                .map(|b| u64::from(b.load(Ordering::Relaxed).count_ones()))
                .sum()
        };
        w.memberships -= lost;
        delete(t, i, w);
        true
    }
}

fn delete(t: &Table, i: usize, w: &mut Writer) {
    t.keys[i].store(TOMB, Ordering::Release);
    let m = t.mem[i].swap(0, Ordering::Relaxed);
    if m & OVERFLOW != 0 {
        let r = (m & u64::from(u32::MAX)) as usize;
        for b in t.record(r) {
            b.store(0, Ordering::Relaxed);
        }
        w.free_records.push(r as u32);
    }
    w.live -= 1;
    w.tombs += 1;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_read_remove_grow_and_widen() {
        let s = Shard::new(7);
        let mut out = [0u64; 4];
        for k in 4..1004u64 {
            s.add(ChainKey(k), (k % 3) as u32, Tier::Gpu, 1, usize::MAX);
        }
        assert!(s.read(ChainKey(5), &mut out, 2));
        assert_eq!(out, [1 << 2, 0, 0, 0], "key 5 is held by slot 5 % 3 = 2");
        s.add(ChainKey(5), 100, Tier::Cpu, 3, usize::MAX);
        assert!(s.read(ChainKey(5), &mut out, 4));
        assert_eq!(out, [1 << 2, 0, 0, 1 << 36]);
        assert!(!s.remove(ChainKey(5), 2, Some(Tier::Gpu)));
        assert!(
            s.remove(ChainKey(5), 100, Some(Tier::Gpu)),
            "still held in CPU"
        );
        assert!(!s.remove(ChainKey(5), 100, None));
        assert!(!s.read(ChainKey(5), &mut out, 5));
        let (blocks, members, _) = s.stats();
        assert_eq!((blocks, members), (999, 999));
        for k in 4..1004u64 {
            s.remove(ChainKey(k), (k % 3) as u32, None);
        }
        assert_eq!(s.stats().0, 0);
    }

    /// Blocks held by more endpoints than fit inline overflow into the arena and keep exact
    /// masks through growth, widening, removals and record reuse; once they fit again a rebuild
    /// moves them back inline.
    #[test]
    fn overflow_records_hold_exact_masks() {
        let s = Shard::new(9);
        let mut out = [0u64; 6];
        let slots = [0u32, 5, 63, 64, 130];
        for k in 4..504u64 {
            for (n, &slot) in slots.iter().enumerate() {
                let tier = if n % 2 == 0 { Tier::Gpu } else { Tier::Cpu };
                s.add(ChainKey(k), slot, tier, 1, usize::MAX);
            }
            s.add(ChainKey(k), 5, Tier::Gpu, 1, usize::MAX);
        }
        let gpu = [1u64 | 1 << 5 | 1 << 63, 0, 1 << 2];
        let cpu = [1u64 << 5, 1, 0];
        for k in 4..504u64 {
            assert!(s.read(ChainKey(k), &mut out, 2));
            assert_eq!(
                out,
                [gpu[0], cpu[0], gpu[1], cpu[1], gpu[2], cpu[2]],
                "key {k}"
            );
        }
        assert_eq!(s.stats().1, 500 * 6);
        // Down to two members: still exact, and a rebuild (forced by growth) moves them inline.
        for k in 4..504u64 {
            assert!(!s.remove(ChainKey(k), 63, None));
            assert!(!s.remove(ChainKey(k), 64, Some(Tier::Cpu)));
            assert!(s.remove(ChainKey(k), 5, Some(Tier::Cpu)), "5 still in GPU");
        }
        for k in 1000..3000u64 {
            s.add(ChainKey(k), 1, Tier::Gpu, 3, usize::MAX);
        }
        for k in 4..504u64 {
            assert!(s.read(ChainKey(k), &mut out, 4));
            assert_eq!(out, [1 | 1 << 5, 0, 0, 0, 1 << 2, 0], "key {k}");
        }
        assert_eq!(s.stats().1, 500 * 3 + 2000);
        // Records freed by deletion are reused.
        for k in 4..504u64 {
            for slot in [0u32, 5, 130] {
                s.remove(ChainKey(k), slot, None);
            }
            assert!(!s.read(ChainKey(k), &mut out, 5));
        }
        for k in 4..504u64 {
            for slot in 0..5u32 {
                s.add(ChainKey(k), slot, Tier::Cpu, 6, usize::MAX);
            }
        }
        assert!(s.read(ChainKey(7), &mut out, 7));
        assert_eq!(out, [0, 0b11111, 0, 0, 0, 0]);
        assert_eq!(s.stats(), (2500, 2000 + 2500, s.stats().2));
    }

    #[test]
    fn eviction_keeps_the_bound() {
        let s = Shard::new(7);
        let mut evicted = 0;
        for k in 4..10_004u64 {
            evicted += s.add(ChainKey(k), 0, Tier::Gpu, k as u32, 100).evicted;
        }
        assert_eq!(s.stats().0, 100);
        assert_eq!(evicted, 9_900);
    }
}
#[cfg(test)]
mod eviction_tests {
    use super::*;

    /// Regression: sampling 32 *slots* at 25 % load sometimes saw only the hot block.
    #[test]
    fn recently_read_blocks_survive_eviction() {
        let s = Shard::new(7);
        let mut out = [0u64; 2];
        let mut now = 0u32;
        s.add(ChainKey(5), 0, Tier::Gpu, now, 256);
        for k in 0..20_000u64 {
            now += 1;
            s.add(ChainKey(k + 100), 0, Tier::Gpu, now, 256);
            if k % 16 == 0 {
                now += 1;
                assert!(s.read(ChainKey(5), &mut out, now), "lost at {k}");
            }
        }
    }
}

#[cfg(test)]
mod concurrency_tests {
    use super::*;

    /// Slots are recycled constantly (evictions at a bound of 8, removals) between keys held by
    /// different endpoint slots; a lock-free reader must never attribute one key's masks to
    /// another. A stress test: it catches stale masks on recycled slots; the narrower race the
    /// key re-check guards against is rarely hit on a 2-core machine.
    /// Same with every block overflowing (5 endpoint slots per key): arena records are freed
    /// and handed to other keys constantly.
    #[test]
    fn readers_never_see_another_keys_overflow_records() {
        let shard = Shard::new(5);
        let stop = std::sync::atomic::AtomicBool::new(false);
        let slots = |k: u64| (0..5u32).map(move |j| (k as u32 * 7 + j) % 40);
        let expect = |k: u64| slots(k).fold(0u64, |m, s| m | 1 << s);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                for round in 0..8_000u64 {
                    for k in 10..40u64 {
                        for s in slots(k) {
                            shard.add(ChainKey(k), s, Tier::Gpu, round as u32, 8);
                        }
                    }
                    if round % 2 == 0 {
                        for k in 10..40u64 {
                            for s in slots(k) {
                                shard.remove(ChainKey(k), s, None);
                            }
                        }
                    }
                }
                stop.store(true, Ordering::Relaxed);
            });
            scope.spawn(|| {
                let mut out = [0u64; 2];
                let mut seen = 0u64;
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
                while !stop.load(Ordering::Relaxed) && std::time::Instant::now() < deadline {
                    for k in 10..40u64 {
                        if shard.read(ChainKey(k), &mut out, 0) {
                            assert_eq!(out[0] & !expect(k), 0, "key {k} read masks {out:?}");
                            assert_eq!(out[1], 0);
                            seen += 1;
                        }
                    }
                }
                assert!(seen > 0, "reader saw the writer's blocks at least once");
            });
        });
    }

    #[test]
    fn readers_never_see_another_keys_masks() {
        let shard = Shard::new(3);
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                for round in 0..40_000u64 {
                    for k in 10..40u64 {
                        // Key k is only ever held by endpoint slot k % 7; a bound of 8 blocks
                        // makes every insert evict, so slots are recycled with masks set.
                        shard.add(ChainKey(k), (k % 7) as u32, Tier::Gpu, round as u32, 8);
                    }
                    if round % 2 == 0 {
                        for k in 10..40u64 {
                            shard.remove(ChainKey(k), (k % 7) as u32, None);
                        }
                    }
                }
                stop.store(true, Ordering::Relaxed);
            });
            scope.spawn(|| {
                let mut out = [0u64; 2];
                let mut seen = 0u64;
                // Bounded even if the writer dies.
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
                while !stop.load(Ordering::Relaxed) && std::time::Instant::now() < deadline {
                    for k in 10..40u64 {
                        if shard.read(ChainKey(k), &mut out, 0) {
                            assert!(
                                out[0] == 0 || out[0] == 1 << (k % 7),
                                "key {k} read masks {out:?}"
                            );
                            assert_eq!(out[1], 0);
                            seen += 1;
                        }
                    }
                }
                assert!(seen > 0, "reader saw the writer's blocks at least once");
            });
        });
    }
}
