//! Starting a whole engine server: KV-event publisher, compute loop, HTTP listener. Used by the
//! `kvmesh engine` binary, the bench launcher and in-process tests.
//!
//! The HTTP listener is served connection by connection with hyper (not `axum::serve`, which has
//! no header-read timeout): a client that sends nothing, trickles its headers, or stalls its body
//! is dropped after [`HttpLimits::header_read_timeout`]; shutdown stops accepting at once and
//! lets in-flight requests, streams included, finish for up to [`HttpLimits::drain_timeout`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvmesh_text::Tokenizer;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admission::AdmissionHook;
use crate::api::{ApiState, router};
use crate::compute::ComputeBackend;
use crate::compute::profiles;
use crate::compute::sim::{SimBackend, SimConfig};
use crate::config::{ConfigError, EngineConfig};
use crate::engine::{Engine, EngineHandle, build_engine};
use crate::p2p::{P2pConsumer, start_producer};
use crate::pd::PdAdmission;
use crate::publish::start_event_publisher;

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

/// Extra wiring for a server. Without an `admission_hook` the server installs
/// [`PdAdmission`] (P/D params; requests naming a `remote_kv_source` pull their missing prefix
/// through `P2pAdmission`); a custom
/// hook can wrap [`RunningServer::p2p`] itself.
#[derive(Default, Clone)]
pub struct ServerOptions {
    pub admission_hook: Option<Arc<dyn AdmissionHook>>,
    /// Connection timeouts and the shutdown drain bound.
    pub http: HttpLimits,
}

/// Bounds on the HTTP server's connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// A connection must deliver a request's complete headers within this, counted from when it
    /// opens or its previous response ended (so it also bounds idle keep-alive connections), and
    /// no two chunks of a request body may be further apart.
    pub header_read_timeout: Duration,
    /// After shutdown begins, how long in-flight requests (streams included) may take to finish
    /// before their connections are closed.
    pub drain_timeout: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            drain_timeout: Duration::from_secs(30),
        }
    }
}

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

/// Builds the `sim` backend for `profile`.
pub fn sim_backend(
    config: &EngineConfig,
    profile: &str,
    time_scale: f64,
    kv_bytes_per_token: usize,
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
    let cancel = CancellationToken::new();
    let background = CancellationToken::new();
    let addr = format!("{}:{}", config.host, config.port);
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
    let core = build_engine(config, backend, tokenizer, publishing.sink)?;
    let engine = core.handle.clone();
    let p2p = async {
        let consumer = Arc::new(P2pConsumer::new(&engine)?);
        let producer = match p2p_port {
            Some(port) => Some(
                start_producer(
                    &engine,
                    &host,
                    port,
                    Arc::clone(consumer.handoffs()),
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
    let mut state = ApiState::new(engine.clone());
    // P/D hook: handles NIXL-style P/D params and delegates `remote_kv_source` to P2pAdmission.
    state.admission_hook = Some(options.admission_hook.unwrap_or_else(|| {
        Arc::new(PdAdmission::new(
            consumer.clone(),
            producer.as_ref().map(|p| p.addr),
        ))
    }));
    let app = router(state);
    let (stop, after) = (cancel.clone(), background.clone());
    let http = tokio::spawn(async move {
        serve(listener, app, options.http, stop).await;
        after.cancel();
    });
    Ok(RunningServer {
        addr: local,
        engine,
        events_endpoint: publishing.endpoint,
        events_mode: publishing.mode,
        replay_endpoint: publishing.replay_endpoint,
        p2p_addr: producer.as_ref().map(|p| p.addr),
        p2p: consumer,
        cancel,
        background,
        http: Some(http),
        producer: producer.map(|p| p.task),
        core: Some(core),
    })
}

/// Serves `app` on `listener` until `stop` fires, then refuses new connections (the listener is
/// closed), lets open requests finish for up to `limits.drain_timeout`, and closes what is left.
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    limits: HttpLimits,
    stop: CancellationToken,
) {
    // A stalled request body is bounded like stalled headers: the timer restarts on every chunk,
    // so a large prompt that keeps arriving is never cut.
    let app = app.layer(tower_http::timeout::RequestBodyTimeoutLayer::new(
        limits.header_read_timeout,
    ));
    let mut http1 = hyper::server::conn::http1::Builder::new();
    // HTTP/1.1 only, like vLLM's server: no protocol sniffing (an auto-detecting server reads
    // the first bytes with no timeout at all).
    http1
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let conns = TaskTracker::new();
    let kill = CancellationToken::new();
    loop {
        let tcp = tokio::select! {
            _ = stop.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    accept_failed(&e).await;
                    continue;
                }
            },
        };
        // Tokens stream out as small writes; without TCP_NODELAY a chunk can wait for the peer's
        // delayed ACK (~40 ms), which a router in front of the engine pays on its first chunk.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "could not set TCP_NODELAY on a client connection");
        }
        let conn = http1.serve_connection(
            hyper_util::rt::TokioIo::new(tcp),
            hyper_util::service::TowerToHyperService::new(app.clone()),
        );
        conns.spawn(drive_connection(conn, stop.clone(), kill.clone()));
    }
    drop(listener);
    conns.close();
    if tokio::time::timeout(limits.drain_timeout, conns.wait())
        .await
        .is_err()
    {
        tracing::warn!(
            open = conns.len(),
            "drain timeout: closing connections whose requests are still running"
        );
        kill.cancel();
        conns.wait().await;
    }
}

/// One client connection as hyper serves it.
type Connection = hyper::server::conn::http1::Connection<
    hyper_util::rt::TokioIo<tokio::net::TcpStream>,
    hyper_util::service::TowerToHyperService<axum::Router>,
>;

/// Runs one connection; on `drain` it finishes the request in progress (no keep-alive after
/// it), on `kill` it is dropped (a dropped response stream aborts its request).
async fn drive_connection(conn: Connection, drain: CancellationToken, kill: CancellationToken) {
    let mut conn = std::pin::pin!(conn);
    let ended = tokio::select! {
        ended = conn.as_mut() => Some(ended),
        _ = drain.cancelled() => None,
    };
    let ended = match ended {
        Some(ended) => ended,
        None => {
            conn.as_mut().graceful_shutdown();
            tokio::select! {
                ended = conn.as_mut() => ended,
                _ = kill.cancelled() => return,
            }
        }
    };
    if let Err(e) = ended {
        // Header timeouts, resets and malformed requests land here: the client's problem.
        tracing::debug!(error = %e, "http connection ended with an error");
    }
}

/// Accept errors are per connection (reset before accept) or resource exhaustion (EMFILE):
/// neither stops the server; back off a little on the latter so the loop does not spin.
async fn accept_failed(e: &std::io::Error) {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if !matches!(
        e.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    ) {
        tracing::warn!(error = %e, "accepting a connection failed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
