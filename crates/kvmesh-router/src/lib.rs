//! kvmesh router: OpenAI gateway with KV-cache-aware scheduling and P2P source selection.
//!
//! Layers: [`config`] (YAML) → [`plugins`] (pure filters/scorers/pickers, P2P source selection)
//! and [`cost_model`] → [`scheduler`] (profiles, decisions) → [`gateway`] (axum handlers, load
//! guards, forwarding) → [`server`] (wiring, background loops). [`indexer`] feeds the prefix index
//! from engines' KV events.

pub mod config;
pub mod cost_model;
pub mod decisions;
pub mod dispatch;
pub mod endpoints;
pub mod error;
mod feed;
pub mod gateway;
pub mod indexer;
pub mod load;
pub mod metrics;
pub mod pd;
pub mod plugins;
pub mod predict;
pub mod prefix;
pub mod request;
pub mod scheduler;
pub mod scrape;
pub mod server;
mod tokenizer;

pub use config::RouterConfig;
pub use error::{ApiError, RouterError};
pub use server::{RouterHandle, RouterOptions, start};
