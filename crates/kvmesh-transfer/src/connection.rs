//! Messages over a socket: the connection knows frames, records and messages, nothing about pulls.
//!
//! Reads of frame heads and control frames go into one small `BytesMut` and take only the bytes
//! the frame still needs (a frame whose length is not known yet: at most a block head), so a
//! block's payload never lands there: once a block's head is in (and, protected, verified) the
//! payload is read straight into its destination — a buffer the caller owns
//! ([`Connection::read_payload_into`], e.g. a sink's own memory) or one allocation of exactly the
//! payload's size ([`Connection::read_message`]) — in reads of at most 256 KiB. Each read is
//! checksummed (CRC32) or, protected, each record verified and decrypted in place while it is
//! still in cache ([`crate::record::PayloadCursor`]); a corrupted block surfaces as
//! [`ConnectionError::Checksum`] without a second pass over the payload. So the consumer copies
//! each payload byte once (the kernel's copy into the destination).
//!
//! Writes of block frames are vectored (head, payload[, tags]) so the payload `Bytes` is never
//! copied into a staging buffer; only an encrypted connection writes each record's ciphertext
//! into a reused staging buffer (about 1 MiB), encrypting straight from the source's buffer (which
//! is shared, so it cannot be encrypted in place) in one pass.
//!
//! Once [`Connection::protect`] is called (after a handshake with a shared secret) every frame is
//! sent and received as records ([`crate::record`], [`crate::mac`]): outgoing records are tagged
//! (or encrypted) on write; incoming ones are verified before they are decoded or handed on, so
//! nothing a forger sends is ever parsed as a message. A connection starts with the small
//! pre-handshake frame bound ([`crate::frame::PREAUTH_MAX_FRAME`] when the caller passes it) and
//! is raised with [`Connection::set_max_frame`] once the peer is accepted.

use std::io::{self, IoSlice};
use std::net::SocketAddr;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::frame::{self, FrameError, HEADER_LEN, RawFrame, Tag};
use crate::mac::{RecordError, RecordKey, SessionKeys, TAG_LEN};
use crate::message::{BlockFrame, BlockHead, Message, MessageError};
use crate::record::{self, BLOCK_HEAD_LEN, PayloadCursor, Step};

/// Most payload bytes taken per read call: small enough that the checksum (or the record's
/// verification) reads them back from L2 cache right after the kernel copied them in.
const READ_CHUNK: usize = 256 << 10;

/// Payload bytes a protected connection tags (or encrypts) before handing them to one write
/// call: a few records, so they are still in cache when the kernel copies them.
const WRITE_BATCH: usize = 4 * record::RECORD_LEN;

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
    /// A record whose tag does not verify: forged, altered, replayed, reordered or truncated.
    #[error("record {seq} failed authentication")]
    Mac { seq: u64 },
    /// A payload read was abandoned midway: the stream position is lost.
    #[error("a block payload was left half read")]
    Desynchronized,
    /// The destination given for a payload does not have the payload's size.
    #[error("payload of {payload} bytes into a destination of {dest}")]
    Destination { payload: usize, dest: usize },
}

impl From<FrameError> for ConnectionError {
    fn from(e: FrameError) -> Self {
        ConnectionError::Message(MessageError::Frame(e))
    }
}

impl From<RecordError> for ConnectionError {
    fn from(e: RecordError) -> Self {
        ConnectionError::Mac { seq: e.seq }
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
            | ConnectionError::Mac { .. }
            | ConnectionError::Desynchronized
            | ConnectionError::Destination { .. } => false,
        }
    }
}

/// What [`Connection::read_frame`] found: a whole control message, or the head of a block frame
/// whose payload must be read next ([`Connection::read_payload_into`]).
#[derive(Debug)]
pub enum Incoming {
    Message(Message),
    Block(BlockHead),
}

/// A block payload being read into a buffer the connection owns (cancel safe across calls).
#[derive(Debug)]
struct OwnedPayload {
    head: BlockHead,
    cursor: PayloadCursor,
    dest: BytesMut,
}

/// One framed TCP connection.
#[derive(Debug)]
pub struct Connection {
    stream: TcpStream,
    /// Bytes read but not yet parsed: frame heads and control frames.
    buf: BytesMut,
    /// Upper bound on one frame, enforced from the length prefix.
    max_frame: usize,
    /// Record protection once authenticated: what we send, what we receive.
    send_key: Option<RecordKey>,
    recv_key: Option<RecordKey>,
    /// A block head was returned whose payload has not been read yet.
    payload_due: Option<BlockHead>,
    /// [`Connection::read_message`]'s block in progress.
    owned: Option<OwnedPayload>,
    /// A borrowed-destination payload read was dropped midway.
    desynchronized: bool,
    /// Encrypted records being written (reused across frames).
    staging: Vec<u8>,
    /// The peer (a producer) said in its `HelloOk` that it reads `Promote` during a background
    /// fetch, and how many fetch streams it runs per peer; kept here so a pooled connection
    /// remembers them.
    peer_promotes: bool,
    peer_max_transfers: u32,
}

impl Connection {
    pub fn new(stream: TcpStream, max_frame: usize) -> Self {
        // Small control messages dominate; without it a Lookup waits for delayed ACKs.
        let _ = stream.set_nodelay(true);
        Self {
            stream,
            buf: BytesMut::with_capacity(4096),
            max_frame,
            send_key: None,
            recv_key: None,
            payload_due: None,
            owned: None,
            desynchronized: false,
            staging: Vec::new(),
            peer_promotes: false,
            peer_max_transfers: 0,
        }
    }

    /// Records what the peer announced in its `HelloOk`: `Promote` support and its fetch-stream
    /// cap per peer (0 = not announced).
    pub fn set_peer_capabilities(&mut self, promotes: bool, max_transfers: u32) {
        self.peer_promotes = promotes;
        self.peer_max_transfers = max_transfers;
    }

    /// Whether the peer reads `Promote` during a background fetch.
    pub fn peer_promotes(&self) -> bool {
        self.peer_promotes
    }

    /// The peer's fetch-stream cap per peer address (0 = not announced).
    pub fn peer_max_transfers(&self) -> u32 {
        self.peer_max_transfers
    }

    /// Raise (or lower) the frame bound, e.g. from the pre-handshake bound once the peer is
    /// accepted.
    pub fn set_max_frame(&mut self, max_frame: usize) {
        self.max_frame = max_frame;
    }

    /// From the next frame on, send and receive records protected by `keys`. Call right after
    /// the last handshake frame (both ends switch at `HelloOk`).
    pub fn protect(&mut self, keys: &SessionKeys) {
        self.send_key = Some(RecordKey::new(&keys.send));
        self.recv_key = Some(RecordKey::new(&keys.recv));
    }

    /// Whether frames are authenticated.
    pub fn authenticated(&self) -> bool {
        self.recv_key.is_some()
    }

    /// Whether frames are encrypted.
    pub fn encrypted(&self) -> bool {
        self.recv_key.as_ref().is_some_and(RecordKey::encrypts)
    }

    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.stream.peer_addr()
    }

    /// The next message (a block with its payload in a buffer of its own), or `None` when the
    /// peer closed cleanly between frames. Cancel safe.
    pub async fn read_message(&mut self) -> Result<Option<Message>, ConnectionError> {
        Ok(self.read_message_with_body().await?.map(|(m, _)| m))
    }

    /// As [`Connection::read_message`], with the frame body as received (zero-copy; empty for a
    /// block), for the handshake transcript the session keys are bound to.
    pub async fn read_message_with_body(
        &mut self,
    ) -> Result<Option<(Message, Bytes)>, ConnectionError> {
        if self.owned.is_none() {
            let head = match self.read_frame_with_body().await? {
                None => return Ok(None),
                Some((Incoming::Message(m), body)) => return Ok(Some((m, body))),
                Some((Incoming::Block(head), _)) => head,
            };
            self.owned = Some(OwnedPayload {
                head,
                cursor: PayloadCursor::new(head.payload_len, self.authenticated()),
                dest: BytesMut::with_capacity(head.payload_len),
            });
        }
        loop {
            let Self {
                stream,
                buf,
                recv_key,
                owned,
                ..
            } = self;
            let Some(o) = owned.as_mut() else {
                unreachable!("set above")
            };
            // Each step completes its read before it updates the cursor: cancel safe.
            let dest = Dest::Owned(&mut o.dest);
            if payload_step(stream, buf, recv_key.as_mut(), &mut o.cursor, dest).await? {
                break;
            }
        }
        self.payload_due = None;
        let Some(o) = self.owned.take() else {
            unreachable!("set above")
        };
        let head = o.head;
        if o.cursor.crc() != head.crc {
            return Err(ConnectionError::Checksum { index: head.index });
        }
        let block = BlockFrame::with_checksum(head.index, head.hash, o.dest.freeze(), head.crc);
        Ok(Some((Message::Block(block), Bytes::new())))
    }

    /// Reads the next frame: a whole control message, or only the head of a block frame (then
    /// the payload must be read with [`Connection::read_payload_into`] before the next frame).
    /// `None` when the peer closed cleanly between frames. Cancel safe.
    pub async fn read_frame(&mut self) -> Result<Option<Incoming>, ConnectionError> {
        Ok(self.read_frame_with_body().await?.map(|(f, _)| f))
    }

    async fn read_frame_with_body(&mut self) -> Result<Option<(Incoming, Bytes)>, ConnectionError> {
        if self.desynchronized || self.payload_due.is_some() || self.owned.is_some() {
            return Err(ConnectionError::Desynchronized);
        }
        loop {
            let wanted = match self.parse_frame()? {
                Parsed::Frame(incoming, body) => {
                    if let Incoming::Block(head) = &incoming {
                        self.payload_due = Some(*head);
                    }
                    return Ok(Some((incoming, body)));
                }
                Parsed::Need(n) => n,
            };
            self.buf.reserve(wanted);
            // Exactly what this frame still needs: never bytes of a block's payload.
            if self
                .stream
                .read_buf(&mut (&mut self.buf).limit(wanted))
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

    /// Splits one frame (or a block's head) off the buffer, verified, or says how many more
    /// bytes it needs.
    fn parse_frame(&mut self) -> Result<Parsed, ConnectionError> {
        let protected = self.recv_key.is_some();
        let tag_len = if protected { TAG_LEN } else { 0 };
        let probe = record::head_wire_len(protected);
        // Bound, emptiness and tag are checked from the first bytes, before any body byte.
        frame::check(&self.buf, self.max_frame)?;
        let Some(prefix) = self.buf.get(..4) else {
            return Ok(Parsed::Need(probe - self.buf.len()));
        };
        let len = u32::from_be_bytes([prefix[0], prefix[1], prefix[2], prefix[3]]) as usize;
        let Some(&tag) = self.buf.get(4) else {
            return Ok(Parsed::Need(probe - self.buf.len()));
        };
        let seq = self.recv_key.as_ref().map_or(0, RecordKey::seq);
        if tag == Tag::Block as u8 {
            if 4 + len < probe {
                return Err(too_short(protected, seq, len));
            }
            if self.buf.len() < probe {
                return Ok(Parsed::Need(probe - self.buf.len()));
            }
            let mut head = self.buf.split_to(probe);
            if let Some(key) = &mut self.recv_key {
                let (record, tag) = head.split_at_mut(BLOCK_HEAD_LEN);
                key.open(record, HEADER_LEN, tag)?;
            }
            let head = BlockHead::decode(&head[HEADER_LEN..BLOCK_HEAD_LEN])?;
            if len != record::block_frame_len(head.payload_len, protected) {
                return Err(MessageError::Malformed {
                    tag: Tag::Block,
                    detail: format!(
                        "frame length {len} does not fit a payload of {} bytes",
                        head.payload_len
                    ),
                }
                .into());
            }
            return Ok(Parsed::Frame(Incoming::Block(head), Bytes::new()));
        }
        let total = 4 + len;
        if len < 1 + tag_len {
            return Err(too_short(protected, seq, len));
        }
        if self.buf.len() < total {
            return Ok(Parsed::Need(total - self.buf.len()));
        }
        let mut frame = self.buf.split_to(total);
        if let Some(key) = &mut self.recv_key {
            let (record, tag) = frame.split_at_mut(total - TAG_LEN);
            key.open(record, HEADER_LEN, tag)?;
            frame.truncate(total - TAG_LEN);
        }
        let mut body = frame.freeze();
        body.advance(HEADER_LEN);
        let tag = Tag::try_from(tag)?;
        let msg = Message::from_frame(RawFrame {
            tag,
            body: body.clone(),
        })?;
        Ok(Parsed::Frame(Incoming::Message(msg), body))
    }

    /// Reads the payload of the block whose head [`Connection::read_frame`] just returned
    /// straight into `dest` (exactly `head.payload_len` bytes): verified record by record (and
    /// decrypted in place) when protected, and checked against the head's CRC32. Not cancel safe:
    /// a read dropped midway leaves the connection unusable (later reads fail). On any error the
    /// contents of `dest` are unspecified.
    pub async fn read_payload_into(
        &mut self,
        head: &BlockHead,
        dest: &mut [u8],
    ) -> Result<(), ConnectionError> {
        if dest.len() != head.payload_len {
            return Err(ConnectionError::Destination {
                payload: head.payload_len,
                dest: dest.len(),
            });
        }
        self.read_payload_to(head, Dest::Borrowed(dest)).await
    }

    /// As [`Connection::read_payload_into`], into one allocation of exactly the payload's size
    /// (filled through its spare capacity: nothing is zeroed first).
    pub async fn read_payload(&mut self, head: &BlockHead) -> Result<Bytes, ConnectionError> {
        let mut dest = BytesMut::with_capacity(head.payload_len);
        self.read_payload_to(head, Dest::Owned(&mut dest)).await?;
        Ok(dest.freeze())
    }

    async fn read_payload_to(
        &mut self,
        head: &BlockHead,
        mut dest: Dest<'_>,
    ) -> Result<(), ConnectionError> {
        if self.payload_due != Some(*head) || self.desynchronized {
            return Err(ConnectionError::Desynchronized);
        }
        // Cleared only when the whole payload is in: a read dropped midway poisons the stream.
        self.desynchronized = true;
        let mut cursor = PayloadCursor::new(head.payload_len, self.authenticated());
        let Self {
            stream,
            buf,
            recv_key,
            ..
        } = self;
        while !payload_step(stream, buf, recv_key.as_mut(), &mut cursor, dest.reborrow()).await? {}
        self.desynchronized = false;
        self.payload_due = None;
        if cursor.crc() != head.crc {
            return Err(ConnectionError::Checksum { index: head.index });
        }
        Ok(())
    }

    /// Write one message (vectored for blocks) and flush it to the socket.
    pub async fn write_message(&mut self, msg: &Message) -> Result<(), ConnectionError> {
        if let Message::Block(b) = msg {
            return self.write_block(b).await;
        }
        let tag_len = if self.send_key.is_some() { TAG_LEN } else { 0 };
        let encoded = msg.encode_framed(self.max_frame, tag_len)?;
        let frame = match &mut self.send_key {
            None => encoded.head,
            Some(key) => Bytes::from(record::seal_control(key, encoded.head.to_vec())),
        };
        self.stream.write_all(&frame).await?;
        Ok(())
    }

    async fn write_block(&mut self, b: &BlockFrame) -> Result<(), ConnectionError> {
        let protected = self.send_key.is_some();
        let frame_len = record::block_frame_len(b.payload.len(), protected);
        let mut head = b.head().encode(frame_len, self.max_frame)?;
        let payload = &b.payload[..];
        let Some(key) = &mut self.send_key else {
            let mut slices = [IoSlice::new(&head), IoSlice::new(payload)];
            return write_all_vectored(&mut self.stream, &mut slices).await;
        };
        let head_tag = key.seal(&mut head, HEADER_LEN);
        let ranges: Vec<_> = record::record_ranges(payload.len()).collect();
        let batches = ranges.chunks(WRITE_BATCH / record::RECORD_LEN);
        if key.encrypts() {
            // The source's buffer is shared: each record is encrypted from it into the staging
            // buffer (one pass: AES-GCM reads the plaintext and writes the ciphertext there), a
            // batch at a time, then written from it. The buffer keeps its size across blocks, so
            // it is zeroed once per connection, not per block.
            let staging = &mut self.staging;
            let batch_wire =
                record::head_wire_len(true) + record::payload_wire_len(WRITE_BATCH, true);
            if staging.len() < batch_wire {
                staging.resize(batch_wire, 0);
            }
            staging[..BLOCK_HEAD_LEN].copy_from_slice(&head);
            staging[BLOCK_HEAD_LEN..BLOCK_HEAD_LEN + TAG_LEN].copy_from_slice(&head_tag);
            let mut used = BLOCK_HEAD_LEN + TAG_LEN;
            for batch in batches {
                for r in batch {
                    let (out, rest) = staging[used..].split_at_mut(r.len());
                    let tag = key.seal_to(&payload[r.clone()], out);
                    rest[..TAG_LEN].copy_from_slice(&tag);
                    used += r.len() + TAG_LEN;
                }
                self.stream.write_all(&staging[..used]).await?;
                used = 0;
            }
            if used > 0 {
                self.stream.write_all(&staging[..used]).await?;
            }
            return Ok(());
        }
        // Authenticated in clear: tags for a batch of records, then one vectored write of the
        // payload in place with its tags.
        let mut lead: Vec<u8> = Vec::with_capacity(BLOCK_HEAD_LEN + TAG_LEN);
        lead.extend_from_slice(&head);
        lead.extend_from_slice(&head_tag);
        let mut tags: Vec<[u8; TAG_LEN]> = Vec::with_capacity(WRITE_BATCH / record::RECORD_LEN);
        let mut batches = batches.peekable();
        if batches.peek().is_none() {
            return Ok(self.stream.write_all(&lead).await?);
        }
        for batch in batches {
            tags.clear();
            for r in batch {
                let Some(tag) = key.tag(&payload[r.clone()]) else {
                    unreachable!("authenticate mode tags records in clear")
                };
                tags.push(tag);
            }
            let mut slices = Vec::with_capacity(1 + 2 * batch.len());
            if !lead.is_empty() {
                slices.push(IoSlice::new(&lead));
            }
            for (r, tag) in batch.iter().zip(&tags) {
                slices.push(IoSlice::new(&payload[r.clone()]));
                slices.push(IoSlice::new(tag));
            }
            write_all_vectored(&mut self.stream, &mut slices).await?;
            lead.clear();
        }
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

/// Where a block's payload goes: a buffer the connection allocated (filled through its spare
/// capacity, so nothing is zeroed first) or the caller's memory.
enum Dest<'a> {
    Owned(&'a mut BytesMut),
    Borrowed(&'a mut [u8]),
}

impl Dest<'_> {
    fn reborrow(&mut self) -> Dest<'_> {
        match self {
            Dest::Owned(b) => Dest::Owned(b),
            Dest::Borrowed(s) => Dest::Borrowed(s),
        }
    }

    /// The payload received so far (owned) or the whole destination (borrowed).
    fn bytes(&mut self) -> &mut [u8] {
        match self {
            Dest::Owned(b) => &mut b[..],
            Dest::Borrowed(s) => s,
        }
    }
}

/// One step of receiving a block payload: places the next bytes (read ahead into `buf` first,
/// then from the socket) where the cursor says, verifying a record when its tag completes.
/// Returns whether the payload is complete. Every await is a read that either completes or took
/// nothing, and the cursor moves only after it: a dropped step loses nothing.
async fn payload_step(
    stream: &mut TcpStream,
    buf: &mut BytesMut,
    key: Option<&mut RecordKey>,
    cursor: &mut PayloadCursor,
    mut dest: Dest<'_>,
) -> Result<bool, ConnectionError> {
    match cursor.step() {
        Step::Done => Ok(true),
        Step::Payload(max) => {
            let at = cursor.filled();
            let n = if buf.is_empty() {
                let max = max.min(READ_CHUNK);
                match &mut dest {
                    Dest::Owned(b) => stream.read_buf(&mut (&mut **b).limit(max)).await?,
                    Dest::Borrowed(s) => stream.read(&mut s[at..at + max]).await?,
                }
            } else {
                let n = buf.len().min(max);
                match &mut dest {
                    Dest::Owned(b) => b.extend_from_slice(&buf[..n]),
                    Dest::Borrowed(s) => s[at..at + n].copy_from_slice(&buf[..n]),
                }
                buf.advance(n);
                n
            };
            if n == 0 {
                return Err(ConnectionError::ClosedMidFrame);
            }
            cursor.payload_read(dest.bytes(), n);
            Ok(false)
        }
        Step::Tag(max) => {
            let Some(key) = key else {
                unreachable!("a cursor asks for tags only on a protected connection")
            };
            if buf.is_empty() {
                let mut tag = [0u8; TAG_LEN];
                let n = stream.read(&mut tag[..max]).await?;
                if n == 0 {
                    return Err(ConnectionError::ClosedMidFrame);
                }
                cursor.tag_read(&tag[..n], dest.bytes(), key)?;
            } else {
                let n = cursor.tag_read(&buf[..buf.len().min(max)], dest.bytes(), key)?;
                buf.advance(n);
            }
            Ok(false)
        }
    }
}

/// What [`Connection::parse_frame`] found in the buffer.
enum Parsed {
    Frame(Incoming, Bytes),
    /// This many more bytes are needed (exactly: the rest of the frame or of the block head).
    Need(usize),
}

/// A frame whose `len` cannot hold what its kind must carry (a protected record's tag, a block's
/// head): a forgery when protected, garbage otherwise.
fn too_short(protected: bool, seq: u64, len: usize) -> ConnectionError {
    if protected {
        ConnectionError::Mac { seq }
    } else {
        MessageError::Malformed {
            tag: Tag::Block,
            detail: format!("frame length {len} is shorter than a block head"),
        }
        .into()
    }
}

/// `write_all` for a list of buffers: one `writev` per call, resumed after partial writes.
async fn write_all_vectored(
    stream: &mut TcpStream,
    mut slices: &mut [IoSlice<'_>],
) -> Result<(), ConnectionError> {
    while !slices.is_empty() {
        let n = stream.write_vectored(slices).await?;
        if n == 0 {
            return Err(io::Error::from(io::ErrorKind::WriteZero).into());
        }
        IoSlice::advance_slices(&mut slices, n);
    }
    Ok(())
}
