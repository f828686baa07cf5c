//! Byte streams under ZMTP: TCP and Unix-domain (`ipc://`) listeners and connections, and the
//! handshake timeout every socket kind shares.

use std::net::IpAddr;
use std::path::PathBuf;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};

use crate::limits::HANDSHAKE_TIMEOUT;
use crate::zmtp::{SocketType, ZmtpError, handshake};

/// Something ZMTP can run over.
pub(crate) trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}
pub(crate) type BoxStream = Box<dyn Stream>;

/// A parsed, resolved endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Addr {
    /// `host:port` as tokio resolves it (`0.0.0.0:5557`, `[::1]:5557`, `localhost:5557`).
    Tcp(String),
    Ipc(PathBuf),
}

impl Addr {
    /// From an endpoint that `resolve_endpoint` produced (`tcp://…` or `ipc://…`).
    pub(crate) fn parse(endpoint: &str) -> Option<Addr> {
        if let Some(rest) = endpoint.strip_prefix("tcp://") {
            Some(Addr::Tcp(rest.to_owned()))
        } else {
            endpoint
                .strip_prefix("ipc://")
                .map(|p| Addr::Ipc(PathBuf::from(p)))
        }
    }
}

pub(crate) enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

impl Listener {
    /// Binds; returns the listener and the endpoint with the real port.
    pub(crate) async fn bind(addr: &Addr) -> std::io::Result<(Listener, String)> {
        match addr {
            Addr::Tcp(hp) => {
                let l = TcpListener::bind(hp.as_str()).await?;
                let local = l.local_addr()?;
                Ok((Listener::Tcp(l), format!("tcp://{local}")))
            }
            Addr::Ipc(path) => {
                // libzmq removes a stale socket file before binding; so do we.
                let _ = std::fs::remove_file(path);
                let l = UnixListener::bind(path)?;
                Ok((Listener::Unix(l), format!("ipc://{}", path.display())))
            }
        }
    }

    /// The next connection and its source address (`None` for a Unix-domain peer).
    pub(crate) async fn accept(&self) -> std::io::Result<(BoxStream, Option<IpAddr>)> {
        match self {
            Listener::Tcp(l) => {
                let (s, peer) = l.accept().await?;
                let _ = s.set_nodelay(true);
                Ok((Box::new(s), Some(peer.ip())))
            }
            Listener::Unix(l) => {
                let (s, _) = l.accept().await?;
                Ok((Box::new(s), None))
            }
        }
    }
}

pub(crate) async fn connect(addr: &Addr) -> std::io::Result<BoxStream> {
    match addr {
        Addr::Tcp(hp) => {
            let s = TcpStream::connect(hp.as_str()).await?;
            let _ = s.set_nodelay(true);
            Ok(Box::new(s))
        }
        Addr::Ipc(path) => Ok(Box::new(UnixStream::connect(path).await?)),
    }
}

/// [`handshake`] bounded by [`HANDSHAKE_TIMEOUT`].
pub(crate) async fn timed_handshake(
    stream: &mut BoxStream,
    ours: SocketType,
) -> Result<SocketType, ZmtpError> {
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake(stream, ours)).await {
        Ok(r) => r,
        Err(_) => Err(ZmtpError::Handshake("timed out".into())),
    }
}
