//! Starting a whole engine server: KV-event publisher, compute loop, HTTP listener. Used by the
//! `kvmesh engine` binary, the bench launcher and in-process tests.
//!
//! The HTTP listener is served connection by connection with hyper (not `axum::serve`, which has
//! no header-read timeout): a client that sends nothing, trickles its headers, or stalls its body
//! is dropped after [`HttpLimits::header_read_timeout`]; shutdown stops accepting at once and
//! lets in-flight requests, streams included, finish for up to [`HttpLimits::drain_timeout`].

use std::net::SocketAddr;
use std::sync::Arc;

use kvmesh_text::Tokenizer;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::api::{ApiState, router};
use crate::compute::ComputeBackend;
use crate::compute::profiles;
use crate::compute::sim::{SimBackend, SimConfig, SimH2d};
use crate::compute::sim_link::SimLink;
use crate::config::{AdvertisedAddr, ConfigError, EngineConfig, host_port};
use crate::engine::{Engine, EngineHandle, build_engine};
use crate::load_report::spawn_reporter;
use crate::p2p::{Handoffs, P2pConsumer, P2pHook, start_producer};
use crate::pd::PdHook;
use crate::prefetch::Prefetcher;
use crate::publish::{advertised_endpoint, start_event_publisher};
use crate::request_hook::RequestHook;

/// Why a server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("kv events: {0}")]
    Events(#[from] kvmesh_events::EventsError),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("unknown sim profile `{0}` (see `kvmesh engine --list-profiles`)")]
    UnknownProfile(String),
    #[error(transparent)]
    P2p(#[from] crate::p2p::P2pConfigError),
}

/// Extra wiring for a server. Without a `request_hook` the server installs P2P ([`P2pHook`]:
/// requests naming a `remote_kv_source` pull their missing prefix) with P/D around it
/// ([`PdHook`]); a custom hook replaces both and can wrap [`RunningServer::p2p`] itself.
#[derive(Default, Clone)]
pub struct ServerOptions {
    pub request_hook: Option<Arc<dyn RequestHook>>,
    /// Connection caps, header and body bounds, and the shutdown drain bound.
    pub http: HttpLimits,
    /// Where the HTTP server counts refusals (`kvmesh_http_*` on `/metrics`).
    pub http_stats: kvmesh_http::HttpStats,
}

pub use kvmesh_http::HttpLimits;

/// A running engine server.
pub struct RunningServer {
    /// The bound HTTP address (real port when started with port 0).
    pub addr: SocketAddr,
    pub engine: EngineHandle,
    /// The KV-event PUB endpoint bound (real port) or connected to, if events are on.
    pub events_endpoint: Option<String>,
    /// Whether the PUB socket bound `events_endpoint` or connects to it.
    pub events_mode: Option<kvmesh_events::EndpointMode>,
    pub replay_endpoint: Option<String>,
    /// The P2P producer's bound address (real port), when `--p2p-port` is set.
    pub p2p_addr: Option<SocketAddr>,
    /// The host this engine tells others ([`EngineConfig::advertised_host`]); None when it binds
    /// all interfaces and nobody must reach it.
    pub advertised_host: Option<String>,
    /// The P2P producer's address as peers are told it (P/D hand-off params, engine id).
    pub p2p_advertised: Option<AdvertisedAddr>,
    /// Where KV-event subscribers connect, when this engine binds the PUB socket and the address
    /// is known ([`crate::publish::advertised_endpoint`]).
    pub events_advertised: Option<String>,
    /// The engine's P2P consumer (one shared pull client).
    pub p2p: Arc<P2pConsumer>,
    /// Stops the HTTP listener (then drains); the rest stops once HTTP has drained.
    cancel: CancellationToken,
    /// Publisher and P2P producer: they keep serving while HTTP drains (a draining request's
    /// blocks are still published, a peer's pull from us still answered).
    background: CancellationToken,
    /// Taken once awaited ([`RunningServer::wait`] then [`RunningServer::shutdown`] is allowed).
    http: Option<JoinHandle<()>>,
    producer: Option<JoinHandle<()>>,
    core: Option<Engine>,
}

impl RunningServer {
    /// Stops accepting, drains in-flight requests (bounded by [`HttpLimits::drain_timeout`]),
    /// then ends the P2P producer, the compute loop and the publisher.
    pub async fn shutdown(mut self) {
        self.cancel.cancel();
        self.wait().await;
        self.background.cancel();
        if let Some(p) = self.producer.take() {
            // In-flight fetches drain; a consumer stuck on a dead socket cannot hold us long.
            let _ = tokio::time::timeout(std::time::Duration::from_secs(5), p).await;
        }
        if let Some(core) = self.core.take() {
            let _ = tokio::task::spawn_blocking(move || core.shutdown()).await;
        }
    }

    /// Resolves when the HTTP server has stopped and drained (e.g. after
    /// [`RunningServer::cancel_token`] fires).
    pub async fn wait(&mut self) {
        if let Some(http) = self.http.take() {
            let _ = http.await;
        }
    }

    /// Cancelling it stops accepting connections and starts the drain.
    pub fn cancel_token(&self) -> CancellationToken {
        self.cancel.clone()
    }
}

/// Builds the `sim` backend for `profile` on the default modelled link
/// ([`crate::compute::sim_link::DEFAULT_SIM_LINK`]).
pub fn sim_backend(
    config: &EngineConfig,
    profile: &str,
    time_scale: f64,
    kv_bytes_per_token: usize,
) -> Result<Box<dyn ComputeBackend>, ServerError> {
    sim_backend_with_link(
        config,
        profile,
        time_scale,
        kv_bytes_per_token,
        SimLink::default(),
        SimH2d::default(),
    )
}

/// Builds the `sim` backend for `profile` whose P2P transfers cost what `link` says
/// (`--sim-link`) and whose CPU-tier restores are charged as `h2d` says (`--sim-h2d`).
pub fn sim_backend_with_link(
    config: &EngineConfig,
    profile: &str,
    time_scale: f64,
    kv_bytes_per_token: usize,
    link: SimLink,
    h2d: SimH2d,
) -> Result<Box<dyn ComputeBackend>, ServerError> {
    let profile = profiles::profile(profile)
        .ok_or_else(|| ServerError::UnknownProfile(profile.to_owned()))?;
    if time_scale.is_nan() || time_scale <= 0.0 {
        return Err(ConfigError::Invalid("--time-scale must be > 0".into()).into());
    }
    if kv_bytes_per_token == 0 {
        return Err(ConfigError::Invalid("--sim-kv-bytes-per-token must be > 0".into()).into());
    }
    Ok(Box::new(SimBackend::new(SimConfig {
        profile,
        time_scale,
        kv_bytes_per_token,
        block_size: config.block_size,
        model_id: format!("sim:{}", profile.name),
        link,
        h2d,
    })))
}

/// Starts publisher, compute loop and HTTP server. Must run inside a tokio runtime.
pub async fn start_server(
    config: EngineConfig,
    backend: Box<dyn ComputeBackend>,
    tokenizer: Arc<dyn Tokenizer>,
    options: ServerOptions,
) -> Result<RunningServer, ServerError> {
    config.validate()?;
    let advertised_host = config.advertised_host()?;
    let cancel = CancellationToken::new();
    let background = CancellationToken::new();
    // Brackets an IPv6 host (`[::]:8000`); `:::8000` would not parse.
    let addr = host_port(&config.host, config.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|source| ServerError::Bind {
            addr: addr.clone(),
            source,
        })?;
    let local = listener
        .local_addr()
        .map_err(|source| ServerError::Bind { addr, source })?;
    let publishing =
        start_event_publisher(config.kv_events.as_ref(), background.child_token()).await?;
    let p2p_port = config.p2p.port;
    let host = config.host.clone();
    let reports = publishing.handle.clone();
    let core = build_engine(config, backend, tokenizer, publishing.sink)?;
    let engine = core.handle.clone();
    // Which P/D reader each retained block is kept for: the P/D hook records, the producer
    // releases.
    let handoffs = Arc::new(Handoffs::default());
    let p2p = async {
        let consumer = Arc::new(P2pConsumer::new(&engine)?);
        let producer = match p2p_port {
            Some(port) => Some(
                start_producer(
                    &engine,
                    &host,
                    port,
                    Arc::clone(&handoffs),
                    background.child_token(),
                )
                .await?,
            ),
            None => None,
        };
        Ok::<_, ServerError>((consumer, producer))
    };
    let (consumer, producer) = match p2p.await {
        Ok(x) => x,
        Err(e) => {
            // Do not leave the compute thread and the publisher running behind a failed start.
            background.cancel();
            let _ = tokio::task::spawn_blocking(move || core.shutdown()).await;
            return Err(e);
        }
    };
    // Peers get the advertised host with the port actually bound (port 0 picks one).
    let p2p_advertised = producer
        .as_ref()
        .zip(advertised_host.as_ref())
        .map(|(p, host)| AdvertisedAddr {
            host: host.clone(),
            port: p.addr.port(),
        });
    let events_advertised = match (&publishing.endpoint, publishing.mode) {
        (Some(ep), Some(kvmesh_events::EndpointMode::Bind)) => {
            advertised_endpoint(ep, advertised_host.as_deref())
        }
        _ => None,
    };
    let mut state = ApiState::new(engine.clone());
    state.prefetcher = Some(Arc::new(Prefetcher::new(Arc::clone(&consumer))));
    // P2P is the default hook; P/D adds its NIXL-style params around it.
    let default_hook = || {
        let p2p = P2pHook {
            consumer: Arc::clone(&consumer),
        };
        Arc::new(PdHook::new(p2p, handoffs, p2p_advertised.clone())) as Arc<dyn RequestHook>
    };
    state.request_hook = Some(options.request_hook.unwrap_or_else(default_hook));
    state.http_stats = Some(options.http_stats.clone());
    if let Some(publisher) = reports {
        spawn_reporter(Arc::clone(&state.load), publisher, background.child_token());
    }
    let app = router(state);
    let (stop, after) = (cancel.clone(), background.clone());
    let http = tokio::spawn(async move {
        kvmesh_http::serve_with_stats(listener, app, options.http, options.http_stats, stop).await;
        after.cancel();
    });
    Ok(RunningServer {
        addr: local,
        engine,
        events_endpoint: publishing.endpoint,
        events_mode: publishing.mode,
        replay_endpoint: publishing.replay_endpoint,
        p2p_addr: producer.as_ref().map(|p| p.addr),
        advertised_host,
        p2p_advertised,
        events_advertised,
        p2p: consumer,
        cancel,
        background,
        http: Some(http),
        producer: producer.map(|p| p.task),
        core: Some(core),
    })
}
