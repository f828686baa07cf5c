//! Endpoint discovery: where the router's endpoint list comes from when the config says
//! `discovery: {kind: dns | kubernetes}` (`docs/discovery.md`). `kind: static` (the default) is
//! the endpoints file watcher in `server`.
//!
//! Each source turns what it sees into a full list of [`Discovered`] endpoints and hands it to a
//! [`Sink`]: the server's `apply_discovered`, the same path as a static reload, so unchanged
//! endpoints keep their ids and index entries and removed ones lose them. The mapping from
//! addresses or pods to endpoints is pure (unit-tested in `dns` and `kubernetes`); resolvers and
//! API clients sit at the edges. Every source error leaves the current list in place, is logged,
//! counted in `kvmesh_router_endpoint_changes_total{kind="discovery_failed"}`, and retried with
//! backoff.

pub mod dns;
pub mod kubernetes;
mod shared;

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::DiscoveryConfig;
use crate::metrics::RouterMetrics;
pub use shared::{Backoff, DiscoveryError, Ports, Sink, host_port, spec_at};

/// Overrides for how discovery reaches the outside (tests).
#[derive(Default, Clone)]
pub struct DiscoveryOverrides {
    /// Use this Kubernetes API config instead of inferring one (in-cluster or kubeconfig).
    pub kube_config: Option<kube::Config>,
}

/// Starts the configured discovery source (nothing for `static`). Clients and resolvers are
/// built here so a router that cannot reach its source fails at start with a clear error.
pub(crate) async fn spawn(
    cfg: &DiscoveryConfig,
    overrides: DiscoveryOverrides,
    sink: Sink,
    metrics: Arc<RouterMetrics>,
    tracker: &TaskTracker,
    cancel: CancellationToken,
) -> Result<(), DiscoveryError> {
    match cfg {
        DiscoveryConfig::Static => Ok(()),
        DiscoveryConfig::Dns(d) => {
            let resolver = dns::resolver(d)?;
            let d = d.clone();
            let name = d.name.clone();
            let resolve = move || {
                let (resolver, name) = (resolver.clone(), name.clone());
                async move { dns::lookup(&resolver, &name).await }
            };
            tracker.spawn(dns::run(d, resolve, sink, metrics, cancel));
            Ok(())
        }
        DiscoveryConfig::Kubernetes(k) => {
            let (client, namespace) = kubernetes::client(k, overrides.kube_config).await?;
            tracker.spawn(kubernetes::run(
                k.clone(),
                client,
                namespace,
                sink,
                metrics,
                cancel,
            ));
            Ok(())
        }
    }
}
