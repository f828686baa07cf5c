//! kvmesh's scheduling core, free of transport: given what the router knows about a request and
//! each endpoint, decide where it runs and from which peer it pulls its prefix.
//!
//! Layers, each a plain data structure with unit tests (the invariants are in `README.md`):
//! [`candidate`] (inputs) → [`plugin`] (the filter / scorer / picker traits) → [`plugins`] (one
//! plugin per file, and the factory from config) → [`scheduler`] (profiles run the pipeline into a
//! [`scheduler::Decision`]) → [`decisions`] (the bounded log `/debug/decisions` shows).
//! [`cost_model`] and [`predict`] price recompute against pulls, discounted by each source's
//! [`reputation`]; [`admission_queue`] orders requests
//! held for admission; [`config`] holds the YAML shapes of all of it.
//!
//! Nothing here does I/O, reads a clock (times are arguments) or draws randomness it was not
//! given. The router (`kvmesh-router`) wraps it with HTTP, forwarding, event feeds and scraping.

pub mod admission_queue;
pub mod candidate;
pub mod config;
pub mod cost_model;
pub mod decisions;
pub mod plugin;
pub mod plugins;
pub mod predict;
pub mod reputation;
pub mod scheduler;

pub use candidate::{Backlog, Candidate, SchedulingContext};
pub use scheduler::{Decision, Profile, Scheduler};
