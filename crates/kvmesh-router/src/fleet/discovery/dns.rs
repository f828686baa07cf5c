//! `discovery: {kind: dns}`: a name (a headless Service's) resolved every `interval`, one
//! endpoint per A/AAAA address.
//!
//! Endpoint names are `dns:<ip>:<http_port>`, a function of the address alone, so an address
//! present in two answers keeps its endpoint (id, index entries, load). An answer with no address
//! (NXDOMAIN or an empty NOERROR) is applied like any other: a headless Service whose pods all
//! went away answers exactly that, so keeping the old list would route to dead pods. Failures
//! (timeouts, SERVFAIL, REFUSED, no reachable name server) keep the list.

use std::future::Future;
use std::net::IpAddr;
use std::sync::Arc;

use hickory_resolver::TokioResolver;
use hickory_resolver::config::{LookupIpStrategy, NameServerConfig, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use tokio_util::sync::CancellationToken;

use super::shared::{Backoff, DiscoveryError, Ports, Sink, failed, host_port, spec_at};
use crate::config::DnsDiscovery;
use crate::fleet::endpoints::Discovered;
use crate::metrics::RouterMetrics;

/// A resolution that failed (as opposed to one that found no address).
#[derive(Debug, thiserror::Error)]
#[error("resolving {name}: {message}")]
pub struct LookupFailed {
    pub name: String,
    pub message: String,
}

/// The endpoints for one answer: one per distinct address, in address order.
fn endpoints_of(addrs: &[IpAddr], cfg: &DnsDiscovery) -> Vec<Discovered> {
    let mut addrs = addrs.to_vec();
    addrs.sort();
    addrs.dedup();
    let ports = Ports {
        http: cfg.http_port,
        p2p: cfg.p2p_port,
        kv_events: cfg.kv_events_port,
        kv_replay: cfg.kv_replay_port,
    };
    addrs
        .into_iter()
        .map(|ip| {
            let name = format!("dns:{}", host_port(ip, cfg.http_port));
            Discovered::ready(spec_at(name, ip, ports, cfg.role, cfg.kv_group.clone()))
        })
        .collect()
}

/// The resolver: the configured name server, or the system's (`/etc/resolv.conf`, whose search
/// domains and `ndots` apply). Nothing is cached: every round asks the server, so a change shows
/// within one `interval` whatever the record TTL.
pub fn resolver(cfg: &DnsDiscovery) -> Result<TokioResolver, DiscoveryError> {
    let mut builder = match cfg.nameserver {
        Some(addr) => {
            let mut ns = NameServerConfig::udp_and_tcp(addr.ip());
            for c in &mut ns.connections {
                c.port = addr.port();
            }
            TokioResolver::builder_with_config(
                ResolverConfig::from_name_servers(vec![ns]),
                TokioRuntimeProvider::default(),
            )
        }
        None => {
            TokioResolver::builder_tokio().map_err(|e| DiscoveryError::Resolver(e.to_string()))?
        }
    };
    let opts = builder.options_mut();
    opts.cache_size = 0;
    opts.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
    builder
        .build()
        .map_err(|e| DiscoveryError::Resolver(e.to_string()))
}

/// Every address of `name`; none when the name does not exist or has no address records.
pub async fn lookup(resolver: &TokioResolver, name: &str) -> Result<Vec<IpAddr>, LookupFailed> {
    match resolver.lookup_ip(name).await {
        Ok(found) => Ok(found.iter().collect()),
        Err(e) if e.is_no_records_found() => Ok(Vec::new()),
        Err(e) => Err(LookupFailed {
            name: name.to_owned(),
            message: e.to_string(),
        }),
    }
}

/// Resolves with `resolve` every `cfg.interval` (after a failure: 0.5 s doubling up to the
/// interval) and hands changed lists to `sink`, until `cancel`.
pub async fn run<R, F>(
    cfg: DnsDiscovery,
    mut resolve: R,
    sink: Sink,
    metrics: Arc<RouterMetrics>,
    cancel: CancellationToken,
) where
    R: FnMut() -> F + Send,
    F: Future<Output = Result<Vec<IpAddr>, LookupFailed>> + Send,
{
    let mut last: Option<Vec<Discovered>> = None;
    let mut backoff = Backoff::new(cfg.interval);
    loop {
        let answer = tokio::select! {
            _ = cancel.cancelled() => return,
            a = resolve() => a,
        };
        let delay = match answer {
            Ok(addrs) => {
                backoff.reset();
                let found = endpoints_of(&addrs, &cfg);
                if last.as_ref() != Some(&found) {
                    if found.is_empty() {
                        tracing::warn!(name = %cfg.name, "resolves to no address; the router has no endpoint");
                    }
                    sink(found.clone());
                    last = Some(found);
                }
                cfg.interval
            }
            Err(e) => {
                failed(&metrics, "dns", &e);
                backoff.next_delay()
            }
        };
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(delay) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use parking_lot::Mutex;

    use super::*;
    use crate::config::Role;

    fn cfg() -> DnsDiscovery {
        serde_norway::from_str(
            "{name: e.svc, interval: 10ms, p2p_port: 7100, kv_events_port: 5557}",
        )
        .expect("cfg")
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    #[test]
    fn one_endpoint_per_distinct_address_named_by_address() {
        let eps = endpoints_of(
            &[
                ip("10.0.0.2"),
                ip("fd00::1"),
                ip("10.0.0.1"),
                ip("10.0.0.2"),
            ],
            &cfg(),
        );
        let names: Vec<_> = eps.iter().map(|d| d.spec.name.as_str()).collect();
        assert_eq!(
            names,
            vec![
                "dns:10.0.0.1:8000",
                "dns:10.0.0.2:8000",
                "dns:[fd00::1]:8000"
            ]
        );
        let s = &eps[2].spec;
        assert_eq!(s.url, "http://[fd00::1]:8000");
        assert_eq!(s.p2p.as_deref(), Some("[fd00::1]:7100"));
        assert_eq!(
            s.kv_events.as_ref().map(|k| k.endpoint.as_str()),
            Some("tcp://[fd00::1]:5557")
        );
        assert!(eps.iter().all(|d| d.ready && d.spec.role == Role::Both));
        let mut bare = cfg();
        bare.p2p_port = None;
        bare.kv_events_port = None;
        let s = &endpoints_of(&[ip("10.0.0.1")], &bare)[0].spec;
        assert_eq!((s.p2p.as_ref(), s.kv_events.as_ref()), (None, None));
        assert_eq!(s.kv_group, None);
        // The section's kv_group applies to every address behind the name.
        bare.kv_group = Some("vllm-llama".into());
        let eps = endpoints_of(&[ip("10.0.0.1"), ip("10.0.0.2")], &bare);
        assert!(
            eps.iter()
                .all(|d| d.spec.kv_group.as_deref() == Some("vllm-llama"))
        );
    }

    #[tokio::test]
    async fn failures_keep_the_list_and_an_empty_answer_empties_it() {
        let answers = Arc::new(Mutex::new(vec![
            Ok(vec![]),
            Err("timeout"),
            Ok(vec![ip("10.0.0.1"), ip("10.0.0.2")]),
            Ok(vec![ip("10.0.0.2"), ip("10.0.0.1")]),
            Err("servfail"),
            Ok(vec![ip("10.0.0.1"), ip("10.0.0.2")]),
        ]));
        let applied = Arc::new(Mutex::new(Vec::<Vec<String>>::new()));
        let calls = Arc::new(AtomicUsize::new(0));
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = Arc::new(RouterMetrics::register(&mut registry));
        let cancel = CancellationToken::new();
        let resolve = {
            let (answers, calls, cancel) = (answers.clone(), calls.clone(), cancel.clone());
            move || {
                calls.fetch_add(1, Ordering::Relaxed);
                let next = {
                    let mut a = answers.lock();
                    if a.is_empty() {
                        None
                    } else {
                        Some(a.remove(0))
                    }
                };
                let cancel = cancel.clone();
                async move {
                    match next {
                        Some(Ok(v)) => Ok(v),
                        Some(Err(m)) => Err(LookupFailed {
                            name: "e.svc".into(),
                            message: m.into(),
                        }),
                        None => {
                            cancel.cancel();
                            Ok(vec![ip("10.0.0.1"), ip("10.0.0.2")])
                        }
                    }
                }
            }
        };
        let sink: Sink = {
            let applied = applied.clone();
            Arc::new(move |d: Vec<Discovered>| {
                applied
                    .lock()
                    .push(d.into_iter().map(|d| d.spec.name).collect());
            })
        };
        tokio::time::timeout(
            Duration::from_secs(10),
            run(cfg(), resolve, sink, metrics.clone(), cancel),
        )
        .await
        .expect("bounded");
        let two = vec![
            "dns:10.0.0.1:8000".to_owned(),
            "dns:10.0.0.2:8000".to_owned(),
        ];
        assert_eq!(*applied.lock(), vec![vec![], two]);
        let failed = metrics
            .endpoint_changes
            .get_or_create(&crate::metrics::Kind {
                kind: "discovery_failed",
            })
            .get();
        assert_eq!(failed, 2);
        assert_eq!(calls.load(Ordering::Relaxed), 7);
    }
}
