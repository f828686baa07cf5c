//! The fast prefix index: sharded block table + per-endpoint engine-hash maps.
//!
//! Concurrency: block entries live in `shards` lock-free-readable tables (`crate::table`):
//! lookups never wait for writers; writers are serialised per shard. Each endpoint's state (its engine-hash map) sits behind its own
//! mutex, held for a whole event, which serialises that endpoint's events in arrival order while
//! different endpoints ingest in parallel.
//!
//! Fairness: `max_blocks` is shared out, each registered endpoint holding at most
//! `max_blocks / endpoints` router blocks. An endpoint past its share evicts its *own* least
//! recently used blocks (a CLOCK over its store order, second chance for blocks stored or looked
//! up since), so one endpoint's flood never evicts another's prefixes (issue 37: a fake publisher
//! announcing 10 M blocks wiped an honest engine's). When a newly registered endpoint shrinks the
//! shares, an endpoint left over its share pays for the others' stores. The table's own per-shard
//! eviction stays as a memory backstop, set 25 % above the shared bound so that it does not fire
//! on hash imbalance between shards.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

use arc_swap::ArcSwapOption;
use hashbrown::HashMap;
use kvmesh_core::events::{BlockRemoved, BlockStored, KvEvent};
use kvmesh_core::{BlockHash, ChainKey};
use parking_lot::{Mutex, RwLock};

use crate::groups::{self, GroupKind, GroupLayout, HybridRule, StoreGroup, group_key};
use crate::table::Shard;
use crate::{EndpointId, EndpointMatch, IndexConfig, IndexError, IndexStats, Tier};

/// Which groups of a hybrid endpoint hold one engine block, per tier (bit `g` = group `g`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct GroupsHeld {
    gpu: u64,
    cpu: u64,
}

impl GroupsHeld {
    fn get(&self, tier: Tier) -> u64 {
        match tier {
            Tier::Gpu => self.gpu,
            Tier::Cpu => self.cpu,
        }
    }
    fn get_mut(&mut self, tier: Tier) -> &mut u64 {
        match tier {
            Tier::Gpu => &mut self.gpu,
            Tier::Cpu => &mut self.cpu,
        }
    }
    fn is_empty(&self) -> bool {
        self.gpu | self.cpu == 0
    }
}

/// Engine hashes of a hybrid endpoint whose non-full-group stores wait for their position
/// (vLLM publishes a step's sliding and mamba groups before its full-attention group, and only
/// the full-attention store says where a hash sits). Past this many the oldest are dropped
/// (counted as unresolved): an under-estimate, never a wrong position.
const MAX_PENDING: usize = 4096;

/// What the index knows about one endpoint's engine hashes.
#[derive(Debug, Default)]
struct EndpointState {
    /// Set (under this mutex) once the endpoint is removed; a writer that raced with the removal
    /// sees it and re-registers instead of writing into a freed slot.
    removed: bool,
    /// Engine hash → key of the last router block it covers.
    hashes: HashMap<BlockHash, ChainKey>,
    /// Engine hash → keys of its leading router blocks, only when the engine block spans several
    /// router blocks.
    spans: HashMap<BlockHash, Box<[ChainKey]>>,
    /// While the endpoint is suspect (events were lost): the engine hashes stored since then.
    /// Everything else is aged out by [`PrefixIndex::expire_suspect`].
    refreshed: Option<hashbrown::HashSet<BlockHash>>,
    /// Engine hashes in the order they were first stored, with the clock value of that moment
    /// (or of their last second chance): the CLOCK that picks the endpoint's own victims when it
    /// exceeds its share. Entries whose hash is gone are skipped (and compacted away).
    order: VecDeque<(BlockHash, u32)>,
    /// The endpoint's KV-cache groups, learned from its events.
    layout: GroupLayout,
    /// Hybrid endpoints only: which groups hold each engine hash of `hashes`, per tier. A hash
    /// stays in `hashes` while any group holds it in any tier.
    groups_held: HashMap<BlockHash, GroupsHeld>,
    /// Hybrid endpoints only: non-full-group stores waiting for their hash's position, and the
    /// order they arrived in (for the [`MAX_PENDING`] bound; may hold resolved hashes until
    /// compacted).
    pending: HashMap<BlockHash, Vec<(u8, Tier)>>,
    pending_order: VecDeque<BlockHash>,
    /// Hybrid endpoints, while suspect: the groups that stored each hash since.
    refreshed_groups: HashMap<BlockHash, u64>,
}

#[derive(Debug)]
struct EndpointEntry {
    slot: u32,
    /// Router blocks the endpoint's engine hashes cover (its use of its share). Outside the
    /// mutex so the global trim can find the largest holder without locking every endpoint.
    held: AtomicUsize,
    state: Mutex<EndpointState>,
    /// The prefix-hit rule of a hybrid endpoint (`None` for dense ones), readable by lookups
    /// without taking `state`'s mutex.
    rule: ArcSwapOption<HybridRule>,
}

#[derive(Debug, Default)]
struct Registry {
    by_id: HashMap<EndpointId, Arc<EndpointEntry>>,
    /// Slot → endpoint, `None` for free slots.
    slots: Vec<Option<EndpointId>>,
    free: Vec<u32>,
}

#[derive(Debug, Default)]
struct Counters {
    evictions: AtomicU64,
    orphan_events: AtomicU64,
    unresolved_blocks: AtomicU64,
    unknown_removals: AtomicU64,
    ignored_events: AtomicU64,
    share_evictions: AtomicU64,
}

/// Second chances one eviction may grant before it takes the oldest candidate anyway (bounds the
/// work of one store).
const SECOND_CHANCES: usize = 16;

/// The router's prefix index. `Send + Sync`; every method takes `&self`.
#[derive(Debug)]
pub struct PrefixIndex {
    config: IndexConfig,
    shards: Box<[Shard]>,
    shard_bits: u32,
    /// Blocks per shard before the backstop eviction (25 % above the fair share of `max_blocks`).
    shard_cap: usize,
    /// Router blocks held over all endpoints (the sum of their `held`).
    held_total: AtomicUsize,
    /// Random per-index value mixed into shard selection so crafted prompts cannot pile onto one
    /// shard.
    shard_seed: u64,
    registry: RwLock<Registry>,
    /// Number of 64-bit words a lookup needs per tier (highest slot ever used / 64 + 1).
    words: AtomicUsize,
    /// Logical clock for recency: bumped by every event and lookup.
    clock: AtomicU32,
    counters: Counters,
}

impl PrefixIndex {
    pub fn new(config: IndexConfig) -> Self {
        let n_shards = config.shards.clamp(1, 1 << 16).next_power_of_two();
        let per_shard = config.max_blocks / n_shards;
        let shard_cap = (per_shard + per_shard / 4).max(16);
        let shard_seed = {
            use std::hash::{BuildHasher, Hasher};
            let mut h = hashbrown::DefaultHashBuilder::default().build_hasher();
            h.write_u64(0x6b76_6d65_7368);
            h.finish() | 1
        };
        let shards = (0..n_shards as u64)
            .map(|i| Shard::new(shard_seed ^ (i << 32)))
            .collect();
        PrefixIndex {
            shard_bits: n_shards.trailing_zeros(),
            config,
            shards,
            shard_cap,
            held_total: AtomicUsize::new(0),
            shard_seed,
            registry: RwLock::new(Registry::default()),
            words: AtomicUsize::new(1),
            clock: AtomicU32::new(1),
            counters: Counters::default(),
        }
    }

    pub fn config(&self) -> &IndexConfig {
        &self.config
    }

    /// Applies one KV event published by `endpoint`. Events of one endpoint must be passed in
    /// publication order (callers use one task per endpoint); the endpoint is registered on first
    /// use. On `Err` the event was skipped in whole (or, for `UnresolvedHashes`, in part); the
    /// index stays consistent.
    pub fn apply_event(&self, endpoint: EndpointId, event: &KvEvent) -> Result<(), IndexError> {
        loop {
            let entry = self.endpoint_entry(endpoint)?;
            let mut state = entry.state.lock();
            if state.removed {
                continue;
            }
            let now = self.tick();
            return match event {
                KvEvent::BlockStored(ev) => self.apply_stored(&entry, &mut state, ev, now),
                KvEvent::BlockRemoved(ev) => {
                    self.apply_removed(&entry, &mut state, ev);
                    Ok(())
                }
                KvEvent::AllBlocksCleared => {
                    self.clear_state(&entry, &mut state);
                    Ok(())
                }
            };
        }
    }

    /// Forgets everything `endpoint` holds (an `AllBlocksCleared`, or a publisher restart). The
    /// endpoint stays registered.
    pub fn clear_endpoint(&self, endpoint: EndpointId) {
        let entry = self.registry.read().by_id.get(&endpoint).cloned();
        if let Some(entry) = entry {
            let mut state = entry.state.lock();
            if !state.removed {
                self.clear_state(&entry, &mut state);
            }
        }
    }

    /// Forgets `endpoint` entirely and frees its slot.
    pub fn remove_endpoint(&self, endpoint: EndpointId) {
        let entry = self.registry.read().by_id.get(&endpoint).cloned();
        let Some(entry) = entry else { return };
        let mut state = entry.state.lock();
        if state.removed {
            return;
        }
        self.clear_state(&entry, &mut state);
        state.removed = true;
        // Free the slot while still holding the endpoint's mutex: no writer can be mid-event on it.
        let mut reg = self.registry.write();
        reg.by_id.remove(&endpoint);
        if let Some(s) = reg.slots.get_mut(entry.slot as usize) {
            *s = None;
        }
        reg.free.push(entry.slot);
    }

    /// Marks `endpoint` suspect: events were lost, so some of what the index holds for it may be
    /// stale. Entries stay usable; blocks stored from now on are remembered as refreshed, and
    /// [`PrefixIndex::expire_suspect`] later drops every entry that was not. Marking an already
    /// suspect endpoint again keeps the earlier starting point.
    pub fn mark_suspect(&self, endpoint: EndpointId) {
        if let Ok(entry) = self.endpoint_entry(endpoint) {
            let mut state = entry.state.lock();
            if !state.removed && state.refreshed.is_none() {
                state.refreshed = Some(hashbrown::HashSet::new());
            }
        }
    }

    /// Ages out a suspect endpoint: drops its entries not stored again since
    /// [`PrefixIndex::mark_suspect`], and ends the suspect state. Returns the number of engine
    /// blocks dropped (0 if the endpoint was not suspect).
    pub fn expire_suspect(&self, endpoint: EndpointId) -> usize {
        let entry = self.registry.read().by_id.get(&endpoint).cloned();
        let Some(entry) = entry else { return 0 };
        let mut state = entry.state.lock();
        let Some(refreshed) = state.refreshed.take() else {
            return 0;
        };
        let stale: Vec<BlockHash> = state
            .hashes
            .keys()
            .filter(|h| !refreshed.contains(*h))
            .copied()
            .collect();
        for hash in &stale {
            self.forget_hash(&entry, &mut state, *hash);
        }
        // A hybrid endpoint refreshes per group: a block stored again by its full-attention group
        // only must not keep a sliding group's stale window alive.
        let refreshed_groups = std::mem::take(&mut state.refreshed_groups);
        let stale_groups: Vec<(BlockHash, u8, Tier)> = state
            .groups_held
            .iter()
            .flat_map(|(hash, held)| {
                let fresh = refreshed_groups.get(hash).copied().unwrap_or(0);
                [Tier::Gpu, Tier::Cpu].into_iter().flat_map(move |tier| {
                    bits(held.get(tier) & !fresh).map(move |g| (*hash, g, tier))
                })
            })
            .collect();
        for (hash, group, tier) in stale_groups {
            self.remove_from_group(&entry, &mut state, hash, group, tier);
        }
        stale.len()
    }

    /// Whether `endpoint` is currently suspect.
    pub fn is_suspect(&self, endpoint: EndpointId) -> bool {
        let entry = self.registry.read().by_id.get(&endpoint).cloned();
        entry.is_some_and(|e| e.state.lock().refreshed.is_some())
    }

    /// Router blocks `endpoint` holds against its share of `max_blocks` (0 if unknown).
    pub fn held_blocks(&self, endpoint: EndpointId) -> usize {
        self.registry
            .read()
            .by_id
            .get(&endpoint)
            .map_or(0, |e| e.held.load(Ordering::Relaxed))
    }

    /// Endpoints currently registered.
    pub fn endpoints(&self) -> Vec<EndpointId> {
        let mut v: Vec<EndpointId> = self.registry.read().by_id.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// For each endpoint holding at least the first block, the longest consecutive prefix of
    /// `keys` it holds in the GPU tier, in the CPU tier and in either tier. `keys` are
    /// `kvmesh_core::chain::chain_keys(tokens, config.block_size)`. Sorted by endpoint id.
    pub fn find_matches(&self, keys: &[ChainKey]) -> Vec<EndpointMatch> {
        if keys.is_empty() {
            return Vec::new();
        }
        let words = self.words.load(Ordering::Acquire).max(1);
        let now = self.tick();
        // Active masks, laid out [gpu, cpu, any] × words; every bit starts active and drops out at
        // the first block it misses, at which point its run length is recorded.
        let mut active = vec![!0u64; 3 * words];
        let mut lens = vec![0u32; 3 * 64 * words];
        let mut block = vec![0u64; 2 * words];
        let mut matched = keys.len();
        for (i, key) in keys.iter().enumerate() {
            self.shard(*key).read(*key, &mut block, now);
            let mut still = 0u64;
            for w in 0..words {
                let (g, c) = (block[2 * w], block[2 * w + 1]);
                for (t, holds) in [g, c, g | c].into_iter().enumerate() {
                    let a = &mut active[t * words + w];
                    let dropped = *a & !holds;
                    if dropped != 0 {
                        *a &= holds;
                        if i > 0 {
                            record(&mut lens[(t * words + w) * 64..][..64], dropped, i as u32);
                        }
                    }
                    still |= *a;
                }
            }
            if still == 0 {
                matched = i;
                break;
            }
        }
        if matched == keys.len() {
            for (aw, a) in active.iter().enumerate() {
                record(&mut lens[aw * 64..][..64], *a, keys.len() as u32);
            }
        }
        let reg = self.registry.read();
        let mut out = Vec::new();
        let any_base = 2 * words * 64;
        let mut probe = GroupProbe::new(words, now);
        for slot in 0..(words * 64).min(reg.slots.len()) {
            let any = lens[any_base + slot];
            if any == 0 {
                continue;
            }
            let Some(endpoint) = reg.slots[slot] else {
                continue;
            };
            let mut m = EndpointMatch {
                endpoint,
                gpu_blocks: lens[slot] as usize,
                cpu_blocks: lens[words * 64 + slot] as usize,
                any_blocks: any as usize,
            };
            let rule = reg.by_id.get(&endpoint).map(|e| e.rule.load());
            if let Some(rule) = rule.as_ref().and_then(|r| r.as_deref()) {
                // A hybrid endpoint's table runs are its full-attention run; vLLM's rule then
                // asks for each sliding group's last window and each mamba group's state.
                m = self.hybrid_match(m, rule, keys, slot, &mut probe);
                if m.any_blocks == 0 {
                    continue;
                }
            }
            out.push(m);
        }
        drop(reg);
        out.sort_unstable_by_key(|m| m.endpoint);
        out
    }

    /// Sizes and counters. Walks every shard (briefly read-locking each) and every endpoint map.
    pub fn stats(&self) -> IndexStats {
        let (mut blocks, mut memberships, mut bytes) = (0u64, 0u64, 0u64);
        for shard in self.shards.iter() {
            let (b, m, by) = shard.stats();
            blocks += b;
            memberships += m;
            bytes += by;
        }
        let entries: Vec<Arc<EndpointEntry>> =
            self.registry.read().by_id.values().cloned().collect();
        for e in &entries {
            let st = e.state.lock();
            bytes += st.hashes.allocation_size() as u64 + st.spans.allocation_size() as u64;
            bytes += st.spans.values().map(|s| (s.len() * 8) as u64).sum::<u64>();
            bytes += (st.order.capacity() * std::mem::size_of::<(BlockHash, u32)>()) as u64;
            bytes += st.groups_held.allocation_size() as u64 + st.pending.allocation_size() as u64;
            bytes += st.refreshed_groups.allocation_size() as u64;
            bytes += (st.pending_order.capacity() * std::mem::size_of::<BlockHash>()) as u64;
        }
        let c = &self.counters;
        IndexStats {
            blocks,
            memberships,
            endpoints: entries.len() as u64,
            approx_bytes: bytes,
            bytes_per_membership: if memberships == 0 {
                0.0
            } else {
                bytes as f64 / memberships as f64
            },
            evictions: c.evictions.load(Ordering::Relaxed)
                + c.share_evictions.load(Ordering::Relaxed),
            share_evictions: c.share_evictions.load(Ordering::Relaxed),
            orphan_events: c.orphan_events.load(Ordering::Relaxed),
            unresolved_blocks: c.unresolved_blocks.load(Ordering::Relaxed),
            unknown_removals: c.unknown_removals.load(Ordering::Relaxed),
            ignored_events: c.ignored_events.load(Ordering::Relaxed),
        }
    }

    // ---- internals ----

    fn tick(&self) -> u32 {
        self.clock.fetch_add(1, Ordering::Relaxed)
    }

    fn shard(&self, key: ChainKey) -> &Shard {
        let h = (key.0 ^ self.shard_seed).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let idx = if self.shard_bits == 0 {
            0
        } else {
            (h >> (64 - self.shard_bits)) as usize
        };
        &self.shards[idx]
    }

    fn endpoint_entry(&self, endpoint: EndpointId) -> Result<Arc<EndpointEntry>, IndexError> {
        if let Some(e) = self.registry.read().by_id.get(&endpoint) {
            return Ok(e.clone());
        }
        let mut reg = self.registry.write();
        if let Some(e) = reg.by_id.get(&endpoint) {
            return Ok(e.clone());
        }
        if reg.by_id.len() >= self.config.max_endpoints {
            return Err(IndexError::TooManyEndpoints {
                max: self.config.max_endpoints,
            });
        }
        // Lowest free slot first keeps the lookup's word count small.
        reg.free.sort_unstable_by(|a, b| b.cmp(a));
        let slot = match reg.free.pop() {
            Some(s) => s,
            None => {
                reg.slots.push(None);
                (reg.slots.len() - 1) as u32
            }
        };
        reg.slots[slot as usize] = Some(endpoint);
        self.words
            .fetch_max(slot as usize / 64 + 1, Ordering::AcqRel);
        let entry = Arc::new(EndpointEntry {
            slot,
            held: AtomicUsize::new(0),
            state: Mutex::new(EndpointState::default()),
            rule: ArcSwapOption::empty(),
        });
        reg.by_id.insert(endpoint, entry.clone());
        Ok(entry)
    }

    fn apply_stored(
        &self,
        entry: &EndpointEntry,
        state: &mut EndpointState,
        ev: &BlockStored,
        now: u32,
    ) -> Result<(), IndexError> {
        let Some(tier) = crate::indexed_store(ev) else {
            return self.ignore();
        };
        match groups::store_group(ev) {
            StoreGroup::Unsupported => self.ignore(),
            // Without its group a hybrid endpoint's block cannot take part in the rule.
            StoreGroup::Ungrouped if state.layout.is_hybrid() => self.ignore(),
            StoreGroup::Ungrouped => self.apply_dense_store(entry, state, ev, tier, now),
            StoreGroup::Grouped {
                idx,
                kind,
                block_size,
            } => {
                if !self.learn_group(entry, state, idx, kind, block_size) {
                    return self.ignore();
                }
                if state.layout.is_hybrid() {
                    self.apply_group_store(entry, state, ev, idx, kind, tier, now)
                } else {
                    self.apply_dense_store(entry, state, ev, tier, now)
                }
            }
        }
    }

    fn ignore(&self) -> Result<(), IndexError> {
        self.counters.ignored_events.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Learns group `idx` of the endpoint from a store. Returns false when the store contradicts
    /// the layout learned so far (the event is then ignored).
    fn learn_group(
        &self,
        entry: &EndpointEntry,
        state: &mut EndpointState,
        idx: u8,
        kind: GroupKind,
        block_size: u32,
    ) -> bool {
        let was_hybrid = state.layout.is_hybrid();
        let Ok(new_group) = state.layout.learn(idx, kind, block_size) else {
            return false;
        };
        if !state.layout.is_hybrid() {
            return true;
        }
        if !was_hybrid {
            // Dense holdings carry no group bits: forget them rather than guess which group held
            // what. vLLM announces a hybrid model's groups in its first batch, so this loses at
            // most that batch's first group.
            self.clear_holdings(entry, state);
        } else if new_group && kind == GroupKind::Full {
            // A new full-attention group holds nothing yet, so no block is in every full group
            // any more: the full-attention run starts over from what that group stores.
            for (hash, last) in state.hashes.iter() {
                for k in state.spans.get(hash).iter().flat_map(|l| l.iter()) {
                    self.remove_member(*k, entry.slot, None);
                }
                self.remove_member(*last, entry.slot, None);
            }
        }
        let rule = state.layout.rule();
        if entry.rule.load().as_deref() != Some(&rule) {
            entry.rule.store(Some(Arc::new(rule)));
        }
        true
    }

    /// A store of a hybrid endpoint in group `idx`.
    #[allow(clippy::too_many_arguments)]
    fn apply_group_store(
        &self,
        entry: &EndpointEntry,
        state: &mut EndpointState,
        ev: &BlockStored,
        idx: u8,
        kind: GroupKind,
        tier: Tier,
        now: u32,
    ) -> Result<(), IndexError> {
        let slot = entry.slot;
        if ev.block_hashes.is_empty() {
            return Ok(());
        }
        if kind == GroupKind::Full && !ev.token_ids.is_empty() {
            // Full attention lists every block of its range: it keys the chain, as a dense store.
            self.key_run(entry, state, ev, None, now)?;
            for hash in &ev.block_hashes {
                self.hold_in_group(slot, state, *hash, idx, tier, now);
                if let Some(waiting) = state.pending.remove(hash) {
                    for (group, tier) in waiting {
                        self.hold_in_group(slot, state, *hash, group, tier, now);
                    }
                }
            }
            return Ok(());
        }
        // Sliding-window and mamba groups list only the blocks vLLM kept while `token_ids` spans
        // the whole range, so counting tokens would misplace them: a block's position is the one
        // its hash (the same digest in every group) has in the full-attention chain. vLLM
        // publishes those groups before the full-attention one, so unknown hashes wait for it.
        let mut unresolved = 0;
        for hash in &ev.block_hashes {
            if state.hashes.contains_key(hash) {
                self.hold_in_group(slot, state, *hash, idx, tier, now);
            } else if kind == GroupKind::Full {
                unresolved += 1;
            } else {
                self.defer(state, *hash, idx, tier);
            }
        }
        if unresolved > 0 {
            self.counters
                .unresolved_blocks
                .fetch_add(unresolved as u64, Ordering::Relaxed);
            return Err(IndexError::UnresolvedHashes {
                unresolved,
                total: ev.block_hashes.len(),
            });
        }
        Ok(())
    }

    /// Marks `hash` (whose position is known) as held by group `group` in `tier`. A full-attention
    /// group's membership is the block's own key, set once every full-attention group holds it;
    /// another group's is the block's [`group_key`], on the last router block of the engine
    /// block (the one a lookup probes).
    fn hold_in_group(
        &self,
        slot: u32,
        state: &mut EndpointState,
        hash: BlockHash,
        group: u8,
        tier: Tier,
        now: u32,
    ) {
        let Some(last) = state.hashes.get(&hash).copied() else {
            return;
        };
        let full = state.layout.full_mask();
        let bit = 1u64 << group;
        let held = state.groups_held.entry(hash).or_default();
        *held.get_mut(tier) |= bit;
        let in_every_full_group = held.get(tier) & full == full;
        if let Some(r) = &mut state.refreshed {
            r.insert(hash);
            *state.refreshed_groups.entry(hash).or_default() |= bit;
        }
        if full & bit == 0 {
            self.add_member(group_key(last, group), slot, tier, now);
        } else if in_every_full_group {
            for k in state.spans.get(&hash).iter().flat_map(|l| l.iter()) {
                self.add_member(*k, slot, tier, now);
            }
            self.add_member(last, slot, tier, now);
        }
    }

    /// Queues a non-full-group store of a hash whose position is not known yet.
    fn defer(&self, state: &mut EndpointState, hash: BlockHash, group: u8, tier: Tier) {
        let waiting = state.pending.entry(hash).or_default();
        if waiting.contains(&(group, tier)) {
            return;
        }
        if waiting.is_empty() {
            state.pending_order.push_back(hash);
        }
        waiting.push((group, tier));
        while state.pending.len() > MAX_PENDING {
            let Some(oldest) = state.pending_order.pop_front() else {
                break;
            };
            if let Some(dropped) = state.pending.remove(&oldest) {
                self.counters
                    .unresolved_blocks
                    .fetch_add(dropped.len() as u64, Ordering::Relaxed);
            }
        }
        if state.pending_order.len() > 2 * state.pending.len() + 64 {
            let pending = &state.pending;
            state.pending_order.retain(|h| pending.contains_key(h));
        }
    }

    /// A store without groups, or in the one group of a dense endpoint: as before groups existed.
    fn apply_dense_store(
        &self,
        entry: &EndpointEntry,
        state: &mut EndpointState,
        ev: &BlockStored,
        tier: Tier,
        now: u32,
    ) -> Result<(), IndexError> {
        if ev.block_hashes.is_empty() {
            return Ok(());
        }
        if ev.token_ids.is_empty() {
            return self.apply_tokenless_store(entry.slot, state, ev, tier, now);
        }
        self.key_run(entry, state, ev, Some(tier), now)
    }

    /// Keys a stored run with tokens: validates it, finds its parent's key, and records each
    /// engine hash's router keys in the endpoint's maps. With `tier`, also adds the endpoint's
    /// membership of every key (a dense store); without, the caller decides per group.
    fn key_run(
        &self,
        entry: &EndpointEntry,
        state: &mut EndpointState,
        ev: &BlockStored,
        tier: Option<Tier>,
        now: u32,
    ) -> Result<(), IndexError> {
        let slot = entry.slot;
        let n = ev.block_hashes.len();
        let mismatch = IndexError::TokenCountMismatch {
            tokens: ev.token_ids.len(),
            blocks: n,
            block_size: ev.block_size,
        };
        if !ev.token_ids.len().is_multiple_of(n) {
            return Err(mismatch);
        }
        let engine_bs = ev.token_ids.len() / n;
        if ev.block_size != 0 && ev.block_size as usize != engine_bs {
            return Err(mismatch);
        }
        let router_bs = self.config.block_size.max(1);
        if !engine_bs.is_multiple_of(router_bs) {
            return Err(IndexError::BlockSizeMismatch {
                engine: engine_bs,
                router: router_bs,
            });
        }
        let mut key = match ev.parent_block_hash {
            None => crate::event_root(ev),
            Some(parent) => match state.hashes.get(&parent) {
                Some(k) => *k,
                None => {
                    self.counters.orphan_events.fetch_add(1, Ordering::Relaxed);
                    return Err(IndexError::UnknownParent { parent, blocks: n });
                }
            },
        };
        let ratio = engine_bs / router_bs;
        for (hash, tokens) in ev
            .block_hashes
            .iter()
            .zip(ev.token_ids.chunks_exact(engine_bs))
        {
            let known = state.hashes.contains_key(hash);
            if !known {
                self.make_room(entry, state, ratio, now);
            }
            let mut lead = Vec::new();
            for (j, sub) in tokens.chunks_exact(router_bs).enumerate() {
                key = key.child(sub);
                if let Some(tier) = tier {
                    self.add_member(key, slot, tier, now);
                }
                if j + 1 < ratio {
                    lead.push(key);
                }
            }
            state.hashes.insert(*hash, key);
            if let Some(r) = &mut state.refreshed {
                r.insert(*hash);
            }
            if ratio > 1 {
                state.spans.insert(*hash, lead.into_boxed_slice());
            }
            if !known {
                self.held_add(entry, ratio);
                state.order.push_back((*hash, now));
            }
        }
        self.compact_order(state);
        Ok(())
    }

    fn apply_tokenless_store(
        &self,
        slot: u32,
        state: &mut EndpointState,
        ev: &BlockStored,
        tier: Tier,
        now: u32,
    ) -> Result<(), IndexError> {
        let mut unresolved = 0;
        for hash in &ev.block_hashes {
            let Some(last) = state.hashes.get(hash).copied() else {
                unresolved += 1;
                continue;
            };
            if let Some(lead) = state.spans.get(hash) {
                for k in lead.iter() {
                    self.add_member(*k, slot, tier, now);
                }
            }
            self.add_member(last, slot, tier, now);
            if let Some(r) = &mut state.refreshed {
                r.insert(*hash);
            }
        }
        if unresolved > 0 {
            self.counters
                .unresolved_blocks
                .fetch_add(unresolved as u64, Ordering::Relaxed);
            return Err(IndexError::UnresolvedHashes {
                unresolved,
                total: ev.block_hashes.len(),
            });
        }
        Ok(())
    }

    fn apply_removed(&self, entry: &EndpointEntry, state: &mut EndpointState, ev: &BlockRemoved) {
        let (Some(tier), Some(group)) = (crate::indexed_remove(ev), groups::remove_group(ev))
        else {
            let _ = self.ignore();
            return;
        };
        if !state.layout.is_hybrid() {
            if group.is_some_and(|g| g != state.layout.dense_group()) {
                let _ = self.ignore();
                return;
            }
            self.apply_dense_removed(entry, state, ev, tier);
            return;
        }
        let Some(group) = group.filter(|g| state.layout.get(*g).is_some()) else {
            let _ = self.ignore();
            return;
        };
        for hash in &ev.block_hashes {
            self.remove_from_group(entry, state, *hash, group, tier);
        }
        self.compact_order(state);
    }

    /// A hybrid endpoint's group `group` dropped `hash` from `tier`.
    fn remove_from_group(
        &self,
        entry: &EndpointEntry,
        state: &mut EndpointState,
        hash: BlockHash,
        group: u8,
        tier: Tier,
    ) {
        let slot = entry.slot;
        let mut was_pending = false;
        if let Some(waiting) = state.pending.get_mut(&hash) {
            let before = waiting.len();
            waiting.retain(|w| *w != (group, tier));
            was_pending = waiting.len() != before;
            if waiting.is_empty() {
                state.pending.remove(&hash);
            }
        }
        let bit = 1u64 << group;
        let (Some(last), Some(held)) = (
            state.hashes.get(&hash).copied(),
            state.groups_held.get_mut(&hash),
        ) else {
            if !was_pending {
                self.counters
                    .unknown_removals
                    .fetch_add(1, Ordering::Relaxed);
            }
            return;
        };
        if held.get(tier) & bit == 0 {
            if !was_pending {
                self.counters
                    .unknown_removals
                    .fetch_add(1, Ordering::Relaxed);
            }
            return;
        }
        let full = state.layout.full_mask();
        let was_in_every_full_group = held.get(tier) & full == full;
        *held.get_mut(tier) &= !bit;
        let held_nowhere = held.is_empty();
        if full & bit == 0 {
            self.remove_member(group_key(last, group), slot, Some(tier));
        } else if was_in_every_full_group {
            for k in state.spans.get(&hash).iter().flat_map(|l| l.iter()) {
                self.remove_member(*k, slot, Some(tier));
            }
            self.remove_member(last, slot, Some(tier));
        }
        if held_nowhere {
            state.groups_held.remove(&hash);
            state.hashes.remove(&hash);
            let lead = state.spans.remove(&hash);
            if let Some(r) = &mut state.refreshed {
                r.remove(&hash);
            }
            self.held_sub(entry, 1 + lead.map_or(0, |l| l.len()));
        }
    }

    fn apply_dense_removed(
        &self,
        entry: &EndpointEntry,
        state: &mut EndpointState,
        ev: &BlockRemoved,
        tier: Tier,
    ) {
        let slot = entry.slot;
        for hash in &ev.block_hashes {
            let Some(last) = state.hashes.get(hash).copied() else {
                self.counters
                    .unknown_removals
                    .fetch_add(1, Ordering::Relaxed);
                continue;
            };
            if let Some(lead) = state.spans.get(hash) {
                for k in lead.iter() {
                    self.remove_member(*k, slot, Some(tier));
                }
            }
            let still_held = self.remove_member(last, slot, Some(tier));
            if !still_held {
                state.hashes.remove(hash);
                let lead = state.spans.remove(hash);
                if let Some(r) = &mut state.refreshed {
                    r.remove(hash);
                }
                self.held_sub(entry, 1 + lead.map_or(0, |l| l.len()));
            }
        }
        self.compact_order(state);
    }

    /// Forgets everything the endpoint holds, its group layout included (a restarted engine may
    /// serve another model; the next events teach the layout again).
    fn clear_state(&self, entry: &EndpointEntry, state: &mut EndpointState) {
        self.clear_holdings(entry, state);
        state.layout = GroupLayout::default();
        entry.rule.store(None);
    }

    /// Forgets every block the endpoint holds, keeping its group layout.
    fn clear_holdings(&self, entry: &EndpointEntry, state: &mut EndpointState) {
        let slot = entry.slot;
        let non_full = !state.layout.full_mask();
        for (hash, last) in state.hashes.drain() {
            if let Some(lead) = state.spans.get(&hash) {
                for k in lead.iter() {
                    self.remove_member(*k, slot, None);
                }
            }
            self.remove_member(last, slot, None);
            if let Some(held) = state.groups_held.get(&hash) {
                for group in bits((held.gpu | held.cpu) & non_full) {
                    self.remove_member(group_key(last, group), slot, None);
                }
            }
        }
        state.groups_held = HashMap::new();
        state.refreshed_groups = HashMap::new();
        state.pending = HashMap::new();
        state.pending_order = VecDeque::new();
        state.spans = HashMap::new();
        state.hashes = HashMap::new();
        // Nothing stale is left: a clear also ends the suspect state.
        state.refreshed = None;
        state.order = VecDeque::new();
        let held = entry.held.swap(0, Ordering::Relaxed);
        self.held_total.fetch_sub(held, Ordering::Relaxed);
    }

    /// Drops every membership of one engine hash of the endpoint (all tiers) and its map entries.
    /// Returns the router blocks it covered (0 if the hash was not held).
    fn forget_hash(
        &self,
        entry: &EndpointEntry,
        state: &mut EndpointState,
        hash: BlockHash,
    ) -> usize {
        let Some(last) = state.hashes.remove(&hash) else {
            return 0;
        };
        let lead = state.spans.remove(&hash);
        for k in lead.iter().flat_map(|l| l.iter()) {
            self.remove_member(*k, entry.slot, None);
        }
        self.remove_member(last, entry.slot, None);
        state.refreshed_groups.remove(&hash);
        if let Some(held) = state.groups_held.remove(&hash) {
            let non_full = (held.gpu | held.cpu) & !state.layout.full_mask();
            for group in bits(non_full) {
                self.remove_member(group_key(last, group), entry.slot, None);
            }
        }
        if let Some(r) = &mut state.refreshed {
            r.remove(&hash);
        }
        let blocks = 1 + lead.map_or(0, |l| l.len());
        self.held_sub(entry, blocks);
        blocks
    }

    fn held_add(&self, entry: &EndpointEntry, blocks: usize) {
        entry.held.fetch_add(blocks, Ordering::Relaxed);
        self.held_total.fetch_add(blocks, Ordering::Relaxed);
    }

    fn held_sub(&self, entry: &EndpointEntry, blocks: usize) {
        entry.held.fetch_sub(blocks, Ordering::Relaxed);
        self.held_total.fetch_sub(blocks, Ordering::Relaxed);
    }

    /// Each registered endpoint's share of `max_blocks`.
    fn share(&self) -> usize {
        let endpoints = self.registry.read().by_id.len().max(1);
        (self.config.max_blocks / endpoints).max(1)
    }

    /// Before `entry` stores `incoming` more router blocks: it evicts its own oldest blocks past
    /// its share; then, if all endpoints together would exceed `max_blocks`, the endpoint that
    /// holds the most pays, if it is over its share.
    fn make_room(
        &self,
        entry: &EndpointEntry,
        state: &mut EndpointState,
        incoming: usize,
        now: u32,
    ) {
        let share = self.share();
        while entry.held.load(Ordering::Relaxed) + incoming > share {
            if !self.evict_own(entry, state, now) {
                break;
            }
        }
        if self.held_total.load(Ordering::Relaxed) + incoming > self.config.max_blocks {
            self.trim_largest(entry.slot, share, now);
        }
    }

    /// Evicts the endpoint's least recently used engine block by CLOCK over its store order: a
    /// candidate stored or looked up since it was queued goes back to the end (at most
    /// [`SECOND_CHANCES`] times per call). Returns false when it holds nothing.
    fn evict_own(&self, entry: &EndpointEntry, state: &mut EndpointState, now: u32) -> bool {
        let mut chances = SECOND_CHANCES;
        while let Some((hash, queued)) = state.order.pop_front() {
            let Some(&last) = state.hashes.get(&hash) else {
                continue;
            };
            let used = self.shard(last).last_used(last);
            let age = |t: u32| now.wrapping_sub(t);
            if chances > 0 && used.is_some_and(|u| age(u) < age(queued)) {
                chances -= 1;
                state.order.push_back((hash, now));
                continue;
            }
            let blocks = self.forget_hash(entry, state, hash);
            self.counters
                .share_evictions
                .fetch_add(blocks as u64, Ordering::Relaxed);
            return true;
        }
        false
    }

    /// Evicts one engine block of the endpoint holding the most, if that is not `storing` and it
    /// is over `share`. Never waits: an endpoint busy with its own event is skipped this time (its
    /// next store trims it), so two endpoints trimming each other cannot deadlock.
    fn trim_largest(&self, storing: u32, share: usize, now: u32) {
        let largest = self
            .registry
            .read()
            .by_id
            .values()
            .filter(|e| e.slot != storing)
            .max_by_key(|e| e.held.load(Ordering::Relaxed))
            .cloned();
        let Some(victim) = largest else { return };
        if victim.held.load(Ordering::Relaxed) <= share {
            return;
        }
        if let Some(mut state) = victim.state.try_lock()
            && !state.removed
        {
            self.evict_own(&victim, &mut state, now);
        }
    }

    /// Drops queue entries whose hash is gone (removed, evicted, re-queued) once they outnumber
    /// the live ones, so the queue stays within twice the endpoint's map.
    fn compact_order(&self, state: &mut EndpointState) {
        if state.order.len() <= 2 * state.hashes.len() + 1024 {
            return;
        }
        let mut seen = hashbrown::HashSet::with_capacity(state.hashes.len());
        let hashes = &state.hashes;
        // Keep the newest entry of each live hash (its latest second chance).
        let mut kept: Vec<(BlockHash, u32)> = state
            .order
            .iter()
            .rev()
            .filter(|(h, _)| hashes.contains_key(h) && seen.insert(*h))
            .copied()
            .collect();
        kept.reverse();
        state.order = kept.into();
    }

    fn add_member(&self, key: ChainKey, slot: u32, tier: Tier, now: u32) {
        let out = self.shard(key).add(key, slot, tier, now, self.shard_cap);
        if out.evicted > 0 {
            self.counters
                .evictions
                .fetch_add(out.evicted, Ordering::Relaxed);
        }
    }

    /// Removes `slot` from `key` in `tier` (both tiers if `None`). Returns whether the slot still
    /// holds the block in some tier afterwards.
    fn remove_member(&self, key: ChainKey, slot: u32, tier: Option<Tier>) -> bool {
        self.shard(key).remove(key, slot, tier)
    }
}

impl PrefixIndex {
    /// `m` (a hybrid endpoint's full-attention runs, in router blocks) with vLLM's prefix-hit
    /// rule applied per tier, in whole engine blocks.
    fn hybrid_match(
        &self,
        m: EndpointMatch,
        rule: &HybridRule,
        keys: &[ChainKey],
        slot: usize,
        probe: &mut GroupProbe,
    ) -> EndpointMatch {
        let router_bs = self.config.block_size.max(1);
        let engine_bs = rule.engine_block_size;
        if engine_bs == 0 || !engine_bs.is_multiple_of(router_bs) {
            return EndpointMatch {
                gpu_blocks: 0,
                cpu_blocks: 0,
                any_blocks: 0,
                ..m
            };
        }
        let ratio = engine_bs / router_bs;
        let mut hit = |run: usize, tiers: TierSet| {
            let blocks = groups::hybrid_hit(run / ratio, &rule.specs, |groups, j| {
                probe.held_in_all(self, groups, keys[(j + 1) * ratio - 1], j, slot, tiers)
            });
            blocks * ratio
        };
        EndpointMatch {
            endpoint: m.endpoint,
            gpu_blocks: hit(m.gpu_blocks, TierSet::GPU),
            cpu_blocks: hit(m.cpu_blocks, TierSet::CPU),
            any_blocks: hit(m.any_blocks, TierSet::ANY),
        }
    }
}

/// Which tiers count as holding a block in a lookup's run.
#[derive(Debug, Clone, Copy)]
struct TierSet {
    gpu: bool,
    cpu: bool,
}

impl TierSet {
    const GPU: TierSet = TierSet {
        gpu: true,
        cpu: false,
    };
    const CPU: TierSet = TierSet {
        gpu: false,
        cpu: true,
    };
    const ANY: TierSet = TierSet {
        gpu: true,
        cpu: true,
    };
}

/// One lookup's reads of group memberships, each (group, engine block) read once for every
/// hybrid endpoint. Only the blocks the rule asks about are read: a window or a state near each
/// endpoint's run end, so a lookup reads a few more table slots per hybrid group, not a whole
/// prompt's worth.
struct GroupProbe {
    words: usize,
    now: u32,
    read: HashMap<(u8, usize), Box<[u64]>>,
}

impl GroupProbe {
    fn new(words: usize, now: u32) -> Self {
        GroupProbe {
            words,
            now,
            read: HashMap::new(),
        }
    }

    /// Whether endpoint `slot` holds engine block `j` (last router key `key`) in every group of
    /// the bit set `groups`, in one of `tiers`.
    fn held_in_all(
        &mut self,
        index: &PrefixIndex,
        groups: u64,
        key: ChainKey,
        j: usize,
        slot: usize,
        tiers: TierSet,
    ) -> bool {
        let (word, bit) = (slot / 64, slot % 64);
        bits(groups).all(|group| {
            let masks = self.read.entry((group, j)).or_insert_with(|| {
                let mut out = vec![0u64; 2 * self.words];
                let gk = group_key(key, group);
                index.shard(gk).read(gk, &mut out, self.now);
                out.into_boxed_slice()
            });
            let gpu = masks.get(2 * word).is_some_and(|w| w >> bit & 1 == 1);
            let cpu = masks.get(2 * word + 1).is_some_and(|w| w >> bit & 1 == 1);
            (tiers.gpu && gpu) || (tiers.cpu && cpu)
        })
    }
}

/// The group indices set in `mask`.
fn bits(mut mask: u64) -> impl Iterator<Item = u8> {
    std::iter::from_fn(move || {
        if mask == 0 {
            return None;
        }
        let b = mask.trailing_zeros() as u8;
        mask &= mask - 1;
        Some(b)
    })
}

/// Stores `value` for every set bit of `bits` (bit b → `lens[b]`).
fn record(lens: &mut [u32], mut bits: u64, value: u32) {
    while bits != 0 {
        let b = bits.trailing_zeros() as usize;
        lens[b] = value;
        bits &= bits - 1;
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod hybrid_tests;
