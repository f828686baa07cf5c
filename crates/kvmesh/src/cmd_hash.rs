//! `kvmesh hash`: vLLM-identical block hashes for a JSON array of token ids read on stdin.
//!
//! One JSON object per full block: `{"index": i, "hex": "<full digest>", "u64": <event value>}`;
//! the `u64` is what the engine publishes in KV events (last 8 digest bytes, big-endian).
//! `--cache-salt` and `--lora NAME=PATH` add vLLM's extra keys (a tenant's or an adapter's blocks).

use std::io::{Read, Write};

use anyhow::{Context, bail};
use kvmesh_core::hashing::{BlockDigest, DEFAULT_NONE_HASH_SEED};
use kvmesh_core::{BlockHasher, HashAlgo, LoraAdapter, TenantKeys, TokenId};

#[derive(clap::Args)]
pub struct HashArgs {
    /// Tokens per block (vLLM `--block-size`; its default is 16).
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Prefix-caching hash algorithm: `sha256_cbor` or `xxhash_cbor` (vLLM's pickle-based
    /// `sha256` is not portable and not supported).
    #[arg(long, default_value = "sha256_cbor")]
    pub algo: String,
    /// The engine's `PYTHONHASHSEED` string; without it vLLM's default seed ("vllm-none-hash").
    #[arg(long, conflicts_with = "none_hash")]
    pub seed: Option<String>,
    /// Chain from this NONE_HASH (hex) instead of deriving it from a seed — for engines whose
    /// seed is random (vLLM `xxhash_cbor` without PYTHONHASHSEED).
    #[arg(long)]
    pub none_hash: Option<String>,
    /// The request's `cache_salt` (hashed into block 0, as vLLM does).
    #[arg(long)]
    pub cache_salt: Option<String>,
    /// The request's LoRA adapter as vLLM's `--lora-modules` names it: `NAME=PATH` (hashed into
    /// every block, path included).
    #[arg(long, value_name = "NAME=PATH")]
    pub lora: Option<String>,
}

pub fn run(args: HashArgs) -> anyhow::Result<()> {
    let algo: HashAlgo = args.algo.parse()?;
    if args.block_size == 0 {
        bail!("--block-size must be at least 1");
    }
    let mut hasher = match &args.none_hash {
        Some(hex) => {
            let digest = BlockDigest::from_hex(hex).context("--none-hash")?;
            if digest.as_bytes().len() != algo.digest_len() {
                bail!(
                    "--none-hash has {} bytes but {algo} digests have {}",
                    digest.as_bytes().len(),
                    algo.digest_len()
                );
            }
            BlockHasher::with_none_hash(algo, digest, args.block_size)
        }
        None => {
            if args.seed.is_none() && !algo.default_seed_is_reproducible() {
                eprintln!(
                    "warning: vLLM seeds {algo} with a random per-process NONE_HASH when \
                     PYTHONHASHSEED is unset, so no tool can reproduce its hashes; these use the \
                     seed {DEFAULT_NONE_HASH_SEED:?}. Pass --seed (the engine's PYTHONHASHSEED) or \
                     --none-hash."
                );
            }
            BlockHasher::new(algo, args.seed.as_deref(), args.block_size)
        }
    };
    let mut input = String::new();
    std::io::stdin()
        .read_to_string(&mut input)
        .context("reading stdin")?;
    let tokens = parse_tokens(&input)?;
    let lora = match &args.lora {
        None => None,
        Some(spec) => match spec.split_once('=') {
            Some((name, path)) if !name.is_empty() && !path.is_empty() => Some(LoraAdapter {
                name: name.to_owned(),
                path: path.to_owned(),
            }),
            _ => bail!("--lora wants NAME=PATH (as vLLM's --lora-modules), got {spec:?}"),
        },
    };
    let tenant = TenantKeys {
        lora,
        cache_salt: args.cache_salt.clone(),
    };
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    for (index, digest) in hasher.hash_prompt_with(&tokens, &tenant).iter().enumerate() {
        // Written by hand to keep the documented key order (index, hex, u64).
        writeln!(
            out,
            r#"{{"index":{index},"hex":"{}","u64":{}}}"#,
            digest.to_hex(),
            digest.event_hash().0
        )?;
    }
    out.flush()?;
    Ok(())
}

/// A JSON array of non-negative integers that fit a token id.
fn parse_tokens(input: &str) -> anyhow::Result<Vec<TokenId>> {
    let value: serde_json::Value =
        serde_json::from_str(input).context("stdin must be a JSON array of token ids")?;
    let Some(items) = value.as_array() else {
        bail!(
            "stdin must be a JSON array of token ids, got {}",
            kind(&value)
        );
    };
    items
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64()
                .and_then(|t| TokenId::try_from(t).ok())
                .with_context(|| format!("token {i} is not a token id (0..2^32): {v}"))
        })
        .collect()
}

fn kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_validated() {
        assert_eq!(parse_tokens("[1, 2, 3]").ok(), Some(vec![1, 2, 3]));
        assert!(parse_tokens("[1, -2]").is_err());
        assert!(parse_tokens("[4294967296]").is_err());
        assert!(parse_tokens("{\"a\": 1}").is_err());
        assert!(parse_tokens("[1.5]").is_err());
        assert!(parse_tokens("nope").is_err());
    }
}
