//! Differential tests: random operation sequences through [`CpuStore`] and a naive reference
//! model of the tier's rules (README), comparing every answer, every evicted hash (in order), the
//! counters and each block's pins after every step, and checking that the budget holds and that
//! no block holding a live hard pin is evicted; plus a self-test proving the harness notices a
//! store that evicts pinned blocks. Case count: `PROPTEST_CASES` (default 256).
//!
//! The model keeps a plain map and sorts it on every eviction: unretained blocks by last use,
//! then retained ones by when they were retained. Sequences stay under 64 blocks, so the store's
//! bound on pinned blocks stepped over per eviction (a unit test covers it) never applies.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvmesh_core::BlockHash;
use kvmesh_tier::{Block, CpuStore, CpuTierStats, Inserted, Landed, PinKind};
use proptest::prelude::*;

/// Distinct block hashes (small, so pins and reads meet stored blocks).
const HASHES: u64 = 16;
/// Tier capacity in bytes; blocks are 1 to 4 bytes (6 to 24 blocks fit), or larger than it.
const CAPACITY: u64 = 24;
const TOO_BIG: u8 = 25;

#[derive(Debug, Clone)]
enum Op {
    Insert {
        hash: u64,
        size: u8,
    },
    Land {
        hash: u64,
        size: u8,
        lease_ms: u64,
    },
    Get {
        hash: u64,
    },
    GetPrefix {
        hashes: Vec<u64>,
    },
    Touch {
        hashes: Vec<u64>,
    },
    Pin {
        kind: PinKind,
        hashes: Vec<u64>,
        lease_ms: u64,
    },
    Unpin {
        kind: PinKind,
        hashes: Vec<u64>,
    },
    TakeExternal {
        hashes: Vec<u64>,
    },
    Advance {
        ms: u64,
    },
    Clear,
}

fn op() -> impl Strategy<Value = Op> {
    let hash = 0..HASHES;
    let hashes = prop::collection::vec(0..HASHES, 0..5);
    let size = prop_oneof![20 => 1u8..=4, 1 => Just(TOO_BIG)];
    let kind = prop_oneof![
        Just(PinKind::Use),
        Just(PinKind::Pull),
        Just(PinKind::Retain)
    ];
    prop_oneof![
        20 => (hash.clone(), size.clone()).prop_map(|(hash, size)| Op::Insert { hash, size }),
        8 => (hash.clone(), size, 0u64..30)
            .prop_map(|(hash, size, lease_ms)| Op::Land { hash, size, lease_ms }),
        6 => hash.prop_map(|hash| Op::Get { hash }),
        4 => hashes.clone().prop_map(|hashes| Op::GetPrefix { hashes }),
        4 => hashes.clone().prop_map(|hashes| Op::Touch { hashes }),
        12 => (kind.clone(), hashes.clone(), 0u64..30)
            .prop_map(|(kind, hashes, lease_ms)| Op::Pin { kind, hashes, lease_ms }),
        8 => (kind, hashes.clone()).prop_map(|(kind, hashes)| Op::Unpin { kind, hashes }),
        2 => hashes.prop_map(|hashes| Op::TakeExternal { hashes }),
        6 => (1u64..20).prop_map(|ms| Op::Advance { ms }),
        1 => Just(Op::Clear),
    ]
}

#[derive(Debug, Clone)]
struct ModelBlock {
    size: u64,
    last_use: u64,
    retained_since: u64,
    uses: Vec<Instant>,
    pulls: Vec<Instant>,
    retains: Vec<Instant>,
    external: bool,
}

impl ModelBlock {
    fn leases(&mut self, kind: PinKind) -> &mut Vec<Instant> {
        match kind {
            PinKind::Use => &mut self.uses,
            PinKind::Pull => &mut self.pulls,
            PinKind::Retain => &mut self.retains,
        }
    }

    fn hard_expiry(&self, now: Instant) -> Option<Instant> {
        self.uses
            .iter()
            .chain(&self.pulls)
            .copied()
            .filter(|&t| t > now)
            .min()
    }

    fn retained(&self, now: Instant) -> bool {
        self.retains.iter().any(|&t| t > now)
    }
}

/// The rules, written the slow, obvious way.
struct Model {
    blocks: BTreeMap<u64, ModelBlock>,
    tick: u64,
    pull_cap: u64,
    /// After a failed eviction: evictions fail until then, or until an insert, unpin or clear.
    all_pinned_until: Option<Instant>,
    stats: CpuTierStats,
    /// Self-test: a broken store that evicts hard-pinned blocks like any other.
    evicts_pinned: bool,
}

impl Model {
    fn new(evicts_pinned: bool) -> Self {
        Self {
            blocks: BTreeMap::new(),
            tick: 0,
            pull_cap: CAPACITY / 2,
            all_pinned_until: None,
            stats: CpuTierStats {
                capacity_bytes: CAPACITY,
                ..CpuTierStats::default()
            },
            evicts_pinned,
        }
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    fn used(&self) -> u64 {
        self.blocks.values().map(|b| b.size).sum()
    }

    fn touch(&mut self, hash: u64) {
        if self.blocks.contains_key(&hash) {
            let tick = self.next_tick();
            if let Some(b) = self.blocks.get_mut(&hash) {
                b.last_use = tick;
            }
        }
    }

    fn touch_prefix(&mut self, hashes: &[u64]) {
        for &h in hashes.iter().rev() {
            self.touch(h);
        }
    }

    /// Blocks in eviction order (`retained`: the retained ones, else the others).
    fn order(&self, retained: bool, now: Instant) -> Vec<u64> {
        let mut v: Vec<(u64, u64)> = self
            .blocks
            .iter()
            .filter(|(_, b)| b.retained(now) == retained)
            .map(|(&h, b)| {
                (
                    if retained {
                        b.retained_since
                    } else {
                        b.last_use
                    },
                    h,
                )
            })
            .collect();
        v.sort_unstable();
        v.into_iter().map(|(_, h)| h).collect()
    }

    /// The first block of `order` without a live hard pin; the pinned ones before it are used.
    fn evict_from(&mut self, order: &[u64], retained: bool, now: Instant) -> Option<u64> {
        for &h in order {
            if self.blocks[&h].hard_expiry(now).is_some() && !self.evicts_pinned {
                let tick = self.next_tick();
                let b = self.blocks.get_mut(&h).unwrap();
                if retained {
                    b.retained_since = tick;
                } else {
                    b.last_use = tick;
                }
                continue;
            }
            self.blocks.remove(&h);
            self.stats.evicted_blocks += 1;
            if retained {
                self.stats.retained_evicted_blocks += 1;
            }
            return Some(h);
        }
        None
    }

    fn evict(&mut self, now: Instant) -> Option<u64> {
        if self.all_pinned_until.is_some_and(|t| now < t) {
            return None;
        }
        let unretained = self.order(false, now);
        if let Some(h) = self.evict_from(&unretained, false, now) {
            return Some(h);
        }
        let retained = self.order(true, now);
        if let Some(h) = self.evict_from(&retained, true, now) {
            return Some(h);
        }
        if !retained.is_empty() {
            // The store looks at the unretained blocks once more before giving up.
            let unretained = self.order(false, now);
            self.evict_from(&unretained, false, now);
        }
        self.all_pinned_until = self
            .blocks
            .values()
            .filter_map(|b| b.hard_expiry(now))
            .min();
        None
    }

    fn insert(&mut self, hash: u64, size: u64, now: Instant, evicted: &mut Vec<u64>) -> Inserted {
        if self.blocks.contains_key(&hash) {
            self.touch(hash);
            return Inserted::Present;
        }
        if size > CAPACITY {
            self.stats.rejected_blocks += 1;
            return Inserted::Rejected;
        }
        while self.used() + size > CAPACITY {
            match self.evict(now) {
                Some(h) => evicted.push(h),
                None => {
                    self.stats.rejected_blocks += 1;
                    return Inserted::Rejected;
                }
            }
        }
        let tick = self.next_tick();
        self.blocks.insert(
            hash,
            ModelBlock {
                size,
                last_use: tick,
                retained_since: 0,
                uses: Vec::new(),
                pulls: Vec::new(),
                retains: Vec::new(),
                external: false,
            },
        );
        self.all_pinned_until = None;
        self.stats.stored_blocks += 1;
        Inserted::Stored
    }

    fn land(
        &mut self,
        hash: u64,
        size: u64,
        until: Instant,
        now: Instant,
        evicted: &mut Vec<u64>,
    ) -> Landed {
        match self.insert(hash, size, now, evicted) {
            Inserted::Present => return Landed::Present,
            Inserted::Rejected => return Landed::Rejected,
            Inserted::Stored => {}
        }
        self.blocks.get_mut(&hash).unwrap().external = true;
        let pulled: u64 = self
            .blocks
            .values()
            .filter(|b| b.pulls.iter().any(|&t| t > now))
            .map(|b| b.size)
            .sum();
        if pulled + size <= self.pull_cap {
            self.pin(PinKind::Pull, &[hash], until);
            Landed::Pinned
        } else {
            self.stats.pull_pin_capped_blocks += 1;
            Landed::Unpinned
        }
    }

    fn pin(&mut self, kind: PinKind, hashes: &[u64], until: Instant) -> usize {
        let mut n = 0;
        for h in hashes {
            if !self.blocks.contains_key(h) {
                break;
            }
            let tick = if kind == PinKind::Retain {
                self.next_tick()
            } else {
                0
            };
            let b = self.blocks.get_mut(h).unwrap();
            b.leases(kind).push(until);
            if kind == PinKind::Retain {
                b.retained_since = tick;
            }
            n += 1;
        }
        n
    }

    fn unpin(&mut self, kind: PinKind, hashes: &[u64], now: Instant) {
        self.all_pinned_until = None;
        for h in hashes {
            if let Some(b) = self.blocks.get_mut(h) {
                let leases = b.leases(kind);
                leases.retain(|&t| t > now);
                if let Some((i, _)) = leases.iter().enumerate().min_by_key(|(_, t)| **t) {
                    leases.remove(i);
                }
            }
        }
    }

    fn pin_count(&self, hash: u64, now: Instant) -> usize {
        self.blocks.get(&hash).map_or(0, |b| {
            b.uses
                .iter()
                .chain(&b.pulls)
                .chain(&b.retains)
                .filter(|&&t| t > now)
                .count()
        })
    }

    fn stats(&self) -> CpuTierStats {
        CpuTierStats {
            used_bytes: self.used(),
            blocks: self.blocks.len() as u64,
            ..self.stats
        }
    }
}

fn block(hash: u64, size: u8) -> Block {
    Block::new(
        BlockHash(hash),
        Bytes::from(vec![hash as u8; usize::from(size)]),
    )
}

fn hashes(v: &[u64]) -> Vec<BlockHash> {
    v.iter().copied().map(BlockHash).collect()
}

fn raw(v: &[BlockHash]) -> Vec<u64> {
    v.iter().map(|h| h.0).collect()
}

/// Runs `ops` through the store and the model; the first disagreement or broken rule, if any.
fn run(ops: &[Op], model_evicts_pinned: bool) -> Result<(), String> {
    let t0 = Instant::now();
    let mut clock = 0u64;
    let mut store = CpuStore::new(CAPACITY);
    let mut model = Model::new(model_evicts_pinned);
    for (step, op) in ops.iter().enumerate() {
        let now = t0 + Duration::from_millis(clock);
        let lease = |ms: u64| now + Duration::from_millis(ms);
        let hard_pinned: Vec<u64> = (0..HASHES)
            .filter(|h| {
                model
                    .blocks
                    .get(h)
                    .is_some_and(|b| b.hard_expiry(now).is_some())
            })
            .collect();
        let mut evicted = Vec::new();
        let mut model_evicted = Vec::new();
        let (got, want) = match op {
            Op::Insert { hash, size } => (
                format!("{:?}", store.insert(block(*hash, *size), now, &mut evicted)),
                format!(
                    "{:?}",
                    model.insert(*hash, u64::from(*size), now, &mut model_evicted)
                ),
            ),
            Op::Land {
                hash,
                size,
                lease_ms,
            } => (
                format!(
                    "{:?}",
                    store.land(block(*hash, *size), lease(*lease_ms), now, &mut evicted)
                ),
                format!(
                    "{:?}",
                    model.land(
                        *hash,
                        u64::from(*size),
                        lease(*lease_ms),
                        now,
                        &mut model_evicted
                    )
                ),
            ),
            Op::Get { hash } => {
                let got = store.get(BlockHash(*hash)).map(|p| p.len());
                let want = model.blocks.get(hash).map(|b| b.size as usize);
                if want.is_some() {
                    model.stats.hits += 1;
                    model.touch(*hash);
                }
                (format!("{got:?}"), format!("{want:?}"))
            }
            Op::GetPrefix { hashes: hs } => {
                let got = store.get_prefix(&hashes(hs)).len();
                let run = hs
                    .iter()
                    .take_while(|h| model.blocks.contains_key(*h))
                    .count();
                model.stats.hits += run as u64;
                model.touch_prefix(&hs[..run]);
                (got.to_string(), run.to_string())
            }
            Op::Touch { hashes: hs } => {
                store.touch_prefix(&hashes(hs));
                model.touch_prefix(hs);
                (String::new(), String::new())
            }
            Op::Pin {
                kind,
                hashes: hs,
                lease_ms,
            } => (
                store
                    .pin(*kind, &hashes(hs), lease(*lease_ms), now)
                    .to_string(),
                model.pin(*kind, hs, lease(*lease_ms)).to_string(),
            ),
            Op::Unpin { kind, hashes: hs } => {
                store.unpin(*kind, &hashes(hs), now);
                model.unpin(*kind, hs, now);
                (String::new(), String::new())
            }
            Op::TakeExternal { hashes: hs } => {
                let want = hs
                    .iter()
                    .filter(|h| {
                        model
                            .blocks
                            .get_mut(*h)
                            .is_some_and(|b| std::mem::take(&mut b.external))
                    })
                    .count();
                (
                    store.take_external(&hashes(hs)).to_string(),
                    want.to_string(),
                )
            }
            Op::Advance { ms } => {
                clock += ms;
                (String::new(), String::new())
            }
            Op::Clear => {
                store.clear();
                model.blocks.clear();
                model.all_pinned_until = None;
                (String::new(), String::new())
            }
        };
        let fail = |what: &str| Err(format!("step {step} {op:?}: {what}"));
        if got != want {
            return fail(&format!("store answered {got}, model {want}"));
        }
        if raw(&evicted) != model_evicted {
            return fail(&format!(
                "store evicted {evicted:?}, model {model_evicted:?}"
            ));
        }
        let stats = store.stats();
        if stats != model.stats() {
            return fail(&format!("counters {stats:?}, model {:?}", model.stats()));
        }
        if stats.used_bytes > CAPACITY {
            return fail(&format!("{} bytes used of {CAPACITY}", stats.used_bytes));
        }
        if let Some(h) = hard_pinned
            .iter()
            .find(|h| !matches!(op, Op::Clear) && !store.contains(BlockHash(**h)))
        {
            return fail(&format!("hard-pinned block {h} evicted"));
        }
        let now = t0 + Duration::from_millis(clock);
        for h in 0..HASHES {
            let (held, pins) = (
                store.contains(BlockHash(h)),
                store.pin_count(BlockHash(h), now),
            );
            let (model_held, model_pins) = (model.blocks.contains_key(&h), model.pin_count(h, now));
            if (held, pins) != (model_held, model_pins) {
                return fail(&format!(
                    "block {h}: store held {held} with {pins} pins, model {model_held} with {model_pins}"
                ));
            }
        }
    }
    Ok(())
}

proptest! {
    #[test]
    fn the_store_keeps_the_rules_of_the_reference_model(ops in prop::collection::vec(op(), 1..120)) {
        if let Err(why) = run(&ops, false) {
            prop_assert!(false, "{}", why);
        }
    }
}

/// The harness compares what matters: a store that evicted pinned blocks would be caught, on a
/// fixed sequence and within the normal case budget.
#[test]
fn the_harness_catches_a_store_that_evicts_pinned_blocks() {
    let ops = [
        Op::Insert { hash: 1, size: 4 },
        Op::Pin {
            kind: PinKind::Use,
            hashes: vec![1],
            lease_ms: 10,
        },
        Op::Insert { hash: 2, size: 4 },
        Op::Insert { hash: 3, size: 4 },
        Op::Insert { hash: 4, size: 4 },
        Op::Insert { hash: 5, size: 4 },
        Op::Insert { hash: 6, size: 4 },
        Op::Insert { hash: 7, size: 4 },
    ];
    assert!(run(&ops, false).is_ok());
    let why = run(&ops, true).expect_err("a model evicting pinned blocks agreed with the store");
    assert!(why.contains("evicted"), "{why}");

    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 256,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let caught = runner.run(&prop::collection::vec(op(), 1..120), |ops| {
        prop_assert!(run(&ops, true).is_ok());
        Ok(())
    });
    assert!(
        caught.is_err(),
        "random sequences never met a pinned block under pressure"
    );
}
