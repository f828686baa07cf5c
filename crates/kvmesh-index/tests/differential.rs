//! Differential tests: random event streams through [`PrefixIndex`] and the naive
//! [`ReferenceIndex`], comparing every apply result and every lookup; plus a self-test proving the
//! harness notices a backend that drops removals. With a bound, the index may only under-estimate,
//! and an endpoint that stays within its share of `max_blocks` must stay exact however the others
//! flood (issue 37). Scenarios also give every endpoint a vLLM hybrid KV-cache group layout
//! (sliding-window, mamba and full-attention groups, HMA): stores and removals then name a group,
//! and non-full groups list a random subset of their range's blocks, as vLLM's events do. Case
//! count: `PROPTEST_CASES` (default 256).

#![allow(clippy::unwrap_used)]

use kvmesh_core::chain::chain_keys;
use kvmesh_core::events::{BlockRemoved, BlockStored, KvEvent, Medium};
use kvmesh_core::{BlockHash, ChainKey};
use kvmesh_index::reference::ReferenceIndex;
use kvmesh_index::{EndpointId, EndpointMatch, IndexBackend, IndexConfig, IndexError, PrefixIndex};
use proptest::prelude::*;

const ROUTER_BS: usize = 2;
/// Engine blocks per prompt.
const NB: usize = 6;
const ENDPOINTS: u8 = 4;

#[derive(Debug, Clone)]
enum Op {
    Store {
        ep: u8,
        prompt: u8,
        start: u8,
        len: u8,
        cpu: bool,
        tokenless: bool,
        bad_parent: bool,
        /// With a hybrid layout: the group (modulo the layout's size) and, for a non-full group,
        /// which blocks of the range it lists (bit i = block `start + i`).
        group: u8,
        keep: u8,
    },
    Remove {
        ep: u8,
        prompt: u8,
        start: u8,
        len: u8,
        cpu: bool,
        group: u8,
    },
    Clear {
        ep: u8,
    },
    ClearCall {
        ep: u8,
    },
    RemoveEndpoint {
        ep: u8,
    },
    BadTokens {
        ep: u8,
        prompt: u8,
    },
    Storage {
        ep: u8,
        prompt: u8,
    },
    Suspect {
        ep: u8,
    },
    Expire {
        ep: u8,
    },
    /// A run of `blocks` engine blocks no prompt shares (a flooding publisher).
    Flood {
        ep: u8,
        seed: u16,
        blocks: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let ep = 0..ENDPOINTS;
    let prompt = 0u8..4;
    prop_oneof![
        8 => (ep.clone(), prompt.clone(), 0u8..NB as u8, 0u8..NB as u8, any::<bool>(), prop::bool::weighted(0.3), prop::bool::weighted(0.05), any::<u8>(), any::<u8>())
            .prop_map(|(ep, prompt, start, len, cpu, tokenless, bad_parent, group, keep)| Op::Store { ep, prompt, start, len, cpu, tokenless, bad_parent, group, keep }),
        5 => (ep.clone(), prompt.clone(), 0u8..NB as u8, 0u8..NB as u8, any::<bool>(), any::<u8>())
            .prop_map(|(ep, prompt, start, len, cpu, group)| Op::Remove { ep, prompt, start, len, cpu, group }),
        1 => ep.clone().prop_map(|ep| Op::Clear { ep }),
        1 => ep.clone().prop_map(|ep| Op::ClearCall { ep }),
        1 => ep.clone().prop_map(|ep| Op::RemoveEndpoint { ep }),
        1 => (ep.clone(), prompt.clone()).prop_map(|(ep, prompt)| Op::BadTokens { ep, prompt }),
        1 => (ep.clone(), prompt).prop_map(|(ep, prompt)| Op::Storage { ep, prompt }),
        1 => ep.clone().prop_map(|ep| Op::Suspect { ep }),
        1 => ep.prop_map(|ep| Op::Expire { ep }),
    ]
}

/// A scenario: engine block size = `ratio × ROUTER_BS`, four prompts over a 2-letter alphabet (so
/// they share prefixes), and the ops.
#[derive(Debug, Clone)]
struct Scenario {
    ratio: usize,
    prompts: Vec<Vec<u32>>,
    ops: Vec<Op>,
    /// Every endpoint's KV-cache groups; empty for dense endpoints (events without groups).
    layout: Vec<Group>,
}

/// A KV-cache group kind; a window is given in engine blocks (the `need` of vLLM's rule).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Group {
    Full,
    Sliding(usize),
    Mamba,
}

fn layout() -> impl Strategy<Value = Vec<Group>> {
    use Group::*;
    prop_oneof![
        3 => Just(vec![]),
        // gemma3: two sliding groups of one spec, then full attention.
        1 => (1usize..=3).prop_map(|need| vec![Sliding(need), Sliding(need), Full]),
        // gpt-oss.
        1 => (1usize..=3).prop_map(|need| vec![Sliding(need), Full]),
        // Qwen3-Next.
        1 => Just(vec![Mamba, Mamba, Full]),
        // Two full-attention groups (one first) and both other kinds.
        1 => (1usize..=3).prop_map(|need| vec![Full, Sliding(need), Mamba, Full]),
    ]
}

fn scenario() -> impl Strategy<Value = Scenario> {
    (1usize..=2, layout()).prop_flat_map(|(ratio, layout)| {
        let len = NB * ratio * ROUTER_BS;
        (
            Just(ratio),
            prop::collection::vec(prop::collection::vec(0u32..2, len), 4),
            prop::collection::vec(op(), 1..60),
            Just(layout),
        )
            .prop_map(|(ratio, prompts, ops, layout)| Scenario {
                ratio,
                prompts,
                ops,
                layout,
            })
    })
}

/// Engine-side hashes of a prompt's engine blocks: a chain with its own seed, like an engine
/// algorithm the router does not share.
fn engine_hashes(tokens: &[u32], engine_bs: usize) -> Vec<BlockHash> {
    let mut k = ChainKey(0xe1e1);
    tokens
        .chunks_exact(engine_bs)
        .map(|b| {
            k = k.child(b);
            BlockHash(k.0)
        })
        .collect()
}

fn medium(cpu: bool) -> Medium {
    if cpu { Medium::Cpu } else { Medium::Gpu }
}

fn to_event(s: &Scenario, op: &Op) -> Option<(EndpointId, KvEvent)> {
    let ebs = s.ratio * ROUTER_BS;
    let range = |prompt: u8, start: u8, len: u8| {
        let start = start as usize % NB;
        let len = 1 + len as usize % (NB - start);
        (prompt as usize % s.prompts.len(), start, start + len)
    };
    Some(match *op {
        Op::Store {
            ep,
            prompt,
            start,
            len,
            cpu,
            tokenless,
            bad_parent,
            group,
            keep,
        } => {
            let (p, a, b) = range(prompt, start, len);
            let hashes = engine_hashes(&s.prompts[p], ebs);
            let group = (!s.layout.is_empty()).then(|| group as usize % s.layout.len());
            let parent = if bad_parent {
                Some(BlockHash(0xbad0 + a as u64))
            } else if a == 0 {
                None
            } else {
                Some(hashes[a - 1])
            };
            let (token_ids, block_size) = if tokenless {
                (Vec::new(), 0)
            } else {
                (s.prompts[p][a * ebs..b * ebs].to_vec(), ebs as u32)
            };
            let mut ev = BlockStored::run(
                medium(cpu),
                parent,
                block_size,
                hashes[a..b].to_vec(),
                token_ids,
            );
            if let Some(g) = group {
                ev.group_idx = Some(g as u32);
                let (kind, window) = match s.layout[g] {
                    Group::Full => ("full_attention", None),
                    // need = cdiv(window − 1, block size) for a window of `need` blocks.
                    Group::Sliding(need) => ("sliding_window", Some((need * ebs) as u32)),
                    Group::Mamba => ("mamba", None),
                };
                ev.kv_cache_spec_kind = Some(kind.to_owned());
                ev.kv_cache_spec_sliding_window = window;
                if s.layout[g] != Group::Full {
                    // Only the blocks vLLM kept are listed; the tokens still span the range.
                    ev.block_hashes = (a..b)
                        .filter(|i| keep >> ((i - a) % 8) & 1 == 1)
                        .map(|i| hashes[i])
                        .collect();
                }
            }
            (EndpointId(ep.into()), KvEvent::BlockStored(ev))
        }
        Op::Remove {
            ep,
            prompt,
            start,
            len,
            cpu,
            group,
        } => {
            let (p, a, b) = range(prompt, start, len);
            let hashes = engine_hashes(&s.prompts[p], ebs);
            let group_idx =
                (!s.layout.is_empty()).then(|| (group as usize % s.layout.len()) as u32);
            (
                EndpointId(ep.into()),
                KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: hashes[a..b].to_vec(),
                    medium: medium(cpu),
                    group_idx,
                }),
            )
        }
        Op::Clear { ep } => (EndpointId(ep.into()), KvEvent::AllBlocksCleared),
        Op::BadTokens { ep, prompt } => {
            let p = prompt as usize % s.prompts.len();
            let hashes = engine_hashes(&s.prompts[p], ebs);
            (
                EndpointId(ep.into()),
                KvEvent::BlockStored(BlockStored {
                    block_hashes: hashes[..2].to_vec(),
                    parent_block_hash: None,
                    token_ids: s.prompts[p][..ebs + 1].to_vec(),
                    block_size: ebs as u32,
                    lora_id: None,
                    medium: Medium::Gpu,
                    lora_name: None,
                    group_idx: None,
                    kv_cache_spec_kind: None,
                    kv_cache_spec_sliding_window: None,
                    cache_salt: None,
                }),
            )
        }
        Op::Storage { ep, prompt } => {
            let p = prompt as usize % s.prompts.len();
            let hashes = engine_hashes(&s.prompts[p], ebs);
            (
                EndpointId(ep.into()),
                KvEvent::BlockStored(BlockStored {
                    block_hashes: hashes[..1].to_vec(),
                    parent_block_hash: None,
                    token_ids: s.prompts[p][..ebs].to_vec(),
                    block_size: ebs as u32,
                    lora_id: None,
                    medium: Medium::Storage,
                    lora_name: None,
                    group_idx: None,
                    kv_cache_spec_kind: None,
                    kv_cache_spec_sliding_window: None,
                    cache_salt: None,
                }),
            )
        }
        Op::Flood { ep, seed, blocks } => {
            let n = 1 + blocks as usize % 40;
            let first = 1_000 + u32::from(seed) * 4_096;
            let tokens: Vec<u32> = (first..first + (n * ebs) as u32).collect();
            (
                EndpointId(ep.into()),
                KvEvent::BlockStored(BlockStored {
                    block_hashes: engine_hashes(&tokens, ebs),
                    parent_block_hash: None,
                    token_ids: tokens,
                    block_size: ebs as u32,
                    lora_id: None,
                    medium: Medium::Gpu,
                    lora_name: None,
                    group_idx: None,
                    kv_cache_spec_kind: None,
                    kv_cache_spec_sliding_window: None,
                    cache_salt: None,
                }),
            )
        }
        Op::ClearCall { .. }
        | Op::RemoveEndpoint { .. }
        | Op::Suspect { .. }
        | Op::Expire { .. } => {
            return None;
        }
    })
}

/// Lookups compared after every op: each prompt in full and cut mid engine block.
fn lookup_keys(s: &Scenario) -> Vec<Vec<ChainKey>> {
    let mut out = Vec::new();
    for p in &s.prompts {
        out.push(chain_keys(p, ROUTER_BS));
        out.push(chain_keys(&p[..p.len() / 2 + 1], ROUTER_BS));
    }
    out
}

/// How two backends may relate: identical answers, or `fast` never above `reference`, or never
/// above and exact for one endpoint.
#[derive(Clone, Copy, PartialEq)]
enum Expect {
    Equal,
    NeverAbove,
    ExactFor(EndpointId),
}

fn run(
    s: &Scenario,
    fast: &dyn IndexBackend,
    reference: &dyn IndexBackend,
    expect: Expect,
) -> Result<(), String> {
    let lookups = lookup_keys(s);
    for (step, op) in s.ops.iter().enumerate() {
        match (to_event(s, op), op) {
            (Some((ep, ev)), _) => {
                let a: Result<(), IndexError> = fast.apply_event(ep, &ev);
                let b = reference.apply_event(ep, &ev);
                if expect == Expect::Equal && a != b {
                    return Err(format!(
                        "step {step} {op:?}: apply {a:?} vs reference {b:?}"
                    ));
                }
            }
            (None, Op::ClearCall { ep }) => {
                fast.clear_endpoint(EndpointId((*ep).into()));
                reference.clear_endpoint(EndpointId((*ep).into()));
            }
            (None, Op::RemoveEndpoint { ep }) => {
                fast.remove_endpoint(EndpointId((*ep).into()));
                reference.remove_endpoint(EndpointId((*ep).into()));
            }
            (None, Op::Suspect { ep }) => {
                fast.mark_suspect(EndpointId((*ep).into()));
                reference.mark_suspect(EndpointId((*ep).into()));
            }
            (None, Op::Expire { ep }) => {
                let a = fast.expire_suspect(EndpointId((*ep).into()));
                let b = reference.expire_suspect(EndpointId((*ep).into()));
                if expect == Expect::Equal && a != b {
                    return Err(format!("step {step} {op:?}: expired {a} vs reference {b}"));
                }
            }
            (None, _) => {}
        }
        for keys in &lookups {
            let a = fast.find_matches(keys);
            let b = reference.find_matches(keys);
            match expect {
                Expect::Equal if a != b => {
                    return Err(format!(
                        "step {step} {op:?}: lookup {a:?} vs reference {b:?}"
                    ));
                }
                Expect::ExactFor(ep) => {
                    let own = |v: &[EndpointMatch]| v.iter().find(|m| m.endpoint == ep).copied();
                    if own(&a) != own(&b) {
                        return Err(format!(
                            "step {step} {op:?}: endpoint {ep} has {:?}, reference {:?}",
                            own(&a),
                            own(&b)
                        ));
                    }
                    for m in &a {
                        let r = b.iter().find(|x| x.endpoint == m.endpoint);
                        if r.is_none_or(|r| m.any_blocks > r.any_blocks) {
                            return Err(format!("step {step}: over-estimate {m:?} vs {r:?}"));
                        }
                    }
                }
                Expect::NeverAbove => {
                    for m in &a {
                        let r = b
                            .iter()
                            .find(|x| x.endpoint == m.endpoint)
                            .copied()
                            .unwrap_or(EndpointMatch {
                                endpoint: m.endpoint,
                                gpu_blocks: 0,
                                cpu_blocks: 0,
                                any_blocks: 0,
                            });
                        if m.gpu_blocks > r.gpu_blocks
                            || m.cpu_blocks > r.cpu_blocks
                            || m.any_blocks > r.any_blocks
                        {
                            return Err(format!(
                                "step {step}: over-estimate {m:?} vs reference {r:?}"
                            ));
                        }
                    }
                }
                _ => {}
            }
        }
    }
    Ok(())
}

fn big_index() -> PrefixIndex {
    PrefixIndex::new(IndexConfig {
        block_size: ROUTER_BS,
        max_blocks: 1 << 20,
        shards: 8,
        max_endpoints: 64,
    })
}

proptest! {
    #[test]
    fn index_agrees_with_reference(s in scenario()) {
        let fast = big_index();
        let reference = ReferenceIndex::new(ROUTER_BS);
        if let Err(e) = run(&s, &fast, &reference, Expect::Equal) {
            prop_assert!(false, "{}", e);
        }
        let stats = fast.stats();
        prop_assert_eq!(stats.memberships as usize, reference.memberships());
    }

    #[test]
    fn bounded_index_never_over_estimates(s in scenario()) {
        let fast = PrefixIndex::new(IndexConfig { block_size: ROUTER_BS, max_blocks: 16, shards: 1, max_endpoints: 64 });
        let reference = ReferenceIndex::new(ROUTER_BS);
        if let Err(e) = run(&s, &fast, &reference, Expect::NeverAbove) {
            prop_assert!(false, "{}", e);
        }
        prop_assert!(fast.stats().blocks <= 16 + 1);
    }
}

/// Scenarios where endpoint 0 only ever stores prompt 0 (at most `NB × ratio` = 12 router blocks)
/// while endpoints 1–3 do anything, floods included.
fn flood_scenario() -> impl Strategy<Value = Scenario> {
    let flood = (1u8..ENDPOINTS, any::<u16>(), any::<u8>())
        .prop_map(|(ep, seed, blocks)| Op::Flood { ep, seed, blocks });
    let ops = prop::collection::vec(prop_oneof![3 => op(), 2 => flood], 1..80).prop_map(|ops| {
        ops.into_iter()
            .map(|op| match op {
                Op::Store {
                    ep: 0,
                    start,
                    len,
                    cpu,
                    tokenless,
                    group,
                    keep,
                    ..
                } => Op::Store {
                    ep: 0,
                    prompt: 0,
                    start,
                    len,
                    cpu,
                    tokenless,
                    bad_parent: false,
                    group,
                    keep,
                },
                Op::Storage { ep: 0, .. } | Op::BadTokens { ep: 0, .. } => Op::Clear { ep: 0 },
                other => other,
            })
            .collect()
    });
    (1usize..=2).prop_flat_map(move |ratio| {
        let len = NB * ratio * ROUTER_BS;
        (
            Just(ratio),
            prop::collection::vec(prop::collection::vec(0u32..2, len), 4),
            ops.clone(),
        )
            .prop_map(|(ratio, prompts, ops)| Scenario {
                ratio,
                prompts,
                ops,
                layout: Vec::new(),
            })
    })
}

proptest! {
    /// Four endpoints share 64 blocks (16 each). Endpoint 0 never holds more than 12, so whatever
    /// the others store (floods of up to 40 engine blocks at a time), its lookups equal the
    /// unbounded reference's: nobody else's blocks ever evict its own.
    #[test]
    fn an_endpoint_within_its_share_is_untouched_by_floods(s in flood_scenario()) {
        let fast = PrefixIndex::new(IndexConfig { block_size: ROUTER_BS, max_blocks: 64, shards: 1, max_endpoints: 64 });
        let reference = ReferenceIndex::new(ROUTER_BS);
        for ep in 0..ENDPOINTS {
            let ep = EndpointId(ep.into());
            fast.apply_event(ep, &KvEvent::AllBlocksCleared).unwrap();
            reference.apply_event(ep, &KvEvent::AllBlocksCleared).unwrap();
        }
        let s = Scenario {
            ops: s.ops.into_iter().filter(|op| !matches!(op, Op::RemoveEndpoint { .. })).collect(),
            ..s
        };
        if let Err(e) = run(&s, &fast, &reference, Expect::ExactFor(EndpointId(0))) {
            prop_assert!(false, "{}", e);
        }
        // The shared bound holds (one engine block of overshoot at most).
        prop_assert!(fast.stats().blocks <= 64 + 2, "{:?}", fast.stats());
        for ep in 0..ENDPOINTS {
            prop_assert!(fast.held_blocks(EndpointId(ep.into())) <= 16 + 2);
        }
    }
}

/// A deliberately broken backend: forgets to apply removals.
struct DropsRemovals(PrefixIndex);

impl IndexBackend for DropsRemovals {
    fn apply_event(&self, endpoint: EndpointId, event: &KvEvent) -> Result<(), IndexError> {
        match event {
            KvEvent::BlockRemoved(_) => Ok(()),
            _ => self.0.apply_event(endpoint, event),
        }
    }
    fn clear_endpoint(&self, endpoint: EndpointId) {
        self.0.clear_endpoint(endpoint)
    }
    fn remove_endpoint(&self, endpoint: EndpointId) {
        self.0.remove_endpoint(endpoint)
    }
    fn find_matches(&self, keys: &[ChainKey]) -> Vec<EndpointMatch> {
        self.0.find_matches(keys)
    }
    fn mark_suspect(&self, endpoint: EndpointId) {
        self.0.mark_suspect(endpoint)
    }
    fn expire_suspect(&self, endpoint: EndpointId) -> usize {
        self.0.expire_suspect(endpoint)
    }
}

/// A broken backend that reports CPU runs as GPU runs.
struct ConfusesTiers(PrefixIndex);

impl IndexBackend for ConfusesTiers {
    fn apply_event(&self, endpoint: EndpointId, event: &KvEvent) -> Result<(), IndexError> {
        self.0.apply_event(endpoint, event)
    }
    fn clear_endpoint(&self, endpoint: EndpointId) {
        self.0.clear_endpoint(endpoint)
    }
    fn remove_endpoint(&self, endpoint: EndpointId) {
        self.0.remove_endpoint(endpoint)
    }
    fn find_matches(&self, keys: &[ChainKey]) -> Vec<EndpointMatch> {
        let mut v = self.0.find_matches(keys);
        for m in &mut v {
            m.gpu_blocks = m.gpu_blocks.max(m.cpu_blocks);
        }
        v
    }
    fn mark_suspect(&self, endpoint: EndpointId) {
        self.0.mark_suspect(endpoint)
    }
    fn expire_suspect(&self, endpoint: EndpointId) -> usize {
        self.0.expire_suspect(endpoint)
    }
}

/// The harness must catch broken backends within the normal case budget.
#[test]
fn harness_catches_broken_backends() {
    use proptest::test_runner::{Config, TestRunner};
    let mut runner = TestRunner::new(Config {
        cases: 256,
        failure_persistence: None,
        ..Config::default()
    });
    let caught = runner.run(&scenario(), |s| {
        let r = run(
            &s,
            &DropsRemovals(big_index()),
            &ReferenceIndex::new(ROUTER_BS),
            Expect::Equal,
        );
        prop_assert!(r.is_ok(), "{:?}", r);
        Ok(())
    });
    assert!(caught.is_err(), "dropping removals went unnoticed");

    let mut runner = TestRunner::new(Config {
        cases: 256,
        failure_persistence: None,
        ..Config::default()
    });
    let caught = runner.run(&scenario(), |s| {
        let r = run(
            &s,
            &ConfusesTiers(big_index()),
            &ReferenceIndex::new(ROUTER_BS),
            Expect::Equal,
        );
        prop_assert!(r.is_ok(), "{:?}", r);
        Ok(())
    });
    assert!(caught.is_err(), "tier confusion went unnoticed");

    let mut runner = TestRunner::new(Config {
        cases: 256,
        failure_persistence: None,
        ..Config::default()
    });
    let caught = runner.run(&scenario(), |s| {
        let r = run(
            &s,
            &IgnoresGroups(big_index()),
            &ReferenceIndex::new(ROUTER_BS),
            Expect::Equal,
        );
        prop_assert!(r.is_ok(), "{:?}", r);
        Ok(())
    });
    assert!(caught.is_err(), "indexing groups as dense went unnoticed");
}

/// A broken backend that indexes every group's events as if the model were dense (what the
/// index did before HMA, minus dropping groups other than 0).
struct IgnoresGroups(PrefixIndex);

impl IndexBackend for IgnoresGroups {
    fn apply_event(&self, endpoint: EndpointId, event: &KvEvent) -> Result<(), IndexError> {
        let mut event = event.clone();
        match &mut event {
            KvEvent::BlockStored(ev) => {
                ev.group_idx = None;
                ev.kv_cache_spec_kind = None;
                ev.kv_cache_spec_sliding_window = None;
            }
            KvEvent::BlockRemoved(ev) => ev.group_idx = None,
            KvEvent::AllBlocksCleared => {}
        }
        self.0.apply_event(endpoint, &event)
    }
    fn clear_endpoint(&self, endpoint: EndpointId) {
        self.0.clear_endpoint(endpoint)
    }
    fn remove_endpoint(&self, endpoint: EndpointId) {
        self.0.remove_endpoint(endpoint)
    }
    fn find_matches(&self, keys: &[ChainKey]) -> Vec<EndpointMatch> {
        self.0.find_matches(keys)
    }
    fn mark_suspect(&self, endpoint: EndpointId) {
        self.0.mark_suspect(endpoint)
    }
    fn expire_suspect(&self, endpoint: EndpointId) -> usize {
        self.0.expire_suspect(endpoint)
    }
}
