//! HTTP serving shared by the engine and the router: hyper's HTTP/1 server driven connection by
//! connection, because `axum::serve` has no header-read timeout and no connection caps.
//!
//! What a client can make the server hold is bounded (issue 37; numbers in
//! `docs/reliability.md#hostile-clients`):
//! - **Headers**: complete within [`HttpLimits::header_read_timeout`] of the connection opening or
//!   its previous response ending, however they trickle in (hyper's deadline; it also bounds idle
//!   keep-alive connections).
//! - **Bodies** ([`body`]): complete within [`HttpLimits::body_timeout`] plus the time their bytes
//!   earn at [`HttpLimits::body_min_rate`], no stall longer than the header timeout, at most
//!   [`HttpLimits::max_body_bytes`], and all bodies in flight together within
//!   [`HttpLimits::body_memory`] (past it: 503 with `Retry-After`).
//! - **Connections** ([`gate`]): at most [`HttpLimits::max_connections`] open (never more than half
//!   the process's file descriptors) and [`HttpLimits::max_connections_per_ip`] per source; past
//!   either, the connection is answered 503 and closed at accept, before hyper reads a byte.
//!   Counted in `kvmesh_http_*` ([`HttpStats`]).
//! - HTTP/1.1 only, like vLLM's server: an auto-detecting server reads the first bytes with no
//!   timeout at all.
//! - `TCP_NODELAY` on every connection: tokens stream out as small writes, and with Nagle's
//!   algorithm the first chunk waited for the client's delayed ACK of the headers (measured through
//!   the router: 43.7 ms vs 1.7 ms).
//! - Shutdown closes the listener at once (new connections are refused) and lets in-flight
//!   requests, streams included, finish for up to [`HttpLimits::drain_timeout`].

mod body;
mod gate;
mod settings;
mod stats;

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use kvmesh_core::conn_gate::{ConnectionGate, Refusal};
pub use settings::HttpSettings;
pub use stats::HttpStats;

/// Bounds on the HTTP server's connections and request bodies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// A connection must deliver a request's complete headers within this, counted from when it
    /// opens or its previous response ended (so it also bounds idle keep-alive connections), and
    /// no two chunks of a request body may be further apart.
    pub header_read_timeout: Duration,
    /// After shutdown begins, how long in-flight requests (streams included) may take to finish
    /// before their connections are closed.
    pub drain_timeout: Duration,
    /// A request body must be complete this long after its headers ended, plus the time its
    /// bytes earn at [`Self::body_min_rate`].
    pub body_timeout: Duration,
    /// Bytes per second: each byte received extends the body's deadline by `1 / body_min_rate`
    /// seconds, so a large body arriving at least this fast is never cut.
    pub body_min_rate: u64,
    /// Largest request body accepted (413 beyond, before reading when `Content-Length` says so).
    pub max_body_bytes: usize,
    /// Bytes of request bodies held at once by all connections together (503 with
    /// `Retry-After` beyond).
    pub body_memory: usize,
    /// Open client connections at most (further ones are answered 503 and closed at accept).
    pub max_connections: usize,
    /// Open connections from one source address (IPv6: one /64) at most; 0 = no such cap.
    pub max_connections_per_ip: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            drain_timeout: Duration::from_secs(30),
            body_timeout: Duration::from_secs(30),
            body_min_rate: 256 << 10,
            max_body_bytes: 64 << 20,
            body_memory: 1 << 30,
            max_connections: 8192,
            max_connections_per_ip: 4096,
        }
    }
}

/// A limit that cannot work, and which setting it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidLimit {
    pub setting: Setting,
    pub reason: String,
}

/// The settings [`HttpLimits::validate`] checks, named as each server spells them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setting {
    HeaderReadTimeout,
    BodyTimeout,
    BodyMinRate,
    MaxConnections,
    BodyMemory,
}

impl Setting {
    /// The router's YAML key.
    pub fn yaml_key(self) -> &'static str {
        match self {
            Setting::HeaderReadTimeout => "header_read_timeout",
            Setting::BodyTimeout => "http.body_timeout",
            Setting::BodyMinRate => "http.body_min_bytes_per_second",
            Setting::MaxConnections => "http.max_connections",
            Setting::BodyMemory => "http.body_memory_bytes",
        }
    }

    /// The engine's command-line flag.
    pub fn flag(self) -> &'static str {
        match self {
            Setting::HeaderReadTimeout => "--header-read-timeout",
            Setting::BodyTimeout => "--http-body-timeout",
            Setting::BodyMinRate => "--http-body-min-rate",
            Setting::MaxConnections => "--http-max-connections",
            Setting::BodyMemory => "--http-body-memory",
        }
    }
}

impl HttpLimits {
    /// Refuses limits that cannot work.
    pub fn validate(&self) -> Result<(), InvalidLimit> {
        let invalid = |setting, reason: &str| {
            Err(InvalidLimit {
                setting,
                reason: reason.to_owned(),
            })
        };
        if self.header_read_timeout.is_zero() {
            return invalid(Setting::HeaderReadTimeout, "must be > 0");
        }
        if self.body_timeout.is_zero() {
            return invalid(Setting::BodyTimeout, "must be > 0");
        }
        if self.body_min_rate == 0 {
            return invalid(Setting::BodyMinRate, "must be > 0");
        }
        if self.max_connections == 0 {
            return invalid(Setting::MaxConnections, "must be > 0");
        }
        if self.body_memory < self.max_body_bytes {
            return invalid(
                Setting::BodyMemory,
                &format!(
                    "{} bytes is below the largest accepted body ({} bytes), which could then never be read",
                    self.body_memory, self.max_body_bytes
                ),
            );
        }
        Ok(())
    }
}

/// Serves `app` on `listener` until `stop` fires, then refuses new connections (the listener is
/// closed), lets open requests finish for up to `limits.drain_timeout`, and closes what is left.
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    limits: HttpLimits,
    stop: CancellationToken,
) {
    serve_with_stats(listener, app, limits, HttpStats::default(), stop).await;
}

/// [`serve`], counting into `stats` (which the caller has registered in its metrics).
pub async fn serve_with_stats(
    listener: TcpListener,
    app: axum::Router,
    limits: HttpLimits,
    stats: HttpStats,
    stop: CancellationToken,
) {
    let app = with_body_bounds(app, limits, &stats);
    let admission = connection_gate(&limits);
    let mut http1 = hyper::server::conn::http1::Builder::new();
    // HTTP/1.1 only, like vLLM's server: no protocol sniffing (an auto-detecting server reads
    // the first bytes with no timeout at all).
    http1
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let conns = TaskTracker::new();
    let kill = CancellationToken::new();
    loop {
        let (tcp, peer) = tokio::select! {
            _ = stop.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    accept_failed(&e).await;
                    continue;
                }
            },
        };
        let slot = match admission.admit(peer.ip()) {
            Ok(slot) => slot,
            Err(refusal) => {
                stats.refuse_connection(refusal.as_str());
                refuse(tcp, refusal);
                continue;
            }
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
        let open = stats.open_connections.clone();
        open.inc();
        let (drain, kill) = (stop.clone(), kill.clone());
        conns.spawn(async move {
            drive_connection(conn, drain, kill).await;
            open.dec();
            drop(slot);
        });
    }
    drop(listener);
    drain(conns, kill, limits.drain_timeout).await;
}

/// `app` with request bodies read whole under the deadline, size and memory bounds ([`body`]).
fn with_body_bounds(app: axum::Router, limits: HttpLimits, stats: &HttpStats) -> axum::Router {
    let guard = Arc::new(body::BodyGuard {
        limits,
        budget: body::BodyBudget::new(limits.body_memory, stats.body_bytes_in_flight.clone()),
        stats: stats.clone(),
    });
    app.layer(axum::middleware::from_fn_with_state(
        guard,
        body::read_whole_body,
    ))
}

/// The connection caps, the total lowered to half the open-file limit if need be (logged).
fn connection_gate(limits: &HttpLimits) -> ConnectionGate {
    let max_connections =
        gate::effective_max_connections(limits.max_connections, gate::open_files_soft_limit());
    if max_connections < limits.max_connections {
        tracing::warn!(
            configured = limits.max_connections,
            applied = max_connections,
            "max_connections lowered to half the open-file limit (raise `ulimit -n` to allow more)"
        );
    }
    ConnectionGate::new(max_connections, limits.max_connections_per_ip)
}

/// Lets the connections still open finish for up to `timeout`, then drops them (`kill`).
async fn drain(conns: TaskTracker, kill: CancellationToken, timeout: Duration) {
    conns.close();
    if tokio::time::timeout(timeout, conns.wait()).await.is_err() {
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

/// Answers a connection past a cap with a 503 and closes it, without waiting: one non-blocking
/// write of a small response straight to the socket (a fresh socket's send buffer always has room
/// for it; tokio's `try_write` would refuse before the reactor has seen the socket writable).
fn refuse(tcp: tokio::net::TcpStream, refusal: Refusal) {
    use std::io::Write;
    let body = format!(
        r#"{{"error":{{"message":"too many connections ({})","type":"ServiceUnavailableError","param":null,"code":503}}}}"#,
        refusal.as_str()
    );
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    if let Ok(mut socket) = tcp.into_std() {
        let _ = socket.write(response.as_bytes());
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
