//! The landing sink: each block a pull brings is checked (position and hash, size, and on a
//! backend whose payloads derive from the hash, the content) and lands in the CPU tier as an
//! ordinary cached block, announced with `BlockStored` (CPU), flagged external and pinned while
//! the `Pull` pins' share of the tier allows. The transport has checked the CRC before.

use std::time::Instant;

use bytes::Bytes;
use kvmesh_core::{BlockHash, TokenId};
use kvmesh_transfer::{BlockSink, SinkError};

use crate::compute::sim::verify_sim_block_payload;
use crate::cpu_tier::{CpuTier, Landed, OffloadBlock};

/// Lands the blocks `hashes[first..]` of `prompt` (whose full-block hashes are `hashes`).
pub(crate) struct TierSink<'a> {
    pub tier: &'a CpuTier,
    pub prompt: &'a [TokenId],
    /// The pulling request's salt (its hashes are in that key space; block 0's event names it).
    pub cache_salt: Option<&'a str>,
    pub hashes: &'a [BlockHash],
    pub first: usize,
    pub block_size: usize,
    pub bytes_per_block: usize,
    /// Sim payloads are a function of the hash: verify content, not just the transport CRC.
    pub verify_sim: bool,
    pub lease_until: Instant,
    /// Blocks newly stored, in order: they count as external hits.
    pub external: Vec<BlockHash>,
    /// Those of `external` that were also pinned (`Pull`).
    pub pinned: Vec<BlockHash>,
    /// Why the sink refused a block (the pull stops there), for the log and
    /// `kvmesh_engine_p2p_sink_rejected_total{reason}`.
    pub rejected: Option<&'static str>,
}

impl BlockSink for TierSink<'_> {
    fn accept(&mut self, index: usize, hash: BlockHash, payload: Bytes) -> Result<(), SinkError> {
        let mut reject = |reason: &'static str| {
            self.rejected = Some(reason);
            SinkError {
                index,
                reason: reason.to_owned(),
            }
        };
        let i = self.first + index;
        let (hashes, prompt, bs) = (self.hashes, self.prompt, self.block_size);
        if hashes.get(i) != Some(&hash) {
            return Err(reject("unexpected block hash"));
        }
        if payload.len() != self.bytes_per_block {
            return Err(reject("payload_size"));
        }
        if self.verify_sim && !verify_sim_block_payload(hash, &payload) {
            return Err(reject("sim_payload_mismatch"));
        }
        let Some(tokens) = prompt.get(i * bs..(i + 1) * bs) else {
            return Err(reject("beyond_prompt"));
        };
        let block = OffloadBlock {
            hash,
            parent: i.checked_sub(1).map(|p| hashes[p]),
            tokens: tokens.to_vec(),
            payload,
            cache_salt: self.cache_salt.filter(|_| i == 0).map(str::to_owned),
        };
        match self.tier.land(block, self.lease_until) {
            Landed::Pinned => {
                self.external.push(hash);
                self.pinned.push(hash);
            }
            // Pull pins hold their share of the tier; the block may be evicted before the
            // request is scheduled (then it is computed), but it does not stop the pull.
            Landed::Unpinned => self.external.push(hash),
            // Computed here meanwhile: a local hit, nothing to do.
            Landed::Present => {}
            Landed::Rejected => return Err(reject("cpu_tier_hard_pinned")),
        }
        Ok(())
    }
}
