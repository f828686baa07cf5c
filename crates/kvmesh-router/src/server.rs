//! Wiring: config → endpoints, index, event feed, scheduler, metrics, background loops (scrape,
//! health, endpoints-file watcher or endpoint discovery) and the HTTP server, with shutdown by
//! token.
//!
//! The HTTP server is driven connection by connection with hyper (`axum::serve` has no
//! header-read timeout): clients that send nothing, trickle their headers or stall their body
//! are dropped after `header_read_timeout`; shutdown closes the listener at once and lets
//! in-flight requests, streams included, finish for up to `drain_timeout`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvmesh_index::{IndexConfig, PrefixIndex};
use kvmesh_text::{ByteTokenizer, Tokenizer};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use kvmesh_sched::Scheduler;
use kvmesh_sched::cost_model::CostModel;
use kvmesh_sched::decisions::DecisionLog;

use crate::config::{
    DiscoveryConfig, EndpointSpec, RouterConfig, TokenizerSpec, load_endpoints_file,
};
use crate::error::RouterError;
use crate::fleet::discovery::{DiscoveryOverrides, Sink};
use crate::fleet::endpoints::{Discovered, EndpointSet};
use crate::fleet::feed::{EventFeed, NoEvents};
use crate::fleet::prefix::PrefixLookup;
use crate::fleet::scrape::{health_loop, scrape_loop};
use crate::http::app::app;
use crate::metrics::{Kind, RouterMetrics};
use crate::pd::conversations::PdRouter;
use crate::prefetch::Prefetch;
use crate::replication::Replicate;
use crate::route::reputation::SourceReputations;
use crate::state::{Hook, RouterState};

/// Optional overrides, mostly for tests.
#[derive(Default)]
pub struct RouterOptions {
    /// Use this prefix lookup (and no KV-event subscription) instead of an index fed by events.
    pub prefix: Option<Arc<dyn PrefixLookup>>,
    pub tokenizer: Option<Arc<dyn Tokenizer>>,
    /// The file the config was loaded from. Without an `endpoints_file`, its inline `endpoints`
    /// list is watched and re-applied on change (other settings need a restart).
    pub config_path: Option<PathBuf>,
    /// How `discovery:` reaches its source (a Kubernetes API config instead of the inferred one).
    pub discovery: DiscoveryOverrides,
}

/// This replica's id in the marks it puts on requests: `prefix` (the pod name under Kubernetes)
/// cut to the characters and length a mark allows, and a random suffix, so a restarted replica
/// never inherits the sequence numbers of the one before it.
pub(crate) fn replica_id(prefix: Option<&str>) -> String {
    let prefix: String = prefix
        .unwrap_or("router")
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        .take(40)
        .collect();
    let prefix = if prefix.is_empty() { "router" } else { &prefix };
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    format!("{prefix}-{}", &suffix[..8])
}

/// Takes engines' load reports (see `crate::fleet::load`): decoded and bounded, counted per
/// endpoint and outcome; an accepted one wakes the admission queue (capacity may have freed).
fn load_report_sink(
    endpoints: Arc<EndpointSet>,
    metrics: Arc<RouterMetrics>,
    admission_queue: Option<Arc<crate::route::admission_queue::AdmissionQueue>>,
    replica_id: Arc<str>,
) -> crate::fleet::indexer::LoadReportSink {
    Arc::new(move |id, payload| {
        let Some(e) = endpoints.list().iter().find(|e| e.id == id).cloned() else {
            return;
        };
        let outcome = match kvmesh_core::load_report::LoadReport::decode(payload) {
            Err(err) => {
                tracing::debug!(endpoint = %e.name, error = %err, "load report refused");
                "malformed"
            }
            Ok(report) => {
                match e
                    .load
                    .accept_report(&report, &replica_id, std::time::Instant::now())
                {
                    Ok(()) => {
                        if let Some(q) = &admission_queue {
                            q.wake();
                        }
                        "accepted"
                    }
                    Err(crate::fleet::load::ReportRefused::Flood) => "flood",
                }
            }
        };
        metrics
            .load_reports
            .get_or_create(&crate::metrics::EndpointOutcome {
                endpoint: e.name.to_string(),
                outcome,
            })
            .inc();
    })
}

/// A running router.
pub struct RouterHandle {
    pub addr: SocketAddr,
    pub state: Arc<RouterState>,
    cancel: CancellationToken,
    tracker: TaskTracker,
    server: JoinHandle<std::io::Result<()>>,
    /// Kept for the router's lifetime: the feed owns the index-stats task (`kvmesh_index_*`
    /// metrics stopped updating when it was dropped after start-up).
    _feed: Arc<dyn EventFeed>,
}

impl RouterHandle {
    /// Stops accepting, lets in-flight responses finish (bounded by the config's
    /// `drain_timeout`), stops background loops.
    pub async fn shutdown(self) -> std::io::Result<()> {
        self.cancel.cancel();
        self.tracker.close();
        self.tracker.wait().await;
        self.server
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e)))
    }

    pub fn cancel_token(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// Resolves when the HTTP server stops.
    pub async fn wait(self) -> std::io::Result<()> {
        let r = self
            .server
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e)));
        self.cancel.cancel();
        self.tracker.close();
        self.tracker.wait().await;
        r
    }
}

async fn build_tokenizer(spec: &TokenizerSpec) -> Result<Arc<dyn Tokenizer>, RouterError> {
    match spec {
        TokenizerSpec::Byte => Ok(Arc::new(ByteTokenizer)),
        TokenizerSpec::Hf {
            path,
            chat_template,
        } => {
            let (path, chat_template) = (path.clone(), chat_template.clone());
            tokio::task::spawn_blocking(move || {
                crate::http::tokenizer::hf(&path, chat_template.as_deref())
            })
            .await
            .map_err(|e| RouterError::Tokenizer(e.to_string()))?
        }
    }
}

/// Starts the router on `listener`.
pub async fn start(
    config: RouterConfig,
    listener: TcpListener,
    opts: RouterOptions,
) -> Result<RouterHandle, RouterError> {
    config.validate()?;
    let config = config.with_default_placement()?;
    if config.header_read_timeout.is_zero() {
        return Err(
            crate::config::ConfigError::Invalid("header_read_timeout must be > 0".into()).into(),
        );
    }
    let discovered = matches!(
        config.discovery,
        Some(DiscoveryConfig::Dns(_) | DiscoveryConfig::Kubernetes(_))
    );
    // A discovered list must not be overwritten by the config file's (empty) inline list.
    let watched = if discovered {
        None
    } else {
        config.endpoints_file.clone().or(opts.config_path)
    };
    let specs = match &config.endpoints_file {
        Some(path) => load_endpoints_file(path)?,
        None => config.endpoints.clone(),
    };
    let tokenizer = match opts.tokenizer {
        Some(t) => t,
        None => build_tokenizer(&config.tokenizer).await?,
    };
    let cost_model = Arc::new(CostModel::new(config.cost_model.clone()));
    let scheduler = Scheduler::build(
        &config.plugins,
        &config.scheduling_profiles,
        config.default_profile.as_deref(),
        config.seed,
        &cost_model,
    )?;
    let http_limits = config.http.apply(kvmesh_http::HttpLimits {
        header_read_timeout: config.header_read_timeout,
        drain_timeout: config.drain_timeout,
        max_body_bytes: config.max_body_bytes,
        ..kvmesh_http::HttpLimits::default()
    });
    http_limits.validate().map_err(|e| {
        crate::config::ConfigError::Invalid(format!("{}: {}", e.setting.yaml_key(), e.reason))
    })?;
    let mut registry = Registry::default();
    let http_stats = kvmesh_http::HttpStats::default();
    http_stats.register(&mut registry);
    let metrics = Arc::new(RouterMetrics::register(&mut registry));
    let cancel = CancellationToken::new();
    let tracker = TaskTracker::new();
    let endpoints = Arc::new(EndpointSet::default());
    let admission_queue = config.admission_queue.clone().map(|c| {
        Arc::new(crate::route::admission_queue::AdmissionQueue::new(
            c,
            &mut registry,
        ))
    });
    let replica_id: Arc<str> = Arc::from(replica_id(std::env::var("HOSTNAME").ok().as_deref()));
    tracing::info!(replica = %replica_id, "router replica id (marks every forwarded request)");
    let (prefix, feed): (Arc<dyn PrefixLookup>, Arc<dyn EventFeed>) = match opts.prefix {
        Some(p) => (p, Arc::new(NoEvents)),
        None => {
            let index = Arc::new(PrefixIndex::new(IndexConfig {
                block_size: config.block_size,
                max_blocks: config.index.max_blocks,
                ..IndexConfig::default()
            }));
            let feed = crate::fleet::feed::start(
                Arc::clone(&index),
                crate::fleet::indexer::IndexerConfig {
                    gap_grace: config.index.gap_grace,
                    max_blocks_per_second: config.index.max_blocks_per_second,
                    ..crate::fleet::indexer::IndexerConfig::default()
                },
                load_report_sink(
                    Arc::clone(&endpoints),
                    Arc::clone(&metrics),
                    admission_queue.clone(),
                    Arc::clone(&replica_id),
                ),
                &mut registry,
                cancel.clone(),
            );
            (index, feed)
        }
    };
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .pool_max_idle_per_host(1024)
        // Servers close idle keep-alive connections (vLLM's uvicorn after 5 s, kvmesh engines
        // after their header-read timeout); reusing one at the moment it closes fails the
        // request, so let idle connections go first.
        .pool_idle_timeout(Duration::from_secs(4))
        .build()
        .map_err(|e| RouterError::Http(e.to_string()))?;
    let pd = match &config.pd {
        Some(c) => Some(Arc::new(PdRouter::new(
            c.clone(),
            &scheduler,
            &mut registry,
        )?)),
        None => None,
    };
    let hooks = hooks(&config, &scheduler, &mut registry)?;
    let p2p_reputation = config.p2p_reputation.clone();
    let state = Arc::new(RouterState {
        pd,
        admission_queue,
        hooks,
        decisions: DecisionLog::new(config.decisions_capacity),
        config,
        endpoints: Arc::clone(&endpoints),
        prefix,
        scheduler,
        cost_model,
        metrics: Arc::clone(&metrics),
        registry,
        client: client.clone(),
        tokenizer,
        in_flight: Default::default(),
        feed: Arc::clone(&feed),
        replica_id,
        started_at: std::time::Instant::now(),
        reputation: SourceReputations::new(p2p_reputation),
    });
    apply_endpoints(&state, &*feed, specs);

    tracker.spawn(scrape_loop(
        Arc::clone(&endpoints),
        client.clone(),
        state.config.metrics_scrape_interval,
        Arc::clone(&state.cost_model),
        state.config.block_size,
        cancel.clone(),
    ));
    tracker.spawn(health_loop(
        Arc::clone(&endpoints),
        client,
        state.config.health_check.clone(),
        metrics,
        Arc::clone(&state.prefix),
        cancel.clone(),
    ));
    if let Some(d) = &state.config.discovery {
        let sink: Sink = {
            let (state, feed) = (Arc::clone(&state), Arc::clone(&feed));
            Arc::new(move |found: Vec<Discovered>| apply_discovered(&state, &*feed, found))
        };
        let started = crate::fleet::discovery::spawn(
            d,
            opts.discovery,
            sink,
            Arc::clone(&state.metrics),
            &tracker,
            cancel.clone(),
        )
        .await;
        if let Err(e) = started {
            // Loops already spawned must not outlive a router that failed to start.
            cancel.cancel();
            tracker.close();
            return Err(e.into());
        }
    }
    if let Some(path) = watched {
        watch_endpoints_file(
            path,
            Arc::clone(&state),
            Arc::clone(&feed),
            &tracker,
            cancel.clone(),
        )?;
    }
    let addr = listener.local_addr()?;
    let router = app(Arc::clone(&state));
    let cancel_http = cancel.clone();
    let server = tokio::spawn(async move {
        kvmesh_http::serve_with_stats(listener, router, http_limits, http_stats, cancel_http).await;
        Ok(())
    });
    Ok(RouterHandle {
        addr,
        state,
        cancel,
        tracker,
        server,
        _feed: feed,
    })
}

/// The features the config turns on, as the hooks the aggregated route calls.
fn hooks(
    config: &RouterConfig,
    scheduler: &Scheduler,
    registry: &mut Registry,
) -> Result<Vec<Arc<dyn Hook>>, RouterError> {
    let mut hooks: Vec<Arc<dyn Hook>> = Vec::new();
    if let Some(c) = &config.prefetch {
        if scheduler.profile(c.profile.as_deref()).is_none() {
            return Err(crate::config::ConfigError::Invalid(format!(
                "prefetch: unknown scheduling profile {:?}",
                c.profile
            ))
            .into());
        }
        hooks.push(Arc::new(Prefetch::new(c.clone(), registry)));
    }
    if let Some(c) = &config.replication {
        hooks.push(Arc::new(Replicate::new(c.clone(), registry)));
    }
    Ok(hooks)
}

/// Applies a new endpoint list: subscribes new endpoints' events, forgets removed ones.
fn apply_endpoints(state: &RouterState, feed: &dyn EventFeed, specs: Vec<EndpointSpec>) {
    apply_discovered(
        state,
        feed,
        specs.into_iter().map(Discovered::ready).collect(),
    );
}

/// [`apply_endpoints`] with readiness (discovery): a not-ready endpoint is kept, index entries
/// and event subscription included, but not placed.
pub fn apply_discovered(state: &RouterState, feed: &dyn EventFeed, found: Vec<Discovered>) {
    let diff = state.endpoints.apply_discovered(found);
    log_readiness(state, &diff.readiness);
    for e in &diff.removed {
        feed.remove_source(e.id);
        state.prefix.remove_endpoint(e.id);
        state.cost_model.forget_endpoint(e.id);
        state.reputation.retain(|id| id != e.id);
        state
            .metrics
            .endpoint_changes
            .get_or_create(&Kind { kind: "removed" })
            .inc();
        tracing::info!(endpoint = %e.name, "endpoint removed");
    }
    for e in &diff.added {
        if let Some(ev) = &e.spec.kv_events {
            feed.add_source(e.id, &e.name, &e.spec.url, ev);
        }
        state
            .metrics
            .endpoint_changes
            .get_or_create(&Kind { kind: "added" })
            .inc();
        tracing::info!(endpoint = %e.name, url = %e.spec.url, "endpoint added");
    }
}

fn log_readiness(state: &RouterState, flipped: &[(Arc<crate::fleet::endpoints::Endpoint>, bool)]) {
    for (e, ready) in flipped {
        let kind = if *ready { "ready" } else { "not_ready" };
        state
            .metrics
            .endpoint_changes
            .get_or_create(&Kind { kind })
            .inc();
        tracing::info!(endpoint = %e.name, ready, "endpoint readiness changed");
    }
}

/// Watches the endpoints file's directory (editors replace files by rename) and reloads on change
/// (the file may be the router config itself: only its `endpoints` list is re-applied). A file
/// that fails to parse leaves the current list in place (logged and counted).
fn watch_endpoints_file(
    path: PathBuf,
    state: Arc<RouterState>,
    feed: Arc<dyn EventFeed>,
    tracker: &TaskTracker,
    cancel: CancellationToken,
) -> Result<(), RouterError> {
    use notify::Watcher;
    let (tx, mut rx) = tokio::sync::mpsc::channel::<()>(1);
    let file_name = path.file_name().map(|n| n.to_owned());
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        if let Ok(ev) = res
            && ev
                .paths
                .iter()
                .any(|p| p.file_name() == file_name.as_deref())
        {
            // Full channel = a reload is already pending; coalesce.
            let _ = tx.try_send(());
        }
    })
    .map_err(|e| RouterError::Watch(e.to_string()))?;
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."))
        .to_owned();
    watcher
        .watch(&dir, notify::RecursiveMode::NonRecursive)
        .map_err(|e| RouterError::Watch(e.to_string()))?;
    tracker.spawn(async move {
        let _watcher = watcher;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                got = rx.recv() => if got.is_none() { return },
            }
            // Let a burst of writes settle before reading.
            tokio::time::sleep(Duration::from_millis(100)).await;
            while rx.try_recv().is_ok() {}
            let p = path.clone();
            match tokio::task::spawn_blocking(move || load_endpoints_file(&p)).await {
                Ok(Ok(specs)) => apply_endpoints(&state, &*feed, specs),
                Ok(Err(e)) => {
                    state
                        .metrics
                        .endpoint_changes
                        .get_or_create(&Kind {
                            kind: "reload_failed",
                        })
                        .inc();
                    tracing::warn!(error = %e, "endpoints file not applied");
                }
                Err(e) => tracing::warn!(error = %e, "endpoints reload task failed"),
            }
        }
    });
    Ok(())
}
