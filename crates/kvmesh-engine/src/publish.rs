//! Glue between the engine's [`KvEventSink`] and the ZMQ publisher of `kvmesh-events`: each
//! `publish` call becomes one numbered batch `[topic, seq, msgpack]` in vLLM's format.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use kvmesh_core::{EventBatch, KvEvent};
use kvmesh_events::{EndpointMode, Publisher, PublisherConfig, PublisherHandle};
use tokio_util::sync::CancellationToken;

use crate::config::KvEventsConfig;
use crate::outbox::{KvEventSink, NullSink};

/// Publishes through a spawned [`Publisher`]; never blocks (a full queue drops the batch and the
/// sequence gap tells subscribers).
pub struct PublisherSink {
    handle: PublisherHandle,
}

impl KvEventSink for PublisherSink {
    fn publish(&self, events: Vec<KvEvent>) {
        if events.is_empty() {
            return;
        }
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        if let Err(e) = self.handle.send(EventBatch {
            ts,
            events,
            data_parallel_rank: None,
        }) {
            tracing::warn!(error = %e, "kv events dropped");
        }
    }
}

/// What [`start_event_publisher`] started.
pub struct EventPublishing {
    pub sink: Arc<dyn KvEventSink>,
    /// The PUB endpoint actually bound (real port for `:0`) or connected to.
    pub endpoint: Option<String>,
    /// Whether the PUB socket bound `endpoint` or connects to it (vLLM's rule: only `*` binds).
    pub mode: Option<EndpointMode>,
    pub replay_endpoint: Option<String>,
    /// The publisher, for load reports; None when events or load reports are off.
    pub handle: Option<PublisherHandle>,
}

/// The endpoint subscribers should connect to, for a PUB socket that bound `bound`
/// (`tcp://0.0.0.0:5557`, `tcp://[::]:5557`, `tcp://10.0.0.7:5557`): a wildcard host is replaced
/// by `advertise_host` (None when there is none to offer); a concrete one is kept. Returns None
/// for an endpoint that is not `tcp://host:port`.
pub fn advertised_endpoint(bound: &str, advertise_host: Option<&str>) -> Option<String> {
    let rest = bound.strip_prefix("tcp://")?;
    let (host, port) = rest.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    let host = if crate::config::is_wildcard_host(host) {
        advertise_host?
    } else {
        host
    };
    Some(format!("tcp://{}", crate::config::host_port(host, port)))
}

/// Starts the ZMQ publisher described by `--kv-events-config` (or a null sink when disabled).
/// Must run inside a tokio runtime.
pub async fn start_event_publisher(
    cfg: Option<&KvEventsConfig>,
    cancel: CancellationToken,
) -> Result<EventPublishing, kvmesh_events::EventsError> {
    let Some(cfg) = cfg.filter(|c| c.enabled()) else {
        return Ok(EventPublishing {
            sink: Arc::new(NullSink),
            endpoint: None,
            mode: None,
            replay_endpoint: None,
            handle: None,
        });
    };
    let mut pc = PublisherConfig::new(cfg.endpoint.clone(), cfg.topic.clone());
    pc.bind = cfg.bind;
    pc.allowed_peers = cfg
        .allowed_peers
        .as_deref()
        .map(kvmesh_events::AllowedPeers::parse)
        .transpose()?;
    pc.replay_endpoint = cfg.replay_endpoint.clone();
    pc.replay_buffer = cfg.buffer_steps.max(1);
    // One batch per engine step and per CPU-tier change; leave room for bursts.
    pc.queue_capacity = 65_536;
    let publisher = Publisher::start(pc).await?;
    let endpoint = Some(publisher.local_endpoint().to_owned());
    let mode = Some(publisher.mode());
    let replay_endpoint = publisher.replay_endpoint().map(str::to_owned);
    let handle = publisher.spawn(cancel);
    Ok(EventPublishing {
        sink: Arc::new(PublisherSink {
            handle: handle.clone(),
        }),
        endpoint,
        mode,
        replay_endpoint,
        handle: cfg.load_reports.then_some(handle),
    })
}

#[cfg(test)]
mod tests {
    use super::advertised_endpoint;

    #[test]
    fn a_wildcard_events_endpoint_is_announced_at_the_advertised_host() {
        let adv = Some("10.0.0.7");
        assert_eq!(
            advertised_endpoint("tcp://0.0.0.0:5557", adv).as_deref(),
            Some("tcp://10.0.0.7:5557")
        );
        assert_eq!(
            advertised_endpoint("tcp://[::]:5557", Some("fd00::7")).as_deref(),
            Some("tcp://[fd00::7]:5557")
        );
        // A concrete bind is where subscribers connect, whatever is advertised elsewhere.
        assert_eq!(
            advertised_endpoint("tcp://127.0.0.1:5557", adv).as_deref(),
            Some("tcp://127.0.0.1:5557")
        );
        assert_eq!(advertised_endpoint("tcp://0.0.0.0:5557", None), None);
        assert_eq!(advertised_endpoint("ipc:///tmp/kv", adv), None);
    }
}
