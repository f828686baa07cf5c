//! Hybrid KV-cache groups (vLLM's HMA) in the index: hand-built events shaped as vLLM 0.32
//! publishes them (docs/notes-vllm-models.md §4), and the predictions vLLM's rule gives
//! (§5's measured table for gemma3 and gpt-oss, a Qwen3-Next-like mamba layout).

use kvmesh_core::chain::chain_keys;
use kvmesh_core::events::{BlockRemoved, BlockStored, Medium};

use super::*;

const BS: usize = 32;

/// Engine-side block hashes of `tokens`: a chain with its own seed (the same digest in every
/// group, as in vLLM), never equal to the router's keys.
fn engine_hashes(tokens: &[u32], bs: usize) -> Vec<u64> {
    let mut k = ChainKey(0xe1e1);
    tokens
        .chunks_exact(bs)
        .map(|b| {
            k = k.child(b);
            k.0
        })
        .collect()
}

#[derive(Clone, Copy)]
enum Kind {
    Full,
    Sliding(u32),
    Mamba,
}

/// A `BlockStored` of group `group`: `kept` are the block indices the group lists (every block
/// of the range for full attention), `token_ids` spans the range `[first, end)` of blocks, as
/// vLLM's `cache_full_blocks` publishes it.
fn group_stored(
    prompt: &[u32],
    bs: usize,
    range: std::ops::Range<usize>,
    kept: &[usize],
    group: u32,
    kind: Kind,
) -> KvEvent {
    let hashes = engine_hashes(prompt, bs);
    let (kind, window) = match kind {
        Kind::Full => ("full_attention", None),
        Kind::Sliding(w) => ("sliding_window", Some(w)),
        Kind::Mamba => ("mamba", None),
    };
    let mut ev = BlockStored::run(
        Medium::Gpu,
        range.start.checked_sub(1).map(|p| BlockHash(hashes[p])),
        bs as u32,
        kept.iter().map(|i| BlockHash(hashes[*i])).collect(),
        prompt[range.start * bs..range.end * bs].to_vec(),
    );
    ev.group_idx = Some(group);
    ev.kv_cache_spec_kind = Some(kind.to_owned());
    ev.kv_cache_spec_sliding_window = window;
    KvEvent::BlockStored(ev)
}

fn group_removed(prompt: &[u32], bs: usize, blocks: &[usize], group: u32) -> KvEvent {
    let hashes = engine_hashes(prompt, bs);
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: blocks.iter().map(|i| BlockHash(hashes[*i])).collect(),
        medium: Medium::Gpu,
        group_idx: Some(group),
    })
}

fn index(bs: usize) -> PrefixIndex {
    PrefixIndex::new(IndexConfig {
        block_size: bs,
        ..IndexConfig::default()
    })
}

/// The cached tokens the index predicts for `prompt` on endpoint 1 (GPU tier), with vLLM's cap:
/// the last prompt token is always computed, so only `(len − 1) / bs` blocks can hit.
fn predicted(index: &PrefixIndex, prompt: &[u32], bs: usize) -> usize {
    let keys = chain_keys(&prompt[..prompt.len() - 1], bs);
    index
        .find_matches(&keys)
        .iter()
        .find(|m| m.endpoint == EndpointId(1))
        .map_or(0, |m| m.gpu_blocks * bs)
}

fn apply(index: &PrefixIndex, events: &[KvEvent]) {
    for ev in events {
        index.apply_event(EndpointId(1), ev).unwrap();
    }
}

/// `p` = 300 tokens, `s`, `t`, `u` = 40 more each (docs/notes-vllm-models.md §5).
fn prompts() -> (Vec<u32>, Vec<u32>, Vec<u32>, Vec<u32>) {
    let p: Vec<u32> = (0..300).map(|i| 1000 + i).collect();
    let with = |from: u32| -> Vec<u32> { p.iter().copied().chain(from..from + 40).collect() };
    (with(5000), with(6000), p.clone(), with(7000))
}

/// One request's events on gemma3 (groups sliding(64), sliding(64), full), in vLLM's order:
/// the sliding groups first, listing only `kept`, then the full group over `full`.
fn gemma3_request(prompt: &[u32], full: std::ops::Range<usize>, kept: &[usize]) -> Vec<KvEvent> {
    let end = full.end;
    vec![
        group_stored(prompt, BS, 0..end, kept, 0, Kind::Sliding(64)),
        group_stored(prompt, BS, 0..end, kept, 1, Kind::Sliding(64)),
        group_stored(
            prompt,
            BS,
            full.clone(),
            &full.collect::<Vec<_>>(),
            2,
            Kind::Full,
        ),
    ]
}

#[test]
fn gemma3_predictions_equal_vllms_cached_tokens() {
    let index = index(BS);
    let (a, b, c, d) = prompts();
    // A = p + s: nothing cached. Computed in one step, its sliding groups keep only the blocks
    // of A's last window (8, 9 of 10), as vLLM's events list them.
    assert_eq!(predicted(&index, &a, BS), 0);
    apply(&index, &gemma3_request(&a, 0..10, &[8, 9]));
    // B = p + t shares blocks 0–8 with A, but the window before its token 288 needs blocks 7
    // and 8, and block 7 was never kept: vLLM reports 0 (288 with HMA off).
    assert_eq!(predicted(&index, &b, BS), 0);
    // B computed (its earlier blocks were cached by A: vLLM keeps three sliding blocks).
    apply(&index, &gemma3_request(&b, 0..10, &[7, 8, 9]));
    // A again: all ten full blocks and its window (8, 9).
    assert_eq!(predicted(&index, &a, BS), 320);
    // C = p: 9 blocks, window 7–8 now held (B kept block 7).
    assert_eq!(predicted(&index, &c, BS), 288);
    assert_eq!(predicted(&index, &c, BS), 288);
    // D = p + u: its block 9 is new; 0–8 with window 7–8.
    assert_eq!(predicted(&index, &d, BS), 288);
    // 1,000 tokens, then again: 0, then 992 (31 blocks; window 29–30).
    let long: Vec<u32> = (0..1000).map(|i| 20_000 + i).collect();
    assert_eq!(predicted(&index, &long, BS), 0);
    apply(&index, &gemma3_request(&long, 0..31, &[29, 30]));
    assert_eq!(predicted(&index, &long, BS), 992);
}

#[test]
fn gpt_oss_needs_four_window_blocks() {
    // gpt-oss: sliding(128) is group 0, full attention group 1; need = cdiv(127, 32) = 4.
    let index = index(BS);
    let (a, b, c, _) = prompts();
    let request = |prompt: &[u32], kept: &[usize]| {
        vec![
            group_stored(prompt, BS, 0..10, kept, 0, Kind::Sliding(128)),
            group_stored(
                prompt,
                BS,
                0..10,
                &(0..10).collect::<Vec<_>>(),
                1,
                Kind::Full,
            ),
        ]
    };
    apply(&index, &request(&a, &[6, 7, 8, 9]));
    // B's window before token 288 is blocks 5–8; A kept 6–9.
    assert_eq!(predicted(&index, &b, BS), 0);
    assert_eq!(predicted(&index, &a, BS), 320);
    apply(&index, &request(&b, &[5, 6, 7, 8, 9]));
    assert_eq!(predicted(&index, &c, BS), 288);
}

#[test]
fn removing_a_window_block_shortens_the_hit() {
    let index = index(BS);
    let (a, b, c, _) = prompts();
    apply(&index, &gemma3_request(&a, 0..10, &[8, 9]));
    apply(&index, &gemma3_request(&b, 0..10, &[7, 8, 9]));
    assert_eq!(predicted(&index, &a, BS), 320);
    // Group 1 drops A's block 9: A's window at 10 blocks is gone, the one at 9 (7, 8) remains.
    apply(&index, &[group_removed(&a, BS, &[9], 1)]);
    assert_eq!(predicted(&index, &a, BS), 288);
    // Group 0 drops block 7: no window before block 9 either; blocks 8 alone are not a window,
    // and the run from block 0 is empty.
    apply(&index, &[group_removed(&a, BS, &[7], 0)]);
    assert_eq!(predicted(&index, &a, BS), 0);
    assert_eq!(predicted(&index, &c, BS), 0);
    // The full-attention group dropping a block cuts the full run; the rule is applied again at
    // the new end (blocks 0–3 have no window either).
    apply(&index, &gemma3_request(&a, 0..10, &[8, 9]));
    apply(&index, &gemma3_request(&c, 0..9, &[7, 8]));
    assert_eq!(predicted(&index, &a, BS), 320);
    apply(&index, &[group_removed(&a, BS, &[4], 2)]);
    assert_eq!(predicted(&index, &a, BS), 0);
    // Every group dropped everything of A's block 9: the index forgets the engine hash.
    apply(
        &index,
        &[
            group_removed(&a, BS, &[9], 0),
            group_removed(&a, BS, &[9], 2),
        ],
    );
    assert_eq!(index.stats().unknown_removals, 0);
    apply(&index, &[group_removed(&a, BS, &[9], 2)]);
    assert_eq!(index.stats().unknown_removals, 1);
}

#[test]
fn mamba_groups_need_the_state_at_the_hits_last_block() {
    // Qwen3-Next-like: three mamba groups (the gated delta net layers), then full attention.
    let bs = 16;
    let index = index(bs);
    let prompt: Vec<u32> = (0..75).map(|i| 300 + i).collect();
    let request = |prompt: &[u32], end: usize, state_groups: &[u32]| {
        let mut evs: Vec<KvEvent> = state_groups
            .iter()
            .map(|g| group_stored(prompt, bs, 0..end, &[end - 1], *g, Kind::Mamba))
            .collect();
        evs.push(group_stored(
            prompt,
            bs,
            0..end,
            &(0..end).collect::<Vec<_>>(),
            3,
            Kind::Full,
        ));
        evs
    };
    // Another prompt shows all four groups.
    let warm: Vec<u32> = (0..40).map(|i| 9000 + i).collect();
    apply(&index, &request(&warm, 2, &[0, 1, 2]));
    assert_eq!(predicted(&index, &warm, bs), 32);
    // Only two of the three mamba groups hold the prompt's state: no hit.
    apply(&index, &request(&prompt, 4, &[0, 1]));
    assert_eq!(predicted(&index, &prompt, bs), 0);
    apply(&index, &request(&prompt, 4, &[2]));
    assert_eq!(predicted(&index, &prompt, bs), 64);
    // A prompt that shares three blocks: the full run is 3 but no state at block 2.
    let mut other = prompt[..48].to_vec();
    other.extend(900..940);
    assert_eq!(predicted(&index, &other, bs), 0);
    // The same prompt extended: the state at block 3 serves it.
    let mut longer = prompt.clone();
    longer.extend(500..540);
    assert_eq!(predicted(&index, &longer, bs), 64);
    // The state is evicted from one group: no hit.
    apply(&index, &[group_removed(&prompt, bs, &[3], 1)]);
    assert_eq!(predicted(&index, &longer, bs), 0);
}

#[test]
fn the_cpu_and_any_runs_follow_the_rule_too() {
    let index = index(BS);
    let (a, _, _, _) = prompts();
    apply(&index, &gemma3_request(&a, 0..10, &[8, 9]));
    // The full group's CPU copies of A's blocks (a connector's token-less CPU store).
    let KvEvent::BlockStored(mut cpu) =
        group_stored(&a, BS, 0..10, &(0..10).collect::<Vec<_>>(), 2, Kind::Full)
    else {
        unreachable!()
    };
    cpu.token_ids.clear();
    cpu.block_size = 0;
    cpu.medium = Medium::Cpu;
    apply(&index, &[KvEvent::BlockStored(cpu)]);
    let m = index.find_matches(&chain_keys(&a[..339], BS));
    // No sliding group holds anything in the CPU tier: the CPU run is the run from block 0 of
    // the window rule, 0. Either tier: A's window is on the GPU, the full blocks in both.
    assert_eq!(
        (m[0].gpu_blocks, m[0].cpu_blocks, m[0].any_blocks),
        (10, 0, 10)
    );
}

#[test]
fn window_blocks_wait_for_the_full_attention_store_that_places_them() {
    let index = index(BS);
    let (a, _, _, _) = prompts();
    let evs = gemma3_request(&a, 0..10, &[8, 9]);
    apply(&index, &evs[..2]);
    // Before the full-attention store the window blocks have no position: no match at all.
    assert!(index.find_matches(&chain_keys(&a, BS)).is_empty());
    apply(&index, &evs[2..]);
    assert_eq!(predicted(&index, &a, BS), 320);
    // Window blocks whose full-attention store never comes are bounded, oldest dropped first.
    let many: Vec<u32> = (0..(MAX_PENDING as u32 + 10) * 32).collect();
    let all: Vec<usize> = (0..many.len() / BS).collect();
    apply(
        &index,
        &[group_stored(
            &many,
            BS,
            0..all.len(),
            &all,
            0,
            Kind::Sliding(64),
        )],
    );
    assert_eq!(index.stats().unresolved_blocks, 10);
}

#[test]
fn dense_and_unmodelled_groups_are_handled_as_before() {
    let index = index(BS);
    let (a, _, _, _) = prompts();
    // A dense vLLM 0.32 model (one full-attention group 0) and kvmesh's own engines: as before.
    apply(
        &index,
        &[group_stored(
            &a,
            BS,
            0..10,
            &(0..10).collect::<Vec<_>>(),
            0,
            Kind::Full,
        )],
    );
    assert_eq!(predicted(&index, &a, BS), 320);
    // Removals without a group apply to a dense endpoint's one group.
    let KvEvent::BlockRemoved(mut rm) = group_removed(&a, BS, &[9], 0) else {
        unreachable!()
    };
    rm.group_idx = None;
    apply(&index, &[KvEvent::BlockRemoved(rm)]);
    assert_eq!(predicted(&index, &a, BS), 288);
    // A kind the index does not model, and a sliding group without its window: ignored.
    let ignored_before = index.stats().ignored_events;
    let KvEvent::BlockStored(mut ev) = group_stored(&a, BS, 0..10, &[8, 9], 1, Kind::Sliding(64))
    else {
        unreachable!()
    };
    ev.kv_cache_spec_sliding_window = None;
    let mut chunked = ev.clone();
    chunked.kv_cache_spec_kind = Some("chunked_local_attention".into());
    apply(
        &index,
        &[KvEvent::BlockStored(ev), KvEvent::BlockStored(chunked)],
    );
    assert_eq!(index.stats().ignored_events, ignored_before + 2);
    assert_eq!(predicted(&index, &a, BS), 288, "still dense");
    // A sliding group appears: the endpoint is hybrid from now on and its dense holdings are
    // forgotten (their groups are unknown).
    apply(
        &index,
        &[group_stored(&a, BS, 0..10, &[8, 9], 1, Kind::Sliding(64))],
    );
    assert_eq!(predicted(&index, &a, BS), 0);
    // A group that changes kind is an odd event: ignored.
    apply(
        &index,
        &[group_stored(&a, BS, 0..10, &[8, 9], 1, Kind::Mamba)],
    );
    assert_eq!(index.stats().ignored_events, ignored_before + 3);
    // Clearing the endpoint forgets its layout: a dense store is indexed again.
    apply(&index, &[KvEvent::AllBlocksCleared]);
    apply(
        &index,
        &[group_stored(
            &a,
            BS,
            0..10,
            &(0..10).collect::<Vec<_>>(),
            0,
            Kind::Full,
        )],
    );
    assert_eq!(predicted(&index, &a, BS), 320);
}

#[test]
fn forgetting_a_hybrid_endpoint_leaves_no_memberships() {
    let index = index(BS);
    let (a, b, _, _) = prompts();
    apply(&index, &gemma3_request(&a, 0..10, &[8, 9]));
    apply(&index, &gemma3_request(&b, 0..10, &[7, 8, 9]));
    assert!(index.stats().memberships > 0);
    index.mark_suspect(EndpointId(1));
    apply(&index, &gemma3_request(&a, 0..10, &[8, 9]));
    // B's own block 9 was not stored again, nor block 7 by the sliding groups: aged out, with
    // their group keys, though the full-attention group stored block 7 again.
    index.expire_suspect(EndpointId(1));
    assert_eq!(predicted(&index, &b, BS), 0);
    assert_eq!(predicted(&index, &a, BS), 320);
    index.clear_endpoint(EndpointId(1));
    let s = index.stats();
    assert_eq!((s.blocks, s.memberships), (0, 0));
    assert_eq!(index.held_blocks(EndpointId(1)), 0);
}
