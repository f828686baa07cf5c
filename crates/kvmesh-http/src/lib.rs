//! HTTP serving shared by the engine and the router: hyper's HTTP/1 server driven connection by
//! connection, because `axum::serve` has no header-read timeout.
//!
//! - A client that sends nothing, trickles its headers or stalls its request body is dropped after
//!   [`HttpLimits::header_read_timeout`] (slowloris); the timer restarts with every body chunk, so a
//!   large prompt that keeps arriving is never cut.
//! - HTTP/1.1 only, like vLLM's server: an auto-detecting server reads the first bytes with no
//!   timeout at all.
//! - `TCP_NODELAY` on every connection: tokens stream out as small writes, and with Nagle's
//!   algorithm the first chunk waited for the client's delayed ACK of the headers (measured through
//!   the router: 43.7 ms vs 1.7 ms).
//! - Shutdown closes the listener at once (new connections are refused) and lets in-flight
//!   requests, streams included, finish for up to [`HttpLimits::drain_timeout`].

use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

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
