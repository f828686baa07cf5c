//! Golden test: reproduce every digest vLLM computed in `shared/vllm-fixtures/golden2*.json`.

use std::path::PathBuf;

use kvmesh_core::{BlockHasher, HashAlgo};

fn fixture(name: &str) -> serde_json::Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/vllm-fixtures")
        .join(name);
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parse {}: {e}", path.display()))
}

fn check_file(name: &str) -> usize {
    let golden = fixture(name);
    let block_size = golden["block_size"].as_u64().unwrap() as usize;
    let mut checked = 0;
    for case in golden["cases"].as_array().unwrap() {
        let algo = match case["algo"].as_str().unwrap().parse::<HashAlgo>() {
            Ok(a) => a,
            Err(_) => continue, // pickle-based sha256 is deliberately unsupported
        };
        let seed = case["seed"].as_str();
        let mut hasher = BlockHasher::new(algo, seed, block_size);
        assert_eq!(
            hasher.none_hash().to_hex(),
            case["none_hash"].as_str().unwrap(),
            "{name} {algo} none_hash"
        );
        let tokens: Vec<u32> = case["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let digests = hasher.hash_prompt(&tokens);
        let blocks = case["blocks"].as_array().unwrap();
        assert_eq!(digests.len(), blocks.len(), "{name} {algo}: block count");
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
            checked += 1;
        }
    }
    checked
}

#[test]
fn sha256_cbor_and_xxhash_cbor_match_vllm_with_seed_zero() {
    assert!(check_file("golden2.json") > 0);
}

#[test]
fn sha256_cbor_and_xxhash_cbor_match_vllm_with_default_seed() {
    assert!(check_file("golden2_defaultseed.json") > 0);
}
