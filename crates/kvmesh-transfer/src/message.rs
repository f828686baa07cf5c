//! Frames → messages: what each frame means.
//!
//! Control messages (everything but [`BlockFrame`]) are MessagePack maps (field names on the wire,
//! so fields can be added without breaking older peers). Block frames are fixed binary so the
//! payload is never re-encoded: a 20-byte head `index u32 | hash u64 | payload_len u32 | crc32 u32`
//! (all big-endian), then the payload. Decoding slices the payload out of the frame body without
//! copying; encoding returns the head and the payload as two buffers for one vectored write. On a
//! protected connection the connection cuts a block into records ([`crate::record`]).

use bytes::{Buf, BufMut, Bytes, BytesMut};
use kvmesh_core::{BlockHash, Fingerprint};
use serde::{Deserialize, Serialize};

use crate::frame::{self, FrameError, HEADER_LEN, RawFrame, Tag};

/// Bumped on any incompatible wire change; checked in `Hello`. Version 4: records are
/// authenticated with AES-256-GMAC instead of POLYVAL-AES (same layout, different tags and keys;
/// [`crate::mac`]). Version 3: with a secret, records with 16-byte POLYVAL-AES tags or AES-256-GCM
/// encryption ([`crate::mac`], [`crate::record`]) instead of per-frame HMAC-SHA256; a block's
/// CRC32 moved into its head; `Auth` may ask for encryption and `Refused` may say `Encryption`;
/// `HelloOk` announces the producer's fetch-stream cap per peer. Version 2: frames after the
/// handshake carry a MAC when a secret is set, handshake frames are bounded by
/// [`frame::PREAUTH_MAX_FRAME`], `Refused` may say `TooManyConnections`.
pub const PROTOCOL_VERSION: u16 = 4;

/// Random bytes exchanged in the handshake so authentication proofs cannot be replayed.
pub type Nonce = [u8; 16];

/// Consumer → producer, first frame on a connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    pub version: u16,
    pub fingerprint: Fingerprint,
    /// The consumer's challenge for the producer's proof (used only with a shared secret).
    pub nonce: Nonce,
}

/// Producer → consumer when it has a shared secret: prove you know it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Challenge {
    pub nonce: Nonce,
}

/// Consumer → producer: keyed digest over both nonces (see [`crate::auth`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Auth {
    pub proof: Vec<u8>,
    /// The consumer wants KV encrypted in transit ([`crate::mac::Protection::Encrypt`]); a
    /// producer configured otherwise refuses with [`RefuseReason::Encryption`]. Written only when
    /// true; absent = authenticate only.
    #[serde(default, skip_serializing_if = "is_false")]
    pub encrypt: bool,
}

/// Producer → consumer: the connection is ready for lookups.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HelloOk {
    pub version: u16,
    /// The producer's proof that it knows the secret too (mutual authentication), if challenged.
    pub proof: Option<Vec<u8>>,
    /// The producer honours [`Fetch::background`] and reads [`Promote`] during a background
    /// fetch. Absent (an older producer, which would close the connection on an unknown frame)
    /// means false: the consumer then never sends `Promote`. Only written when true, so the
    /// frame of a producer without it is unchanged.
    #[serde(default, skip_serializing_if = "is_false")]
    pub promote: bool,
    /// Fetch streams one peer address may run at once on this producer (its
    /// `max_transfers_per_peer`): a consumer stripes a pull over at most this many connections.
    /// 0 (absent) = not announced.
    #[serde(default)]
    pub max_transfers: u32,
}

/// Serde helper: optional flags are left out of the map when false (older peers see the exact
/// frames they always did, and a missing key decodes as false).
fn is_false(b: &bool) -> bool {
    !*b
}

/// Why a producer refused a connection. The connection closes after it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RefuseReason {
    Version {
        ours: u16,
        theirs: u16,
    },
    Fingerprint {
        field: String,
        ours: String,
        theirs: String,
    },
    AuthFailed,
    NotAllowed,
    /// The consumer's address already holds the producer's per-IP connection cap.
    TooManyConnections,
    /// The two ends disagree on encrypting KV in transit: the producer `ours`, the consumer
    /// `theirs` (`true` = encrypt).
    Encryption {
        ours: bool,
        theirs: bool,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refused {
    pub reason: RefuseReason,
}

/// Consumer → producer: which of these blocks do you hold?
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lookup {
    /// Correlates the pull with the request that caused it (logs only).
    pub kv_request_id: String,
    pub hashes: Vec<BlockHash>,
}

/// Per-block answer to a lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockStatus {
    /// Held and (if in the leading run) pinned under a lease.
    Hit,
    /// Not held; nothing after it in the prefix is useful.
    Miss,
    /// Being computed right now; may become a hit before a deadline.
    Pending,
}

impl BlockStatus {
    fn code(self) -> u8 {
        match self {
            BlockStatus::Hit => 0,
            BlockStatus::Miss => 1,
            BlockStatus::Pending => 2,
        }
    }

    fn from_code(c: u8) -> Option<Self> {
        match c {
            0 => Some(BlockStatus::Hit),
            1 => Some(BlockStatus::Miss),
            2 => Some(BlockStatus::Pending),
            _ => None,
        }
    }
}

/// Producer → consumer: statuses in lookup order; the leading `Hit` run is pinned for `lease_ms`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LookupReply {
    pub statuses: Vec<BlockStatus>,
    pub lease_ms: u32,
}

#[derive(Serialize, Deserialize)]
struct LookupReplyWire {
    statuses: Vec<u8>,
    lease_ms: u32,
}

/// Consumer → producer: stream these blocks, in order. Blocks still pending may be waited for up
/// to `pending_wait_ms`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fetch {
    pub hashes: Vec<BlockHash>,
    pub pending_wait_ms: u32,
    /// A prefetch nobody waits for yet: a time-modelled producer paces it as background traffic
    /// on its link (it moves only while no demand fetch does) until a [`Promote`] arrives.
    /// Absent (older consumers, other encoders) means false, i.e. demand; written only when
    /// true, so a demand `Fetch` is byte-for-byte the frame it always was.
    #[serde(default, skip_serializing_if = "is_false")]
    pub background: bool,
    /// Layer-major streaming ([`crate::layers`]): the byte length of each segment of a block (they
    /// sum to the block size). The producer then sends segment 0 of every block, then segment 1…,
    /// each as a block frame numbered `segment × hashes.len() + block`. Empty (absent) = the
    /// block-by-block stream; written only when set, so a plain `Fetch` is unchanged on the wire.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub segments: Vec<u32>,
}

/// Consumer → producer, only during a background fetch and only to a producer that announced
/// [`HelloOk::promote`]: a request now waits for this fetch's blocks, so the rest of it is demand
/// traffic. No reply. A `Promote` that arrives after the fetch ended is ignored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Promote {}

/// One block of a fetch. `index` is the position in the `Fetch` list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockFrame {
    pub index: u32,
    pub hash: BlockHash,
    pub payload: Bytes,
    pub crc: u32,
}

/// Fixed part of a block body before the payload: index, hash, payload length, CRC32.
pub const BLOCK_HEAD: usize = 4 + 8 + 4 + 4;

/// A block frame's head: what a receiver knows before the payload arrives (where to put it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHead {
    pub index: u32,
    pub hash: BlockHash,
    pub payload_len: usize,
    pub crc: u32,
}

impl BlockHead {
    /// Decodes the 20 head bytes of a block body.
    pub fn decode(mut head: &[u8]) -> Result<Self, MessageError> {
        if head.len() < BLOCK_HEAD {
            return Err(malformed(
                Tag::Block,
                format!("{} bytes is shorter than the block head", head.len()),
            ));
        }
        Ok(Self {
            index: head.get_u32(),
            hash: BlockHash(head.get_u64()),
            payload_len: head.get_u32() as usize,
            crc: head.get_u32(),
        })
    }

    /// The head's wire bytes: `len | 9 | index | hash | payload_len | crc`, with `len` the
    /// frame's length field (which a protected connection makes count its tags too).
    pub fn encode(
        &self,
        frame_len: usize,
        max_frame: usize,
    ) -> Result<[u8; HEADER_LEN + BLOCK_HEAD], MessageError> {
        let payload_len = u32::try_from(self.payload_len).map_err(|_| FrameError::TooLarge {
            len: self.payload_len,
            max: max_frame,
        })?;
        let h = frame::header(Tag::Block, frame_len - 1, max_frame)?;
        let mut out = [0u8; HEADER_LEN + BLOCK_HEAD];
        let mut w = &mut out[..];
        w.put_slice(&h);
        w.put_u32(self.index);
        w.put_u64(self.hash.0);
        w.put_u32(payload_len);
        w.put_u32(self.crc);
        Ok(out)
    }
}

impl BlockFrame {
    /// A frame whose checksum matches its payload.
    pub fn new(index: u32, hash: BlockHash, payload: Bytes) -> Self {
        let crc = crc32fast::hash(&payload);
        Self {
            index,
            hash,
            payload,
            crc,
        }
    }

    /// A frame carrying a checksum computed earlier (e.g. when the block was stored).
    pub fn with_checksum(index: u32, hash: BlockHash, payload: Bytes, crc: u32) -> Self {
        Self {
            index,
            hash,
            payload,
            crc,
        }
    }

    /// Does the payload match the checksum that travelled with it?
    pub fn checksum_ok(&self) -> bool {
        crc32fast::hash(&self.payload) == self.crc
    }

    pub fn head(&self) -> BlockHead {
        BlockHead {
            index: self.index,
            hash: self.hash,
            payload_len: self.payload.len(),
            crc: self.crc,
        }
    }
}

/// How a fetch stream ended (producer's view).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum FetchEnd {
    /// Every requested block was sent.
    Complete,
    /// The block at `index` is no longer held (evicted or never there); the stream stops there.
    Miss { index: u32 },
    /// The block at `index` was still pending when the wait deadline passed.
    PendingDeadline { index: u32 },
}

/// Producer → consumer: end of a fetch stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Done {
    pub blocks: u32,
    pub bytes: u64,
    pub end: FetchEnd,
}

/// Either side: a protocol violation; the sender closes the connection after it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorMsg {
    pub message: String,
}

/// Every message of the protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Hello(Hello),
    Challenge(Challenge),
    Auth(Auth),
    HelloOk(HelloOk),
    Refused(Refused),
    Lookup(Lookup),
    LookupReply(LookupReply),
    Fetch(Fetch),
    Block(BlockFrame),
    Done(Done),
    Error(ErrorMsg),
    Promote(Promote),
}

/// A frame whose body does not decode as its tag says.
#[derive(Debug, thiserror::Error)]
pub enum MessageError {
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("malformed {tag:?} body: {detail}")]
    Malformed { tag: Tag, detail: String },
    #[error("encode {tag:?}: {detail}")]
    Encode { tag: Tag, detail: String },
}

/// An encoded frame as up to three buffers (header, payload, trailer) for a vectored write.
#[derive(Debug, Clone)]
pub struct EncodedFrame {
    pub head: Bytes,
    pub payload: Bytes,
    pub tail: Bytes,
}

impl EncodedFrame {
    pub fn len(&self) -> usize {
        self.head.len() + self.payload.len() + self.tail.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The three buffers chained as one `Buf` (chunks_vectored yields all three).
    pub fn into_buf(self) -> impl Buf {
        self.head.chain(self.payload).chain(self.tail)
    }

    /// Contiguous copy, for tests.
    pub fn to_vec(&self) -> Vec<u8> {
        [&self.head[..], &self.payload[..], &self.tail[..]].concat()
    }
}

fn malformed(tag: Tag, detail: impl ToString) -> MessageError {
    MessageError::Malformed {
        tag,
        detail: detail.to_string(),
    }
}

fn decode_mp<T: for<'de> Deserialize<'de>>(tag: Tag, body: &[u8]) -> Result<T, MessageError> {
    rmp_serde::from_slice(body).map_err(|e| malformed(tag, e))
}

impl Message {
    pub fn tag(&self) -> Tag {
        match self {
            Message::Hello(_) => Tag::Hello,
            Message::Challenge(_) => Tag::Challenge,
            Message::Auth(_) => Tag::Auth,
            Message::HelloOk(_) => Tag::HelloOk,
            Message::Refused(_) => Tag::Refused,
            Message::Lookup(_) => Tag::Lookup,
            Message::LookupReply(_) => Tag::LookupReply,
            Message::Fetch(_) => Tag::Fetch,
            Message::Block(_) => Tag::Block,
            Message::Done(_) => Tag::Done,
            Message::Error(_) => Tag::Error,
            Message::Promote(_) => Tag::Promote,
        }
    }

    /// Decode a frame. Never panics on any body.
    pub fn from_frame(frame: RawFrame) -> Result<Message, MessageError> {
        let tag = frame.tag;
        let body = frame.body;
        Ok(match tag {
            Tag::Hello => Message::Hello(decode_mp(tag, &body)?),
            Tag::Challenge => Message::Challenge(decode_mp(tag, &body)?),
            Tag::Auth => Message::Auth(decode_mp(tag, &body)?),
            Tag::HelloOk => Message::HelloOk(decode_mp(tag, &body)?),
            Tag::Refused => Message::Refused(decode_mp(tag, &body)?),
            Tag::Lookup => Message::Lookup(decode_mp(tag, &body)?),
            Tag::LookupReply => {
                let w: LookupReplyWire = decode_mp(tag, &body)?;
                let statuses = w
                    .statuses
                    .iter()
                    .map(|&c| {
                        BlockStatus::from_code(c)
                            .ok_or_else(|| malformed(tag, format!("status code {c}")))
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Message::LookupReply(LookupReply {
                    statuses,
                    lease_ms: w.lease_ms,
                })
            }
            Tag::Fetch => Message::Fetch(decode_mp(tag, &body)?),
            Tag::Block => Message::Block(decode_block(body)?),
            Tag::Done => Message::Done(decode_mp(tag, &body)?),
            Tag::Error => Message::Error(decode_mp(tag, &body)?),
            Tag::Promote => Message::Promote(decode_mp(tag, &body)?),
        })
    }

    /// Encode into frame buffers, refusing frames larger than `max_frame`.
    pub fn encode(&self, max_frame: usize) -> Result<EncodedFrame, MessageError> {
        self.encode_framed(max_frame, 0)
    }

    /// As [`Message::encode`], with a length prefix that also counts `trailer` bytes the caller
    /// appends after the body (the frame MAC, [`crate::mac`]).
    pub fn encode_framed(
        &self,
        max_frame: usize,
        trailer: usize,
    ) -> Result<EncodedFrame, MessageError> {
        let tag = self.tag();
        let enc = |e: rmp_serde::encode::Error| MessageError::Encode {
            tag,
            detail: e.to_string(),
        };
        let body = match self {
            // A protected connection writes blocks as records itself (`crate::record`).
            Message::Block(b) if trailer == 0 => return encode_block(b, max_frame),
            Message::Block(_) => {
                return Err(MessageError::Encode {
                    tag,
                    detail: "a block frame's tags are placed per record".into(),
                });
            }
            Message::Hello(m) => rmp_serde::to_vec_named(m).map_err(enc)?,
            Message::Challenge(m) => rmp_serde::to_vec_named(m).map_err(enc)?,
            Message::Auth(m) => rmp_serde::to_vec_named(m).map_err(enc)?,
            Message::HelloOk(m) => rmp_serde::to_vec_named(m).map_err(enc)?,
            Message::Refused(m) => rmp_serde::to_vec_named(m).map_err(enc)?,
            Message::Lookup(m) => rmp_serde::to_vec_named(m).map_err(enc)?,
            Message::LookupReply(m) => rmp_serde::to_vec_named(&LookupReplyWire {
                statuses: m.statuses.iter().map(|s| s.code()).collect(),
                lease_ms: m.lease_ms,
            })
            .map_err(enc)?,
            Message::Fetch(m) => rmp_serde::to_vec_named(m).map_err(enc)?,
            Message::Done(m) => rmp_serde::to_vec_named(m).map_err(enc)?,
            Message::Error(m) => rmp_serde::to_vec_named(m).map_err(enc)?,
            Message::Promote(m) => rmp_serde::to_vec_named(m).map_err(enc)?,
        };
        let mut head = BytesMut::with_capacity(HEADER_LEN + body.len());
        head.put_slice(&frame::header(tag, body.len() + trailer, max_frame)?);
        head.put_slice(&body);
        Ok(EncodedFrame {
            head: head.freeze(),
            payload: Bytes::new(),
            tail: Bytes::new(),
        })
    }
}

fn decode_block(mut body: Bytes) -> Result<BlockFrame, MessageError> {
    let head = BlockHead::decode(&body)?;
    body.advance(BLOCK_HEAD);
    if body.len() != head.payload_len {
        return Err(malformed(
            Tag::Block,
            format!(
                "payload_len {} but {} bytes follow",
                head.payload_len,
                body.len()
            ),
        ));
    }
    Ok(BlockFrame {
        index: head.index,
        hash: head.hash,
        payload: body,
        crc: head.crc,
    })
}

fn encode_block(b: &BlockFrame, max_frame: usize) -> Result<EncodedFrame, MessageError> {
    let head = b
        .head()
        .encode(1 + BLOCK_HEAD + b.payload.len(), max_frame)?;
    Ok(EncodedFrame {
        head: Bytes::copy_from_slice(&head),
        payload: b.payload.clone(),
        tail: Bytes::new(),
    })
}

#[cfg(test)]
mod tests {
    use kvmesh_core::HashAlgo;
    use proptest::prelude::*;

    use super::*;

    fn fp() -> Fingerprint {
        Fingerprint {
            model_id: "m".into(),
            kv_dtype: "sim".into(),
            block_size: 16,
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 8,
            hash_algo: HashAlgo::Sha256Cbor,
            none_hash: "00".into(),
        }
    }

    fn round_trip(m: &Message) -> Message {
        let wire = m.encode(1 << 20).unwrap().to_vec();
        let mut buf = BytesMut::from(&wire[..]);
        let f = frame::parse(&mut buf, 1 << 20).unwrap().unwrap();
        assert!(buf.is_empty());
        Message::from_frame(f).unwrap()
    }

    fn arb_message() -> impl Strategy<Value = Message> {
        let hashes = proptest::collection::vec(any::<u64>().prop_map(BlockHash), 0..64);
        prop_oneof![
            any::<[u8; 16]>().prop_map(|nonce| Message::Hello(Hello {
                version: 1,
                fingerprint: fp(),
                nonce
            })),
            any::<[u8; 16]>().prop_map(|nonce| Message::Challenge(Challenge { nonce })),
            proptest::collection::vec(any::<u8>(), 0..40).prop_flat_map(|proof| any::<bool>()
                .prop_map(move |encrypt| Message::Auth(Auth {
                    proof: proof.clone(),
                    encrypt
                }))),
            (
                proptest::option::of(proptest::collection::vec(any::<u8>(), 32)),
                any::<bool>()
            )
                .prop_map(|(proof, promote)| Message::HelloOk(HelloOk {
                    version: 1,
                    proof,
                    promote,
                    max_transfers: 4,
                })),
            Just(Message::Refused(Refused {
                reason: RefuseReason::Fingerprint {
                    field: "block_size".into(),
                    ours: "16".into(),
                    theirs: "32".into()
                }
            })),
            Just(Message::Refused(Refused {
                reason: RefuseReason::AuthFailed
            })),
            ("[a-z0-9-]{0,20}", hashes.clone()).prop_map(
                |(kv_request_id, hashes)| Message::Lookup(Lookup {
                    kv_request_id,
                    hashes
                })
            ),
            (proptest::collection::vec(0u8..3, 0..64), any::<u32>()).prop_map(
                |(codes, lease_ms)| {
                    Message::LookupReply(LookupReply {
                        statuses: codes
                            .into_iter()
                            .filter_map(BlockStatus::from_code)
                            .collect(),
                        lease_ms,
                    })
                }
            ),
            (hashes, any::<u32>(), any::<bool>()).prop_map(
                |(hashes, pending_wait_ms, background)| Message::Fetch(Fetch {
                    segments: if background {
                        vec![]
                    } else {
                        vec![pending_wait_ms | 1, 7]
                    },
                    hashes,
                    pending_wait_ms,
                    background,
                })
            ),
            Just(Message::Promote(Promote {})),
            (
                any::<u32>(),
                any::<u64>(),
                proptest::collection::vec(any::<u8>(), 0..4096)
            )
                .prop_map(|(i, h, p)| {
                    Message::Block(BlockFrame::new(i, BlockHash(h), Bytes::from(p)))
                }),
            (any::<u32>(), any::<u64>(), any::<u32>()).prop_map(|(blocks, bytes, index)| {
                Message::Done(Done {
                    blocks,
                    bytes,
                    end: FetchEnd::PendingDeadline { index },
                })
            }),
            ".{0,30}".prop_map(|message| Message::Error(ErrorMsg { message })),
        ]
    }

    #[test]
    fn block_layout_is_fixed_binary() {
        let b = BlockFrame::new(7, BlockHash(0x0102030405060708), Bytes::from_static(b"xyz"));
        let wire = Message::Block(b.clone()).encode(1024).unwrap().to_vec();
        let body_len = 20 + 3;
        assert_eq!(&wire[..4], &((body_len + 1) as u32).to_be_bytes());
        assert_eq!(wire[4], Tag::Block as u8);
        assert_eq!(&wire[5..9], &7u32.to_be_bytes());
        assert_eq!(&wire[9..17], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&wire[17..21], &3u32.to_be_bytes());
        assert_eq!(&wire[21..25], &crc32fast::hash(b"xyz").to_be_bytes());
        assert_eq!(&wire[25..], b"xyz");
        assert_eq!(BlockHead::decode(&wire[5..25]).unwrap(), b.head());
        assert!(b.checksum_ok());
        let mut bad = b;
        bad.crc ^= 1;
        assert!(!bad.checksum_ok());
    }

    #[test]
    fn block_with_inconsistent_length_is_malformed() {
        let mut body = BytesMut::new();
        body.put_u32(0);
        body.put_u64(1);
        body.put_u32(100); // claims 100 payload bytes
        body.put_u32(0);
        body.put_slice(b"short");
        let err = Message::from_frame(RawFrame {
            tag: Tag::Block,
            body: body.freeze(),
        })
        .unwrap_err();
        assert!(
            matches!(
                err,
                MessageError::Malformed {
                    tag: Tag::Block,
                    ..
                }
            ),
            "{err}"
        );
        assert!(BlockHead::decode(&[0; 19]).is_err(), "a head is 20 bytes");
    }

    /// Golden bytes of a `Fetch` frame as every encoder before the `background` flag wrote it
    /// (and as the Rust consumer still writes a demand fetch): a two-key msgpack map.
    const FETCH_V2_GOLDEN: &[u8] = &[
        0, 0, 0, 31, 8,    // len 31 (tag + 30-byte body), tag 8 = Fetch
        0x82, // map of 2
        0xa6, b'h', b'a', b's', b'h', b'e', b's', 0x92, 0x01, 0xcd, 0x01, 0x00, // [1, 256]
        0xaf, b'p', b'e', b'n', b'd', b'i', b'n', b'g', b'_', b'w', b'a', b'i', b't', b'_', b'm',
        b's', 0x07, // pending_wait_ms: 7
    ];

    fn parse_one(wire: &[u8]) -> Message {
        let mut buf = BytesMut::from(wire);
        let f = frame::parse(&mut buf, 1 << 20).unwrap().unwrap();
        assert!(buf.is_empty());
        Message::from_frame(f).unwrap()
    }

    /// Wire compatibility of the `background` flag: a demand fetch is the same bytes as before
    /// the flag existed, an old frame (no key) decodes as demand, and a background fetch adds
    /// exactly one key that an older decoder skips like any unknown key.
    #[test]
    fn fetch_background_flag_is_wire_compatible() {
        let demand = Fetch {
            hashes: vec![BlockHash(1), BlockHash(256)],
            pending_wait_ms: 7,
            background: false,
            segments: Vec::new(),
        };
        let wire = Message::Fetch(demand.clone())
            .encode(1024)
            .unwrap()
            .to_vec();
        assert_eq!(wire, FETCH_V2_GOLDEN, "a demand Fetch changed on the wire");
        assert_eq!(parse_one(FETCH_V2_GOLDEN), Message::Fetch(demand.clone()));

        let bg = Fetch {
            background: true,
            ..demand.clone()
        };
        let wire = Message::Fetch(bg.clone()).encode(1024).unwrap().to_vec();
        let mut expected = FETCH_V2_GOLDEN.to_vec();
        expected[3] += 12; // "background": true = 1 + 10 + 1 bytes
        expected[5] = 0x83;
        expected.extend_from_slice(b"\xaabackground\xc3");
        assert_eq!(wire, expected);
        assert_eq!(parse_one(&wire), Message::Fetch(bg));

        // An older decoder: the map without the flag's field, which ignores unknown keys.
        #[derive(Debug, Deserialize, PartialEq)]
        struct FetchV2 {
            hashes: Vec<BlockHash>,
            pending_wait_ms: u32,
        }
        let old: FetchV2 = rmp_serde::from_slice(&wire[HEADER_LEN..]).unwrap();
        assert_eq!(old.hashes, demand.hashes);
        assert_eq!(old.pending_wait_ms, 7);
    }

    /// `HelloOk` of a version-4 producer (unchanged since version 3): `promote` written only when
    /// true, `max_transfers` always; a `HelloOk` without them decodes as a producer that does not
    /// promote and did not announce its cap (0).
    #[test]
    fn hello_ok_capabilities_on_the_wire() {
        let ok = HelloOk {
            version: PROTOCOL_VERSION,
            proof: None,
            promote: false,
            max_transfers: 4,
        };
        let wire = Message::HelloOk(ok.clone()).encode(1024).unwrap().to_vec();
        // {version: 4, proof: nil, max_transfers: 4}
        let mut golden = vec![0, 0, 0, 33, Tag::HelloOk as u8, 0x83, 0xa7];
        golden.extend_from_slice(b"version\x04\xa5proof\xc0\xadmax_transfers\x04");
        assert_eq!(wire, golden);
        assert_eq!(parse_one(&golden), Message::HelloOk(ok.clone()));
        let mut minimal = vec![0, 0, 0, 18, Tag::HelloOk as u8, 0x82, 0xa7];
        minimal.extend_from_slice(b"version\x04\xa5proof\xc0");
        assert_eq!(
            parse_one(&minimal),
            Message::HelloOk(HelloOk {
                max_transfers: 0,
                ..ok.clone()
            })
        );
        let new = HelloOk {
            promote: true,
            ..ok
        };
        assert_eq!(
            parse_one(&Message::HelloOk(new.clone()).encode(1024).unwrap().to_vec()),
            Message::HelloOk(new)
        );
        // `Promote` is an empty map under its own tag.
        let wire = Message::Promote(Promote {}).encode(1024).unwrap().to_vec();
        assert_eq!(wire, [0, 0, 0, 2, Tag::Promote as u8, 0x80]);
    }

    /// `Auth` asks for encryption only when it wants it: an authenticate-only `Auth` is the
    /// one-key map of before.
    #[test]
    fn auth_encrypt_flag_is_written_only_when_set() {
        let plain = Auth {
            proof: vec![1],
            encrypt: false,
        };
        let wire = Message::Auth(plain.clone()).encode(1024).unwrap().to_vec();
        assert_eq!(&wire[5..], b"\x81\xa5proof\x91\x01");
        let enc = Auth {
            encrypt: true,
            ..plain
        };
        let wire = Message::Auth(enc.clone()).encode(1024).unwrap().to_vec();
        assert!(wire.ends_with(b"\xa7encrypt\xc3"), "{wire:?}");
        assert_eq!(parse_one(&wire), Message::Auth(enc));
    }

    proptest! {
        #[test]
        fn messages_round_trip(m in arb_message()) {
            prop_assert_eq!(round_trip(&m), m);
        }

        #[test]
        fn arbitrary_bodies_never_panic(tag_ix in 0usize..Tag::ALL.len(), body in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = Message::from_frame(RawFrame { tag: Tag::ALL[tag_ix], body: Bytes::from(body) });
        }
    }
}
