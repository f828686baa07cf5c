//! kvmesh router: OpenAI gateway with KV-cache-aware scheduling and P2P source selection.
//!
//! The decisions themselves are made by `kvmesh-sched` (transport-free: plugins, profiles, cost
//! model, decision records); this crate gives them inputs and carries them out. The folders follow
//! a request:
//!
//! 1. [`http`] — the HTTP surface: the axum app and its handlers ([`http::app`]), the request
//!    parsed once ([`http::request`], with the [`http::tokenizer`]), 400 before any engine is
//!    touched.
//! 2. [`route`] — the aggregated route ([`route::aggregated`]): the admission queue
//!    ([`route::admission_queue`]), who may take the request and what the scheduler is told
//!    ([`route::candidates`]), `kvmesh_sched::Scheduler`, the decision's P2P source as
//!    `remote_kv_source` ([`route::remote_source`]), the engine request and the one response tap
//!    ([`route::forward`]). [`pd`] is the other route: prefill and decode legs, with its
//!    conversation cache and its config.
//! 3. [`fleet`] — what the routes read about the engines: the live endpoint set
//!    ([`fleet::endpoints`], from the config or [`fleet::discovery`]), the router's own load
//!    accounting ([`fleet::load`]), scraped metrics and health ([`fleet::scrape`]), and the prefix
//!    index fed by KV events ([`fleet::prefix`], [`fleet::feed`], [`fleet::indexer`]).
//! 4. Features, each in its folder with its config, hooked into the aggregated route through
//!    [`state::Hook`] (the route calls every registered hook at fixed points and knows nothing
//!    of what they do): [`prefetch`] (sessions' next turns prepared during the client's gap) and
//!    [`replication`] (hot prefixes copied to a second holder).
//!
//! Around them: [`config`] (the YAML's top-level shape), [`state`] (what handlers share, the hook
//! traits, how a placement is recorded), [`metrics`], [`error`], [`server`] (wiring).

pub mod config;
pub mod error;
pub mod fleet;
pub mod http;
pub mod metrics;
pub mod pd;
pub mod prefetch;
pub mod replication;
pub mod route;
pub mod server;
pub mod state;

pub use config::RouterConfig;
pub use error::{ApiError, RouterError};
pub use fleet::{discovery, indexer, prefix};
pub use server::{RouterHandle, RouterOptions, start};
