//! kvmesh router: OpenAI gateway with KV-cache-aware scheduling and P2P source selection.
//!
//! The decisions themselves are made by `kvmesh-sched` (transport-free: plugins, profiles, cost
//! model, decision records); this crate gives them inputs and carries them out.
//!
//! A request's way through the files: [`app`] (HTTP surface, parse once) → [`route`] (aggregated)
//! or [`pd_route`] (prefill + decode legs, with [`conversations`]) → [`candidates`] (who may take
//! it, and what the scheduler is told) → `kvmesh_sched::Scheduler` → [`remote_source`] (the
//! decision's P2P source as `remote_kv_source`) → [`forward`] (engine request, one response tap
//! that releases [`load`] and feeds the cost model). Around it: [`config`] (YAML), [`state`]
//! (what handlers share), [`dispatch`] (admission queue), [`endpoints`] + [`scrape`] (health,
//! engine metrics), [`indexer`] + `feed` (KV events → prefix index), [`server`] (wiring).

pub mod app;
mod candidates;
pub mod config;
pub mod conversations;
pub mod discovery;
pub mod dispatch;
pub mod endpoints;
pub mod error;
mod feed;
pub mod forward;
pub mod hot_prefixes;
pub mod indexer;
pub mod load;
pub mod metrics;
pub mod pd_route;
mod prefetch;
pub mod prefix;
mod remote_source;
pub mod replicate;
pub mod request;
pub mod route;
pub mod scrape;
pub mod server;
pub mod sessions;
pub mod state;
mod tokenizer;

pub use config::RouterConfig;
pub use error::{ApiError, RouterError};
pub use server::{RouterHandle, RouterOptions, start};
