//! Decode every ZMQ frame vLLM published in `capture2.json` / `capture3.json` and check it against
//! the golden hashes of the prompts, and that re-encoding reproduces vLLM's bytes exactly.
#![allow(clippy::unwrap_used)]

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

use base64::Engine as _;
use kvmesh_core::events::{
    BlockStored, EventEncoding, EventFrame, KvEvent, Medium, decode_batch, encode_batch,
};
use kvmesh_core::hashing::BlockDigest;
use kvmesh_core::{BlockHasher, HashAlgo};

fn fixture(name: &str) -> serde_json::Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/vllm")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Frames of a capture as `(topic, seq, payload)`.
fn frames(name: &str) -> Vec<EventFrame> {
    fixture(name)["frames"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            let payload = base64::engine::general_purpose::STANDARD
                .decode(f["payload_b64"].as_str().unwrap())
                .unwrap();
            let parts = [
                f["topic"].as_str().unwrap().as_bytes().to_vec(),
                f["seq"].as_u64().unwrap().to_be_bytes().to_vec(),
                payload,
            ];
            EventFrame::from_parts(&parts).unwrap()
        })
        .collect()
}

/// The sha256_cbor (seed "0") golden prompts: tokens, per-block u64 and full digest.
struct GoldenPrompt {
    tokens: Vec<u32>,
    u64s: Vec<u64>,
    digests: Vec<BlockDigest>,
}

fn golden_prompts(name: &str) -> (usize, Vec<GoldenPrompt>) {
    let g = fixture(name);
    let bs = g["block_size"].as_u64().unwrap() as usize;
    let prompts = g["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["algo"] == "sha256_cbor")
        .map(|c| GoldenPrompt {
            tokens: c["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect(),
            u64s: c["blocks"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b["u64"].as_u64().unwrap())
                .collect(),
            digests: c["blocks"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| BlockDigest::from_hex(b["hex"].as_str().unwrap()).unwrap())
                .collect(),
        })
        .collect();
    (bs, prompts)
}

/// Checks a `BlockStored` against the golden prompt it continues: its parent locates the prompt
/// and block offset (or, without a parent, the prompt starting with its tokens); its tokens must
/// be that prompt's next tokens and its hashes that prompt's next golden hashes. Also recomputes
/// the chain with `BlockHasher` from the parent's full digest.
fn check_stored(e: &BlockStored, bs: usize, prompts: &[GoldenPrompt]) {
    assert_eq!(e.block_size as usize, bs);
    assert_eq!(e.medium, Medium::Gpu);
    assert_eq!(
        e.token_ids.len(),
        e.block_hashes.len() * bs,
        "token_ids = n_blocks x block_size"
    );
    let located = prompts.iter().find_map(|p| {
        let start = match e.parent_block_hash {
            None => 0,
            Some(parent) => p.u64s.iter().position(|&u| u == parent.0)? + 1,
        };
        let toks = p.tokens.get(start * bs..start * bs + e.token_ids.len())?;
        (toks == e.token_ids.as_slice()).then_some((p, start))
    });
    let (p, start) = located.unwrap_or_else(|| panic!("no golden prompt carries event {e:?}"));
    let expected: Vec<u64> = p.u64s[start..start + e.block_hashes.len()].to_vec();
    let got: Vec<u64> = e.block_hashes.iter().map(|h| h.0).collect();
    assert_eq!(got, expected);

    let mut hasher = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0"), bs);
    let parent = if start == 0 {
        hasher.none_hash()
    } else {
        p.digests[start - 1]
    };
    let recomputed: Vec<u64> = hasher
        .hash_prompt_from(&parent, &e.token_ids)
        .iter()
        .map(|d| d.event_hash().0)
        .collect();
    assert_eq!(recomputed, got);
}

#[test]
fn capture2_every_block_stored_matches_golden2() {
    let (bs, prompts) = golden_prompts("golden2.json");
    let frames = frames("capture2.json");
    assert!(!frames.is_empty());
    let mut stored = 0;
    for f in &frames {
        assert_eq!(f.topic, "kv-events");
        let batch = f.decode().unwrap();
        assert_eq!(batch.data_parallel_rank, Some(0));
        assert!(batch.ts > 1.7e9, "unix seconds");
        for ev in &batch.events {
            let KvEvent::BlockStored(e) = ev else {
                panic!("capture2 holds only stores: {ev:?}")
            };
            assert_eq!(e.group_idx, Some(0));
            assert_eq!(e.kv_cache_spec_kind.as_deref(), Some("full_attention"));
            assert_eq!(e.lora_id, None);
            check_stored(e, bs, &prompts);
            stored += 1;
        }
    }
    assert_eq!(stored, frames.len());
}

#[test]
fn capture3_counts_and_hashes_match_golden3() {
    let (bs, prompts) = golden_prompts("golden3.json");
    let frames = frames("capture3.json");
    assert_eq!(frames.len(), 13);
    let (mut stored, mut removed, mut cleared) = (0, 0, 0);
    let mut live: HashSet<u64> = HashSet::new();
    for (i, f) in frames.iter().enumerate() {
        assert_eq!(f.seq, i as u64, "capture3 is gap-free from 0");
        for ev in f.decode().unwrap().events {
            match ev {
                KvEvent::BlockStored(e) => {
                    check_stored(&e, bs, &prompts);
                    live.extend(e.block_hashes.iter().map(|h| h.0));
                    stored += 1;
                }
                KvEvent::BlockRemoved(e) => {
                    assert_eq!(e.medium, Medium::Gpu);
                    for h in &e.block_hashes {
                        assert!(live.remove(&h.0), "removed block {h} was never stored");
                    }
                    removed += 1;
                }
                KvEvent::AllBlocksCleared => {
                    live.clear();
                    cleared += 1;
                }
            }
        }
    }
    assert_eq!((stored, removed, cleared), (9, 66, 1));
}

#[test]
fn reencoding_reproduces_vllm_bytes_exactly() {
    let mut n = 0;
    for name in ["capture2.json", "capture3.json"] {
        for f in frames(name) {
            let batch = decode_batch(&f.payload).unwrap();
            let again = encode_batch(&batch, EventEncoding::Map);
            assert_eq!(again.as_slice(), f.payload.as_ref(), "{name} seq {}", f.seq);
            // The array form carries the same information.
            let arr = encode_batch(&batch, EventEncoding::Array);
            assert_eq!(decode_batch(&arr).unwrap(), batch);
            n += 1;
        }
    }
    assert_eq!(n, 16);
}

#[test]
fn prompts_of_capture2_are_those_of_golden2() {
    // Guards the fixture pairing the tests above rely on.
    let cap = fixture("capture2.json");
    let (_, prompts) = golden_prompts("golden2.json");
    let by_tokens: HashMap<Vec<u32>, usize> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| (p.tokens.clone(), i))
        .collect();
    for p in cap["prompts"].as_array().unwrap() {
        let toks: Vec<u32> = p
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        assert!(by_tokens.contains_key(&toks));
    }
}
