//! End-to-end with the real SmolLM2-135M-Instruct GGUF. Runs only when the GGUF is already in the
//! cache (`kvmesh model fetch smollm2`, or `KVMESH_SMOLLM2_GGUF=<path>`); otherwise it says so and
//! passes, because tests never download.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::sync::Arc;

use kvmesh_engine::compute::{BlockId, ComputeBackend, KvArena, SamplingParams, SeqStep};
use kvmesh_model::{
    LoadOptions, ModelBackend, default_cache_dir, find_smollm2, generate, load_backend,
};
use kvmesh_text::{ChatMessage, Tokenizer};

fn smollm2() -> Option<(ModelBackend, Arc<dyn Tokenizer>)> {
    let path = std::env::var_os("KVMESH_SMOLLM2_GGUF")
        .map(PathBuf::from)
        .or_else(|| find_smollm2(&default_cache_dir()));
    let Some(path) = path else {
        // CI fetches the model (scripts/setup.sh) and sets KVMESH_REQUIRE_EXTERNAL: missing is a failure there.
        assert!(
            std::env::var_os("KVMESH_REQUIRE_EXTERNAL").is_none(),
            "SmolLM2 is required (KVMESH_REQUIRE_EXTERNAL is set) but was not found; run `kvmesh model fetch smollm2`"
        );
        eprintln!(
            "SKIPPED: SmolLM2 GGUF not found in {} (run `kvmesh model fetch smollm2`)",
            default_cache_dir().display()
        );
        return None;
    };
    Some(load_backend(&path, &LoadOptions::default()).unwrap())
}

fn chat_prompt(tok: &dyn Tokenizer, question: &str) -> Vec<u32> {
    let msgs = [ChatMessage {
        role: "user".into(),
        content: question.into(),
    }];
    let text = tok.apply_chat_template(&msgs, true).unwrap();
    tok.encode(&text).unwrap()
}

fn s<'a>(tokens: &'a [u32], start_pos: usize, block_table: &'a [BlockId]) -> SeqStep<'a> {
    SeqStep {
        seq_id: 1,
        tokens,
        start_pos,
        block_table,
        sample: None,
        num_generated: 0,
    }
}

fn greedy() -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        top_p: 1.0,
        seed: None,
    }
}

#[test]
fn smollm2_tokenizer_template_and_restored_prefix() {
    let Some((mut m, tok)) = smollm2() else {
        return;
    };
    let layout = m.kv_layout();
    assert_eq!(
        (layout.num_layers, layout.num_kv_heads, layout.head_dim),
        (30, 3, 64)
    );
    assert_eq!(m.eos_token_ids(), vec![2], "<|im_end|> ends a turn");

    let text = "Hello, world! The year 2024 had 366 days.";
    let ids = tok.encode(text).unwrap();
    assert_eq!(tok.decode(&ids).unwrap(), text);
    assert!(ids.len() < text.len() / 2, "BPE merges applied: {ids:?}");
    // SmolLM2's pre-tokenizer splits digits one by one.
    assert_eq!(tok.encode("2024").unwrap().len(), 4);
    assert_eq!(
        tok.encode(" Paris").unwrap().len(),
        1,
        "common word with its leading space is one token"
    );

    let prompt = chat_prompt(tok.as_ref(), "What is the capital of France?");
    assert_eq!(prompt[0], 1, "<|im_start|> is one special token");

    // Logits after a prefix restored into other blocks of another arena == full recompute.
    let bs = layout.block_size;
    let n = prompt.len();
    let prefix = (n - 1) / bs * bs;
    let blocks = n.div_ceil(bs);
    let table: Vec<BlockId> = (0..blocks as BlockId).collect();
    let mut a = KvArena::new(blocks, layout.bytes_per_block);
    let full = m
        .forward_logits(&[s(&prompt, 0, &table)], &mut a)
        .unwrap()
        .remove(0);
    let other: Vec<BlockId> = (0..blocks as BlockId)
        .map(|i| blocks as BlockId * 2 - 1 - i)
        .collect();
    let mut c = KvArena::new(blocks * 2, layout.bytes_per_block);
    for i in 0..prefix / bs {
        let bytes = a.block(table[i]).to_vec();
        c.block_mut(other[i]).copy_from_slice(&bytes);
    }
    let restored = m
        .forward_logits(&[s(&prompt[prefix..], prefix, &other)], &mut c)
        .unwrap()
        .remove(0);
    let diff = full
        .iter()
        .zip(&restored)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    assert!(diff <= 1e-4, "restored-prefix logits differ by {diff}");
    assert_eq!(
        kvmesh_model::sample::argmax(&full),
        kvmesh_model::sample::argmax(&restored)
    );

    // A short greedy answer is real text.
    let (out, _) = generate(&mut m, &prompt, 8, &greedy(), 512, &[2]).unwrap();
    let answer = tok.decode(&out).unwrap();
    assert!(answer.chars().any(char::is_alphabetic), "{answer:?}");
}

#[test]
#[ignore = "needs the SmolLM2 GGUF (kvmesh model fetch smollm2); ~seconds in release"]
fn smollm2_knows_the_capital_of_france() {
    let Some((mut m, tok)) = smollm2() else {
        panic!("SmolLM2 GGUF not in cache")
    };
    let prompt = chat_prompt(tok.as_ref(), "What is the capital of France?");
    let eos = m.eos_token_ids();
    let (out, _) = generate(&mut m, &prompt, 32, &greedy(), 512, &eos).unwrap();
    let answer = tok.decode(&out).unwrap();
    eprintln!("answer: {answer}");
    assert!(answer.contains("Paris"), "{answer:?}");
}
