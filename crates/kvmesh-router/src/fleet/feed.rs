//! Connects the router's endpoint list to the KV-event indexer ([`crate::fleet::indexer::Indexer`]).

use std::sync::Arc;

use kvmesh_index::{EndpointId, PrefixIndex};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::config::KvEventsSpec;
use crate::fleet::indexer::{EventSource, Indexer, IndexerConfig};

/// Subscribes the prefix index to endpoints' KV events (the indexer implements it).
pub trait EventFeed: Send + Sync {
    fn add_source(&self, endpoint: EndpointId, name: &str, spec: &KvEventsSpec);
    fn remove_source(&self, endpoint: EndpointId);
    /// Batches received from the endpoint's events so far; None when it has no event source.
    fn batches_received(&self, endpoint: EndpointId) -> Option<u64>;
}

/// A feed that subscribes to nothing (tests with a fake index).
pub struct NoEvents;

impl EventFeed for NoEvents {
    fn add_source(&self, _: EndpointId, _: &str, _: &KvEventsSpec) {}
    fn remove_source(&self, _: EndpointId) {}
    fn batches_received(&self, _: EndpointId) -> Option<u64> {
        None
    }
}

impl EventFeed for Indexer {
    fn add_source(&self, endpoint: EndpointId, name: &str, spec: &KvEventsSpec) {
        Indexer::add_source(
            self,
            EventSource {
                endpoint,
                name: name.to_owned(),
                zmq_endpoint: spec.endpoint.clone(),
                bind: spec.bind,
                topic: spec.topic.clone(),
                replay_endpoint: spec.replay_endpoint.clone(),
            },
        );
    }

    fn remove_source(&self, endpoint: EndpointId) {
        Indexer::remove_source(self, endpoint);
    }

    fn batches_received(&self, endpoint: EndpointId) -> Option<u64> {
        Indexer::batches_received(self, endpoint)
    }
}

/// Starts the KV-event feeder for `index` and registers its metrics; sources are added as
/// endpoints appear.
pub fn start(
    index: Arc<PrefixIndex>,
    config: IndexerConfig,
    registry: &mut Registry,
    cancel: CancellationToken,
) -> Arc<dyn EventFeed> {
    let indexer = Indexer::start_with_config(index, Vec::new(), config, cancel);
    indexer.register_metrics(registry);
    Arc::new(indexer)
}
