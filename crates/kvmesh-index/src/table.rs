//! One shard of the block table: an open-addressing hash table of atomics that readers probe
//! without any lock, while writers are serialised by a per-shard mutex.
//!
//! Why: lookups sweep every shard (3,750 keys of a 240K-token prompt touch all of them), so with
//! reader/writer locks a lookup stalls whenever a writer thread is descheduled while holding any
//! shard — measured at 20–40 ms p99 on a busy host. Here a reader never waits: it loads the
//! current table (`arc-swap`), probes, copies the masks and re-checks the key.
//!
//! Slot protocol (the only unsynchronised sharing):
//! - keys: `EMPTY` (never used; ends a probe), `TOMB` (deleted; probes continue), else the key.
//! - insert: masks are written first (slot masks are zero while free), then the key is published
//!   with `Release`; a reader that sees the key (`Acquire`) sees the masks.
//! - delete: the key becomes `TOMB` first, then the masks are zeroed; a reader that copied masks
//!   of a slot being recycled sees a different key on its re-check (after an `Acquire` fence) and
//!   retries.
//! - growth (or more endpoint words) builds a new table under the writer mutex and swaps it in;
//!   readers still holding the old one see a consistent, slightly older snapshot.

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

/// The stored form of a key: 0 and 1 are reserved, so they fold onto 2 and 3 (a 2⁻⁶³ collision,
/// the same order as any 64-bit chain-key collision, and equally harmless).
fn stored(key: ChainKey) -> u64 {
    if key.0 < 2 { key.0 + 2 } else { key.0 }
}

fn tier_off(tier: Tier) -> usize {
    match tier {
        Tier::Gpu => 0,
        Tier::Cpu => 1,
    }
}

#[derive(Debug)]
struct Table {
    keys: Box<[AtomicU64]>,
    used: Box<[AtomicU32]>,
    /// Per slot `2 × words` masks: `[gpu_w0, cpu_w0, gpu_w1, cpu_w1, ...]`.
    bits: Box<[AtomicU64]>,
    words: usize,
    mask: usize,
    /// Per-shard random value mixed into probe positions, so crafted prompts cannot build long
    /// probe chains.
    seed: u64,
}

impl Table {
    fn home(&self, key: u64) -> usize {
        let h = (key ^ self.seed).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (h ^ (h >> 29)) as usize
    }

    fn new(cap: usize, words: usize, seed: u64) -> Table {
        let cap = cap.next_power_of_two().max(8);
        Table {
            keys: (0..cap).map(|_| AtomicU64::new(EMPTY)).collect(),
            used: (0..cap).map(|_| AtomicU32::new(0)).collect(),
            bits: (0..cap * 2 * words).map(|_| AtomicU64::new(0)).collect(),
            words,
            mask: cap - 1,
            seed,
        }
    }

    fn cap(&self) -> usize {
        self.mask + 1
    }

    fn bytes(&self) -> usize {
        self.cap() * (8 + 4 + 16 * self.words)
    }

    fn slot_bits(&self, i: usize) -> &[AtomicU64] {
        &self.bits[i * 2 * self.words..(i + 1) * 2 * self.words]
    }

    /// Slot holding `key`, if any (writer side: no concurrent mutation).
    fn find(&self, key: u64) -> Option<usize> {
        let mut i = self.home(key) & self.mask;
        loop {
            match self.keys[i].load(Ordering::Relaxed) {
                EMPTY => return None,
                k if k == key => return Some(i),
                _ => i = (i + 1) & self.mask,
            }
        }
    }
}

#[derive(Debug, Default)]
struct Writer {
    live: usize,
    tombs: usize,
    memberships: u64,
    /// xorshift state for eviction sampling.
    rng: u64,
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
            table: ArcSwap::from_pointee(Table::new(8, 1, seed)),
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
            let mut i = t.home(key) & t.mask;
            loop {
                let k = t.keys[i].load(Ordering::Acquire);
                if k == EMPTY {
                    break 'retry;
                }
                if k == key {
                    let bits = t.slot_bits(i);
                    for (j, o) in out.iter_mut().enumerate() {
                        *o = bits.get(j).map_or(0, |b| b.load(Ordering::Relaxed));
                    }
                    fence(Ordering::Acquire);
                    if t.keys[i].load(Ordering::Relaxed) != key {
                        continue 'retry;
                    }
                    t.used[i].store(now, Ordering::Relaxed);
                    return true;
                }
                i = (i + 1) & t.mask;
            }
        }
        out.fill(0);
        false
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
        let mut w = self.writer.lock();
        let need_words = slot as usize / 64 + 1;
        let mut t = self.table.load_full();
        let i = match t.find(key) {
            Some(i) => i,
            None => {
                if t.words < need_words || (w.live + w.tombs + 1) * 4 > t.cap() * 3 {
                    t = self.rebuild(&mut w, &t, need_words.max(t.words));
                }
                // First free slot on the probe path (a tombstone or the ending empty slot).
                let mut i = t.home(key) & t.mask;
                while !matches!(t.keys[i].load(Ordering::Relaxed), EMPTY | TOMB) {
                    i = (i + 1) & t.mask;
                }
                if t.keys[i].load(Ordering::Relaxed) == TOMB {
                    w.tombs -= 1;
                }
                w.live += 1;
                t.used[i].store(now, Ordering::Relaxed);
                set_bit(&t, i, slot, tier, &mut w);
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
        };
        if t.words < need_words {
            t = self.rebuild(&mut w, &t, need_words);
        }
        let i = t.find(key).unwrap_or(i);
        t.used[i].store(now, Ordering::Relaxed);
        set_bit(&t, i, slot, tier, &mut w);
        WriteOutcome::default()
    }

    /// Clears `slot` from `key` in `tier` (both if `None`), deleting the block once nobody holds
    /// it. Returns whether `slot` still holds `key` in some tier.
    pub(crate) fn remove(&self, key: ChainKey, slot: u32, tier: Option<Tier>) -> bool {
        let key = stored(key);
        let mut w = self.writer.lock();
        let t = self.table.load_full();
        let Some(i) = t.find(key) else { return false };
        let word = slot as usize / 64;
        if word >= t.words {
            return false;
        }
        let bit = 1u64 << (slot % 64);
        let bits = t.slot_bits(i);
        let tiers: &[Tier] = match tier {
            Some(Tier::Gpu) => &[Tier::Gpu],
            Some(Tier::Cpu) => &[Tier::Cpu],
            None => &[Tier::Gpu, Tier::Cpu],
        };
        for t2 in tiers {
            let prev = bits[2 * word + tier_off(*t2)].fetch_and(!bit, Ordering::Relaxed);
            if prev & bit != 0 {
                w.memberships -= 1;
            }
        }
        let still = (bits[2 * word].load(Ordering::Relaxed)
            | bits[2 * word + 1].load(Ordering::Relaxed))
            & bit
            != 0;
        if bits.iter().all(|b| b.load(Ordering::Relaxed) == 0) {
            delete(&t, i, &mut w);
        }
        still
    }

    /// (blocks, memberships, bytes).
    pub(crate) fn stats(&self) -> (u64, u64, u64) {
        let w = self.writer.lock();
        let t = self.table.load();
        (w.live as u64, w.memberships, t.bytes() as u64)
    }

    /// A new table sized for twice the live blocks, with `words` mask words, holding every live
    /// block; swapped in for readers.
    fn rebuild(&self, w: &mut Writer, old: &Table, words: usize) -> Arc<Table> {
        let new = Table::new((w.live + 1) * 2, words, old.seed);
        for i in 0..old.cap() {
            let k = old.keys[i].load(Ordering::Relaxed);
            if k == EMPTY || k == TOMB {
                continue;
            }
            let mut j = new.home(k) & new.mask;
            while new.keys[j].load(Ordering::Relaxed) != EMPTY {
                j = (j + 1) & new.mask;
            }
            new.used[j].store(old.used[i].load(Ordering::Relaxed), Ordering::Relaxed);
            for (d, s) in new.slot_bits(j).iter().zip(old.slot_bits(i)) {
                d.store(s.load(Ordering::Relaxed), Ordering::Relaxed);
            }
            new.keys[j].store(k, Ordering::Relaxed);
        }
        w.tombs = 0;
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
        let start = w.rng as usize & t.mask;
        let mut victim: Option<(usize, u32)> = None;
        let mut sampled = 0;
        for n in 0..t.cap() {
            let i = (start + n) & t.mask;
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
        let lost: u64 = t
            .slot_bits(i)
            .iter()
            .map(|b| u64::from(b.load(Ordering::Relaxed).count_ones()))
            .sum();
        w.memberships -= lost;
        delete(t, i, w);
        true
    }
}

fn set_bit(t: &Table, i: usize, slot: u32, tier: Tier, w: &mut Writer) {
    let bit = 1u64 << (slot % 64);
    let prev =
        t.slot_bits(i)[2 * (slot as usize / 64) + tier_off(tier)].fetch_or(bit, Ordering::Relaxed);
    if prev & bit == 0 {
        w.memberships += 1;
    }
}

fn delete(t: &Table, i: usize, w: &mut Writer) {
    t.keys[i].store(TOMB, Ordering::Release);
    for b in t.slot_bits(i) {
        b.store(0, Ordering::Relaxed);
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
