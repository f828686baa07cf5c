//! Connects the router's endpoint list to the KV-event indexer ([`crate::fleet::indexer::Indexer`]).

use std::sync::Arc;

use kvmesh_events::AllowedPeers;
use kvmesh_index::{EndpointId, PrefixIndex};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::config::KvEventsSpec;
use crate::fleet::indexer::{EventSource, Indexer, IndexerConfig, LoadReportSink, PeerFilter};

/// Subscribes the prefix index to endpoints' KV events (the indexer implements it).
pub trait EventFeed: Send + Sync {
    /// Follows the events of the endpoint served at `url`; a bound socket admits publishers from
    /// `spec.allowed_peers`, or else from `url`'s host only.
    fn add_source(&self, endpoint: EndpointId, name: &str, url: &str, spec: &KvEventsSpec);
    fn remove_source(&self, endpoint: EndpointId);
    /// Batches received from the endpoint's events so far; None when it has no event source.
    fn batches_received(&self, endpoint: EndpointId) -> Option<u64>;
    /// Whether the endpoint's stream delivered nothing since the previous call and has been
    /// quiet a while (or never spoke); None when it has no event source.
    fn events_silent(&self, endpoint: EndpointId) -> Option<bool>;
    /// Whether every source has caught up on what its engine published before it joined (or
    /// tried to): the router is placement-ready.
    fn caught_up(&self) -> bool {
        true
    }
}

/// A feed that subscribes to nothing (tests with a fake index).
pub struct NoEvents;

impl EventFeed for NoEvents {
    fn add_source(&self, _: EndpointId, _: &str, _: &str, _: &KvEventsSpec) {}
    fn remove_source(&self, _: EndpointId) {}
    fn batches_received(&self, _: EndpointId) -> Option<u64> {
        None
    }
    fn events_silent(&self, _: EndpointId) -> Option<bool> {
        None
    }
}

/// Who may publish into a bound socket for the endpoint at `url`: the configured networks, or the
/// URL's host (an invalid list was refused when the config was validated; here it admits no one).
pub fn peer_filter(url: &str, spec: &KvEventsSpec) -> PeerFilter {
    if let Some(list) = &spec.allowed_peers {
        return match AllowedPeers::parse(list) {
            Ok(allowed) => PeerFilter::Networks(allowed),
            Err(e) => {
                tracing::error!(error = %e, "kv_events.allowed_peers invalid; admitting no publisher");
                PeerFilter::Networks(AllowedPeers::addresses([]))
            }
        };
    }
    PeerFilter::Host(url_host(url).to_owned())
}

/// The host of `http://host:port/...` (brackets of an IPv6 literal removed).
fn url_host(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or(rest);
    let authority = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    if let Some(v6) = authority.strip_prefix('[') {
        return v6.split(']').next().unwrap_or(v6);
    }
    authority.split(':').next().unwrap_or(authority)
}

impl EventFeed for Indexer {
    fn add_source(&self, endpoint: EndpointId, name: &str, url: &str, spec: &KvEventsSpec) {
        Indexer::add_source_admitting(
            self,
            EventSource {
                endpoint,
                name: name.to_owned(),
                zmq_endpoint: spec.endpoint.clone(),
                bind: spec.bind,
                topic: spec.topic.clone(),
                replay_endpoint: spec.replay_endpoint.clone(),
            },
            peer_filter(url, spec),
        );
    }

    fn remove_source(&self, endpoint: EndpointId) {
        Indexer::remove_source(self, endpoint);
    }

    fn batches_received(&self, endpoint: EndpointId) -> Option<u64> {
        Indexer::batches_received(self, endpoint)
    }

    fn events_silent(&self, endpoint: EndpointId) -> Option<bool> {
        Indexer::events_silent(self, endpoint)
    }

    fn caught_up(&self) -> bool {
        Indexer::caught_up(self)
    }
}

/// Starts the KV-event feeder for `index` and registers its metrics; sources are added as
/// endpoints appear. Engines' load reports go to `load_sink`.
pub fn start(
    index: Arc<PrefixIndex>,
    config: IndexerConfig,
    load_sink: LoadReportSink,
    registry: &mut Registry,
    cancel: CancellationToken,
) -> Arc<dyn EventFeed> {
    let indexer = Indexer::start_with_config(index, Vec::new(), config, cancel);
    indexer.set_load_sink(load_sink);
    indexer.register_metrics(registry);
    Arc::new(indexer)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(allowed: Option<Vec<&str>>) -> KvEventsSpec {
        KvEventsSpec {
            endpoint: "tcp://127.0.0.1:5557".into(),
            bind: true,
            topic: String::new(),
            replay_endpoint: None,
            allowed_peers: allowed.map(|v| v.into_iter().map(str::to_owned).collect()),
        }
    }

    #[test]
    fn a_bound_socket_admits_the_endpoints_own_host_unless_told_otherwise() {
        assert_eq!(
            peer_filter("http://10.0.0.5:8000", &spec(None)),
            PeerFilter::Host("10.0.0.5".into())
        );
        assert_eq!(
            peer_filter("http://[fd00::5]:8000/v1", &spec(None)),
            PeerFilter::Host("fd00::5".into())
        );
        assert_eq!(
            peer_filter("http://engine-0.svc:8000", &spec(None)),
            PeerFilter::Host("engine-0.svc".into())
        );
        assert_eq!(
            peer_filter("http://e:1", &spec(Some(vec!["10.0.0.0/8"]))),
            PeerFilter::Networks(AllowedPeers::parse(&["10.0.0.0/8"]).unwrap())
        );
    }
}
