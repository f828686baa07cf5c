//! A clean-room, obviously-correct model of the index semantics, for differential tests.
//!
//! Per endpoint it keeps a map `ChainKey → (gpu, cpu)` and the engine-hash → keys map, all in
//! ordered maps behind one mutex, and answers lookups by walking each endpoint separately. It
//! has no memory bound (never evicts) and no concurrency story; it exists so property tests can
//! compare every lookup of [`crate::PrefixIndex`] against it.
//!
//! Hybrid endpoints (vLLM's KV-cache groups): per engine hash, which group holds it in which
//! tier; a lookup finds each engine block's hash by its keys and applies vLLM's rule
//! (`groups::hybrid_hit`) to those per-block facts, where the fast index reads memberships of
//! derived keys from its table.

use std::collections::{BTreeMap, BTreeSet};

use kvmesh_core::events::{BlockRemoved, BlockStored, KvEvent};
use kvmesh_core::{BlockHash, ChainKey};
use parking_lot::Mutex;

use crate::groups::{self, GroupKind, GroupLayout, StoreGroup};
use crate::{EndpointId, EndpointMatch, IndexBackend, IndexError, Tier};

/// (held in GPU, held in CPU).
type Tiers = (bool, bool);

#[derive(Debug, Default)]
struct Endpoint {
    /// Key → (held in GPU, held in CPU).
    held: BTreeMap<ChainKey, (bool, bool)>,
    /// Engine hash → every router key it covers, in order.
    keys: BTreeMap<BlockHash, Vec<ChainKey>>,
    /// While suspect: hashes stored since the endpoint was marked.
    refreshed: Option<BTreeSet<BlockHash>>,
    layout: GroupLayout,
    /// Hybrid endpoints: engine hash → group → tiers holding it.
    groups: BTreeMap<BlockHash, BTreeMap<u8, Tiers>>,
    /// Hybrid endpoints: non-full-group stores of hashes whose keys are not known yet
    /// (group, in CPU).
    pending: BTreeMap<BlockHash, BTreeSet<(u8, bool)>>,
    /// Hybrid endpoints, while suspect: the groups that stored each hash since.
    refreshed_groups: BTreeMap<BlockHash, BTreeSet<u8>>,
}

/// The naive reference index.
#[derive(Debug)]
pub struct ReferenceIndex {
    block_size: usize,
    endpoints: Mutex<BTreeMap<EndpointId, Endpoint>>,
}

impl ReferenceIndex {
    pub fn new(block_size: usize) -> Self {
        ReferenceIndex {
            block_size,
            endpoints: Mutex::new(BTreeMap::new()),
        }
    }

    /// How many (key, endpoint, tier) memberships the model holds.
    /// For a hybrid endpoint: each key of a block every full-attention group holds, per tier,
    /// and each (block, other group, tier).
    pub fn memberships(&self) -> usize {
        let all = self.endpoints.lock();
        let dense: usize = all
            .values()
            .flat_map(|e| e.held.values())
            .map(|(g, c)| usize::from(*g) + usize::from(*c))
            .sum();
        // Sets, as the table holds one membership per key: engine blocks of two prompts share
        // their leading router blocks' keys.
        let mut hybrid: BTreeSet<(EndpointId, ChainKey, Option<u8>, bool)> = BTreeSet::new();
        for (id, e) in all.iter().filter(|(_, e)| e.layout.is_hybrid()) {
            let full = e.layout.full_mask();
            for (h, by_group) in &e.groups {
                let keys = e.keys.get(h).map(Vec::as_slice).unwrap_or_default();
                for (cpu, tier) in [
                    (false, (|t: &Tiers| t.0) as fn(&Tiers) -> bool),
                    (true, |t| t.1),
                ] {
                    let in_every_full = full != 0
                        && (0..64u8)
                            .filter(|g| full >> g & 1 == 1)
                            .all(|g| by_group.get(&g).is_some_and(tier));
                    if in_every_full {
                        hybrid.extend(keys.iter().map(|k| (*id, *k, None, cpu)));
                    }
                    for (g, t) in by_group {
                        if full >> g & 1 == 0
                            && tier(t)
                            && let Some(last) = keys.last()
                        {
                            hybrid.insert((*id, *last, Some(*g), cpu));
                        }
                    }
                }
            }
        }
        dense + hybrid.len()
    }
}

fn set_tier(entry: &mut (bool, bool), tier: Tier, value: bool) {
    match tier {
        Tier::Gpu => entry.0 = value,
        Tier::Cpu => entry.1 = value,
    }
}

impl ReferenceIndex {
    fn apply_stored(&self, ep: &mut Endpoint, ev: &BlockStored) -> Result<(), IndexError> {
        let Some(tier) = crate::indexed_store(ev) else {
            return Ok(());
        };
        match groups::store_group(ev) {
            StoreGroup::Unsupported => Ok(()),
            StoreGroup::Ungrouped if ep.layout.is_hybrid() => Ok(()),
            StoreGroup::Ungrouped => self.dense_store(ep, ev, tier),
            StoreGroup::Grouped {
                idx,
                kind,
                block_size,
            } => {
                let was_hybrid = ep.layout.is_hybrid();
                if ep.layout.learn(idx, kind, block_size).is_err() {
                    return Ok(());
                }
                if !ep.layout.is_hybrid() {
                    return self.dense_store(ep, ev, tier);
                }
                if !was_hybrid {
                    // Becoming hybrid forgets the dense holdings.
                    *ep = Endpoint {
                        layout: ep.layout.clone(),
                        ..Endpoint::default()
                    };
                }
                self.group_store(ep, ev, idx, kind, tier)
            }
        }
    }

    fn group_store(
        &self,
        ep: &mut Endpoint,
        ev: &BlockStored,
        group: u8,
        kind: GroupKind,
        tier: Tier,
    ) -> Result<(), IndexError> {
        let n = ev.block_hashes.len();
        if n == 0 {
            return Ok(());
        }
        let hold = |ep: &mut Endpoint, h: BlockHash, g: u8, tier: Tier| {
            let e = ep.groups.entry(h).or_default().entry(g).or_default();
            set_tier(e, tier, true);
            if let Some(r) = &mut ep.refreshed {
                r.insert(h);
                ep.refreshed_groups.entry(h).or_default().insert(g);
            }
        };
        if kind == GroupKind::Full && !ev.token_ids.is_empty() {
            let keyed = self.keys_of_run(ep, ev)?;
            for (h, keys) in keyed {
                ep.keys.insert(h, keys);
                if let Some(r) = &mut ep.refreshed {
                    r.insert(h);
                }
                hold(ep, h, group, tier);
                for (g, cpu) in ep.pending.remove(&h).unwrap_or_default() {
                    hold(ep, h, g, if cpu { Tier::Cpu } else { Tier::Gpu });
                }
            }
            return Ok(());
        }
        let mut unresolved = 0;
        for h in &ev.block_hashes {
            if ep.keys.contains_key(h) {
                hold(ep, *h, group, tier);
            } else if kind == GroupKind::Full {
                unresolved += 1;
            } else {
                ep.pending
                    .entry(*h)
                    .or_default()
                    .insert((group, tier == Tier::Cpu));
            }
        }
        if unresolved == 0 {
            Ok(())
        } else {
            Err(IndexError::UnresolvedHashes {
                unresolved,
                total: n,
            })
        }
    }

    /// Each engine hash of a run with tokens and the router keys it covers.
    fn keys_of_run(
        &self,
        ep: &Endpoint,
        ev: &BlockStored,
    ) -> Result<Vec<(BlockHash, Vec<ChainKey>)>, IndexError> {
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
        let bs = self.block_size.max(1);
        if !engine_bs.is_multiple_of(bs) {
            return Err(IndexError::BlockSizeMismatch {
                engine: engine_bs,
                router: bs,
            });
        }
        let mut parent = match ev.parent_block_hash {
            None => crate::event_root(ev),
            Some(p) => match ep.keys.get(&p).and_then(|k| k.last()) {
                Some(k) => *k,
                None => {
                    return Err(IndexError::UnknownParent {
                        parent: p,
                        blocks: n,
                    });
                }
            },
        };
        let mut out = Vec::new();
        for (i, h) in ev.block_hashes.iter().enumerate() {
            let tokens = &ev.token_ids[i * engine_bs..(i + 1) * engine_bs];
            let mut keys = Vec::new();
            for sub in tokens.chunks(bs) {
                parent = parent.child(sub);
                keys.push(parent);
            }
            out.push((*h, keys));
        }
        Ok(out)
    }

    fn dense_store(
        &self,
        ep: &mut Endpoint,
        ev: &BlockStored,
        tier: Tier,
    ) -> Result<(), IndexError> {
        let n = ev.block_hashes.len();
        if n == 0 {
            return Ok(());
        }
        if ev.token_ids.is_empty() {
            let mut unresolved = 0;
            for h in &ev.block_hashes {
                match ep.keys.get(h) {
                    None => unresolved += 1,
                    Some(keys) => {
                        for k in keys {
                            set_tier(ep.held.entry(*k).or_default(), tier, true);
                        }
                        if let Some(r) = &mut ep.refreshed {
                            r.insert(*h);
                        }
                    }
                }
            }
            return if unresolved == 0 {
                Ok(())
            } else {
                Err(IndexError::UnresolvedHashes {
                    unresolved,
                    total: n,
                })
            };
        }
        for (h, keys) in self.keys_of_run(ep, ev)? {
            for k in &keys {
                set_tier(ep.held.entry(*k).or_default(), tier, true);
            }
            ep.keys.insert(h, keys);
            if let Some(r) = &mut ep.refreshed {
                r.insert(h);
            }
        }
        Ok(())
    }

    fn apply_removed(ep: &mut Endpoint, ev: &BlockRemoved) {
        let (Some(tier), Some(group)) = (crate::indexed_remove(ev), groups::remove_group(ev))
        else {
            return;
        };
        if !ep.layout.is_hybrid() {
            if group.is_none_or(|g| g == ep.layout.dense_group()) {
                Self::dense_removed(ep, ev, tier);
            }
            return;
        }
        let Some(g) = group.filter(|g| ep.layout.get(*g).is_some()) else {
            return;
        };
        for h in &ev.block_hashes {
            if let Some(p) = ep.pending.get_mut(h) {
                p.remove(&(g, tier == Tier::Cpu));
                if p.is_empty() {
                    ep.pending.remove(h);
                }
            }
            let Some(by_group) = ep.groups.get_mut(h) else {
                continue;
            };
            if let Some(e) = by_group.get_mut(&g) {
                set_tier(e, tier, false);
                if !e.0 && !e.1 {
                    by_group.remove(&g);
                }
            }
            if by_group.is_empty() {
                ep.groups.remove(h);
                ep.keys.remove(h);
                if let Some(r) = &mut ep.refreshed {
                    r.remove(h);
                }
            }
        }
    }

    fn dense_removed(ep: &mut Endpoint, ev: &BlockRemoved, tier: Tier) {
        for h in &ev.block_hashes {
            let Some(keys) = ep.keys.get(h).cloned() else {
                continue;
            };
            for k in &keys {
                if let Some(e) = ep.held.get_mut(k) {
                    set_tier(e, tier, false);
                    if !e.0 && !e.1 {
                        ep.held.remove(k);
                    }
                }
            }
            let last = keys.last().copied();
            if last.is_none_or(|k| !ep.held.contains_key(&k)) {
                ep.keys.remove(h);
                if let Some(r) = &mut ep.refreshed {
                    r.remove(h);
                }
            }
        }
    }

    /// A hybrid endpoint's match: per engine block, the groups holding its hash; the full
    /// attention run (every full group in one tier: the GPU, the CPU, or for `any` either one),
    /// then vLLM's rule over the other groups (`any`: each group in either tier).
    fn hybrid_match(&self, id: EndpointId, ep: &Endpoint, keys: &[ChainKey]) -> EndpointMatch {
        let rule = ep.layout.rule();
        let bs = self.block_size.max(1);
        let zero = EndpointMatch {
            endpoint: id,
            gpu_blocks: 0,
            cpu_blocks: 0,
            any_blocks: 0,
        };
        let ebs = rule.engine_block_size;
        if ebs == 0 || !ebs.is_multiple_of(bs) {
            return zero;
        }
        let r = ebs / bs;
        let by_last: BTreeMap<ChainKey, BlockHash> = ep
            .keys
            .iter()
            .filter_map(|(h, ks)| ks.last().map(|k| (*k, *h)))
            .collect();
        let blocks = keys.len() / r;
        // Per engine block: group → tiers of the hash whose keys are exactly the block's.
        let per_block: Vec<BTreeMap<u8, Tiers>> = (0..blocks)
            .map(|j| {
                let slice = &keys[j * r..(j + 1) * r];
                slice
                    .last()
                    .and_then(|k| by_last.get(k))
                    .filter(|h| ep.keys.get(h).is_some_and(|ks| ks.as_slice() == slice))
                    .and_then(|h| ep.groups.get(h))
                    .cloned()
                    .unwrap_or_default()
            })
            .collect();
        let full: Vec<u8> = (0..64u8)
            .filter(|g| ep.layout.full_mask() >> g & 1 == 1)
            .collect();
        let in_tier = |j: usize, g: u8, gpu: bool, cpu: bool| {
            per_block[j]
                .get(&g)
                .is_some_and(|t| (gpu && t.0) || (cpu && t.1))
        };
        let full_run = |gpu: bool, cpu: bool| {
            if full.is_empty() {
                return 0;
            }
            let all_in = |j: usize, g: bool, c: bool| full.iter().all(|f| in_tier(j, *f, g, c));
            (0..blocks)
                .take_while(|j| {
                    if gpu && cpu {
                        all_in(*j, true, false) || all_in(*j, false, true)
                    } else {
                        all_in(*j, gpu, cpu)
                    }
                })
                .count()
        };
        let hit = |gpu: bool, cpu: bool| {
            groups::hybrid_hit(full_run(gpu, cpu), &rule.specs, |mask, j| {
                (0..64u8)
                    .filter(|g| mask >> g & 1 == 1)
                    .all(|g| in_tier(j, g, gpu, cpu))
            }) * r
        };
        EndpointMatch {
            gpu_blocks: hit(true, false),
            cpu_blocks: hit(false, true),
            any_blocks: hit(true, true),
            ..zero
        }
    }
}

impl IndexBackend for ReferenceIndex {
    fn apply_event(&self, endpoint: EndpointId, event: &KvEvent) -> Result<(), IndexError> {
        let mut all = self.endpoints.lock();
        let ep = all.entry(endpoint).or_default();
        match event {
            KvEvent::AllBlocksCleared => {
                *ep = Endpoint::default();
                Ok(())
            }
            KvEvent::BlockRemoved(ev) => {
                Self::apply_removed(ep, ev);
                Ok(())
            }
            KvEvent::BlockStored(ev) => self.apply_stored(ep, ev),
        }
    }

    fn clear_endpoint(&self, endpoint: EndpointId) {
        if let Some(ep) = self.endpoints.lock().get_mut(&endpoint) {
            *ep = Endpoint::default();
        }
    }

    fn remove_endpoint(&self, endpoint: EndpointId) {
        self.endpoints.lock().remove(&endpoint);
    }

    fn mark_suspect(&self, endpoint: EndpointId) {
        let mut all = self.endpoints.lock();
        let ep = all.entry(endpoint).or_default();
        if ep.refreshed.is_none() {
            ep.refreshed = Some(BTreeSet::new());
        }
    }

    fn expire_suspect(&self, endpoint: EndpointId) -> usize {
        let mut all = self.endpoints.lock();
        let Some(ep) = all.get_mut(&endpoint) else {
            return 0;
        };
        let Some(refreshed) = ep.refreshed.take() else {
            return 0;
        };
        let stale: Vec<BlockHash> = ep
            .keys
            .keys()
            .filter(|h| !refreshed.contains(*h))
            .copied()
            .collect();
        for h in &stale {
            for k in ep.keys.remove(h).unwrap_or_default() {
                ep.held.remove(&k);
            }
            ep.groups.remove(h);
        }
        // Hybrid endpoints: groups that did not store a hash again lose it.
        let fresh = std::mem::take(&mut ep.refreshed_groups);
        let mut emptied = Vec::new();
        for (h, by_group) in ep.groups.iter_mut() {
            by_group.retain(|g, _| fresh.get(h).is_some_and(|f| f.contains(g)));
            if by_group.is_empty() {
                emptied.push(*h);
            }
        }
        for h in emptied {
            ep.groups.remove(&h);
            ep.keys.remove(&h);
        }
        stale.len()
    }

    fn find_matches(&self, keys: &[ChainKey]) -> Vec<EndpointMatch> {
        let all = self.endpoints.lock();
        let mut out = Vec::new();
        for (id, ep) in all.iter() {
            if ep.layout.is_hybrid() {
                let m = self.hybrid_match(*id, ep, keys);
                if m.any_blocks > 0 {
                    out.push(m);
                }
                continue;
            }
            let run = |pred: &dyn Fn(&(bool, bool)) -> bool| {
                keys.iter()
                    .take_while(|k| ep.held.get(k).is_some_and(pred))
                    .count()
            };
            let m = EndpointMatch {
                endpoint: *id,
                gpu_blocks: run(&|e| e.0),
                cpu_blocks: run(&|e| e.1),
                any_blocks: run(&|e| e.0 || e.1),
            };
            if m.any_blocks > 0 {
                out.push(m);
            }
        }
        out
    }
}
