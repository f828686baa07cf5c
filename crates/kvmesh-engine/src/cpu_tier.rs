//! The CPU tier: a byte-capped LRU store of offloaded KV block payloads keyed by block hash.
//!
//! [`CpuStore`] is the pure data structure (explicit `now`, events pushed to a `Vec`).
//! [`CpuTier`] shares it across threads (`Arc<CpuTier>`, one `parking_lot` mutex never held
//! across `.await`) so the P2P producer can serve blocks without touching the compute loop, and
//! adds the *pending* registry: blocks a running request is computing right now, which a peer may
//! wait for ([`CpuTier::wait_ready`]).
//!
//! Pins come in three kinds ([`PinKind`]): `Use` (a peer's fetch in progress), `Pull` (landed by
//! a pull for a request not yet scheduled) and `Retain` (kept for a P/D remote reader until its
//! expiry). `Use` and `Pull` are hard: such a block is never evicted. `Retain` is soft: retained
//! blocks live in their own LRU and are evicted, oldest retention first, only once no unprotected
//! block is left — a retention is a promise to a reader that may never come (or already came: a
//! peer's read of a retained block releases one retention), and must not make the tier refuse the
//! blocks a pull is landing for a request being served now. Blocks held by `Pull` leases are
//! capped at a fraction of the capacity ([`DEFAULT_PULL_PIN_FRACTION`]); beyond it a pulled block
//! lands unpinned.
//!
//! Invariants: `used_bytes` = sum of stored payload lengths ≤ capacity; a block holding at least
//! one unexpired hard pin is never evicted; pins are counted (each `pin` adds a lease with its own
//! expiry, each `unpin` releases one of that kind), so two peers pinning the same block cannot
//! release each other's protection; a block landed by a pull carries an *external* flag until
//! the first request that asked for it restores it ([`CpuTier::take_external`]), so pulled tokens
//! count as external hits exactly once whatever the order of the requests sharing them; every stored payload keeps the CRC32 taken when it was stored (a peer
//! serving it sends that checksum, so corruption at rest is caught by the receiver); every
//! store/evict publishes `BlockStored`/`BlockRemoved` with medium CPU, in order (published under
//! the lock).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use bytes::Bytes;
use hashbrown::{HashMap, HashSet};
use kvmesh_core::events::{BlockRemoved, BlockStored};
use kvmesh_core::{BlockHash, KvEvent, Medium, TokenId};
use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::outbox::KvEventSink;

/// One block to store: its hash, its parent's hash (None for the first block), its tokens and
/// the KV payload bytes.
#[derive(Debug, Clone)]
pub struct OffloadBlock {
    pub hash: BlockHash,
    pub parent: Option<BlockHash>,
    pub tokens: Vec<TokenId>,
    pub payload: Bytes,
}

#[derive(Debug)]
struct Entry {
    payload: Bytes,
    parent: Option<BlockHash>,
    tokens: Arc<[TokenId]>,
    tick: u64,
    /// CRC32 of `payload`, taken at store time.
    crc: u32,
    /// Expiry of each live `Use` pin (one entry per pin; expired entries are dropped lazily).
    leases: Vec<Instant>,
    /// Expiry of each live `Pull` pin.
    pulled: Vec<Instant>,
    /// Expiry of each live `Retain` pin (soft).
    retained: Vec<Instant>,
    /// Key in `CpuStore::retained_lru` while indexed there (instead of in `lru` at `tick`).
    rkey: Option<u64>,
    /// Counted in `CpuStore::pull_pinned_bytes`.
    pull_counted: bool,
    /// Landed by a pull and not yet counted as an external hit.
    external: bool,
}

impl Entry {
    fn new(b: &OffloadBlock, tick: u64) -> Self {
        Self {
            payload: b.payload.clone(),
            parent: b.parent,
            tokens: b.tokens.as_slice().into(),
            tick,
            crc: crc32fast::hash(&b.payload),
            leases: Vec::new(),
            pulled: Vec::new(),
            retained: Vec::new(),
            rkey: None,
            pull_counted: false,
            external: false,
        }
    }

    /// Earliest expiry among live hard (`Use`, `Pull`) pins; None when no hard pin is live.
    fn hard_expiry(&self, now: Instant) -> Option<Instant> {
        self.leases
            .iter()
            .chain(&self.pulled)
            .copied()
            .filter(|&t| t > now)
            .min()
    }

    fn leases_mut(&mut self, kind: PinKind) -> &mut Vec<Instant> {
        match kind {
            PinKind::Use => &mut self.leases,
            PinKind::Pull => &mut self.pulled,
            PinKind::Retain => &mut self.retained,
        }
    }
}

/// Why a block is pinned (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PinKind {
    /// A peer's fetch (or a waiting request) uses the block: hard.
    Use,
    /// Landed by a pull for a request not yet scheduled: hard, capped.
    Pull,
    /// Kept for a P/D remote reader: soft (evicted after unprotected blocks).
    Retain,
}

/// Default share of the tier's capacity that `Pull` pins may hold.
pub const DEFAULT_PULL_PIN_FRACTION: f64 = 0.5;

/// What [`CpuTier::insert_external_pinned`] did with a pulled block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Landed {
    /// Stored and pinned (`Pull`) until the request is scheduled.
    Pinned,
    /// Stored without a pin: `Pull` pins already hold their share of the tier.
    Unpinned,
    /// Already here (computed or landed meanwhile): a local hit, not pinned.
    Present,
    /// Could not be stored: hard pins fill the tier.
    Rejected,
}

/// Per-block answer to a peer's lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockStatus {
    Hit,
    /// Being computed by a running request; may become a hit.
    Pending,
    Miss,
}

/// Counters of the CPU tier (exported as `kvmesh_engine_cpu_*`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpuTierStats {
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub blocks: u64,
    pub stored_blocks: u64,
    pub evicted_blocks: u64,
    /// Inserts refused because pinned blocks filled the tier (or a payload exceeded capacity).
    pub rejected_blocks: u64,
    pub hits: u64,
    /// Retained (`Retain`-pinned) blocks evicted under pressure before their retention expired.
    pub retained_evicted_blocks: u64,
    /// Pulled blocks stored without a pin because `Pull` pins held their share of the tier.
    pub pull_pin_capped_blocks: u64,
}

/// Hard-pinned blocks one eviction steps over before evicting a retained block instead.
const MAX_PINNED_STEPS: usize = 64;

/// Byte-capped LRU store of block payloads (pure data structure).
#[derive(Debug)]
pub struct CpuStore {
    block_size: u32,
    capacity: u64,
    used: u64,
    entries: HashMap<BlockHash, Entry>,
    lru: BTreeMap<u64, BlockHash>,
    /// Blocks with a (possibly expired) retention, by when they were retained: evicted only
    /// when `lru` has nothing evictable, oldest retention first.
    retained_lru: BTreeMap<u64, BlockHash>,
    tick: u64,
    stats: CpuTierStats,
    /// Bytes of blocks holding a `Pull` pin (expired pins counted until the next recount).
    pull_pinned_bytes: u64,
    /// Cap on `pull_pinned_bytes`.
    pull_pin_cap: u64,
    /// No recount of `pull_pinned_bytes` is useful before this (earliest `Pull` expiry seen).
    pull_recount_after: Option<Instant>,
    /// Set when an eviction scan found every block pinned: until this instant (the earliest
    /// lease expiry seen) or the next unpin/insert/clear, evictions fail at once instead of
    /// rescanning the whole tier for every block offered (that rescan, under the tier's lock,
    /// stalled the compute loop and the producer when pulled blocks filled the tier).
    all_pinned_until: Option<Instant>,
}

impl CpuStore {
    pub fn new(capacity_bytes: u64, block_size: usize) -> Self {
        Self {
            block_size: block_size as u32,
            capacity: capacity_bytes,
            used: 0,
            entries: HashMap::new(),
            lru: BTreeMap::new(),
            retained_lru: BTreeMap::new(),
            tick: 0,
            stats: CpuTierStats {
                capacity_bytes,
                ..Default::default()
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

    pub fn used_bytes(&self) -> u64 {
        self.used
    }

    pub fn stats(&self) -> CpuTierStats {
        CpuTierStats {
            used_bytes: self.used,
            blocks: self.entries.len() as u64,
            ..self.stats
        }
    }

    fn touch(&mut self, hash: BlockHash) {
        if let Some(e) = self.entries.get_mut(&hash) {
            self.tick += 1;
            if e.rkey.is_none() {
                self.lru.remove(&e.tick);
                self.lru.insert(self.tick, hash);
            }
            // A retained block keeps its retention order; `tick` is where it rejoins `lru`.
            e.tick = self.tick;
        }
    }

    /// Moves blocks whose retentions all expired from `retained_lru` back to `lru` (at their
    /// last-use position), oldest retention first; stops at the first still retained.
    fn expire_retentions(&mut self, now: Instant) {
        while let Some((&k, &hash)) = self.retained_lru.first_key_value() {
            let Some(e) = self.entries.get_mut(&hash) else {
                self.retained_lru.remove(&k);
                continue;
            };
            e.retained.retain(|&t| t > now);
            if !e.retained.is_empty() {
                break;
            }
            self.retained_lru.remove(&k);
            e.rkey = None;
            self.lru.insert(e.tick, hash);
        }
    }

    /// Marks the stored ones of `hashes` (a prefix, in order) recently used without reading
    /// them: a request that hits these blocks in the GPU tier is using them, so their CPU copies
    /// (the ones peers pull) must not age out meanwhile (vLLM's offloading manager `touch`).
    /// Touched tail first, so the head ends most recent: LRU then evicts a prefix from its tail,
    /// and what stays is still a usable prefix (a lost first block makes the rest unreachable).
    pub fn touch_all(&mut self, hashes: &[BlockHash]) {
        for &hash in hashes.iter().rev() {
            self.touch(hash);
        }
    }

    /// The payload (cheap clone) and marks it recently used.
    pub fn get(&mut self, hash: BlockHash) -> Option<Bytes> {
        let payload = self.entries.get(&hash)?.payload.clone();
        self.touch(hash);
        self.stats.hits += 1;
        Some(payload)
    }

    /// The tokens and parent of a stored block (for re-publishing or serving metadata).
    pub fn meta(&self, hash: BlockHash) -> Option<(Option<BlockHash>, Arc<[TokenId]>)> {
        self.entries
            .get(&hash)
            .map(|e| (e.parent, e.tokens.clone()))
    }

    /// Length of the leading run of `hashes` stored here.
    pub fn lookup_prefix(&self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.entries.contains_key(*h))
            .count()
    }

    /// Evicts the least recently used unprotected block, else the oldest retained block without
    /// a hard pin. Hard-pinned blocks met on the way are in use (a queued request or a peer's
    /// fetch holds them): they move to the recent end, so each is stepped over once per pass
    /// instead of once per eviction (amortised O(log n); the old scan from the LRU end was
    /// O(pinned) per evicted block).
    fn evict_one(&mut self, now: Instant, removed: &mut Vec<BlockHash>) -> bool {
        if self.all_pinned_until.is_some_and(|t| now < t) {
            return false;
        }
        self.expire_retentions(now);
        let mut earliest_expiry: Option<Instant> = None;
        // With retained blocks as a fallback, step over at most a few hard-pinned blocks of `lru`
        // per eviction: a pull landing thousands of blocks pins each as it lands, and a full pass
        // over them for every later block of the same pull cost O(pinned) per block (seconds per
        // history read, stalling the runtime the pull runs on). The stepped-over ones move to the
        // recent end, so later evictions reach the unpinned blocks behind them.
        let bounded = if self.retained_lru.is_empty() {
            usize::MAX
        } else {
            MAX_PINNED_STEPS
        };
        if self.evict_from(false, bounded, now, removed, &mut earliest_expiry)
            || self.evict_from(true, usize::MAX, now, removed, &mut earliest_expiry)
            || (bounded != usize::MAX
                && self.evict_from(false, usize::MAX, now, removed, &mut earliest_expiry))
        {
            return true;
        }
        // Everything is hard-pinned: fail fast until a lease expires or something changes.
        self.all_pinned_until = earliest_expiry;
        false
    }

    /// Evicts the first block of `lru` (or `retained_lru`) without a hard pin, looking at most
    /// at `max_steps` entries; hard-pinned ones met on the way move to the recent end.
    fn evict_from(
        &mut self,
        retained: bool,
        max_steps: usize,
        now: Instant,
        removed: &mut Vec<BlockHash>,
        earliest_expiry: &mut Option<Instant>,
    ) -> bool {
        let len = if retained {
            self.retained_lru.len()
        } else {
            self.lru.len()
        };
        for _ in 0..len.min(max_steps) {
            let map = if retained {
                &mut self.retained_lru
            } else {
                &mut self.lru
            };
            let Some((_, hash)) = map.pop_first() else {
                break;
            };
            let Some(e) = self.entries.get_mut(&hash) else {
                continue;
            };
            if let Some(expiry) = e.hard_expiry(now) {
                *earliest_expiry = Some(earliest_expiry.map_or(expiry, |x| x.min(expiry)));
                self.tick += 1;
                if retained {
                    e.rkey = Some(self.tick);
                    self.retained_lru.insert(self.tick, hash);
                } else {
                    e.tick = self.tick;
                    self.lru.insert(self.tick, hash);
                }
                continue;
            }
            if retained && e.retained.iter().any(|&t| t > now) {
                self.stats.retained_evicted_blocks += 1;
            }
            if let Some(e) = self.entries.remove(&hash) {
                self.used -= e.payload.len() as u64;
                if e.pull_counted {
                    self.pull_pinned_bytes -= e.payload.len() as u64;
                }
            }
            self.stats.evicted_blocks += 1;
            removed.push(hash);
            return true;
        }
        false
    }

    /// Stores a run of consecutive blocks, evicting LRU unpinned blocks to make room. Pushes, in
    /// order, `BlockRemoved` (CPU) for evictions then `BlockStored` (CPU) per contiguous run of
    /// newly stored blocks. Returns how many blocks were newly stored.
    pub fn insert_run(
        &mut self,
        blocks: &[OffloadBlock],
        now: Instant,
        events: &mut Vec<KvEvent>,
    ) -> usize {
        let mut stored = 0;
        let mut run: Option<BlockStored> = None;
        let mut removed = Vec::new();
        let mut stored_events = Vec::new();
        for b in blocks {
            if self.entries.contains_key(&b.hash) {
                self.touch(b.hash);
                if let Some(r) = run.take() {
                    stored_events.push(r);
                }
                continue;
            }
            let need = b.payload.len() as u64;
            let mut fits = need <= self.capacity;
            while fits && self.used + need > self.capacity {
                fits = self.evict_one(now, &mut removed);
            }
            if !fits {
                self.stats.rejected_blocks += 1;
                if let Some(r) = run.take() {
                    stored_events.push(r);
                }
                continue;
            }
            self.tick += 1;
            self.lru.insert(self.tick, b.hash);
            self.entries.insert(b.hash, Entry::new(b, self.tick));
            self.used += need;
            self.all_pinned_until = None;
            self.stats.stored_blocks += 1;
            stored += 1;
            let r = run.get_or_insert_with(|| {
                BlockStored::run(
                    Medium::Cpu,
                    b.parent,
                    self.block_size,
                    Vec::new(),
                    Vec::new(),
                )
                .in_full_attention_group()
            });
            r.block_hashes.push(b.hash);
            r.token_ids.extend_from_slice(&b.tokens);
        }
        if let Some(r) = run.take() {
            stored_events.push(r);
        }
        if !removed.is_empty() {
            events.push(KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: removed,
                medium: Medium::Cpu,
                group_idx: Some(0),
            }));
        }
        events.extend(stored_events.into_iter().map(KvEvent::BlockStored));
        stored
    }

    /// Adds one `Use` pin (lease until `until`) to each block of the leading run of stored
    /// `hashes`. Returns the run length. Pins are counted: each needs its own
    /// [`CpuStore::unpin`] (or expires on its own).
    pub fn pin(&mut self, hashes: &[BlockHash], until: Instant) -> usize {
        self.pin_as(PinKind::Use, hashes, until)
    }

    /// [`CpuStore::pin`] with a pin kind. `Pull` pins are not capped here (they protect blocks
    /// already stored); the cap applies when a pull lands a new block.
    pub fn pin_as(&mut self, kind: PinKind, hashes: &[BlockHash], until: Instant) -> usize {
        let now = Instant::now();
        let mut n = 0;
        for h in hashes {
            let Some(e) = self.entries.get_mut(h) else {
                break;
            };
            let leases = e.leases_mut(kind);
            leases.retain(|&t| t > now);
            leases.push(until);
            match kind {
                PinKind::Pull if !e.pull_counted => {
                    e.pull_counted = true;
                    self.pull_pinned_bytes += e.payload.len() as u64;
                }
                PinKind::Retain => {
                    // (Re)retained: joins the retained LRU at its recent end.
                    self.tick += 1;
                    match e.rkey.replace(self.tick) {
                        Some(k) => self.retained_lru.remove(&k),
                        None => self.lru.remove(&e.tick),
                    };
                    self.retained_lru.insert(self.tick, *h);
                }
                _ => {}
            }
            n += 1;
        }
        n
    }

    /// Releases one `Use` pin per hash (the one expiring soonest; already expired pins are
    /// ignored).
    pub fn unpin(&mut self, hashes: &[BlockHash]) {
        self.unpin_as(PinKind::Use, hashes);
    }

    /// [`CpuStore::unpin`] of one pin kind.
    pub fn unpin_as(&mut self, kind: PinKind, hashes: &[BlockHash]) {
        let now = Instant::now();
        self.all_pinned_until = None;
        for h in hashes {
            if let Some(e) = self.entries.get_mut(h) {
                let leases = e.leases_mut(kind);
                leases.retain(|&t| t > now);
                if let Some(i) = leases
                    .iter()
                    .enumerate()
                    .min_by_key(|(_, t)| **t)
                    .map(|(i, _)| i)
                {
                    leases.swap_remove(i);
                }
                if kind == PinKind::Pull && e.pull_counted && e.pulled.is_empty() {
                    e.pull_counted = false;
                    self.pull_pinned_bytes -= e.payload.len() as u64;
                }
                if kind == PinKind::Retain
                    && e.retained.is_empty()
                    && let Some(k) = e.rkey.take()
                {
                    self.retained_lru.remove(&k);
                    self.lru.insert(e.tick, *h);
                }
            }
        }
    }

    /// Live (unexpired) pins of every kind on a block.
    pub fn pin_count(&self, hash: BlockHash, now: Instant) -> usize {
        self.entries.get(&hash).map_or(0, |e| {
            e.leases
                .iter()
                .chain(&e.pulled)
                .chain(&e.retained)
                .filter(|&&t| t > now)
                .count()
        })
    }

    /// Whether `Pull` pins may hold `more` more bytes. At the cap, recounts once (dropping
    /// expired pull pins) unless no pull pin can have expired since the last recount.
    fn pull_pin_room(&mut self, more: u64, now: Instant) -> bool {
        if self.pull_pinned_bytes + more <= self.pull_pin_cap {
            return true;
        }
        // Never fits (a zero share): no recount can help.
        if more > self.pull_pin_cap {
            return false;
        }
        if self.pull_recount_after.is_some_and(|t| now < t) {
            return false;
        }
        let mut bytes = 0;
        let mut earliest: Option<Instant> = None;
        for e in self.entries.values_mut() {
            e.pulled.retain(|&t| t > now);
            e.pull_counted = !e.pulled.is_empty();
            if e.pull_counted {
                bytes += e.payload.len() as u64;
                if let Some(first) = e.pulled.iter().copied().min() {
                    earliest = Some(earliest.map_or(first, |x| x.min(first)));
                }
            }
        }
        self.pull_pinned_bytes = bytes;
        self.pull_recount_after = earliest;
        bytes + more <= self.pull_pin_cap
    }

    /// Stores one pulled block and pins it (`Pull`, until `until`) when the pull-pin cap allows;
    /// flags it external. See [`Landed`].
    pub fn insert_pulled(
        &mut self,
        block: &OffloadBlock,
        until: Instant,
        now: Instant,
        events: &mut Vec<KvEvent>,
    ) -> Landed {
        if self.entries.contains_key(&block.hash) {
            self.touch(block.hash);
            return Landed::Present;
        }
        if self.insert_run(std::slice::from_ref(block), now, events) != 1 {
            return Landed::Rejected;
        }
        if let Some(e) = self.entries.get_mut(&block.hash) {
            e.external = true;
        }
        if self.pull_pin_room(block.payload.len() as u64, now) {
            self.pin_as(PinKind::Pull, &[block.hash], until);
            Landed::Pinned
        } else {
            self.stats.pull_pin_capped_blocks += 1;
            Landed::Unpinned
        }
    }

    /// Clears the external flag of each of `hashes` that has it; returns how many had it (the
    /// caller counts those as external hits, once).
    pub fn take_external(&mut self, hashes: &[BlockHash]) -> usize {
        let mut n = 0;
        for h in hashes {
            if let Some(e) = self.entries.get_mut(h)
                && std::mem::take(&mut e.external)
            {
                n += 1;
            }
        }
        n
    }

    /// Flags a stored block as landed by a pull (external, not yet counted).
    pub fn flag_external(&mut self, hash: BlockHash) {
        if let Some(e) = self.entries.get_mut(&hash) {
            e.external = true;
        }
    }

    /// A peer read a block: the reader a retention was kept for has been served, so one
    /// retention (the soonest expiring) is released.
    pub fn release_one_retention(&mut self, hash: BlockHash) {
        let retained = self
            .entries
            .get(&hash)
            .is_some_and(|e| e.rkey.is_some() || !e.retained.is_empty());
        if retained {
            self.unpin_as(PinKind::Retain, &[hash]);
        }
    }

    /// The payload and the CRC32 taken when it was stored (marks it recently used).
    pub fn get_with_checksum(&mut self, hash: BlockHash) -> Option<(Bytes, u32)> {
        let e = self.entries.get(&hash)?;
        let out = (e.payload.clone(), e.crc);
        self.touch(hash);
        self.stats.hits += 1;
        Some(out)
    }

    /// Drops everything (reset). Pushes nothing: the pool's `AllBlocksCleared` covers all tiers.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.lru.clear();
        self.retained_lru.clear();
        self.used = 0;
        self.pull_pinned_bytes = 0;
        self.pull_recount_after = None;
        self.all_pinned_until = None;
    }
}

#[derive(Debug)]
struct Shared {
    store: CpuStore,
    pending: HashSet<BlockHash>,
}

/// The shared CPU tier (see module docs). Cheap to clone behind `Arc`.
pub struct CpuTier {
    inner: Mutex<Shared>,
    sink: Arc<dyn KvEventSink>,
    /// Woken whenever a block is stored or leaves the pending set.
    changed: Notify,
    external_inserts: AtomicU64,
}

impl std::fmt::Debug for CpuTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuTier")
            .field("stats", &self.stats())
            .finish()
    }
}

impl CpuTier {
    pub fn new(capacity_bytes: u64, block_size: usize, sink: Arc<dyn KvEventSink>) -> Self {
        Self {
            inner: Mutex::new(Shared {
                store: CpuStore::new(capacity_bytes, block_size),
                pending: HashSet::new(),
            }),
            sink,
            changed: Notify::new(),
            external_inserts: AtomicU64::new(0),
        }
    }

    /// The payload of a stored block (a cheap `Bytes` clone; stays valid after eviction).
    pub fn get(&self, hash: BlockHash) -> Option<Bytes> {
        self.inner.lock().store.get(hash)
    }

    /// [`CpuStore::touch_all`].
    pub fn touch(&self, hashes: &[BlockHash]) {
        if !hashes.is_empty() {
            self.inner.lock().store.touch_all(hashes);
        }
    }

    pub fn contains(&self, hash: BlockHash) -> bool {
        self.inner.lock().store.contains(hash)
    }

    /// Tokens and parent of a stored block.
    pub fn meta(&self, hash: BlockHash) -> Option<(Option<BlockHash>, Arc<[TokenId]>)> {
        self.inner.lock().store.meta(hash)
    }

    /// Length of the leading run of `hashes` stored here.
    pub fn lookup_prefix(&self, hashes: &[BlockHash]) -> usize {
        self.inner.lock().store.lookup_prefix(hashes)
    }

    /// Per-block status for a peer's lookup.
    pub fn lookup(&self, hashes: &[BlockHash]) -> Vec<BlockStatus> {
        let g = self.inner.lock();
        hashes
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
            .collect()
    }

    /// Adds one counted pin (lease until `lease_until`) to the leading run of stored `hashes`;
    /// returns its length.
    pub fn pin(&self, hashes: &[BlockHash], lease_until: Instant) -> usize {
        self.inner.lock().store.pin(hashes, lease_until)
    }

    /// [`CpuTier::pin`] with a pin kind (see [`PinKind`]).
    pub fn pin_as(&self, kind: PinKind, hashes: &[BlockHash], lease_until: Instant) -> usize {
        self.inner.lock().store.pin_as(kind, hashes, lease_until)
    }

    /// Releases one `Use` pin per hash.
    pub fn unpin(&self, hashes: &[BlockHash]) {
        self.inner.lock().store.unpin(hashes);
    }

    /// Releases one pin of `kind` per hash.
    pub fn unpin_as(&self, kind: PinKind, hashes: &[BlockHash]) {
        self.inner.lock().store.unpin_as(kind, hashes);
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

    /// Live pins on a block.
    pub fn pin_count(&self, hash: BlockHash) -> usize {
        self.inner.lock().store.pin_count(hash, Instant::now())
    }

    /// A peer's lookup, atomically: status per block, and one pin (lease until `lease_until`) on
    /// each block of the leading run of hits — under one lock, so nothing can evict a block
    /// between "it is here" and "it is pinned".
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
        g.store.pin(&hashes[..leading], lease_until);
        statuses
    }

    /// The payload with the CRC32 taken when it was stored.
    pub fn get_with_checksum(&self, hash: BlockHash) -> Option<(Bytes, u32)> {
        self.inner.lock().store.get_with_checksum(hash)
    }

    /// As [`CpuTier::get_with_checksum`], for a peer's fetch: the read serves the reader a
    /// retention was kept for, so one retention on the block is released (vLLM's prefiller frees
    /// a request's blocks once its decoder has read them).
    pub fn read_for_peer(&self, hash: BlockHash) -> Option<(Bytes, u32)> {
        let mut g = self.inner.lock();
        let out = g.store.get_with_checksum(hash)?;
        g.store.release_one_retention(hash);
        Some(out)
    }

    /// Test hook: replaces a stored payload *without* updating its checksum, as bit rot or a
    /// buggy writer would. Returns whether the block was present.
    #[doc(hidden)]
    pub fn corrupt_for_test(&self, hash: BlockHash, payload: Bytes) -> bool {
        let mut g = self.inner.lock();
        match g.store.entries.get_mut(&hash) {
            Some(e) if e.payload.len() == payload.len() => {
                e.payload = payload;
                true
            }
            _ => false,
        }
    }

    /// Stores computed blocks (offload from the GPU tier) and publishes their CPU events.
    /// Stored blocks leave the pending set. Returns how many were newly stored.
    pub fn insert_run(&self, blocks: &[OffloadBlock]) -> usize {
        let n = {
            let mut g = self.inner.lock();
            let mut events = Vec::new();
            let n = g.store.insert_run(blocks, Instant::now(), &mut events);
            for b in blocks {
                g.pending.remove(&b.hash);
            }
            // Published under the lock so concurrent inserts keep event order.
            self.sink.publish(events);
            n
        };
        self.changed.notify_waiters();
        n
    }

    /// Stores one block pulled from a peer (publishes `BlockStored` medium CPU). Returns false if
    /// it was already present or could not fit.
    pub fn insert_external(
        &self,
        hash: BlockHash,
        parent: Option<BlockHash>,
        tokens: Vec<TokenId>,
        payload: Bytes,
    ) -> bool {
        let stored = self.insert_run(&[OffloadBlock {
            hash,
            parent,
            tokens,
            payload,
        }]) == 1;
        if stored {
            self.inner.lock().store.flag_external(hash);
            self.external_inserts.fetch_add(1, Ordering::Relaxed);
        }
        stored
    }

    /// As [`CpuTier::insert_external`], and pins the newly stored block (`Pull`, lease until
    /// `lease_until`) under the same lock, so nothing evicts it before the request that pulled
    /// it is scheduled — unless `Pull` pins already hold their share of the tier, then it lands
    /// unpinned. Unprotected, then retained, blocks are evicted to make room; only hard pins
    /// filling the tier reject it. See [`Landed`].
    pub fn insert_external_pinned(&self, block: OffloadBlock, lease_until: Instant) -> Landed {
        let hash = block.hash;
        let landed = {
            let mut g = self.inner.lock();
            let mut events = Vec::new();
            let landed = g
                .store
                .insert_pulled(&block, lease_until, Instant::now(), &mut events);
            if matches!(landed, Landed::Pinned | Landed::Unpinned) {
                g.pending.remove(&hash);
            }
            self.sink.publish(events);
            landed
        };
        if matches!(landed, Landed::Pinned | Landed::Unpinned) {
            self.external_inserts.fetch_add(1, Ordering::Relaxed);
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

    /// Drops every stored block and pending mark (reset; the pool publishes `AllBlocksCleared`).
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

    /// Blocks stored via [`CpuTier::insert_external`].
    pub fn external_inserts(&self) -> u64 {
        self.external_inserts.load(Ordering::Relaxed)
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
        }
    }

    #[test]
    fn run_insert_emits_one_cpu_stored_event_with_tokens() {
        let mut s = CpuStore::new(1000, 2);
        let mut ev = Vec::new();
        let now = Instant::now();
        assert_eq!(
            s.insert_run(&[blk(1, None, 10), blk(2, Some(1), 10)], now, &mut ev),
            2
        );
        assert_eq!(ev.len(), 1);
        let KvEvent::BlockStored(st) = &ev[0] else {
            panic!("expected stored")
        };
        assert_eq!(st.block_hashes, vec![BlockHash(1), BlockHash(2)]);
        assert_eq!(st.parent_block_hash, None);
        assert_eq!(st.token_ids, vec![1, 1, 2, 2]);
        assert_eq!(st.medium, Medium::Cpu);
        assert_eq!(s.used_bytes(), 20);
    }

    #[test]
    fn byte_cap_evicts_lru_and_publishes_removed_before_stored() {
        let mut s = CpuStore::new(30, 2);
        let mut ev = Vec::new();
        let now = Instant::now();
        s.insert_run(
            &[blk(1, None, 10), blk(2, Some(1), 10), blk(3, Some(2), 10)],
            now,
            &mut ev,
        );
        assert!(s.get(BlockHash(1)).is_some()); // 1 is now most recent; 2 is LRU
        ev.clear();
        s.insert_run(&[blk(4, None, 10)], now, &mut ev);
        assert!(!s.contains(BlockHash(2)));
        assert!(s.contains(BlockHash(1)) && s.contains(BlockHash(3)) && s.contains(BlockHash(4)));
        assert!(
            matches!(&ev[0], KvEvent::BlockRemoved(r) if r.block_hashes == vec![BlockHash(2)] && r.medium == Medium::Cpu)
        );
        assert!(
            matches!(&ev[1], KvEvent::BlockStored(st) if st.block_hashes == vec![BlockHash(4)])
        );
        assert!(s.used_bytes() <= 30);
        assert_eq!(s.stats().evicted_blocks, 1);
    }

    #[test]
    fn leased_blocks_survive_pressure_until_the_lease_expires() {
        let mut s = CpuStore::new(20, 2);
        let mut ev = Vec::new();
        let t0 = Instant::now();
        s.insert_run(&[blk(1, None, 10), blk(2, Some(1), 10)], t0, &mut ev);
        assert_eq!(
            s.pin(
                &[BlockHash(1), BlockHash(2), BlockHash(9)],
                t0 + Duration::from_secs(5)
            ),
            2
        );
        assert_eq!(
            s.insert_run(&[blk(3, None, 10)], t0, &mut ev),
            0,
            "all pinned: refused"
        );
        assert_eq!(s.stats().rejected_blocks, 1);
        // After the lease, eviction may proceed.
        assert_eq!(
            s.insert_run(&[blk(3, None, 10)], t0 + Duration::from_secs(6), &mut ev),
            1
        );
        s.unpin(&[BlockHash(2)]);
        assert_eq!(s.insert_run(&[blk(4, None, 10)], t0, &mut ev), 1);
        assert!(s.used_bytes() <= 20);
    }

    #[test]
    fn a_touched_block_outlives_newer_untouched_ones() {
        // Capacity 3 blocks of 1 byte: A, B, C stored in that order; A is in use (touched, as a
        // GPU hit does), so storing D evicts B, the least recently used, not A.
        let mut s = CpuStore::new(3, 1);
        let mut ev = Vec::new();
        let t0 = Instant::now();
        s.insert_run(
            &[blk(1, None, 1), blk(2, None, 1), blk(3, None, 1)],
            t0,
            &mut ev,
        );
        s.touch_all(&[BlockHash(1), BlockHash(99)]);
        s.insert_run(&[blk(4, None, 1)], t0, &mut ev);
        assert!(s.contains(BlockHash(1)), "the touched block was evicted");
        assert!(!s.contains(BlockHash(2)));
        assert!(s.contains(BlockHash(3)) && s.contains(BlockHash(4)));
    }

    #[test]
    fn a_touched_prefix_is_evicted_from_its_tail() {
        // A 3-block prefix stored head first is touched as a whole; two new blocks then evict
        // its last two blocks, and its head stays usable.
        let mut s = CpuStore::new(3, 1);
        let mut ev = Vec::new();
        let t0 = Instant::now();
        let prefix = [blk(1, None, 1), blk(2, Some(1), 1), blk(3, Some(2), 1)];
        s.insert_run(&prefix, t0, &mut ev);
        s.touch_all(&[BlockHash(1), BlockHash(2), BlockHash(3)]);
        s.insert_run(&[blk(10, None, 1), blk(11, Some(10), 1)], t0, &mut ev);
        assert_eq!(
            s.lookup_prefix(&[BlockHash(1), BlockHash(2), BlockHash(3)]),
            1
        );
    }

    #[test]
    fn a_pull_landing_among_retained_blocks_does_not_rescan_its_own_pins() {
        // A P/D prefiller: its tier is full of retained prompts; a history read lands 10,000
        // blocks, each hard-pinned (Pull) as it lands. Each landing evicts one retained block;
        // it must not first step over every block the same pull already pinned (that was
        // 50 M steps here, seconds per real history read, under the tier's lock).
        let n = 10_000u64;
        let mut s = CpuStore::new(n, 1);
        s.set_pull_pin_fraction(1.0);
        let mut ev = Vec::new();
        let t0 = Instant::now();
        let far = t0 + Duration::from_secs(600);
        let run: Vec<OffloadBlock> = (0..n).map(|h| blk(h, None, 1)).collect();
        s.insert_run(&run, t0, &mut ev);
        let kept: Vec<BlockHash> = (0..n).map(BlockHash).collect();
        assert_eq!(s.pin_as(PinKind::Retain, &kept, far), n as usize);
        let started = Instant::now();
        for h in 0..n {
            ev.clear();
            let hash = 1_000_000 + h;
            assert_eq!(s.insert_run(&[blk(hash, None, 1)], t0, &mut ev), 1);
            assert_eq!(s.pin_as(PinKind::Pull, &[BlockHash(hash)], far), 1);
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
        // evictable ones: offloading 20,000 more blocks must not rescan the pinned ones per
        // eviction (that was 400M steps under the tier lock), and once everything is pinned,
        // offers are refused without a rescan each.
        let pinned = 20_000u64;
        let mut s = CpuStore::new(pinned + 1_000, 1);
        let mut ev = Vec::new();
        let t0 = Instant::now();
        let far = t0 + Duration::from_secs(600);
        let run: Vec<OffloadBlock> = (0..pinned).map(|h| blk(h, None, 1)).collect();
        s.insert_run(&run, t0, &mut ev);
        let hashes: Vec<BlockHash> = (0..pinned).map(BlockHash).collect();
        assert_eq!(s.pin(&hashes, far), pinned as usize);
        let free: Vec<OffloadBlock> = (pinned..pinned + 1_000).map(|h| blk(h, None, 1)).collect();
        s.insert_run(&free, t0, &mut ev);
        let started = Instant::now();
        for h in 0..20_000u64 {
            ev.clear();
            assert_eq!(s.insert_run(&[blk(1_000_000 + h, None, 1)], t0, &mut ev), 1);
        }
        for h in &hashes {
            assert!(s.contains(*h), "pinned block {h:?} evicted");
        }
        assert_eq!(s.len() as u64, pinned + 1_000);
        // Now fill the unpinned rest with pinned blocks: every further offer is refused.
        let tail: Vec<BlockHash> = (1_019_000..1_020_000).map(BlockHash).collect();
        assert_eq!(s.pin(&tail, far), 1_000);
        assert_eq!(s.lookup_prefix(&tail), 1_000);
        for h in 0..20_000u64 {
            assert_eq!(s.insert_run(&[blk(2_000_000 + h, None, 1)], t0, &mut ev), 0);
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "evictions past pinned blocks took {:?}",
            started.elapsed()
        );
        // A released pin makes room again at once.
        s.unpin(&hashes[..1]);
        assert_eq!(s.insert_run(&[blk(3_000_000, None, 1)], t0, &mut ev), 1);
        assert!(!s.contains(hashes[0]));
    }

    #[test]
    fn pins_are_counted_per_lease() {
        let mut s = CpuStore::new(20, 2);
        let mut ev = Vec::new();
        let t0 = Instant::now();
        s.insert_run(&[blk(1, None, 10), blk(2, Some(1), 10)], t0, &mut ev);
        let far = t0 + Duration::from_secs(60);
        // Two consumers pin block 1; one finishes: the other's pin still protects it.
        assert_eq!(s.pin(&[BlockHash(1)], far), 1);
        assert_eq!(s.pin(&[BlockHash(1)], t0 + Duration::from_secs(30)), 1);
        s.unpin(&[BlockHash(1)]);
        assert_eq!(s.pin_count(BlockHash(1), t0), 1);
        assert_eq!(s.insert_run(&[blk(3, None, 10)], t0, &mut ev), 1);
        assert!(s.contains(BlockHash(1)), "still pinned by the second lease");
        assert!(!s.contains(BlockHash(2)));
        s.unpin(&[BlockHash(1)]);
        s.unpin(&[BlockHash(1)]); // extra unpin is harmless
        assert_eq!(s.pin_count(BlockHash(1), t0), 0);
        // An expired lease no longer protects, even without unpin.
        s.pin(&[BlockHash(3)], t0 + Duration::from_millis(1));
        assert_eq!(s.pin_count(BlockHash(3), t0 + Duration::from_secs(1)), 0);
    }

    #[test]
    fn lookup_and_pin_pins_only_the_leading_hits_and_checksums_are_kept() {
        let tier = CpuTier::new(1000, 2, Arc::new(CollectingSink::default()));
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
        let (p, crc) = tier.get_with_checksum(BlockHash(2)).unwrap();
        assert_eq!(crc, crc32fast::hash(&p));
        assert!(tier.corrupt_for_test(BlockHash(2), Bytes::from(vec![0u8; 8])));
        let (p2, crc2) = tier.get_with_checksum(BlockHash(2)).unwrap();
        assert_eq!(crc2, crc, "checksum from store time survives corruption");
        assert_ne!(crc32fast::hash(&p2), crc2);
    }

    #[test]
    fn a_pull_lands_in_a_tier_full_of_retained_blocks() {
        // A prefiller: every prompt block retained for its decoder (480 s), the tier full.
        // A history pull must still land: the oldest retention gives way, never the pull.
        let tier = CpuTier::new(40, 2, Arc::new(CollectingSink::default()));
        tier.insert_run(&[blk(1, None, 10), blk(2, Some(1), 10)]);
        tier.insert_run(&[blk(3, None, 10), blk(4, Some(3), 10)]);
        let ttl = Instant::now() + Duration::from_secs(480);
        assert_eq!(
            tier.pin_as(PinKind::Retain, &[BlockHash(1), BlockHash(2)], ttl),
            2
        );
        assert_eq!(
            tier.pin_as(PinKind::Retain, &[BlockHash(3), BlockHash(4)], ttl),
            2
        );
        let lease = Instant::now() + Duration::from_secs(60);
        assert_eq!(
            tier.insert_external_pinned(blk(10, None, 10), lease),
            Landed::Pinned
        );
        assert!(!tier.contains(BlockHash(1)), "oldest retention evicted");
        assert!(tier.contains(BlockHash(3)) && tier.contains(BlockHash(10)));
        assert_eq!(tier.stats().retained_evicted_blocks, 1);
        assert_eq!(tier.stats().rejected_blocks, 0);
        // Unprotected blocks go before retained ones.
        tier.unpin_as(PinKind::Pull, &[BlockHash(10)]);
        assert_eq!(
            tier.insert_external_pinned(blk(11, None, 10), lease),
            Landed::Pinned
        );
        assert!(!tier.contains(BlockHash(10)));
        assert!(tier.contains(BlockHash(2)) && tier.contains(BlockHash(3)));
        // Hard pins everywhere: refused (the only rejection left).
        tier.pin(&[2, 3, 4].map(BlockHash), lease);
        assert_eq!(
            tier.insert_external_pinned(blk(12, None, 10), lease),
            Landed::Rejected
        );
    }

    #[test]
    fn a_peer_read_releases_one_retention() {
        let tier = CpuTier::new(100, 2, Arc::new(CollectingSink::default()));
        tier.insert_run(&[blk(1, None, 10)]);
        let ttl = Instant::now() + Duration::from_secs(480);
        // Two prefill legs with this block: two retentions; one decoder reads it.
        tier.pin_as(PinKind::Retain, &[BlockHash(1)], ttl);
        tier.pin_as(PinKind::Retain, &[BlockHash(1)], ttl);
        assert!(tier.read_for_peer(BlockHash(1)).is_some());
        assert_eq!(tier.pin_count(BlockHash(1)), 1);
        assert!(tier.read_for_peer(BlockHash(1)).is_some());
        assert_eq!(tier.pin_count(BlockHash(1)), 0);
        // A plain (non-retained) read changes no pin.
        tier.pin(&[BlockHash(1)], ttl);
        assert!(tier.read_for_peer(BlockHash(1)).is_some());
        assert_eq!(tier.pin_count(BlockHash(1)), 1);
    }

    #[test]
    fn expired_retentions_rejoin_the_lru_at_their_last_use() {
        let mut s = CpuStore::new(30, 2);
        let mut ev = Vec::new();
        let t0 = Instant::now();
        s.insert_run(
            &[blk(1, None, 10), blk(2, None, 10), blk(3, None, 10)],
            t0,
            &mut ev,
        );
        s.pin_as(
            PinKind::Retain,
            &[BlockHash(1)],
            t0 + Duration::from_millis(1),
        );
        // Retention over: 1 is the least recently used again and goes first.
        s.insert_run(&[blk(4, None, 10)], t0 + Duration::from_secs(1), &mut ev);
        assert!(!s.contains(BlockHash(1)));
        assert_eq!(s.stats().retained_evicted_blocks, 0);
    }

    #[test]
    fn pull_pins_hold_at_most_their_share_of_the_tier() {
        let tier = CpuTier::new(100, 2, Arc::new(CollectingSink::default()));
        let lease = Instant::now() + Duration::from_secs(60);
        // Default: half of 10 blocks may be pinned by pulls; the rest land unpinned.
        let landed: Vec<Landed> = (1..=10)
            .map(|h| tier.insert_external_pinned(blk(h, None, 10), lease))
            .collect();
        assert_eq!(&landed[..5], &[Landed::Pinned; 5]);
        assert_eq!(&landed[5..], &[Landed::Unpinned; 5]);
        assert_eq!(tier.stats().pull_pin_capped_blocks, 5);
        // The tier keeps taking new blocks (evicting the unpinned half), never refusing.
        for h in 11..=20 {
            assert_eq!(
                tier.insert_external_pinned(blk(h, None, 10), lease),
                Landed::Unpinned
            );
        }
        assert_eq!(tier.stats().rejected_blocks, 0);
        assert!((1..=5).all(|h| tier.contains(BlockHash(h))), "pinned kept");
        // A released pull pin frees its share.
        tier.unpin_as(PinKind::Pull, &[BlockHash(1)]);
        assert_eq!(
            tier.insert_external_pinned(blk(21, None, 10), lease),
            Landed::Pinned
        );
        // Expired pull pins are recounted at the cap.
        let mut s = CpuStore::new(100, 2);
        let t0 = Instant::now();
        let short = t0 + Duration::from_millis(1);
        for h in 1..=5 {
            assert_eq!(
                s.insert_pulled(&blk(h, None, 10), short, t0, &mut ev()),
                Landed::Pinned
            );
        }
        let later = t0 + Duration::from_secs(1);
        assert_eq!(
            s.insert_pulled(
                &blk(6, None, 10),
                later + Duration::from_secs(60),
                later,
                &mut ev()
            ),
            Landed::Pinned
        );
        // A zero share: every pulled block lands unpinned.
        s.set_pull_pin_fraction(0.0);
        assert_eq!(
            s.insert_pulled(&blk(7, None, 10), later, later, &mut ev()),
            Landed::Unpinned
        );
    }

    fn ev() -> Vec<KvEvent> {
        Vec::new()
    }

    #[test]
    fn pulled_blocks_count_as_external_once() {
        let tier = CpuTier::new(100, 2, Arc::new(CollectingSink::default()));
        let lease = Instant::now() + Duration::from_secs(60);
        tier.insert_external_pinned(blk(1, None, 10), lease);
        tier.insert_external_pinned(blk(2, Some(1), 10), lease);
        tier.insert_run(&[blk(3, Some(2), 10)]);
        let all = [1, 2, 3].map(BlockHash);
        // Whichever request is scheduled first takes the flag; the next sees local blocks.
        assert_eq!(tier.take_external(&all), 2);
        assert_eq!(tier.take_external(&all), 0);
        // Present already when the pull lands: a local hit, not flagged.
        assert_eq!(
            tier.insert_external_pinned(blk(3, Some(2), 10), lease),
            Landed::Present
        );
        assert_eq!(tier.take_external(&all), 0);
    }

    #[test]
    fn eviction_through_a_tier_of_retained_blocks_stays_cheap() {
        // A prefiller's steady state: 20,000 retained blocks, new blocks keep coming.
        let n = 20_000u64;
        let mut s = CpuStore::new(n, 1);
        let mut ev = Vec::new();
        let t0 = Instant::now();
        let ttl = t0 + Duration::from_secs(480);
        let run: Vec<OffloadBlock> = (0..n).map(|h| blk(h, None, 1)).collect();
        s.insert_run(&run, t0, &mut ev);
        let hashes: Vec<BlockHash> = (0..n).map(BlockHash).collect();
        s.pin_as(PinKind::Retain, &hashes, ttl);
        let started = Instant::now();
        for h in 0..n {
            ev.clear();
            assert_eq!(s.insert_run(&[blk(1_000_000 + h, None, 1)], t0, &mut ev), 1);
            s.pin_as(PinKind::Retain, &[BlockHash(1_000_000 + h)], ttl);
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "evictions through retained blocks took {:?}",
            started.elapsed()
        );
        assert_eq!(s.stats().retained_evicted_blocks, n);
        assert!(!s.contains(BlockHash(0)) && s.contains(BlockHash(1_000_000)));
    }

    #[tokio::test]
    async fn pending_blocks_become_ready_or_fail_for_waiters() {
        let sink = CollectingSink::default();
        let tier = Arc::new(CpuTier::new(1000, 2, Arc::new(sink.clone())));
        tier.mark_pending(&[BlockHash(7), BlockHash(8)]);
        assert_eq!(
            tier.lookup(&[BlockHash(7), BlockHash(1)]),
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
        assert_eq!(tier.external_inserts(), 1);
        assert_eq!(sink.take().len(), 2);
    }
}
