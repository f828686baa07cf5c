//! The aggregated route, one engine computing the prompt and decoding, in the order a request
//! meets it: [`aggregated`] (keys once → admission queue → candidates → schedule → P2P source →
//! reserve load → forward, with the features' hooks at fixed points), [`admission_queue`] (the admission
//! queue), [`candidates`] (who may take the request, and what the scheduler is told),
//! [`remote_source`] (a decision's P2P source as `remote_kv_source`, shared with the P/D route),
//! [`reputation`] (what each pull's outcome says about its source)
//! and [`forward`] (the engine request and the one response tap).

pub mod admission_queue;
pub(crate) mod aggregated;
pub(crate) mod candidates;
pub mod forward;
pub(crate) mod remote_source;
pub mod reputation;
