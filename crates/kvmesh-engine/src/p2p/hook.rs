//! [`P2pHook`], every server's default [`RequestHook`]: a request naming a `remote_kv_source`
//! pulls its missing prefix before submission (or, with `--p2p-load-mode layerwise` on a
//! backend computing layer by layer, starts pulling it layer-major and submits at once); a finished (or refused) request releases the
//! pins its pull took. On a backend that models transfer time, such a request first waits for
//! the pulls in flight that carry any of its blocks (it must not get them sooner than the
//! modelled link delivers them). A request naming no source is not held: a pull stuck on a
//! silent peer must delay no one (`tests/p2p_robustness.rs`).

use std::sync::Arc;

use futures::future::BoxFuture;

use super::consumer::{P2pConsumer, release_pulled};
use crate::config::P2pLoadMode;
use crate::engine::{EngineHandle, EngineRequest, FinishInfo};
use crate::request_hook::RequestHook;

/// The P2P request hook (see the module docs).
#[derive(Debug, Clone)]
pub struct P2pHook {
    pub consumer: Arc<P2pConsumer>,
}

impl RequestHook for P2pHook {
    fn before_submit<'a>(
        &'a self,
        engine: &'a EngineHandle,
        req: &'a mut EngineRequest,
    ) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let Some(params) = req.kv_transfer_params.as_ref() else {
                return;
            };
            let Some(source) = params.remote_kv_source.clone() else {
                return;
            };
            // The router's price of this pull bounds it (and the wait below), so a stalling
            // source costs about the prediction rather than the flat budget.
            let predicted = params.kvmesh_predicted_pull_ms;
            if engine.capabilities().models_pull_time && self.consumer.inflight_pulls() > 0 {
                let hashes = engine.cacheable_block_hashes(req);
                let deadline = tokio::time::Instant::now() + self.consumer.read_budget(predicted);
                self.consumer
                    .wait_for_pulls_in_flight(&hashes, deadline)
                    .await;
            }
            let layerwise = engine.config().p2p.load_mode == P2pLoadMode::Layerwise
                && engine.capabilities().layered_blocks;
            if layerwise
                && self
                    .consumer
                    .start_layered_read(engine, req, &source, predicted)
                    .await
            {
                return;
            }
            self.consumer
                .prepare_request(engine, req, &source, predicted)
                .await;
        })
    }

    fn on_finish(&self, engine: &EngineHandle, req: &EngineRequest, _info: &mut FinishInfo) {
        // The request has been scheduled: what its pull landed may be evicted normally now.
        release_pulled(engine, req);
    }

    fn on_not_submitted(&self, engine: &EngineHandle, req: &EngineRequest) {
        release_pulled(engine, req);
    }
}
