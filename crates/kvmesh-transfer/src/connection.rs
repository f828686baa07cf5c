//! Messages over a socket: the connection knows frames and messages, nothing about pulls.
//!
//! Reads go into one growing `BytesMut`; once a frame's length is known the buffer reserves the
//! whole frame so a multi-megabyte block lands in a single allocation, and the payload handed up
//! is a zero-copy slice of it. A block's CRC32 is computed progressively as its bytes arrive
//! (while they are still in cache) and checked when the frame completes, so a corrupted block
//! surfaces as [`ConnectionError::Checksum`] without a second pass over the payload. Writes of
//! block frames are vectored (header, payload, checksum) so
//! the payload `Bytes` is never copied into a staging buffer.

use std::io;
use std::net::SocketAddr;

use bytes::{BufMut, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::frame::{self, Check, FrameError, Tag};
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
            ConnectionError::Message(_) | ConnectionError::Checksum { .. } => false,
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
        }
    }

    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.stream.peer_addr()
    }

    /// The next message, or `None` when the peer closed cleanly between frames.
    pub async fn read_message(&mut self) -> Result<Option<Message>, ConnectionError> {
        loop {
            match frame::check(&self.buf, self.max_frame)? {
                Check::Complete { total } => {
                    self.digest_block(total);
                    let crc = self.block_crc.take().map(|(h, _)| h.finalize());
                    if let Some(f) = frame::parse(&mut self.buf, self.max_frame)? {
                        let msg = Message::from_frame(f)?;
                        if let (Message::Block(b), Some(crc)) = (&msg, crc)
                            && b.crc != crc
                        {
                            return Err(ConnectionError::Checksum { index: b.index });
                        }
                        return Ok(Some(msg));
                    }
                }
                Check::Incomplete { needed } => {
                    self.digest_block(self.buf.len() + needed);
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

    /// Hash the newly buffered payload bytes of a block frame of `total` bytes at the front of
    /// the buffer. Malformed block frames are left to the message decoder to reject.
    fn digest_block(&mut self, total: usize) {
        if self.buf.get(4) != Some(&(Tag::Block as u8))
            || total < BLOCK_PAYLOAD_OFFSET + BLOCK_TRAILER
        {
            return;
        }
        let end = self.buf.len().min(total - BLOCK_TRAILER);
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
        let encoded = msg.encode(self.max_frame)?;
        let mut buf = encoded.into_buf();
        self.stream.write_all_buf(&mut buf).await?;
        Ok(())
    }

    /// Half-close our side so the peer sees EOF after what we wrote.
    pub async fn shutdown(&mut self) {
        let _ = self.stream.shutdown().await;
    }
}
