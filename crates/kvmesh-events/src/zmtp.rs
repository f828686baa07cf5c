//! ZMTP 3.0 with the NULL mechanism — the ZeroMQ wire protocol vLLM's pyzmq speaks — written to
//! face hostile peers: every length a peer declares is checked against a bound from
//! [`crate::limits`] before anything is read, and a frame is buffered only as its bytes arrive.
//!
//! Why not libzmq: its `ZMQ_MAXMSGSIZE` bounds one frame, but it queues the frames of a multipart
//! message without limit until the last one arrives (measured with libzmq 4.3.4: 31 MB of empty
//! "more" frames grew a SUB socket to 1 GB of RSS in 3 s), and the pure-Rust `zeromq` crate
//! reserved whatever a long-size header declared (2^62 bytes aborted the process). The subset
//! here is what KV events need: PUB, SUB, ROUTER (one reply stream per connection) and DEALER.
//!
//! We greet as ZMTP 3.0, so peers speaking 3.1 (libzmq ≥ 4.2) fall back to 3.0 subscription
//! messages (`\x01topic`); the 3.1 SUBSCRIBE/CANCEL commands are understood on input anyway.

use bytes::{BufMut, Bytes, BytesMut};
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::limits::{FRAME_TIMEOUT, MAX_HANDSHAKE_FRAME};

/// The ZMTP socket types kvmesh uses, plus the ones it must recognise in a peer's READY.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SocketType {
    Pub,
    Sub,
    XPub,
    XSub,
    Router,
    Dealer,
    Req,
    Rep,
    Other,
}

impl SocketType {
    fn name(self) -> &'static str {
        match self {
            SocketType::Pub => "PUB",
            SocketType::Sub => "SUB",
            SocketType::XPub => "XPUB",
            SocketType::XSub => "XSUB",
            SocketType::Router => "ROUTER",
            SocketType::Dealer => "DEALER",
            SocketType::Req => "REQ",
            SocketType::Rep => "REP",
            SocketType::Other => "?",
        }
    }

    fn parse(raw: &[u8]) -> SocketType {
        match raw {
            b"PUB" => SocketType::Pub,
            b"SUB" => SocketType::Sub,
            b"XPUB" => SocketType::XPub,
            b"XSUB" => SocketType::XSub,
            b"ROUTER" => SocketType::Router,
            b"DEALER" => SocketType::Dealer,
            b"REQ" => SocketType::Req,
            b"REP" => SocketType::Rep,
            _ => SocketType::Other,
        }
    }

    /// ZMTP's compatibility table (RFC 23), as libzmq enforces it.
    fn accepts(self, peer: SocketType) -> bool {
        use SocketType::*;
        match self {
            Pub | XPub => matches!(peer, Sub | XSub),
            Sub | XSub => matches!(peer, Pub | XPub),
            Router => matches!(peer, Dealer | Req | Router),
            Dealer => matches!(peer, Router | Rep | Dealer),
            Req => matches!(peer, Router | Rep),
            Rep => matches!(peer, Dealer | Req),
            Other => false,
        }
    }
}

/// Why a ZMTP connection was refused or dropped.
#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("not a ZMTP 3 NULL-mechanism greeting: {0}")]
    Greeting(String),
    #[error("handshake: {0}")]
    Handshake(String),
    #[error("frame of {size} bytes exceeds the bound of {limit}")]
    FrameTooLarge { size: u64, limit: usize },
    #[error("message exceeds the bound of {limit} parts / {bytes} bytes")]
    MessageTooLarge { limit: usize, bytes: usize },
    #[error("protocol: {0}")]
    Protocol(String),
    #[error("peer too slow: a frame did not complete in time")]
    Timeout,
}

/// Per-connection receive bounds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub max_frame: usize,
    pub max_parts: usize,
    pub max_message: usize,
}

const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;
const GREETING_LEN: usize = 64;

/// Our greeting: signature (with libzmq's ZMTP 1.0-compatible padding), version 3.0, NULL.
fn greeting() -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0] = 0xff;
    g[8] = 0x01;
    g[9] = 0x7f;
    g[10] = 3;
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// Checks a peer's 64-byte greeting: ZMTP 3.x, NULL mechanism.
pub(crate) fn check_greeting(g: &[u8; GREETING_LEN]) -> Result<(), ZmtpError> {
    if g[0] != 0xff || g[9] & 0x01 == 0 {
        return Err(ZmtpError::Greeting("bad signature".into()));
    }
    if g[10] < 3 {
        return Err(ZmtpError::Greeting(format!("ZMTP version {} < 3", g[10])));
    }
    let mechanism = &g[12..32];
    let end = mechanism.iter().position(|&b| b == 0).unwrap_or(20);
    if &mechanism[..end] != b"NULL" {
        return Err(ZmtpError::Greeting(format!(
            "mechanism {:?} (only NULL is spoken)",
            String::from_utf8_lossy(&mechanism[..end])
        )));
    }
    Ok(())
}

/// Appends one frame.
fn put_frame(buf: &mut BytesMut, flags: u8, body: &[u8]) {
    if body.len() > 255 {
        buf.put_u8(flags | FLAG_LONG);
        buf.put_u64(body.len() as u64);
    } else {
        buf.put_u8(flags);
        buf.put_u8(body.len() as u8);
    }
    buf.put_slice(body);
}

/// Encodes a multipart message (at least one part; an empty list sends one empty frame).
pub(crate) fn encode_message<P: AsRef<[u8]>>(parts: &[P]) -> Bytes {
    let size: usize = parts.iter().map(|p| p.as_ref().len() + 9).sum();
    let mut buf = BytesMut::with_capacity(size.max(2));
    if parts.is_empty() {
        put_frame(&mut buf, 0, &[]);
    }
    for (i, p) in parts.iter().enumerate() {
        let more = if i + 1 < parts.len() { FLAG_MORE } else { 0 };
        put_frame(&mut buf, more, p.as_ref());
    }
    buf.freeze()
}

fn encode_command(name: &str, body: &[u8]) -> Bytes {
    let mut cmd = Vec::with_capacity(1 + name.len() + body.len());
    cmd.push(name.len() as u8);
    cmd.extend_from_slice(name.as_bytes());
    cmd.extend_from_slice(body);
    let mut buf = BytesMut::with_capacity(cmd.len() + 9);
    put_frame(&mut buf, FLAG_COMMAND, &cmd);
    buf.freeze()
}

fn ready_command(ours: SocketType) -> Bytes {
    let mut props = Vec::new();
    let mut prop = |name: &str, value: &[u8]| {
        props.push(name.len() as u8);
        props.extend_from_slice(name.as_bytes());
        props.extend_from_slice(&(value.len() as u32).to_be_bytes());
        props.extend_from_slice(value);
    };
    prop("Socket-Type", ours.name().as_bytes());
    if matches!(
        ours,
        SocketType::Dealer | SocketType::Router | SocketType::Req
    ) {
        prop("Identity", b"");
    }
    encode_command("READY", &props)
}

/// The peer's socket type from a READY body (after the command name).
fn parse_ready(mut props: &[u8]) -> Result<SocketType, ZmtpError> {
    let bad = |why: &str| ZmtpError::Handshake(format!("malformed READY: {why}"));
    let mut socket_type = None;
    while !props.is_empty() {
        let name_len = props[0] as usize;
        let name = props.get(1..1 + name_len).ok_or_else(|| bad("name"))?;
        let rest = &props[1 + name_len..];
        let len_bytes: [u8; 4] = rest
            .get(..4)
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| bad("value length"))?;
        let value_len = u32::from_be_bytes(len_bytes) as usize;
        let value = rest.get(4..4 + value_len).ok_or_else(|| bad("value"))?;
        if name.eq_ignore_ascii_case(b"Socket-Type") {
            socket_type = Some(SocketType::parse(value));
        }
        props = &rest[4 + value_len..];
    }
    socket_type.ok_or_else(|| bad("no Socket-Type"))
}

/// Greeting and READY exchange; returns the peer's socket type. The caller bounds it in time
/// ([`crate::limits::HANDSHAKE_TIMEOUT`]).
pub(crate) async fn handshake<S>(stream: &mut S, ours: SocketType) -> Result<SocketType, ZmtpError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    stream.write_all(&greeting()).await?;
    stream.write_all(&ready_command(ours)).await?;
    stream.flush().await?;
    let mut g = [0u8; GREETING_LEN];
    // The signature alone tells a non-ZMTP peer (say, an HTTP client) apart: refuse it at once
    // rather than wait for bytes it will never send.
    stream.read_exact(&mut g[..10]).await?;
    if g[0] != 0xff || g[9] & 0x01 == 0 {
        return Err(ZmtpError::Greeting("bad signature".into()));
    }
    stream.read_exact(&mut g[10..]).await?;
    check_greeting(&g)?;
    let limits = Limits {
        max_frame: MAX_HANDSHAKE_FRAME,
        max_parts: 1,
        max_message: MAX_HANDSHAKE_FRAME,
    };
    match read_inbound(stream, &limits, None).await? {
        Inbound::Command { name, body } if name.as_ref() == b"READY" => {
            let peer = parse_ready(&body)?;
            if !ours.accepts(peer) {
                let reason = format!("{} cannot talk to {}", ours.name(), peer.name());
                let _ = stream
                    .write_all(&encode_command("ERROR", &error_body(&reason)))
                    .await;
                return Err(ZmtpError::Handshake(reason));
            }
            Ok(peer)
        }
        Inbound::Command { name, body } if name.as_ref() == b"ERROR" => {
            Err(ZmtpError::Handshake(format!(
                "peer refused: {}",
                String::from_utf8_lossy(body.get(1..).unwrap_or(&[]))
            )))
        }
        _ => Err(ZmtpError::Handshake("expected READY".into())),
    }
}

fn error_body(reason: &str) -> Vec<u8> {
    let r = &reason.as_bytes()[..reason.len().min(255)];
    let mut b = vec![r.len() as u8];
    b.extend_from_slice(r);
    b
}

/// One thing a peer sent after the handshake.
#[derive(Debug)]
pub(crate) enum Inbound {
    /// A complete message, and the buffer permits it holds (released when it is dropped).
    Message(Vec<Bytes>, Option<OwnedSemaphorePermit>),
    Command {
        name: Bytes,
        body: Bytes,
    },
}

/// Reads one message or command within `limits`. With a `budget`, the bytes of each frame body
/// are reserved from it before they are read, so all peers of one socket together stay under it.
/// Not cancel-safe: run it in a task of its own, not as a `select!` branch.
pub(crate) async fn read_inbound<R>(
    r: &mut R,
    limits: &Limits,
    budget: Option<&Arc<Semaphore>>,
) -> Result<Inbound, ZmtpError>
where
    R: AsyncRead + Unpin,
{
    let mut parts = Vec::new();
    let mut total = 0usize;
    let mut held: Option<OwnedSemaphorePermit> = None;
    loop {
        let flags = r.read_u8().await?;
        let size = if flags & FLAG_LONG != 0 {
            timed(r.read_u64()).await?
        } else {
            u64::from(timed(r.read_u8()).await?)
        };
        if size > limits.max_frame as u64 {
            return Err(ZmtpError::FrameTooLarge {
                size,
                limit: limits.max_frame,
            });
        }
        // Bounded by `max_frame` just above, so it fits a usize.
        let size = size as usize;
        if flags & FLAG_COMMAND != 0 {
            if !parts.is_empty() {
                return Err(ZmtpError::Protocol(
                    "command inside a multipart message".into(),
                ));
            }
            let body = read_body(r, size).await?;
            let name_len = body.first().copied().unwrap_or(0) as usize;
            if body.len() < 1 + name_len {
                return Err(ZmtpError::Protocol("truncated command name".into()));
            }
            return Ok(Inbound::Command {
                name: body.slice(1..1 + name_len),
                body: body.slice(1 + name_len..),
            });
        }
        total += size;
        if parts.len() >= limits.max_parts || total > limits.max_message {
            return Err(ZmtpError::MessageTooLarge {
                limit: limits.max_parts,
                bytes: limits.max_message,
            });
        }
        if let Some(budget) = budget
            && size > 0
        {
            let permit = budget
                .clone()
                .acquire_many_owned(size as u32)
                .await
                .map_err(|_| ZmtpError::Protocol("socket closed".into()))?;
            match held.as_mut() {
                Some(h) => h.merge(permit),
                None => held = Some(permit),
            }
        }
        parts.push(read_body(r, size).await?);
        if flags & FLAG_MORE == 0 {
            return Ok(Inbound::Message(parts, held));
        }
    }
}

/// Reads `size` bytes, growing the buffer only as they arrive.
async fn read_body<R: AsyncRead + Unpin>(r: &mut R, size: usize) -> Result<Bytes, ZmtpError> {
    let mut buf = Vec::with_capacity(size.min(64 << 10));
    let read = timed((&mut *r).take(size as u64).read_to_end(&mut buf)).await?;
    if read != size {
        return Err(ZmtpError::Io(std::io::ErrorKind::UnexpectedEof.into()));
    }
    Ok(Bytes::from(buf))
}

async fn timed<T>(
    f: impl std::future::Future<Output = std::io::Result<T>>,
) -> Result<T, ZmtpError> {
    match tokio::time::timeout(FRAME_TIMEOUT, f).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(ZmtpError::Timeout),
    }
}

/// A subscription change carried by a message (ZMTP 3.0) or a command (3.1): `(subscribe, topic)`.
pub(crate) fn subscription(inbound: &Inbound) -> Option<(bool, Bytes)> {
    match inbound {
        Inbound::Message(parts, _) if parts.len() == 1 => {
            let p = &parts[0];
            match p.first() {
                Some(1) => Some((true, p.slice(1..))),
                Some(0) => Some((false, p.slice(1..))),
                _ => None,
            }
        }
        Inbound::Command { name, body } if name.as_ref() == b"SUBSCRIBE" => {
            Some((true, body.clone()))
        }
        Inbound::Command { name, body } if name.as_ref() == b"CANCEL" => {
            Some((false, body.clone()))
        }
        _ => None,
    }
}

/// The subscription message a SUB sends for `topic` (ZMTP 3.0 form).
pub(crate) fn subscribe_message(topic: &[u8]) -> Bytes {
    let mut body = Vec::with_capacity(1 + topic.len());
    body.push(1);
    body.extend_from_slice(topic);
    encode_message(&[body])
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: Limits = Limits {
        max_frame: 100,
        max_parts: 3,
        max_message: 150,
    };

    async fn read(bytes: &[u8]) -> Result<Inbound, ZmtpError> {
        let mut r = bytes;
        read_inbound(&mut r, &L, None).await
    }

    #[tokio::test]
    async fn a_long_size_header_beyond_the_bound_is_refused_unread() {
        let mut f = vec![FLAG_LONG];
        f.extend_from_slice(&(1u64 << 62).to_be_bytes());
        match read(&f).await {
            Err(ZmtpError::FrameTooLarge { size, limit: 100 }) => assert_eq!(size, 1 << 62),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn endless_more_frames_stop_at_the_part_bound() {
        let f: Vec<u8> = std::iter::repeat_n([FLAG_MORE, 0], 10).flatten().collect();
        assert!(matches!(
            read(&f).await,
            Err(ZmtpError::MessageTooLarge { .. })
        ));
    }

    #[tokio::test]
    async fn messages_round_trip_and_truncation_is_an_error() {
        let wire = encode_message(&[&b"kv"[..], &[0u8; 8][..], &[7u8; 90][..]]);
        match read(&wire).await {
            Ok(Inbound::Message(parts, None)) => {
                assert_eq!(parts.len(), 3);
                assert_eq!(parts[2].len(), 90);
            }
            other => panic!("{other:?}"),
        }
        assert!(read(&wire[..wire.len() - 1]).await.is_err());
        let big = encode_message(&[vec![1u8; 300]]);
        assert_eq!(big[0], FLAG_LONG, "bodies over 255 bytes use the long form");
    }

    #[test]
    fn greetings_are_checked() {
        assert!(check_greeting(&greeting()).is_ok());
        let mut g = greeting();
        g[10] = 2;
        assert!(check_greeting(&g).is_err());
        let mut g = greeting();
        g[12..17].copy_from_slice(b"PLAIN");
        assert!(check_greeting(&g).is_err());
        let mut g = greeting();
        g[0] = b'G';
        assert!(check_greeting(&g).is_err());
    }

    #[test]
    fn ready_round_trips_and_garbage_is_refused() {
        let cmd = ready_command(SocketType::Dealer);
        // flags, size, name-len, "READY", props
        assert_eq!(parse_ready(&cmd[8..]).ok(), Some(SocketType::Dealer));
        assert!(parse_ready(&[11, b'S']).is_err());
        assert!(parse_ready(&[0, 0xff, 0xff, 0xff, 0xff]).is_err());
        assert!(SocketType::Sub.accepts(SocketType::XPub));
        assert!(!SocketType::Pub.accepts(SocketType::Pub));
    }

    #[test]
    fn subscriptions_in_both_forms() {
        let m = Inbound::Message(vec![Bytes::from_static(b"\x01kv")], None);
        assert_eq!(subscription(&m), Some((true, Bytes::from_static(b"kv"))));
        let c = Inbound::Command {
            name: Bytes::from_static(b"CANCEL"),
            body: Bytes::from_static(b"kv"),
        };
        assert_eq!(subscription(&c), Some((false, Bytes::from_static(b"kv"))));
    }
}
