//! Golden test: reproduce every digest vLLM computed in `tests/fixtures/vllm/golden*.json`.
//!
//! vLLM without `PYTHONHASHSEED` seeds `sha256_cbor` with the fixed string `"vllm-none-hash"` but
//! `xxhash_cbor` with `os.urandom(32).hex()` (per process, on purpose: the algorithm is not
//! collision resistant). So for that one case the recorded NONE_HASH cannot be derived; the test
//! checks that it is *not* the deterministic one and that every block chains from it exactly.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use kvmesh_core::hashing::BlockDigest;
use kvmesh_core::{BlockHasher, HashAlgo};

fn fixture(name: &str) -> serde_json::Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/vllm")
        .join(name);
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parse {}: {e}", path.display()))
}

#[derive(Default, Debug)]
struct Checked {
    blocks: usize,
    seeded_from_string: usize,
    chained_from_recorded: usize,
}

fn check_file(name: &str) -> Checked {
    let golden = fixture(name);
    let block_size = golden["block_size"].as_u64().unwrap() as usize;
    let mut checked = Checked::default();
    for case in golden["cases"].as_array().unwrap() {
        let algo = match case["algo"].as_str().unwrap().parse::<HashAlgo>() {
            Ok(a) => a,
            Err(_) => continue, // pickle-based sha256 is deliberately unsupported
        };
        let seed = case["seed"].as_str();
        let recorded = BlockDigest::from_hex(case["none_hash"].as_str().unwrap()).unwrap();
        let mut hasher = if seed.is_none() && !algo.default_seed_is_reproducible() {
            // Random per-process seed in vLLM: cannot be derived, only followed.
            assert_ne!(
                BlockHasher::new(algo, None, block_size).none_hash(),
                recorded,
                "{name} {algo}: expected vLLM's random NONE_HASH, got the deterministic one"
            );
            checked.chained_from_recorded += 1;
            BlockHasher::with_none_hash(algo, recorded, block_size)
        } else {
            let h = BlockHasher::new(algo, seed, block_size);
            assert_eq!(h.none_hash(), recorded, "{name} {algo} none_hash");
            checked.seeded_from_string += 1;
            h
        };
        let tokens: Vec<u32> = case["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let digests = hasher.hash_prompt(&tokens);
        let blocks = case["blocks"].as_array().unwrap();
        assert_eq!(digests.len(), blocks.len(), "{name} {algo}: block count");
        assert_eq!(
            digests.len(),
            tokens.len() / block_size,
            "{name}: only full blocks"
        );
        for (i, (d, g)) in digests.iter().zip(blocks).enumerate() {
            assert_eq!(
                d.to_hex(),
                g["hex"].as_str().unwrap(),
                "{name} {algo} block {i} hex"
            );
            assert_eq!(
                d.event_hash().0,
                g["u64"].as_u64().unwrap(),
                "{name} {algo} block {i} u64"
            );
            checked.blocks += 1;
        }
    }
    checked
}

#[test]
fn sha256_cbor_and_xxhash_cbor_match_vllm_with_seed_zero() {
    let c = check_file("golden2.json");
    assert!(c.blocks > 0);
    assert_eq!(
        c.chained_from_recorded, 0,
        "every case with a seed derives NONE_HASH"
    );
    assert_eq!(
        c.seeded_from_string, 8,
        "4 prompts x (sha256_cbor, xxhash_cbor)"
    );
}

#[test]
fn default_seed_sha256_cbor_derives_and_xxhash_cbor_chains_from_recorded_none_hash() {
    let c = check_file("golden2_defaultseed.json");
    assert!(c.blocks > 0);
    assert_eq!(
        c.seeded_from_string, 4,
        "sha256_cbor uses \"vllm-none-hash\""
    );
    assert_eq!(
        c.chained_from_recorded, 4,
        "xxhash_cbor's seed is random per process"
    );
}

#[test]
fn eviction_capture_prompts_match_vllm() {
    let c = check_file("golden3.json");
    assert_eq!(c.seeded_from_string, 8);
    assert_eq!(c.blocks, 8 * 640 / 32);
}

/// Tenants and adapters: `hash_extra_keys.json` holds digests vLLM's own block hasher computed
/// for one prompt with `cache_salt` and/or a `LoRARequest` (24 cases: two seeds × two block sizes
/// × plain, salt "tenant-a", salt "tenant-b", LoRA, same LoRA name at another path, LoRA + salt).
#[test]
fn salted_and_lora_digests_match_vllm() {
    use kvmesh_core::{LoraAdapter, TenantKeys};

    let golden = fixture("hash_extra_keys.json");
    let tokens: Vec<u32> = golden["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let mut blocks = 0;
    let mut cases = 0;
    for case in golden["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let algo: HashAlgo = case["algo"].as_str().unwrap().parse().unwrap();
        let bs = case["block_size"].as_u64().unwrap() as usize;
        let seed = case["seed"].as_str();
        let tenant = TenantKeys {
            lora: case["lora"].as_object().map(|l| LoraAdapter {
                name: l["name"].as_str().unwrap().to_owned(),
                path: l["path"].as_str().unwrap().to_owned(),
            }),
            cache_salt: case["cache_salt"].as_str().map(str::to_owned),
        };
        // The fixture's recorded hash input agrees with the layout TenantKeys encodes: LoRA in
        // every block, the salt in block 0 only, null when neither.
        for (i, ek) in case["extra_keys"].as_array().unwrap().iter().enumerate() {
            let mut want = Vec::new();
            if let Some(l) = &tenant.lora {
                want.push(serde_json::json!(["lora", l.name, l.path]));
            }
            if let (0, Some(s)) = (i, tenant.salt()) {
                want.push(serde_json::json!(["cache_salt", s]));
            }
            let want = if want.is_empty() {
                serde_json::Value::Null
            } else {
                serde_json::Value::Array(want)
            };
            assert_eq!(ek, &want, "{name} bs {bs} block {i} extra keys");
        }
        let mut hasher = BlockHasher::new(algo, seed, bs);
        assert_eq!(
            hasher.none_hash().to_hex(),
            case["none_hash"].as_str().unwrap(),
            "{name} seed {seed:?} none_hash"
        );
        let digests = hasher.hash_prompt_with(&tokens, &tenant);
        let want = case["blocks"].as_array().unwrap();
        assert_eq!(digests.len(), want.len(), "{name} bs {bs}: block count");
        for (i, (d, g)) in digests.iter().zip(want).enumerate() {
            let what = format!("{name} seed {seed:?} bs {bs} block {i}");
            assert_eq!(d.to_hex(), g["hex"].as_str().unwrap(), "{what} hex");
            assert_eq!(d.event_hash().0, g["u64"].as_u64().unwrap(), "{what} u64");
            blocks += 1;
        }
        cases += 1;
    }
    assert_eq!(cases, 24);
    assert_eq!(blocks, 2 * 6 * (6 + 3));
}
