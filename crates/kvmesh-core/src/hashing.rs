//! Chained block hashing exactly as vLLM's `hash_block_tokens` with `sha256_cbor` / `xxhash_cbor`.
//!
//! A block's digest is `H(cbor([parent_digest, [token ids...], extra_keys_or_null]))`, where the
//! first block's parent is `NONE_HASH = H(cbor(seed_string))`. The value that travels in KV events
//! is the last 8 digest bytes read big-endian ([`BlockDigest::event_hash`]).
//!
//! Tenants and adapters ([`TenantKeys`]) fill the third element as vLLM's
//! `generate_block_hash_extra_keys` does: a LoRA adapter's `("lora", name, path)` in every block,
//! then `("cache_salt", salt)` in block 0 only (later blocks inherit it through the parent chain);
//! a block with neither hashes `null`, so untenanted prompts hash exactly as before.

use std::fmt;
use std::str::FromStr;

use sha2::{Digest, Sha256};
use thiserror::Error;

use crate::TokenId;

/// The seed vLLM uses for NONE_HASH when `PYTHONHASHSEED` is not set and the algorithm is
/// cryptographic (`sha256`, `sha256_cbor`).
///
/// For the non-cryptographic `xxhash`/`xxhash_cbor`, vLLM deliberately derives NONE_HASH from
/// `os.urandom(32).hex()` per process when `PYTHONHASHSEED` is unset
/// (`kv_cache_utils.resolve_none_hash_seed`: a predictable seed would let an attacker precompute
/// colliding blocks), so such an engine's hashes cannot be reproduced from a seed at all. To
/// follow one, take its NONE_HASH (or first block) from elsewhere and use
/// [`BlockHasher::with_none_hash`]; for sharing, run every engine with one `PYTHONHASHSEED`.
pub const DEFAULT_NONE_HASH_SEED: &str = "vllm-none-hash";

/// The hash value an engine publishes for a block in KV events (last 8 digest bytes, big-endian).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct BlockHash(pub u64);

impl fmt::Display for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Prefix-caching hash algorithms kvmesh can reproduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum HashAlgo {
    /// SHA-256 over canonical CBOR (vLLM `--prefix-caching-hash-algo sha256_cbor`).
    #[serde(rename = "sha256_cbor")]
    Sha256Cbor,
    /// XXH3-128 over canonical CBOR (vLLM `xxhash_cbor`).
    #[serde(rename = "xxhash_cbor")]
    XxhashCbor,
}

impl HashAlgo {
    /// The name vLLM uses on its command line.
    pub fn as_str(self) -> &'static str {
        match self {
            HashAlgo::Sha256Cbor => "sha256_cbor",
            HashAlgo::XxhashCbor => "xxhash_cbor",
        }
    }

    /// Whether vLLM treats the algorithm as collision resistant. Only those get the fixed
    /// default seed; the others get a random per-process NONE_HASH unless `PYTHONHASHSEED` is set.
    pub fn is_cryptographic(self) -> bool {
        matches!(self, HashAlgo::Sha256Cbor)
    }

    /// Whether an engine started without `PYTHONHASHSEED` has reproducible hashes.
    pub fn default_seed_is_reproducible(self) -> bool {
        self.is_cryptographic()
    }

    /// Digest length in bytes.
    pub fn digest_len(self) -> usize {
        match self {
            HashAlgo::Sha256Cbor => 32,
            HashAlgo::XxhashCbor => 16,
        }
    }
}

impl fmt::Display for HashAlgo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a hash algorithm name was refused.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum HashAlgoError {
    #[error(
        "hash algorithm `{0}` hashes Python pickle output, which is not portable across processes; \
         kvmesh supports sha256_cbor and xxhash_cbor (start vLLM with --prefix-caching-hash-algo sha256_cbor)"
    )]
    PickleUnsupported(String),
    #[error("unknown hash algorithm `{0}` (supported: sha256_cbor, xxhash_cbor)")]
    Unknown(String),
}

impl FromStr for HashAlgo {
    type Err = HashAlgoError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "sha256_cbor" => Ok(HashAlgo::Sha256Cbor),
            "xxhash_cbor" => Ok(HashAlgo::XxhashCbor),
            "sha256" | "xxhash" | "builtin" => Err(HashAlgoError::PickleUnsupported(s.to_owned())),
            other => Err(HashAlgoError::Unknown(other.to_owned())),
        }
    }
}

/// A full block digest (32 bytes for SHA-256, 16 for XXH3-128).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockDigest {
    bytes: [u8; 32],
    len: u8,
}

impl BlockDigest {
    /// Builds a digest from raw bytes (at most 32; longer input keeps the last 32 bytes).
    pub fn from_bytes(raw: &[u8]) -> Self {
        let tail = &raw[raw.len().saturating_sub(32)..];
        let mut bytes = [0u8; 32];
        bytes[..tail.len()].copy_from_slice(tail);
        Self {
            bytes,
            len: tail.len() as u8,
        }
    }

    /// The digest bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }

    /// The value vLLM publishes in KV events: the last 8 bytes, big-endian.
    pub fn event_hash(&self) -> BlockHash {
        BlockHash(event_hash_from_bytes(self.as_bytes()))
    }

    /// Parses a hex digest (16 or 32 bytes, as the two supported algorithms produce).
    pub fn from_hex(s: &str) -> Result<Self, DigestParseError> {
        let raw = hex::decode(s.trim()).map_err(|e| DigestParseError(e.to_string()))?;
        if raw.len() != 16 && raw.len() != 32 {
            return Err(DigestParseError(format!(
                "expected 16 or 32 bytes, got {}",
                raw.len()
            )));
        }
        Ok(Self::from_bytes(&raw))
    }

    /// Lower-case hex of the full digest.
    pub fn to_hex(&self) -> String {
        hex::encode(self.as_bytes())
    }
}

impl fmt::Debug for BlockDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockDigest({})", self.to_hex())
    }
}

/// Last 8 bytes of `raw` read big-endian (shorter input is left-padded with zeros), as vLLM does
/// when `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` turns digests into integers.
pub fn event_hash_from_bytes(raw: &[u8]) -> u64 {
    let tail = &raw[raw.len().saturating_sub(8)..];
    tail.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b))
}

/// A hex digest that could not be parsed.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("invalid digest hex: {0}")]
pub struct DigestParseError(String);

/// A LoRA adapter as vLLM names it in block hashes: `--lora-modules name=path`.
///
/// The path is part of the hash, so re-pointing a name at another adapter gives other digests.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraAdapter {
    pub name: String,
    pub path: String,
}

/// What besides tokens keys a request's blocks: its LoRA adapter and its `cache_salt`.
///
/// The default (no adapter, no salt) is the base model's shared key space.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct TenantKeys {
    pub lora: Option<LoraAdapter>,
    /// Only a non-empty salt counts: vLLM adds the salt key only when the salt is truthy, and its
    /// OpenAI server refuses an empty one, so `""` is the same as none.
    pub cache_salt: Option<String>,
}

impl TenantKeys {
    /// The key space of a base-model request with `cache_salt` (no adapter).
    pub fn salted(cache_salt: Option<&str>) -> Self {
        TenantKeys {
            lora: None,
            cache_salt: cache_salt.map(str::to_owned),
        }
    }

    /// No adapter, no salt: the shared key space.
    pub fn is_shared(&self) -> bool {
        self.lora.is_none() && self.salt().is_none()
    }

    /// The salt if it is non-empty.
    pub fn salt(&self) -> Option<&str> {
        self.cache_salt.as_deref().filter(|s| !s.is_empty())
    }

    /// Where this tenant's router chain starts (see [`crate::chain::ChainKey::tenant_root`]).
    pub fn chain_root(&self) -> crate::chain::ChainKey {
        crate::chain::ChainKey::tenant_root(
            self.lora.as_ref().map(|l| l.name.as_str()),
            self.salt(),
        )
    }

    /// Writes block `index`'s extra keys (vLLM's tuple of tuples, or null) as canonical CBOR.
    fn encode_block<W: minicbor::encode::Write>(
        &self,
        enc: &mut minicbor::Encoder<W>,
        index: usize,
    ) -> Result<(), minicbor::encode::Error<W::Error>> {
        // Order matters and follows vLLM: LoRA keys, then the salt (block 0 only).
        let salt = if index == 0 { self.salt() } else { None };
        let n = u64::from(self.lora.is_some()) + u64::from(salt.is_some());
        if n == 0 {
            enc.null()?;
            return Ok(());
        }
        enc.array(n)?;
        if let Some(l) = &self.lora {
            enc.array(3)?.str("lora")?.str(&l.name)?.str(&l.path)?;
        }
        if let Some(s) = salt {
            enc.array(2)?.str("cache_salt")?.str(s)?;
        }
        Ok(())
    }
}

/// Computes chained block digests for one algorithm, seed and block size.
///
/// Holds a reusable CBOR buffer so hashing a prompt allocates only the output vector.
#[derive(Clone)]
pub struct BlockHasher {
    algo: HashAlgo,
    block_size: usize,
    none_hash: BlockDigest,
    buf: Vec<u8>,
}

impl fmt::Debug for BlockHasher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockHasher")
            .field("algo", &self.algo)
            .field("block_size", &self.block_size)
            .field("none_hash", &self.none_hash)
            .finish()
    }
}

impl BlockHasher {
    /// `seed` is the `PYTHONHASHSEED` string if the engine sets one; `None` means
    /// [`DEFAULT_NONE_HASH_SEED`] — vLLM's default for `sha256_cbor`. (For `xxhash_cbor` vLLM's
    /// default is random per process; `None` then gives kvmesh's own deterministic choice, which
    /// matches kvmesh engines but no unseeded vLLM — see [`DEFAULT_NONE_HASH_SEED`].)
    pub fn new(algo: HashAlgo, seed: Option<&str>, block_size: usize) -> Self {
        let seed = seed.unwrap_or(DEFAULT_NONE_HASH_SEED);
        Self::with_none_hash(algo, none_hash_for_seed(algo, seed), block_size)
    }

    /// A hasher chaining from a known NONE_HASH, e.g. one recorded from an engine whose seed is
    /// random (vLLM `xxhash_cbor` without `PYTHONHASHSEED`) or advertised in a fingerprint.
    pub fn with_none_hash(algo: HashAlgo, none_hash: BlockDigest, block_size: usize) -> Self {
        let buf = Vec::with_capacity(64 + block_size * 5);
        Self {
            algo,
            block_size,
            none_hash,
            buf,
        }
    }

    pub fn algo(&self) -> HashAlgo {
        self.algo
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// NONE_HASH: the parent digest of the first block.
    pub fn none_hash(&self) -> BlockDigest {
        self.none_hash
    }

    /// Digest of one block given its parent's full digest and its tokens (no extra keys).
    pub fn hash_block(&mut self, parent: &BlockDigest, tokens: &[TokenId]) -> BlockDigest {
        self.hash_block_with(parent, tokens, &TenantKeys::default(), 0)
    }

    /// Digest of block `index` of a request keyed by `tenant` (its extra keys depend on the
    /// block's position: the salt is hashed into block 0 only).
    pub fn hash_block_with(
        &mut self,
        parent: &BlockDigest,
        tokens: &[TokenId],
        tenant: &TenantKeys,
        index: usize,
    ) -> BlockDigest {
        self.buf.clear();
        let mut enc = minicbor::Encoder::new(&mut self.buf);
        // Writing into a Vec never fails; ignore the infallible Result.
        let _ = enc
            .array(3)
            .and_then(|e| e.bytes(parent.as_bytes()))
            .and_then(|e| e.array(tokens.len() as u64));
        for &t in tokens {
            let _ = enc.u32(t);
        }
        let _ = tenant.encode_block(&mut enc, index);
        digest(self.algo, &self.buf)
    }

    /// Digests of every full block of `tokens`, chained from NONE_HASH.
    pub fn hash_prompt(&mut self, tokens: &[TokenId]) -> Vec<BlockDigest> {
        self.hash_prompt_from(&self.none_hash.clone(), tokens)
    }

    /// Digests of every full block of `tokens`, chained from `parent`.
    pub fn hash_prompt_from(
        &mut self,
        parent: &BlockDigest,
        tokens: &[TokenId],
    ) -> Vec<BlockDigest> {
        self.hash_blocks_from(parent, tokens, &TenantKeys::default(), 0)
    }

    /// Digests of every full block of a prompt keyed by `tenant`, chained from NONE_HASH.
    pub fn hash_prompt_with(
        &mut self,
        tokens: &[TokenId],
        tenant: &TenantKeys,
    ) -> Vec<BlockDigest> {
        self.hash_blocks_from(&self.none_hash.clone(), tokens, tenant, 0)
    }

    /// Digests of the full blocks of `tokens`, the first being block `first_index` of a request
    /// keyed by `tenant`, chained from `parent` (the digest of block `first_index - 1`, or
    /// NONE_HASH for 0).
    pub fn hash_blocks_from(
        &mut self,
        parent: &BlockDigest,
        tokens: &[TokenId],
        tenant: &TenantKeys,
        first_index: usize,
    ) -> Vec<BlockDigest> {
        if self.block_size == 0 {
            return Vec::new();
        }
        let mut out = Vec::with_capacity(tokens.len() / self.block_size);
        let mut parent = *parent;
        for (i, block) in tokens.chunks_exact(self.block_size).enumerate() {
            parent = self.hash_block_with(&parent, block, tenant, first_index + i);
            out.push(parent);
        }
        out
    }
}

/// NONE_HASH as vLLM derives it from a seed string: `H(cbor(seed))`.
pub fn none_hash_for_seed(algo: HashAlgo, seed: &str) -> BlockDigest {
    let mut buf = Vec::with_capacity(seed.len() + 9);
    // A CBOR text string header followed by the utf-8 bytes; encoding into a Vec cannot fail.
    let mut enc = minicbor::Encoder::new(&mut buf);
    let _ = enc.str(seed);
    digest(algo, &buf)
}

fn digest(algo: HashAlgo, data: &[u8]) -> BlockDigest {
    match algo {
        HashAlgo::Sha256Cbor => BlockDigest::from_bytes(&Sha256::digest(data)),
        HashAlgo::XxhashCbor => {
            BlockDigest::from_bytes(&xxhash_rust::xxh3::xxh3_128(data).to_be_bytes())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pickle_algorithms_are_refused_with_a_reason() {
        let err = "sha256".parse::<HashAlgo>().unwrap_err();
        assert!(err.to_string().contains("pickle"));
    }

    #[test]
    fn digest_hex_round_trips_and_rejects_bad_lengths() {
        let d = none_hash_for_seed(HashAlgo::XxhashCbor, "0");
        assert_eq!(d.as_bytes().len(), 16);
        assert_eq!(BlockDigest::from_hex(&d.to_hex()), Ok(d));
        assert!(BlockDigest::from_hex("abcd").is_err());
        assert!(BlockDigest::from_hex("zz").is_err());
    }

    #[test]
    fn with_none_hash_chains_like_new() {
        let mut a = BlockHasher::new(HashAlgo::Sha256Cbor, Some("7"), 4);
        let mut b = BlockHasher::with_none_hash(HashAlgo::Sha256Cbor, a.none_hash(), 4);
        let toks: Vec<u32> = (0..12).collect();
        assert_eq!(a.hash_prompt(&toks), b.hash_prompt(&toks));
        assert!(!HashAlgo::XxhashCbor.default_seed_is_reproducible());
        assert!(HashAlgo::Sha256Cbor.default_seed_is_reproducible());
    }

    fn tenant(lora: Option<(&str, &str)>, salt: Option<&str>) -> TenantKeys {
        TenantKeys {
            lora: lora.map(|(name, path)| LoraAdapter {
                name: name.into(),
                path: path.into(),
            }),
            cache_salt: salt.map(Into::into),
        }
    }

    #[test]
    fn salt_and_lora_path_change_every_block() {
        let mut h = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0"), 4);
        let toks: Vec<u32> = (0..16).collect();
        let plain = h.hash_prompt(&toks);
        assert_eq!(h.hash_prompt_with(&toks, &TenantKeys::default()), plain);
        // An empty salt is no salt, as in vLLM.
        assert_eq!(h.hash_prompt_with(&toks, &tenant(None, Some(""))), plain);
        let a = h.hash_prompt_with(&toks, &tenant(None, Some("a")));
        let b = h.hash_prompt_with(&toks, &tenant(None, Some("b")));
        let l1 = h.hash_prompt_with(&toks, &tenant(Some(("x", "/p1")), None));
        let l2 = h.hash_prompt_with(&toks, &tenant(Some(("x", "/p2")), None));
        for i in 0..plain.len() {
            let all = [plain[i], a[i], b[i], l1[i], l2[i]];
            for (j, x) in all.iter().enumerate() {
                for y in &all[j + 1..] {
                    assert_ne!(x, y, "block {i}");
                }
            }
        }
        // Resuming mid-prompt from a salted parent continues the salted chain.
        let tail = h.hash_blocks_from(&a[1], &toks[8..], &tenant(None, Some("a")), 2);
        assert_eq!(tail, a[2..]);
    }

    #[test]
    fn event_hash_is_last_eight_bytes_big_endian() {
        let raw: Vec<u8> = (0u8..32).collect();
        assert_eq!(event_hash_from_bytes(&raw), 0x18191a1b1c1d1e1f);
    }
}
