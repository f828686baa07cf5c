//! The peer fingerprint: what two engines must agree on before one may pull KV from the other.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::hashing::{BlockHasher, HashAlgo};

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

/// Version tag of [`Fingerprint::encode`]; bumped on any layout change.
pub const FINGERPRINT_ENCODING_VERSION: u8 = 1;

/// Why a fingerprint encoding was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid fingerprint encoding: {0}")]
pub struct FingerprintDecodeError(String);

impl Fingerprint {
    /// A fingerprint whose hash algorithm and NONE_HASH come from the engine's hasher.
    pub fn new(
        model_id: impl Into<String>,
        kv_dtype: impl Into<String>,
        num_layers: u32,
        num_kv_heads: u32,
        head_dim: u32,
        hasher: &BlockHasher,
    ) -> Self {
        Fingerprint {
            model_id: model_id.into(),
            kv_dtype: kv_dtype.into(),
            block_size: u32::try_from(hasher.block_size()).unwrap_or(u32::MAX),
            num_layers,
            num_kv_heads,
            head_dim,
            hash_algo: hasher.algo(),
            none_hash: hasher.none_hash().to_hex(),
        }
    }

    /// Stable binary form: a msgpack array
    /// `[version, model_id, kv_dtype, block_size, num_layers, num_kv_heads, head_dim, hash_algo,
    /// none_hash]` (strings and minimal unsigned integers). Identical fingerprints always encode to
    /// identical bytes, so the encoding can itself be hashed or compared.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.model_id.len() + self.none_hash.len());
        // Writing into a Vec cannot fail; the Results only carry the writer's I/O errors.
        let _ = rmp::encode::write_array_len(&mut out, 9);
        let _ = rmp::encode::write_uint(&mut out, u64::from(FINGERPRINT_ENCODING_VERSION));
        let _ = rmp::encode::write_str(&mut out, &self.model_id);
        let _ = rmp::encode::write_str(&mut out, &self.kv_dtype);
        for v in [
            self.block_size,
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
        ] {
            let _ = rmp::encode::write_uint(&mut out, u64::from(v));
        }
        let _ = rmp::encode::write_str(&mut out, self.hash_algo.as_str());
        let _ = rmp::encode::write_str(&mut out, &self.none_hash);
        out
    }

    /// A short stable name of the fingerprint: the first 16 hex digits of SHA-256 over
    /// [`Fingerprint::encode`]. Engines and the vLLM connector export it
    /// (`kvmesh_p2p_fingerprint_info{fingerprint}`), so a router can tell which endpoints can
    /// use each other's blocks without asking anyone to configure it.
    pub fn id(&self) -> String {
        use sha2::{Digest, Sha256};
        let digest = Sha256::digest(self.encode());
        hex::encode(&digest[..8])
    }

    /// Parses [`Fingerprint::encode`]'s output; trailing bytes and unknown versions are refused.
    pub fn decode(bytes: &[u8]) -> Result<Fingerprint, FingerprintDecodeError> {
        let err = |m: &str| FingerprintDecodeError(m.to_owned());
        let mut rd = bytes;
        let n = rmp::decode::read_array_len(&mut rd).map_err(|_| err("expected an array"))?;
        if n != 9 {
            return Err(FingerprintDecodeError(format!(
                "expected 9 fields, got {n}"
            )));
        }
        let version: u8 = rmp::decode::read_int(&mut rd).map_err(|_| err("version"))?;
        if version != FINGERPRINT_ENCODING_VERSION {
            return Err(FingerprintDecodeError(format!(
                "unsupported version {version}"
            )));
        }
        fn text<'a>(rd: &mut &'a [u8], field: &str) -> Result<&'a str, FingerprintDecodeError> {
            let (s, rest) = rmp::decode::read_str_from_slice(*rd)
                .map_err(|_| FingerprintDecodeError(format!("{field}: expected a string")))?;
            *rd = rest;
            Ok(s)
        }
        fn num(rd: &mut &[u8], field: &str) -> Result<u32, FingerprintDecodeError> {
            rmp::decode::read_int(rd)
                .map_err(|_| FingerprintDecodeError(format!("{field}: expected a u32")))
        }
        let model_id = text(&mut rd, "model_id")?.to_owned();
        let kv_dtype = text(&mut rd, "kv_dtype")?.to_owned();
        let block_size = num(&mut rd, "block_size")?;
        let num_layers = num(&mut rd, "num_layers")?;
        let num_kv_heads = num(&mut rd, "num_kv_heads")?;
        let head_dim = num(&mut rd, "head_dim")?;
        let hash_algo = text(&mut rd, "hash_algo")?
            .parse::<HashAlgo>()
            .map_err(|e| FingerprintDecodeError(e.to_string()))?;
        let none_hash = text(&mut rd, "none_hash")?.to_owned();
        if !rd.is_empty() {
            return Err(FingerprintDecodeError(format!(
                "{} trailing bytes",
                rd.len()
            )));
        }
        Ok(Fingerprint {
            model_id,
            kv_dtype,
            block_size,
            num_layers,
            num_kv_heads,
            head_dim,
            hash_algo,
            none_hash,
        })
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn id_is_stable_and_changes_with_any_field() {
        let hasher = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0"), 32);
        let base = Fingerprint::new("tiny", "bf16:vllm-cpu:auto:0.32.0", 2, 2, 64, &hasher);
        assert_eq!(base.id(), base.clone().id());
        assert_eq!(base.id().len(), 16);
        let other_block = Fingerprint::new(
            "tiny",
            "bf16:vllm-cpu:auto:0.32.0",
            2,
            2,
            64,
            &BlockHasher::new(HashAlgo::Sha256Cbor, Some("0"), 16),
        );
        let other_seed = Fingerprint::new(
            "tiny",
            "bf16:vllm-cpu:auto:0.32.0",
            2,
            2,
            64,
            &BlockHasher::new(HashAlgo::Sha256Cbor, Some("1"), 32),
        );
        let other_layout = Fingerprint::new("tiny", "sim", 2, 2, 64, &hasher);
        for other in [other_block, other_seed, other_layout] {
            assert_ne!(base.id(), other.id(), "{other:?}");
        }
    }

    use super::*;

    fn fp() -> Fingerprint {
        let hasher = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0"), 32);
        Fingerprint::new("tiny-llama", "f32", 4, 2, 64, &hasher)
    }

    #[test]
    fn constructor_takes_algo_block_size_and_none_hash_from_the_hasher() {
        let f = fp();
        assert_eq!(f.block_size, 32);
        assert_eq!(f.hash_algo, HashAlgo::Sha256Cbor);
        // sha256_cbor NONE_HASH for PYTHONHASHSEED=0, as recorded from vLLM in golden2.json.
        assert_eq!(
            f.none_hash,
            "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
        );
    }

    #[test]
    fn encoding_round_trips_and_is_stable() {
        let f = fp();
        let bytes = f.encode();
        assert_eq!(Fingerprint::decode(&bytes).unwrap(), f);
        assert_eq!(bytes, fp().encode());
        // Layout pin: array of 9, version 1, then the model id.
        assert_eq!(&bytes[..3], &[0x99, 0x01, 0xaa]);
        assert_eq!(&bytes[3..13], b"tiny-llama");
    }

    #[test]
    fn decoding_refuses_garbage_without_panicking() {
        let good = fp().encode();
        assert!(Fingerprint::decode(&[]).is_err());
        assert!(Fingerprint::decode(&good[..good.len() - 1]).is_err());
        let mut trailing = good.clone();
        trailing.push(0);
        assert!(Fingerprint::decode(&trailing).is_err());
        let mut v2 = good.clone();
        v2[1] = 2;
        assert!(
            Fingerprint::decode(&v2)
                .unwrap_err()
                .to_string()
                .contains("version")
        );
        for i in 0..good.len() {
            let mut b = good.clone();
            b[i] ^= 0xff;
            let _ = Fingerprint::decode(&b);
        }
    }

    #[test]
    fn mismatch_names_the_first_differing_field() {
        let ours = fp();
        let mut theirs = fp();
        theirs.head_dim = 128;
        theirs.none_hash = "00".into();
        let e = ours.check_compatible(&theirs).unwrap_err();
        assert_eq!(e.field, "head_dim");
        assert_eq!((e.ours.as_str(), e.theirs.as_str()), ("64", "128"));
        assert!(ours.check_compatible(&fp()).is_ok());
    }
}
