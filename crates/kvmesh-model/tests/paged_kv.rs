//! The tiny random model: KV restored from elsewhere (another block id, another arena — as the CPU
//! tier or a peer would provide it) gives the same logits and tokens as a full recompute; chunked
//! prefill equals one-shot prefill; a batched step equals separate steps.
#![allow(clippy::unwrap_used)]

use kvmesh_engine::compute::{BlockId, ComputeBackend, KvArena, SamplingParams, SeqStep};
use kvmesh_model::{KvDtype, LoadOptions, ModelBackend, tiny_random_llama, tiny_random_llama_with};

const TOL: f32 = 1e-5;

fn prompt(n: usize) -> Vec<u32> {
    let text =
        "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. ";
    text.bytes().cycle().take(n).map(u32::from).collect()
}

fn step<'a>(
    tokens: &'a [u32],
    start_pos: usize,
    table: &'a [BlockId],
    sample: Option<&'a SamplingParams>,
) -> SeqStep<'a> {
    SeqStep {
        seq_id: 1,
        tokens,
        start_pos,
        block_table: table,
        sample,
        num_generated: 0,
    }
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn arena_for(m: &ModelBackend, blocks: usize) -> KvArena {
    KvArena::new(blocks, m.kv_layout().bytes_per_block)
}

fn greedy() -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        top_p: 1.0,
        seed: None,
    }
}

/// Greedy decode `n` tokens after the prompt's KV (positions `0..prompt.len()-1`) is in `table`,
/// feeding the last prompt token first.
fn decode(
    m: &mut ModelBackend,
    arena: &mut KvArena,
    table: &[BlockId],
    prompt: &[u32],
    n: usize,
) -> Vec<u32> {
    let p = greedy();
    let mut out = Vec::new();
    let mut last = *prompt.last().unwrap();
    for i in 0..n {
        let pos = prompt.len() - 1 + i;
        let s = SeqStep {
            seq_id: 1,
            tokens: std::slice::from_ref(&last),
            start_pos: pos,
            block_table: table,
            sample: Some(&p),
            num_generated: i,
        };
        last = m.step(&[s], arena).unwrap()[0].unwrap();
        out.push(last);
    }
    out
}

fn restored_prefix_matches_recompute(kv_dtype: KvDtype) {
    let bs = 4;
    let opts = LoadOptions {
        block_size: bs,
        kv_dtype,
        ..LoadOptions::default()
    };
    let mut m = tiny_random_llama_with(7, &opts);
    let toks = prompt(45);
    let prefix = 28; // 7 full blocks, as the engine caches whole blocks only.

    // Full recompute in arena A.
    let mut a = arena_for(&m, 24);
    let table_a: Vec<BlockId> = (0..24).collect();
    let full = m
        .forward_logits(&[step(&toks, 0, &table_a, None)], &mut a)
        .unwrap()
        .remove(0);

    // The prefix computed in arena B ("the producer"), its blocks copied byte-for-byte into
    // arena C under different ids ("the consumer", after a CPU-tier restore or a peer pull).
    let mut b = arena_for(&m, 8);
    let table_b: Vec<BlockId> = (0..7).collect();
    m.forward_logits(&[step(&toks[..prefix], 0, &table_b, None)], &mut b)
        .unwrap();
    let mut c = arena_for(&m, 30);
    let table_c: Vec<BlockId> = vec![
        17, 3, 29, 11, 0, 22, 5, 9, 14, 2, 25, 8, 19, 27, 1, 6, 12, 20, 23, 4,
    ];
    for (i, &src) in table_b.iter().enumerate() {
        let bytes = b.block(src).to_vec(); // what goes over the wire / into the CPU tier
        c.block_mut(table_c[i]).copy_from_slice(&bytes);
    }
    let restored = m
        .forward_logits(&[step(&toks[prefix..], prefix, &table_c, None)], &mut c)
        .unwrap()
        .remove(0);
    let diff = max_diff(&full, &restored);
    assert!(diff <= TOL, "restored-prefix logits differ by {diff}");

    // Greedy continuations agree token for token.
    let from_full = decode(&mut m, &mut a, &table_a, &toks, 24);
    let from_restored = decode(&mut m, &mut c, &table_c, &toks, 24);
    assert_eq!(from_full, from_restored);
    let distinct: std::collections::HashSet<_> = from_full.iter().collect();
    assert!(
        distinct.len() > 3,
        "the tiny model should not be degenerate: {from_full:?}"
    );
}

#[test]
fn restored_prefix_matches_full_recompute_f32() {
    restored_prefix_matches_recompute(KvDtype::F32);
}

#[test]
fn restored_prefix_matches_full_recompute_bf16_kv() {
    restored_prefix_matches_recompute(KvDtype::Bf16);
}

#[test]
fn logits_depend_on_the_restored_prefix() {
    // Guard against a test that cannot fail: garbage KV in the prefix blocks changes the logits.
    let mut m = tiny_random_llama_with(
        7,
        &LoadOptions {
            block_size: 4,
            ..LoadOptions::default()
        },
    );
    let toks = prompt(20);
    let table: Vec<BlockId> = (0..5).collect();
    let mut a = arena_for(&m, 5);
    let full = m
        .forward_logits(&[step(&toks, 0, &table, None)], &mut a)
        .unwrap()
        .remove(0);
    let mut c = arena_for(&m, 5);
    for id in 0..4 {
        c.block_mut(id)
            .iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = (i % 7) as u8);
    }
    let wrong = m
        .forward_logits(&[step(&toks[16..], 16, &table, None)], &mut c)
        .unwrap()
        .remove(0);
    assert!(max_diff(&full, &wrong) > 1e-3);
}

#[test]
fn chunked_prefill_equals_one_shot() {
    // Long enough that one-shot prefill tiles both queries (256) and keys (512).
    let mut m = tiny_random_llama(3);
    let toks = prompt(1100);
    let blocks = 1100usize.div_ceil(16);
    let table: Vec<BlockId> = (0..blocks as BlockId).collect();
    let mut a = arena_for(&m, blocks);
    let one_shot = m
        .forward_logits(&[step(&toks, 0, &table, None)], &mut a)
        .unwrap()
        .remove(0);
    for chunks in [vec![100usize; 11], vec![1, 15, 17, 300, 767]] {
        let mut b = arena_for(&m, blocks);
        let mut pos = 0;
        let mut last = Vec::new();
        for c in chunks {
            last = m
                .forward_logits(&[step(&toks[pos..pos + c], pos, &table, None)], &mut b)
                .unwrap()
                .remove(0);
            pos += c;
        }
        assert_eq!(pos, toks.len());
        let diff = max_diff(&one_shot, &last);
        assert!(diff <= TOL, "chunked prefill differs by {diff}");
    }
}

#[test]
fn batched_step_equals_separate_steps() {
    let mut m = tiny_random_llama(11);
    let p = greedy();
    let t1 = prompt(40);
    let t2: Vec<u32> = prompt(90)[50..].to_vec();
    let t3 = prompt(33);
    // Sequence 1: a decode step after 39 prompt positions; 2: first prefill chunk; 3: a later chunk.
    let tables: [Vec<BlockId>; 3] = [(0..3).collect(), (3..6).collect(), (6..9).collect()];
    let mut arena = arena_for(&m, 9);
    m.forward_logits(
        &[
            step(&t1[..39], 0, &tables[0], None),
            step(&t3[..20], 0, &tables[2], None),
        ],
        &mut arena,
    )
    .unwrap();
    let snapshot: Vec<Vec<u8>> = (0..9).map(|i| arena.block(i).to_vec()).collect();
    let steps = |a: usize| -> [SeqStep<'_>; 3] {
        let _ = a;
        [
            SeqStep {
                seq_id: 1,
                tokens: &t1[39..],
                start_pos: 39,
                block_table: &tables[0],
                sample: Some(&p),
                num_generated: 3,
            },
            SeqStep {
                seq_id: 2,
                tokens: &t2,
                start_pos: 0,
                block_table: &tables[1],
                sample: Some(&p),
                num_generated: 0,
            },
            SeqStep {
                seq_id: 3,
                tokens: &t3[20..],
                start_pos: 20,
                block_table: &tables[2],
                sample: None,
                num_generated: 0,
            },
        ]
    };
    let batched = m.forward_logits(&steps(0), &mut arena).unwrap();
    let batched_tokens = {
        let mut again = arena_for(&m, 9);
        for (i, s) in snapshot.iter().enumerate() {
            again.block_mut(i as BlockId).copy_from_slice(s);
        }
        m.step(&steps(0), &mut again).unwrap()
    };
    assert_eq!(batched_tokens[2], None, "no sample asked for sequence 3");
    for (i, s) in steps(0).into_iter().enumerate() {
        let mut alone = arena_for(&m, 9);
        for (j, snap) in snapshot.iter().enumerate() {
            alone.block_mut(j as BlockId).copy_from_slice(snap);
        }
        let single = m
            .forward_logits(std::slice::from_ref(&s), &mut alone)
            .unwrap()
            .remove(0);
        let diff = max_diff(&batched[i], &single);
        assert!(diff <= TOL, "sequence {i}: batched differs by {diff}");
        if let Some(tok) = batched_tokens[i] {
            assert_eq!(tok, kvmesh_model::sample::argmax(&single));
        }
    }
}

#[test]
fn seeded_sampling_is_deterministic_and_temperature_matters() {
    let mut m = tiny_random_llama(5);
    let toks = prompt(30);
    let table: Vec<BlockId> = (0..4).collect();
    let run = |m: &mut ModelBackend, seed: u64| -> Vec<u32> {
        let p = SamplingParams {
            temperature: 1.5,
            top_p: 0.95,
            seed: Some(seed),
        };
        let mut arena = arena_for(m, 4);
        let mut out = Vec::new();
        let s = SeqStep {
            seq_id: 9,
            tokens: &toks,
            start_pos: 0,
            block_table: &table,
            sample: Some(&p),
            num_generated: 0,
        };
        let mut last = m.step(&[s], &mut arena).unwrap()[0].unwrap();
        for i in 1..20 {
            out.push(last);
            let s = SeqStep {
                seq_id: 9,
                tokens: std::slice::from_ref(&last),
                start_pos: toks.len() + i - 1,
                block_table: &table,
                sample: Some(&p),
                num_generated: i,
            };
            last = m.step(&[s], &mut arena).unwrap()[0].unwrap();
        }
        out
    };
    let a = run(&mut m, 1);
    assert_eq!(a, run(&mut m, 1));
    assert_ne!(a, run(&mut m, 2));
}

#[test]
fn bad_step_inputs_are_errors_not_panics() {
    let mut m = tiny_random_llama(1);
    let mut arena = arena_for(&m, 2);
    let toks = prompt(20);
    // Block table too short for 20 positions.
    assert!(m.step(&[step(&toks, 0, &[0], None)], &mut arena).is_err());
    // Block id outside the arena.
    assert!(
        m.step(&[step(&toks[..4], 0, &[7], None)], &mut arena)
            .is_err()
    );
    // Token outside the vocabulary.
    assert!(m.step(&[step(&[300], 0, &[0], None)], &mut arena).is_err());
}

#[test]
fn kv_layout_describes_the_blocks() {
    let m = tiny_random_llama(1);
    let l = m.kv_layout();
    assert_eq!(
        (l.block_size, l.num_layers, l.num_kv_heads, l.head_dim),
        (16, 2, 2, 16)
    );
    assert_eq!(l.bytes_per_block, 16 * 2 * 2 * 2 * 16 * 4);
    assert_eq!(l.dtype, "f32");
    let b = tiny_random_llama_with(
        1,
        &LoadOptions {
            kv_dtype: KvDtype::Bf16,
            ..LoadOptions::default()
        },
    );
    assert_eq!(b.kv_layout().bytes_per_block, l.bytes_per_block / 2);
    assert_eq!(m.eos_token_ids(), vec![kvmesh_text::ByteTokenizer::EOS]);
}
