//! Seams for a *modelled* link: a time-modelled engine (the `sim` backend) paces what its
//! producer serves and what its consumer receives by a model of its node's link, because loopback
//! moves the scaled-down payloads far faster than the modelled hardware would move the real KV.
//! Real deployments set no pacer: the wire is the truth.
//!
//! The transfer crate knows blocks, not the model: a [`LinkPacer`] turns a number of blocks into
//! modelled bytes and a wait. The engine implements it (`kvmesh_engine::link_pacer`).

use futures::future::BoxFuture;

/// A node's modelled link, as the producer and the consumer see it.
pub trait LinkPacer: Send + Sync + std::fmt::Debug {
    /// Registers a transfer of `blocks` blocks on the link, starting now. Dropping the returned
    /// transfer deregisters it (finished or cancelled).
    fn begin(&self, blocks: usize) -> Box<dyn PacedTransfer>;
    /// Modelled bytes of one block (the real model's KV, not the wire payload): counted in
    /// `kvmesh_p2p_modelled_bytes_total`.
    fn modelled_bytes_per_block(&self) -> u64;
    /// Blocks a producer releases per pacing step ([`PacedTransfer::reached`] is awaited every
    /// this many blocks). The default, [`crate::server::PACE_CHUNK_BLOCKS`], suits a fast
    /// modelled link; a slow link (a bandwidth cap) paces block by block, so that no block
    /// waits for a whole chunk's time.
    fn chunk_blocks(&self) -> usize {
        crate::server::PACE_CHUNK_BLOCKS
    }
}

/// One registered transfer.
pub trait PacedTransfer: Send {
    /// Resolves once the first `blocks` blocks have crossed the modelled link (at once if they
    /// already have). Cancel safe.
    fn reached(&mut self, blocks: usize) -> BoxFuture<'_, ()>;
    /// Shrinks the transfer to `blocks` (fewer arrived or will be sent than were registered).
    fn truncate(&mut self, blocks: usize);
}
