//! What the discovery sources share: the sink type, start errors, how an address becomes an
//! endpoint spec, failure accounting and retry backoff.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::config::{EndpointSpec, KvEventsSpec, Role};
use crate::fleet::endpoints::Discovered;
use crate::metrics::{Kind, RouterMetrics};

/// Where discovered lists go (the server applies them to the endpoint set).
pub type Sink = Arc<dyn Fn(Vec<Discovered>) + Send + Sync>;

/// Why discovery could not start.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("dns discovery: cannot build a resolver: {0}")]
    Resolver(String),
    #[error(
        "kubernetes discovery: no Kubernetes API credentials ({0}); the router must run in a pod \
         with a service account (token and CA under /var/run/secrets/kubernetes.io/serviceaccount) \
         or have a kubeconfig"
    )]
    Credentials(String),
    #[error("kubernetes discovery: {0}")]
    Client(String),
}

/// `ip:port` with an IPv6 address bracketed, as URLs and `host:port` strings need it.
pub fn host_port(ip: IpAddr, port: u16) -> String {
    match ip {
        IpAddr::V4(v4) => format!("{v4}:{port}"),
        IpAddr::V6(v6) => format!("[{v6}]:{port}"),
    }
}

/// Ports of one discovered engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ports {
    pub http: u16,
    pub p2p: Option<u16>,
    pub kv_events: Option<u16>,
    /// The KV-event replay socket (vLLM's `replay_endpoint`): a router that joins catches up
    /// from it at once instead of when the engine next publishes.
    pub kv_replay: Option<u16>,
}

/// The endpoint spec of an engine at `ip` in KV group `kv_group`; KV events use the static
/// config's defaults (connect, every topic).
pub fn spec_at(
    name: String,
    ip: IpAddr,
    ports: Ports,
    role: Role,
    kv_group: Option<String>,
) -> EndpointSpec {
    EndpointSpec {
        name,
        url: format!("http://{}", host_port(ip, ports.http)),
        kv_events: ports.kv_events.map(|p| KvEventsSpec {
            endpoint: format!("tcp://{}", host_port(ip, p)),
            bind: false,
            topic: String::new(),
            replay_endpoint: ports
                .kv_replay
                .map(|r| format!("tcp://{}", host_port(ip, r))),
            allowed_peers: None,
        }),
        p2p: ports.p2p.map(|p| host_port(ip, p)),
        role,
        kv_group,
    }
}

/// Counts and logs a source error; the list stays as it is.
pub(crate) fn failed(metrics: &RouterMetrics, source: &str, error: &dyn std::fmt::Display) {
    metrics
        .endpoint_changes
        .get_or_create(&Kind {
            kind: "discovery_failed",
        })
        .inc();
    tracing::warn!(source, error = %error, "endpoint discovery failed; keeping the current list");
}

/// Counts a discovered object that maps to no endpoint (logged by the caller, once).
pub(crate) fn skipped(metrics: &RouterMetrics) {
    metrics
        .endpoint_changes
        .get_or_create(&Kind {
            kind: "discovery_skipped",
        })
        .inc();
}

/// Retry delays after consecutive failures: 0.5 s doubling up to `max`.
#[derive(Debug)]
pub struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(500);

    pub fn new(max: Duration) -> Backoff {
        Backoff {
            next: Self::FIRST.min(max),
            max,
        }
    }

    pub fn next_delay(&mut self) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(self.max);
        d
    }

    pub fn reset(&mut self) {
        self.next = Self::FIRST.min(self.max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv6_is_bracketed_everywhere() {
        let ip: IpAddr = "fd00::7".parse().expect("ip");
        let s = spec_at(
            "x".into(),
            ip,
            Ports {
                http: 8000,
                p2p: Some(7100),
                kv_events: Some(5557),
                kv_replay: Some(5558),
            },
            Role::Both,
            None,
        );
        assert_eq!(s.url, "http://[fd00::7]:8000");
        assert_eq!(s.p2p.as_deref(), Some("[fd00::7]:7100"));
        let events = s.kv_events.expect("events");
        assert_eq!(events.endpoint, "tcp://[fd00::7]:5557");
        assert_eq!(
            events.replay_endpoint.as_deref(),
            Some("tcp://[fd00::7]:5558")
        );
        crate::config::validate_endpoints(&[spec_at(
            "y".into(),
            ip,
            Ports {
                http: 1,
                p2p: Some(2),
                kv_events: None,
                kv_replay: None,
            },
            Role::Decode,
            Some("g".into()),
        )])
        .expect("valid");
    }

    #[test]
    fn backoff_doubles_to_its_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_secs(2));
        let d: Vec<_> = (0..4).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(d, vec![500, 1000, 2000, 2000]);
        b.reset();
        assert_eq!(b.next_delay(), Duration::from_millis(500));
    }
}
