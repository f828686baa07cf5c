//! The compute loop: scheduler + block pool + CPU tier + backend, on one dedicated std thread.
//!
//! - [`types`]: what goes in and out (requests, outputs, finish accounting, the loop's commands);
//! - [`handle`]: [`EngineHandle`] (what HTTP handlers hold), [`SeqStream`], [`build_engine`];
//! - [`compute_loop`]: the loop itself, which owns the pool, the arena and the backend.
//!
//! HTTP handlers hold an [`EngineHandle`]; [`EngineHandle::submit`] sends the request to the loop
//! and returns a stream of [`SeqOutput`]. Dropping that stream (client disconnect) aborts the
//! request and frees its blocks.
//!
//! Scheduling (vLLM v1 style, one step at a time):
//! 1. running sequences first, in order, each taking up to its remaining tokens from the step's
//!    token budget (`max_num_batched_tokens`); when blocks run out the *last* running sequence is
//!    preempted (blocks freed, state reset, back to the *front* of the queue — delayed, never
//!    dropped; its computed full blocks stay cached, so resuming is mostly prefix hits);
//! 2. then waiting sequences FCFS while budget and `max_num_seqs` allow; on first scheduling a
//!    sequence takes its prefix hit (GPU tier, then restore from the CPU tier) and prompts longer
//!    than the budget are prefilled in chunks over several steps.
//!
//! After the backend step, newly full blocks get their hash, are published (`BlockStored` GPU)
//! and offloaded to the CPU tier (`BlockStored` CPU). Evictions publish `BlockRemoved` before the
//! block is reused.

mod compute_loop;
mod copy_engine;
mod handle;
mod types;

#[cfg(test)]
mod tests;

pub use handle::{Engine, EngineHandle, SeqStream, build_engine};
pub use types::{
    EngineRequest, FinishInfo, FinishReason, RestoreReport, SeqOutput, SharedCounters, SubmitError,
};
