//! Workloads, trace replay, fleet launcher, statistics and reports for kvmesh experiments
//! (`docs/architecture.md#reference-experiments`): the library behind `kvmesh up`, `kvmesh bench`, `kvmesh calibrate` and
//! `kvmesh demo`.
//!
//! Layers: [`tokens`] and [`workload`]/[`trace`] are pure (seeded data), named in [`catalog`]; [`stats`], [`paired`], [`metrics`],
//! [`router_config`], [`repeat`] and [`report`] (of [`arm_result`]s) are pure transformations; [`client`], [`driver`], [`fleet`],
//! [`peers`] (external routers as arms), [`runner`] and [`calibrate`] do the I/O, sharing
//! [`launch`]'s vocabulary.

pub mod agentic;
pub mod arm_result;
pub mod audit;
pub mod bound;
pub mod calibrate;
pub mod catalog;
pub mod client;
pub mod driver;
pub mod fleet;
pub mod hot_prefix;
pub mod launch;
pub mod metrics;
pub mod paired;
pub mod peers;
pub mod repeat;
pub mod report;
pub mod restart;
pub mod router_config;
pub mod runner;
pub mod scale_out;
pub mod stats;
pub mod tokens;
pub mod trace;
pub mod waves;
pub mod workload;

pub use fleet::{Fleet, FleetSpec};
pub use report::{ArmResult, BenchReport};
pub use router_config::Arm;
pub use workload::{Scale, Workload};
