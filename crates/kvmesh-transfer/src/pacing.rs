//! Seams for a *modelled* link: a time-modelled engine (the `sim` backend) paces what its
//! producer serves and what its consumer receives by a model of its node's link, because loopback
//! moves the scaled-down payloads far faster than the modelled hardware would move the real KV.
//! Real deployments set no pacer: the wire is the truth.
//!
//! The transfer crate knows blocks, not the model: a [`LinkPacer`] turns a number of blocks into
//! modelled bytes and a wait. The engine implements it (`kvmesh_engine::link_pacer`).
//!
//! Each transfer has a [`TrafficClass`]: on-demand work (a request waits for the blocks) or
//! background work (a prefetch nobody waits for yet), which a modelled link serves only while no
//! demand transfer moves bytes, so a prefetch never delays a request's pull. A background
//! transfer a request starts waiting for is promoted ([`PacedTransfer::promote`]).

use futures::future::BoxFuture;

/// Blocks released per pacing step of a fetch (the default of [`LinkPacer::chunk_blocks`]).
/// Pacing the whole fetch up front would hold the first block back for the whole modelled
/// transfer: under heavy fan-out on one holder (each fetch getting 1/N of the link) that can
/// exceed the consumer's per-block step timeout, which would then read a slow link as a dead
/// peer. Released chunk by chunk, the gap between two block frames is one chunk's modelled time
/// (64 blocks of 16 gpt-oss tokens = 75 MB, ~4 ms alone on the default link), while the consumer
/// still sees the fetch end when the link says.
pub const PACE_CHUNK_BLOCKS: usize = 64;

/// Who waits for a transfer, which decides its priority on a modelled link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TrafficClass {
    /// A request waits for these blocks (the default: a peer that says nothing means demand).
    #[default]
    Demand,
    /// Nobody waits yet (a prefetch): it gets the link only while no demand transfer moves bytes.
    Background,
}

/// A node's modelled link, as the producer and the consumer see it.
pub trait LinkPacer: Send + Sync + std::fmt::Debug {
    /// Registers a transfer of `blocks` blocks of `class` on the link, starting now. Dropping the
    /// returned transfer deregisters it (finished or cancelled). A pacer without priorities (a
    /// plain bandwidth cap) may ignore the class.
    fn begin(&self, blocks: usize, class: TrafficClass) -> Box<dyn PacedTransfer>;
    /// Modelled bytes of one block (the real model's KV, not the wire payload): counted in
    /// `kvmesh_p2p_modelled_bytes_total`.
    fn modelled_bytes_per_block(&self) -> u64;
    /// Blocks a producer releases per pacing step ([`PacedTransfer::reached`] is awaited every
    /// this many blocks). The default, [`PACE_CHUNK_BLOCKS`], suits a fast
    /// modelled link; a slow link (a bandwidth cap) paces block by block, so that no block
    /// waits for a whole chunk's time.
    fn chunk_blocks(&self) -> usize {
        PACE_CHUNK_BLOCKS
    }
}

/// One registered transfer.
pub trait PacedTransfer: Send {
    /// Resolves once the first `blocks` blocks have crossed the modelled link (at once if they
    /// already have). Cancel safe.
    fn reached(&mut self, blocks: usize) -> BoxFuture<'_, ()>;
    /// Shrinks the transfer to `blocks` (fewer arrived or will be sent than were registered).
    fn truncate(&mut self, blocks: usize);
    /// Makes a background transfer a demand one from now on, for what is left of it (a request
    /// now waits for its blocks). No-op for a demand transfer or a pacer without priorities.
    fn promote(&mut self) {}
}
