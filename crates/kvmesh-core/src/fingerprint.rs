//! The peer fingerprint: what two engines must agree on before one may pull KV from the other.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::hashing::HashAlgo;

/// Everything that makes KV bytes of one engine meaningful to another. Compared field by field
/// at P2P connect time; any difference refuses the peer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fingerprint {
    /// Served model identity (name or content hash of the weights).
    pub model_id: String,
    /// KV element type, e.g. `"f32"`, `"bf16"`, or `"sim"` for the GPU-profile backend.
    pub kv_dtype: String,
    pub block_size: u32,
    pub num_layers: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    pub hash_algo: HashAlgo,
    /// Hex of NONE_HASH, which captures the hash seed.
    pub none_hash: String,
}

/// The first field in which two fingerprints differ.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("fingerprint mismatch on `{field}`: ours {ours}, theirs {theirs}")]
pub struct FingerprintMismatch {
    pub field: &'static str,
    pub ours: String,
    pub theirs: String,
}

impl Fingerprint {
    /// The first differing field, in declaration order, or `Ok(())` when compatible.
    pub fn check_compatible(&self, theirs: &Fingerprint) -> Result<(), FingerprintMismatch> {
        fn cmp<T: PartialEq + fmt::Display>(
            field: &'static str,
            ours: &T,
            theirs: &T,
        ) -> Result<(), FingerprintMismatch> {
            if ours == theirs {
                Ok(())
            } else {
                Err(FingerprintMismatch {
                    field,
                    ours: ours.to_string(),
                    theirs: theirs.to_string(),
                })
            }
        }
        cmp("model_id", &self.model_id, &theirs.model_id)?;
        cmp("kv_dtype", &self.kv_dtype, &theirs.kv_dtype)?;
        cmp("block_size", &self.block_size, &theirs.block_size)?;
        cmp("num_layers", &self.num_layers, &theirs.num_layers)?;
        cmp("num_kv_heads", &self.num_kv_heads, &theirs.num_kv_heads)?;
        cmp("head_dim", &self.head_dim, &theirs.head_dim)?;
        cmp("hash_algo", &self.hash_algo, &theirs.hash_algo)?;
        cmp("none_hash", &self.none_hash, &theirs.none_hash)?;
        Ok(())
    }
}
