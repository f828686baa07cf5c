//! Bytes → frames: the length-prefixed framing of the P2P protocol.
//!
//! Wire layout of every frame: `len: u32 BE | tag: u8 | body[len - 1]`, where `len` counts the tag
//! and the body. Parsing is two-phase, as in mini-redis: [`check`] looks at the buffered bytes and
//! says whether a whole frame is there (`Incomplete` is a normal answer, not an error), then
//! [`parse`] splits exactly that frame off the buffer without copying the body. Every frame has a
//! maximum size, enforced on the length prefix before any body byte is buffered, so a peer cannot
//! make us allocate more than `max_frame` bytes per connection. Until the handshake has
//! succeeded the bound is [`PREAUTH_MAX_FRAME`] (4 KiB): an unauthenticated peer cannot make us
//! buffer more than that, whatever its length prefix claims.

use bytes::{Buf, Bytes, BytesMut};

/// Length prefix plus tag.
pub const HEADER_LEN: usize = 5;

/// Default bound on one frame (tag + body). A block frame carries one KV block; 64 MiB leaves room
/// for a 64-token block of a large model (~93 KB/token ⇒ ~6 MB) many times over.
pub const DEFAULT_MAX_FRAME: usize = 64 << 20;

/// Bound on every frame before the handshake has succeeded (`Hello`, `Challenge`, `Auth`,
/// `HelloOk`, `Refused`): they carry a fingerprint, nonces and proofs, a few hundred bytes.
pub const PREAUTH_MAX_FRAME: usize = 4 << 10;

/// What a frame carries; the body layout per tag lives in [`crate::message`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Tag {
    Hello = 1,
    Challenge = 2,
    Auth = 3,
    HelloOk = 4,
    Refused = 5,
    Lookup = 6,
    LookupReply = 7,
    Fetch = 8,
    Block = 9,
    Done = 10,
    Error = 11,
    /// A background fetch became demand (consumer → producer, during the fetch).
    Promote = 12,
}

impl Tag {
    /// All tags, for exhaustive tests.
    pub const ALL: [Tag; 12] = [
        Tag::Hello,
        Tag::Challenge,
        Tag::Auth,
        Tag::HelloOk,
        Tag::Refused,
        Tag::Lookup,
        Tag::LookupReply,
        Tag::Fetch,
        Tag::Block,
        Tag::Done,
        Tag::Error,
        Tag::Promote,
    ];
}

impl TryFrom<u8> for Tag {
    type Error = FrameError;

    fn try_from(v: u8) -> Result<Self, FrameError> {
        Tag::ALL
            .into_iter()
            .find(|t| *t as u8 == v)
            .ok_or(FrameError::UnknownTag(v))
    }
}

/// A frame that does not follow the framing rules. Any of these closes the connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("frame of {len} bytes exceeds the maximum of {max}")]
    TooLarge { len: usize, max: usize },
    #[error("zero-length frame")]
    Empty,
    #[error("unknown frame tag {0}")]
    UnknownTag(u8),
}

/// Answer of the first parsing phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// Not a whole frame yet; at least `needed` more bytes must arrive.
    Incomplete { needed: usize },
    /// A whole frame of `total` bytes (header included) is buffered.
    Complete { total: usize },
}

/// One frame: a tag and its body (a zero-copy slice of the read buffer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawFrame {
    pub tag: Tag,
    pub body: Bytes,
}

/// Phase one: is a whole, well-formed frame at the start of `buf`?
pub fn check(buf: &[u8], max_frame: usize) -> Result<Check, FrameError> {
    let Some(prefix) = buf.get(..4) else {
        return Ok(Check::Incomplete {
            needed: 4 - buf.len(),
        });
    };
    let len = u32::from_be_bytes([prefix[0], prefix[1], prefix[2], prefix[3]]) as usize;
    if len == 0 {
        return Err(FrameError::Empty);
    }
    if len > max_frame {
        return Err(FrameError::TooLarge {
            len,
            max: max_frame,
        });
    }
    if let Some(&tag) = buf.get(4) {
        Tag::try_from(tag)?;
    }
    let total = 4 + len;
    if buf.len() < total {
        Ok(Check::Incomplete {
            needed: total - buf.len(),
        })
    } else {
        Ok(Check::Complete { total })
    }
}

/// Phase two: split one frame off the front of `buf` if a whole one is buffered. `Ok(None)` means
/// "read more bytes".
pub fn parse(buf: &mut BytesMut, max_frame: usize) -> Result<Option<RawFrame>, FrameError> {
    match check(buf, max_frame)? {
        Check::Incomplete { .. } => Ok(None),
        Check::Complete { total } => {
            let mut frame = buf.split_to(total).freeze();
            frame.advance(4);
            let tag = Tag::try_from(frame.get_u8())?;
            Ok(Some(RawFrame { tag, body: frame }))
        }
    }
}

/// The 5-byte header of a frame whose body has `body_len` bytes.
pub fn header(tag: Tag, body_len: usize, max_frame: usize) -> Result<[u8; HEADER_LEN], FrameError> {
    let len = body_len + 1;
    if len > max_frame || u32::try_from(len).is_err() {
        return Err(FrameError::TooLarge {
            len,
            max: max_frame,
        });
    }
    let mut h = [0u8; HEADER_LEN];
    h[..4].copy_from_slice(&(len as u32).to_be_bytes());
    h[4] = tag as u8;
    Ok(h)
}

/// Encode a whole frame into one contiguous buffer (used for small control frames).
pub fn encode(tag: Tag, body: &[u8], max_frame: usize) -> Result<Bytes, FrameError> {
    let h = header(tag, body.len(), max_frame)?;
    let mut out = BytesMut::with_capacity(HEADER_LEN + body.len());
    out.extend_from_slice(&h);
    out.extend_from_slice(body);
    Ok(out.freeze())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn incomplete_is_not_an_error() {
        assert_eq!(check(&[], 100), Ok(Check::Incomplete { needed: 4 }));
        assert_eq!(
            check(&[0, 0, 0, 3, 9], 100),
            Ok(Check::Incomplete { needed: 2 })
        );
        assert_eq!(
            check(&[0, 0, 0, 3, 9, 1, 2], 100),
            Ok(Check::Complete { total: 7 })
        );
    }

    #[test]
    fn oversized_and_empty_and_unknown_rejected_before_body() {
        assert_eq!(
            check(&[0, 0, 1, 0], 255),
            Err(FrameError::TooLarge { len: 256, max: 255 })
        );
        assert_eq!(check(&[0, 0, 0, 0], 255), Err(FrameError::Empty));
        assert_eq!(
            check(&[0, 0, 0, 2, 200], 255),
            Err(FrameError::UnknownTag(200))
        );
        assert!(header(Tag::Block, 300, 255).is_err());
    }

    #[test]
    fn parse_splits_exactly_one_frame() {
        let mut buf = BytesMut::new();
        buf.extend_from_slice(&encode(Tag::Lookup, b"abc", 100).unwrap());
        buf.extend_from_slice(&encode(Tag::Done, b"", 100).unwrap());
        buf.extend_from_slice(&[0, 0]);
        let f1 = parse(&mut buf, 100).unwrap().unwrap();
        assert_eq!((f1.tag, &f1.body[..]), (Tag::Lookup, &b"abc"[..]));
        let f2 = parse(&mut buf, 100).unwrap().unwrap();
        assert_eq!((f2.tag, f2.body.len()), (Tag::Done, 0));
        assert_eq!(parse(&mut buf, 100).unwrap(), None);
        assert_eq!(buf.len(), 2);
    }

    proptest! {
        #[test]
        fn round_trip(tag_ix in 0usize..Tag::ALL.len(), body in proptest::collection::vec(any::<u8>(), 0..2048), split in 0usize..4096) {
            let tag = Tag::ALL[tag_ix];
            let wire = encode(tag, &body, 4096).unwrap();
            // Feed in two pieces: the first parse must say "incomplete" unless all bytes are in.
            let split = split.min(wire.len());
            let mut buf = BytesMut::from(&wire[..split]);
            let first = parse(&mut buf, 4096).unwrap();
            if split < wire.len() {
                prop_assert!(first.is_none());
                buf.extend_from_slice(&wire[split..]);
                let f = parse(&mut buf, 4096).unwrap().unwrap();
                prop_assert_eq!(f.tag, tag);
                prop_assert_eq!(&f.body[..], &body[..]);
            } else {
                let f = first.unwrap();
                prop_assert_eq!(f.tag, tag);
                prop_assert_eq!(&f.body[..], &body[..]);
            }
            prop_assert!(buf.is_empty());
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let mut buf = BytesMut::from(&bytes[..]);
            // Drain frames until incomplete or error; must terminate and never panic.
            while let Ok(Some(_)) = parse(&mut buf, 64) {}
        }

        #[test]
        fn oversized_length_rejected(len in 65u32..u32::MAX, tag in any::<u8>()) {
            let mut buf = BytesMut::new();
            buf.extend_from_slice(&len.to_be_bytes());
            buf.extend_from_slice(&[tag]);
            prop_assert_eq!(parse(&mut buf, 64), Err(FrameError::TooLarge { len: len as usize, max: 64 }));
        }
    }
}
