//! Messages over a socket: the connection knows frames and messages, nothing about pulls.
//!
//! Reads go into one growing `BytesMut`; once a frame's length is known the buffer reserves the
//! whole frame so a multi-megabyte block lands in a single allocation, and the payload handed up
//! is a zero-copy slice of it. A block's CRC32 is computed progressively as its bytes arrive
//! (while they are still in cache) and checked when the frame completes, so a corrupted block
//! surfaces as [`ConnectionError::Checksum`] without a second pass over the payload. Writes of
//! block frames are vectored (header, payload, checksum) so
//! the payload `Bytes` is never copied into a staging buffer.
//!
//! Once [`Connection::enable_mac`] is called (after a handshake with a shared secret) every frame
//! carries a MAC trailer ([`crate::mac`]): outgoing frames are sealed on write; incoming frames are
//! MACed progressively as their bytes arrive and verified before they are decoded, so nothing a
//! forger sends is ever parsed as a message. A connection starts with the small pre-handshake
//! frame bound ([`crate::frame::PREAUTH_MAX_FRAME`] when the caller passes it) and is raised with
//! [`Connection::set_max_frame`] once the peer is accepted.

use std::io;
use std::net::SocketAddr;

use bytes::{BufMut, Bytes, BytesMut};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::frame::{self, Check, FrameError, HEADER_LEN, Tag};
use crate::mac::{FrameMac, MAC_LEN, SessionKeys};
use crate::message::{BLOCK_PAYLOAD_OFFSET, BLOCK_TRAILER, Message, MessageError};

/// Most bytes taken per read call: small enough that the progressive checksum of a block
/// reads them back from L2 cache right after the kernel copied them in.
const READ_CHUNK: usize = 256 << 10;

/// Read-ahead beyond the current frame, so the next frame's header usually arrives in the same
/// read call.
const READ_AHEAD: usize = 64 << 10;

#[derive(Debug, thiserror::Error)]
pub enum ConnectionError {
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    #[error("peer closed the connection in the middle of a frame")]
    ClosedMidFrame,
    #[error(transparent)]
    Message(#[from] MessageError),
    #[error("block {index}: payload does not match its checksum")]
    Checksum { index: u32 },
    /// A frame whose MAC does not verify: forged, altered, replayed, reordered or truncated.
    #[error("frame {seq} failed authentication")]
    Mac { seq: u64 },
}

impl From<FrameError> for ConnectionError {
    fn from(e: FrameError) -> Self {
        ConnectionError::Message(MessageError::Frame(e))
    }
}

impl ConnectionError {
    /// True when the peer went away (as opposed to sending something invalid).
    pub fn is_closed(&self) -> bool {
        match self {
            ConnectionError::ClosedMidFrame => true,
            ConnectionError::Io(e) => matches!(
                e.kind(),
                io::ErrorKind::ConnectionReset
                    | io::ErrorKind::ConnectionAborted
                    | io::ErrorKind::BrokenPipe
                    | io::ErrorKind::UnexpectedEof
            ),
            ConnectionError::Message(_)
            | ConnectionError::Checksum { .. }
            | ConnectionError::Mac { .. } => false,
        }
    }
}

/// One framed TCP connection.
#[derive(Debug)]
pub struct Connection {
    stream: TcpStream,
    /// Bytes read but not yet parsed into a frame.
    buf: BytesMut,
    /// Upper bound on one frame, enforced from the length prefix.
    max_frame: usize,
    /// CRC32 of the payload bytes of the block frame at the front of `buf` hashed so far, and
    /// the offset (from the frame start) up to which they are hashed.
    block_crc: Option<(crc32fast::Hasher, usize)>,
    /// Frame MACs once authenticated: what we send, what we receive.
    send_mac: Option<FrameMac>,
    recv_mac: Option<FrameMac>,
    /// MAC of the frame at the front of `buf` over the bytes received so far, and the offset up
    /// to which they are fed.
    frame_mac: Option<(Hmac<Sha256>, usize)>,
    /// The peer (a producer) said in its `HelloOk` that it reads `Promote` during a background
    /// fetch; kept here so a pooled connection remembers it.
    peer_promotes: bool,
}

impl Connection {
    pub fn new(stream: TcpStream, max_frame: usize) -> Self {
        // Small control messages dominate; without it a Lookup waits for delayed ACKs.
        let _ = stream.set_nodelay(true);
        Self {
            stream,
            buf: BytesMut::with_capacity(READ_AHEAD),
            max_frame,
            block_crc: None,
            send_mac: None,
            recv_mac: None,
            frame_mac: None,
            peer_promotes: false,
        }
    }

    /// Records whether the peer announced `Promote` support (its `HelloOk`).
    pub fn set_peer_promotes(&mut self, promotes: bool) {
        self.peer_promotes = promotes;
    }

    /// Whether the peer reads `Promote` during a background fetch.
    pub fn peer_promotes(&self) -> bool {
        self.peer_promotes
    }

    /// Raise (or lower) the frame bound, e.g. from the pre-handshake bound once the peer is
    /// accepted.
    pub fn set_max_frame(&mut self, max_frame: usize) {
        self.max_frame = max_frame;
    }

    /// From the next frame on, seal what we send and verify what we receive. Call right after
    /// the last handshake frame (both ends switch at `HelloOk`).
    pub fn enable_mac(&mut self, keys: &SessionKeys) {
        self.send_mac = Some(FrameMac::new(keys.send));
        self.recv_mac = Some(FrameMac::new(keys.recv));
        self.frame_mac = None;
    }

    /// Whether frames are authenticated.
    pub fn authenticated(&self) -> bool {
        self.recv_mac.is_some()
    }

    fn mac_len(&self) -> usize {
        if self.recv_mac.is_some() { MAC_LEN } else { 0 }
    }

    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.stream.peer_addr()
    }

    /// The next message, or `None` when the peer closed cleanly between frames.
    pub async fn read_message(&mut self) -> Result<Option<Message>, ConnectionError> {
        Ok(self.read_message_with_body().await?.map(|(m, _)| m))
    }

    /// As [`Connection::read_message`], with the frame body as received (zero-copy), for the
    /// handshake transcript the session keys are bound to.
    pub async fn read_message_with_body(
        &mut self,
    ) -> Result<Option<(Message, Bytes)>, ConnectionError> {
        loop {
            match frame::check(&self.buf, self.max_frame)? {
                Check::Complete { total } => {
                    self.digest_mac(total)?;
                    self.verify_mac(total)?;
                    self.digest_block(total);
                    let crc = self.block_crc.take().map(|(h, _)| h.finalize());
                    if let Some(mut f) = frame::parse(&mut self.buf, self.max_frame)? {
                        // Verified above; the decoder sees the body without its MAC.
                        f.body.truncate(f.body.len().saturating_sub(self.mac_len()));
                        let body = f.body.clone();
                        let msg = Message::from_frame(f)?;
                        if let (Message::Block(b), Some(crc)) = (&msg, crc)
                            && b.crc != crc
                        {
                            return Err(ConnectionError::Checksum { index: b.index });
                        }
                        return Ok(Some((msg, body)));
                    }
                }
                Check::Incomplete { needed } => {
                    // Until the length prefix is in, `needed` is not the frame's size.
                    if self.buf.len() >= 4 {
                        self.digest_mac(self.buf.len() + needed)?;
                        self.digest_block(self.buf.len() + needed);
                    }
                    let spare = self.buf.capacity() - self.buf.len();
                    if spare < needed.max(4096) {
                        self.buf.reserve(needed + READ_AHEAD);
                    }
                }
            }
            if self
                .stream
                .read_buf(&mut (&mut self.buf).limit(READ_CHUNK))
                .await?
                == 0
            {
                return if self.buf.is_empty() {
                    Ok(None)
                } else {
                    Err(ConnectionError::ClosedMidFrame)
                };
            }
        }
    }

    /// Feed the newly buffered bytes of the frame of `total` bytes at the front of the buffer to
    /// its MAC (everything but the MAC itself). A frame too short to carry a MAC is a forgery.
    fn digest_mac(&mut self, total: usize) -> Result<(), ConnectionError> {
        let Some(rx) = &self.recv_mac else {
            return Ok(());
        };
        if total < HEADER_LEN + MAC_LEN {
            return Err(ConnectionError::Mac { seq: rx.seq() });
        }
        let end = self.buf.len().min(total - MAC_LEN);
        let (mac, upto) = self.frame_mac.get_or_insert_with(|| (rx.begin(), 0));
        if end > *upto {
            mac.update(&self.buf[*upto..end]);
            *upto = end;
        }
        Ok(())
    }

    /// Check the MAC of the whole frame of `total` bytes at the front of the buffer (all fed).
    fn verify_mac(&mut self, total: usize) -> Result<(), ConnectionError> {
        let Some(rx) = &mut self.recv_mac else {
            return Ok(());
        };
        let seq = rx.seq();
        let Some((mac, _)) = self.frame_mac.take() else {
            return Err(ConnectionError::Mac { seq });
        };
        let tag = self.buf.get(total - MAC_LEN..total).unwrap_or_default();
        if rx.verify(mac, tag) {
            Ok(())
        } else {
            Err(ConnectionError::Mac { seq })
        }
    }

    /// Hash the newly buffered payload bytes of a block frame of `total` bytes at the front of
    /// the buffer. Malformed block frames are left to the message decoder to reject.
    fn digest_block(&mut self, total: usize) {
        let trailer = BLOCK_TRAILER + self.mac_len();
        if self.buf.get(4) != Some(&(Tag::Block as u8)) || total < BLOCK_PAYLOAD_OFFSET + trailer {
            return;
        }
        let end = self.buf.len().min(total - trailer);
        let (hasher, upto) = self
            .block_crc
            .get_or_insert_with(|| (crc32fast::Hasher::new(), BLOCK_PAYLOAD_OFFSET));
        if end > *upto {
            hasher.update(&self.buf[*upto..end]);
            *upto = end;
        }
    }

    /// Write one message (vectored for blocks) and flush it to the socket.
    pub async fn write_message(&mut self, msg: &Message) -> Result<(), ConnectionError> {
        let mut encoded = msg.encode_framed(self.max_frame, self.mac_len())?;
        if let Some(tx) = &mut self.send_mac {
            let mut mac = tx.begin();
            mac.update(&encoded.head);
            mac.update(&encoded.payload);
            mac.update(&encoded.tail);
            let tag = tx.finish(mac);
            let mut tail = BytesMut::with_capacity(encoded.tail.len() + MAC_LEN);
            tail.put_slice(&encoded.tail);
            tail.put_slice(&tag);
            encoded.tail = tail.freeze();
        }
        let mut buf = encoded.into_buf();
        self.stream.write_all_buf(&mut buf).await?;
        Ok(())
    }

    /// Test hook: write `bytes` as they are, bypassing framing and MAC (hostile-peer tests).
    #[doc(hidden)]
    pub async fn write_raw(&mut self, bytes: &[u8]) -> Result<(), ConnectionError> {
        self.stream.write_all(bytes).await?;
        Ok(())
    }

    /// Half-close our side so the peer sees EOF after what we wrote.
    pub async fn shutdown(&mut self) {
        let _ = self.stream.shutdown().await;
    }
}
