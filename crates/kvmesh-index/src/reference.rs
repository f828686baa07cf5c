//! A clean-room, obviously-correct model of the index semantics, for differential tests.
//!
//! Per endpoint it keeps a map `ChainKey → (gpu, cpu)` and the engine-hash → keys map, all in
//! ordered maps behind one mutex, and answers lookups by walking each endpoint separately. It
//! has no memory bound (never evicts) and no concurrency story; it exists so property tests can
//! compare every lookup of [`crate::PrefixIndex`] against it.

use std::collections::{BTreeMap, BTreeSet};

use kvmesh_core::events::KvEvent;
use kvmesh_core::{BlockHash, ChainKey};
use parking_lot::Mutex;

use crate::{EndpointId, EndpointMatch, IndexBackend, IndexError, Tier};

#[derive(Debug, Default)]
struct Endpoint {
    /// Key → (held in GPU, held in CPU).
    held: BTreeMap<ChainKey, (bool, bool)>,
    /// Engine hash → every router key it covers, in order.
    keys: BTreeMap<BlockHash, Vec<ChainKey>>,
    /// While suspect: hashes stored since the endpoint was marked.
    refreshed: Option<BTreeSet<BlockHash>>,
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
    pub fn memberships(&self) -> usize {
        self.endpoints
            .lock()
            .values()
            .flat_map(|e| e.held.values())
            .map(|(g, c)| usize::from(*g) + usize::from(*c))
            .sum()
    }
}

fn set_tier(entry: &mut (bool, bool), tier: Tier, value: bool) {
    match tier {
        Tier::Gpu => entry.0 = value,
        Tier::Cpu => entry.1 = value,
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
                let Some(tier) = crate::indexed_remove(ev) else {
                    return Ok(());
                };
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
                Ok(())
            }
            KvEvent::BlockStored(ev) => {
                let Some(tier) = crate::indexed_store(ev) else {
                    return Ok(());
                };
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
                for (i, h) in ev.block_hashes.iter().enumerate() {
                    let tokens = &ev.token_ids[i * engine_bs..(i + 1) * engine_bs];
                    let mut keys = Vec::new();
                    for sub in tokens.chunks(bs) {
                        parent = parent.child(sub);
                        keys.push(parent);
                        set_tier(ep.held.entry(parent).or_default(), tier, true);
                    }
                    ep.keys.insert(*h, keys);
                    if let Some(r) = &mut ep.refreshed {
                        r.insert(*h);
                    }
                }
                Ok(())
            }
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
        }
        stale.len()
    }

    fn find_matches(&self, keys: &[ChainKey]) -> Vec<EndpointMatch> {
        let all = self.endpoints.lock();
        let mut out = Vec::new();
        for (id, ep) in all.iter() {
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
