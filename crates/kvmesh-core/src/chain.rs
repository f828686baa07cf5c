//! The router's own block keys: a fast chained hash over token ids.
//!
//! The router keys blocks by `ChainKey`, computed from the token ids carried in `BlockStored`
//! events, so it never depends on an engine's hash algorithm or seed. The key of block `i` is
//! `xxh3_64_with_seed(le_bytes(tokens of block i), seed = key of block i-1)`, starting from
//! [`ChainKey::ROOT`]. Collision properties: a 64-bit hash, so among `n` distinct blocks the chance
//! of any collision is about `n² / 2^65` (≈ 3·10⁻⁶ at 10 M blocks); a collision can at worst make
//! the router over-estimate one endpoint's prefix, which the engine then finds is a miss and
//! computes — it can never corrupt KV.
//!
//! Tenants and adapters: vLLM mixes a request's LoRA adapter (every block) and `cache_salt`
//! (block 0, then the parent chain) into its block hashes, so blocks of different tenants or
//! adapters never match. The router mirrors that by starting such a request's chain from
//! [`ChainKey::tenant_root`] instead of [`ChainKey::ROOT`]: every key of the chain then differs,
//! just as every vLLM digest does. The root covers the adapter *name* and the salt, the two things
//! KV events carry (vLLM publishes the adapter name, not its path), so the index can put an
//! event's blocks in the same key space from the event alone.

use crate::TokenId;

/// A router-side chained block key.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct ChainKey(pub u64);

impl ChainKey {
    /// The parent of the first block.
    pub const ROOT: ChainKey = ChainKey(0x6b76_6d65_7368_0001);

    /// The parent of block 0 for a request with LoRA adapter `lora_name` and `cache_salt` `salt`;
    /// [`ChainKey::ROOT`] when it has neither (an empty salt is none, as in vLLM).
    pub fn tenant_root(lora_name: Option<&str>, salt: Option<&str>) -> ChainKey {
        let salt = salt.filter(|s| !s.is_empty());
        if lora_name.is_none() && salt.is_none() {
            return ChainKey::ROOT;
        }
        // Tagged, length-prefixed fields so that no (name, salt) pair encodes like another.
        let mut buf =
            Vec::with_capacity(16 + lora_name.map_or(0, str::len) + salt.map_or(0, str::len));
        for (tag, field) in [(b'l', lora_name), (b's', salt)] {
            if let Some(f) = field {
                buf.push(tag);
                buf.extend_from_slice(&(f.len() as u64).to_le_bytes());
                buf.extend_from_slice(f.as_bytes());
            }
        }
        ChainKey(xxhash_rust::xxh3::xxh3_64_with_seed(&buf, Self::ROOT.0))
    }

    /// Key of the block with tokens `tokens` whose parent has key `self`.
    pub fn child(self, tokens: &[TokenId]) -> ChainKey {
        let mut buf = [0u8; 4 * 64];
        if tokens.len() <= 64 {
            for (i, t) in tokens.iter().enumerate() {
                buf[i * 4..i * 4 + 4].copy_from_slice(&t.to_le_bytes());
            }
            ChainKey(xxhash_rust::xxh3::xxh3_64_with_seed(
                &buf[..tokens.len() * 4],
                self.0,
            ))
        } else {
            let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
            ChainKey(xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, self.0))
        }
    }
}

/// Keys of every full `block_size` block of `tokens`, chained from [`ChainKey::ROOT`].
pub fn chain_keys(tokens: &[TokenId], block_size: usize) -> Vec<ChainKey> {
    chain_keys_from(ChainKey::ROOT, tokens, block_size)
}

/// Keys of every full `block_size` block of `tokens`, chained from `root` (see
/// [`ChainKey::tenant_root`]).
pub fn chain_keys_from(root: ChainKey, tokens: &[TokenId], block_size: usize) -> Vec<ChainKey> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    let mut key = root;
    for block in tokens.chunks_exact(block_size) {
        key = key.child(block);
        out.push(key);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_prefixes_give_equal_keys_and_diverge_after() {
        let a: Vec<u32> = (0..64).collect();
        let mut b = a.clone();
        b[40] = 9999;
        let ka = chain_keys(&a, 16);
        let kb = chain_keys(&b, 16);
        assert_eq!(ka[..2], kb[..2]);
        assert_ne!(ka[2], kb[2]);
        assert_ne!(ka[3], kb[3]);
    }

    #[test]
    fn tenants_and_adapters_get_disjoint_chains() {
        let t: Vec<u32> = (0..64).collect();
        assert_eq!(ChainKey::tenant_root(None, None), ChainKey::ROOT);
        assert_eq!(ChainKey::tenant_root(None, Some("")), ChainKey::ROOT);
        let roots = [
            ChainKey::ROOT,
            ChainKey::tenant_root(None, Some("a")),
            ChainKey::tenant_root(None, Some("b")),
            ChainKey::tenant_root(Some("a"), None),
            ChainKey::tenant_root(Some("a"), Some("a")),
            ChainKey::tenant_root(Some("x"), Some("a")),
        ];
        let chains: Vec<_> = roots.iter().map(|r| chain_keys_from(*r, &t, 16)).collect();
        for (i, a) in chains.iter().enumerate() {
            for b in &chains[i + 1..] {
                for (x, y) in a.iter().zip(b) {
                    assert_ne!(x, y);
                }
            }
        }
    }

    #[test]
    fn long_blocks_hash_like_short_ones() {
        let tokens: Vec<u32> = (0..256).collect();
        let keys = chain_keys(&tokens, 128);
        assert_eq!(keys.len(), 2);
        assert_ne!(keys[0], keys[1]);
    }
}
