//! The CPU block tier's store, shared by the kvmesh engine (`kvmesh_engine::cpu_tier::CpuTier`)
//! and the vLLM connector's native module (`kvmesh_py::tier::NodeTier`): whole KV blocks as
//! opaque bytes keyed by block hash, under a byte budget, LRU eviction, counted pins with leases.
//!
//! [`CpuStore`] is a plain data structure: no I/O, no lock, no clock (every call whose answer
//! depends on time takes `now`), O(log n) bookkeeping per block. Its users wrap it behind one
//! mutex and add what is theirs (KV events, the pending registry, a `BlockSource`). The rules it
//! keeps are in this crate's README; `tests/differential.rs` checks them against a naive
//! reference model.

mod store;

pub use store::{
    Block, CpuStore, CpuTierStats, DEFAULT_PULL_PIN_FRACTION, Inserted, Landed, PinKind,
};
