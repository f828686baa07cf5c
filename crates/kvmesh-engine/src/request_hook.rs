//! The engine's extension point around one request (`docs/architecture.md#request-hooks`): the
//! HTTP layer ([`crate::api`]) calls a [`RequestHook`] before it submits a request, when it
//! finishes, and when the engine refused it after all. The default hook is the P2P consumer's
//! ([`crate::p2p::P2pHook`]); P/D ([`crate::pd::PdHook`]) layers its behaviour around it. The
//! trait lives here, on its own, so implementers and the caller depend on it without depending
//! on each other.

use futures::future::BoxFuture;

use crate::engine::{EngineHandle, EngineRequest, FinishInfo};

/// Work around one request: e.g. pull a prefix into the CPU tier before the request is
/// submitted, set the response's `kv_transfer_params` when it finishes.
pub trait RequestHook: Send + Sync {
    /// Runs before the request is submitted (e.g. the P2P consumer pulling a prefix into the
    /// CPU tier and recording `external_hashes`). Must not fail the request: on any problem,
    /// return with the request unchanged.
    fn before_submit<'a>(
        &'a self,
        engine: &'a EngineHandle,
        req: &'a mut EngineRequest,
    ) -> BoxFuture<'a, ()>;

    /// Runs when the request finished, before the response's last chunk is built: e.g. set
    /// `info.kv_transfer_params` for P/D (`do_remote_decode`) responses.
    fn on_finish(&self, _engine: &EngineHandle, _req: &EngineRequest, _info: &mut FinishInfo) {}

    /// Runs when the engine refused the request after `before_submit` (overloaded, stopped):
    /// e.g. release what a pull pinned for it, which `on_finish` would otherwise have done.
    fn on_not_submitted(&self, _engine: &EngineHandle, _req: &EngineRequest) {}
}
