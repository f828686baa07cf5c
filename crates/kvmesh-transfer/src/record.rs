//! Records: how a block frame's payload travels, and how a protected connection cuts it into
//! tagged pieces that are verified while they are still in cache.
//!
//! A block frame is `len u32 | 9 | index u32 | hash u64 | payload_len u32 | crc32 u32` (its
//! *head*, [`BLOCK_HEAD_LEN`] bytes) followed by the payload. On a connection with a shared secret
//! ([`crate::mac`]) the head is one record (its 16-byte tag follows it) and the payload is cut into
//! records of [`RECORD_LEN`] bytes (the last one shorter), each followed by its tag:
//!
//! ```text
//! head | T(head) | payload[0..R] | T0 | payload[R..2R] | T1 | … | payload[kR..] | Tk
//! ```
//!
//! `len` counts everything after itself: tag byte, head fields, payload and tags
//! ([`block_frame_len`]), so a receiver bounds a frame from its first four bytes as before. The head
//! record is verified before the payload's destination is chosen; each payload record is verified
//! (and decrypted) as soon as its tag is in. A control frame is a single record:
//! `len | tag | body | T`.
//!
//! [`PayloadCursor`] is the receiving side as a pure state machine (where the next bytes go, when
//! a record is complete), driven by the connection's socket reads and, in the tests, by arbitrary
//! splits of [`seal_block`]'s output.

use std::ops::Range;

use crate::frame::HEADER_LEN;
use crate::mac::{RecordError, RecordKey, TAG_LEN};
use crate::message::BLOCK_HEAD;

/// Largest payload record: small enough that the receiver verifies a record right after the
/// kernel copied it in (L2-resident), large enough that a tag costs 16 bytes per 256 KiB.
pub const RECORD_LEN: usize = 256 << 10;

/// Bytes of a block frame's head on the wire (length prefix and tag byte included).
pub const BLOCK_HEAD_LEN: usize = HEADER_LEN + BLOCK_HEAD;

/// Payload records of a payload of `payload_len` bytes (none for an empty payload).
pub fn payload_records(payload_len: usize) -> usize {
    payload_len.div_ceil(RECORD_LEN)
}

/// The payload range of each record, in order.
pub fn record_ranges(payload_len: usize) -> impl Iterator<Item = Range<usize>> {
    (0..payload_len)
        .step_by(RECORD_LEN)
        .map(move |start| start..(start + RECORD_LEN).min(payload_len))
}

/// Wire bytes of a block payload: the payload, plus one tag per record when `protected`.
pub fn payload_wire_len(payload_len: usize, protected: bool) -> usize {
    payload_len
        + if protected {
            TAG_LEN * payload_records(payload_len)
        } else {
            0
        }
}

/// Bytes of a block head plus its tag when `protected`.
pub fn head_wire_len(protected: bool) -> usize {
    BLOCK_HEAD_LEN + if protected { TAG_LEN } else { 0 }
}

/// The `len` field of a block frame carrying `payload_len` bytes.
pub fn block_frame_len(payload_len: usize, protected: bool) -> usize {
    head_wire_len(protected) - 4 + payload_wire_len(payload_len, protected)
}

/// Where the next bytes of a block payload on the wire go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Up to this many payload bytes, into the destination at [`PayloadCursor::filled`].
    Payload(usize),
    /// Up to this many bytes of the current record's tag.
    Tag(usize),
    /// The whole payload is in and verified.
    Done,
}

/// Receives one block payload: tracks where the wire bytes go, verifies (and decrypts) each record
/// in the destination as its tag completes, and computes the CRC32 of the plaintext on the way.
#[derive(Debug)]
pub struct PayloadCursor {
    len: usize,
    /// Payload bytes received into the destination.
    filled: usize,
    /// Payload bytes verified (and checksummed): the start of the record being received.
    verified: usize,
    protected: bool,
    tag: [u8; TAG_LEN],
    tag_filled: usize,
    crc: crc32fast::Hasher,
}

impl PayloadCursor {
    pub fn new(payload_len: usize, protected: bool) -> Self {
        Self {
            len: payload_len,
            filled: 0,
            verified: 0,
            protected,
            tag: [0; TAG_LEN],
            tag_filled: 0,
            crc: crc32fast::Hasher::new(),
        }
    }

    /// Payload bytes received so far (the destination offset of the next payload byte).
    pub fn filled(&self) -> usize {
        self.filled
    }

    /// The current record's end in the payload.
    fn record_end(&self) -> usize {
        if self.protected {
            (self.verified + RECORD_LEN).min(self.len)
        } else {
            self.len
        }
    }

    pub fn step(&self) -> Step {
        if self.filled < self.record_end() {
            Step::Payload(self.record_end() - self.filled)
        } else if self.protected && self.verified < self.len {
            Step::Tag(TAG_LEN - self.tag_filled)
        } else {
            Step::Done
        }
    }

    /// `n` more payload bytes are in `dest[filled..filled + n]`. Unprotected payloads are
    /// checksummed as they arrive (the bytes are in cache now); protected ones when their record
    /// verifies.
    pub fn payload_read(&mut self, dest: &[u8], n: usize) {
        let n = n.min(self.record_end() - self.filled);
        if !self.protected {
            self.crc.update(&dest[self.filled..self.filled + n]);
            self.verified = self.filled + n;
        }
        self.filled += n;
    }

    /// Tag bytes arrived (at most [`Step::Tag`]'s count are used; returns how many). When the tag
    /// is complete its record in `dest` is verified with `key`, decrypted in place if encrypted,
    /// and checksummed.
    pub fn tag_read(
        &mut self,
        bytes: &[u8],
        dest: &mut [u8],
        key: &mut RecordKey,
    ) -> Result<usize, RecordError> {
        let take = bytes.len().min(TAG_LEN - self.tag_filled);
        self.tag[self.tag_filled..self.tag_filled + take].copy_from_slice(&bytes[..take]);
        self.tag_filled += take;
        if self.tag_filled == TAG_LEN {
            let record = &mut dest[self.verified..self.filled];
            key.open(record, 0, &self.tag)?;
            self.crc.update(record);
            self.verified = self.filled;
            self.tag_filled = 0;
        }
        Ok(take)
    }

    /// CRC32 of the whole (plaintext) payload; call at [`Step::Done`].
    pub fn crc(self) -> u32 {
        self.crc.finalize()
    }
}

/// A whole block frame as a protected connection sends it: `head` (its `len` field must say
/// [`block_frame_len`]`(payload.len(), true)`), the head's tag, then each payload record and its
/// tag. For tests and forgers; the connection writes the same bytes from the payload in place
/// (vectored) or from a staging buffer (encrypted).
pub fn seal_block(key: &mut RecordKey, head: [u8; BLOCK_HEAD_LEN], payload: &[u8]) -> Vec<u8> {
    let mut wire = Vec::with_capacity(BLOCK_HEAD_LEN + payload_wire_len(payload.len(), true));
    let mut head = head;
    let tag = key.seal(&mut head, HEADER_LEN);
    wire.extend_from_slice(&head);
    wire.extend_from_slice(&tag);
    for r in record_ranges(payload.len()) {
        seal_record_into(key, &payload[r], &mut wire);
    }
    wire
}

/// A control frame (`len | tag | body`, `len` already counting the tag) protected as one record:
/// the body encrypted in place if `key` encrypts, the tag appended.
pub fn seal_control(key: &mut RecordKey, mut frame: Vec<u8>) -> Vec<u8> {
    let tag = key.seal(&mut frame, HEADER_LEN);
    frame.extend_from_slice(&tag);
    frame
}

/// Appends one payload record and its tag to `out`, encrypted if `key` encrypts.
pub fn seal_record_into(key: &mut RecordKey, record: &[u8], out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(record);
    let tag = key.seal(&mut out[start..], 0);
    out.extend_from_slice(&tag);
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::auth::Secret;
    use crate::mac::{Protection, Role, SessionKeys};

    fn key(p: Protection) -> RecordKey {
        let k = SessionKeys::derive(
            &Secret::from("s"),
            p,
            Role::Producer,
            &[1; 16],
            &[2; 16],
            &[3; 32],
        );
        RecordKey::new(&k.send)
    }

    fn head(payload_len: usize, protected: bool) -> [u8; BLOCK_HEAD_LEN] {
        let mut h = [0u8; BLOCK_HEAD_LEN];
        let len = block_frame_len(payload_len, protected) as u32;
        h[..4].copy_from_slice(&len.to_be_bytes());
        h[4] = 9;
        h[17..21].copy_from_slice(&(payload_len as u32).to_be_bytes());
        h
    }

    /// A receiving key that has verified the head record of the sealed block `wire`.
    fn head_opened(p: Protection, wire: &[u8]) -> RecordKey {
        let mut rx = key(p);
        let mut head = wire[..BLOCK_HEAD_LEN].to_vec();
        rx.open(
            &mut head,
            HEADER_LEN,
            &wire[BLOCK_HEAD_LEN..head_wire_len(true)],
        )
        .unwrap();
        rx
    }

    /// Feeds `wire` (the bytes after the head and its tag) to a cursor in pieces of the given
    /// sizes, as socket reads would deliver them; returns the payload and its CRC32.
    fn receive(
        wire: &[u8],
        payload_len: usize,
        rx: Option<&mut RecordKey>,
        cuts: &[usize],
    ) -> Result<(Vec<u8>, u32), RecordError> {
        let protected = rx.is_some();
        let mut rx = rx;
        let mut cursor = PayloadCursor::new(payload_len, protected);
        let mut dest = vec![0u8; payload_len];
        let mut at = 0;
        let mut cut = cuts.iter().cycle();
        loop {
            let chunk = cut.next().copied().unwrap_or(1).max(1);
            match cursor.step() {
                Step::Done => break,
                Step::Payload(max) => {
                    let n = max.min(chunk).min(wire.len() - at);
                    let off = cursor.filled();
                    dest[off..off + n].copy_from_slice(&wire[at..at + n]);
                    cursor.payload_read(&dest, n);
                    at += n;
                }
                Step::Tag(max) => {
                    let n = max.min(chunk).min(wire.len() - at);
                    let key = rx.as_deref_mut().expect("tags only when protected");
                    at += cursor.tag_read(&wire[at..at + n], &mut dest, key)?;
                }
            }
        }
        assert_eq!(at, wire.len(), "every wire byte consumed");
        Ok((dest, cursor.crc()))
    }

    #[test]
    fn lengths_of_a_protected_block() {
        assert_eq!(payload_records(0), 0);
        assert_eq!(payload_records(1), 1);
        assert_eq!(payload_records(RECORD_LEN), 1);
        assert_eq!(payload_records(RECORD_LEN + 1), 2);
        // 2.6 MB block: 10 full records and one of 128 KiB.
        let p = 40 * 1024 * 64;
        assert_eq!(payload_records(p), 10);
        assert_eq!(block_frame_len(p, false), 1 + 20 + p);
        assert_eq!(block_frame_len(p, true), 1 + 20 + 16 + p + 10 * 16);
        let ranges: Vec<_> = record_ranges(RECORD_LEN * 2 + 5).collect();
        assert_eq!(
            ranges,
            [
                0..RECORD_LEN,
                RECORD_LEN..2 * RECORD_LEN,
                2 * RECORD_LEN..2 * RECORD_LEN + 5
            ]
        );
    }

    #[test]
    fn an_altered_reordered_or_truncated_payload_record_fails() {
        let payload: Vec<u8> = (0..(RECORD_LEN * 2 + 100)).map(|i| i as u8).collect();
        for p in [Protection::Authenticate, Protection::Encrypt] {
            let wire = seal_block(&mut key(p), head(payload.len(), true), &payload);
            let body = &wire[head_wire_len(true)..];
            let mut rx = head_opened(p, &wire);
            let (got, crc) = receive(body, payload.len(), Some(&mut rx), &[4096]).unwrap();
            assert_eq!(got, payload);
            assert_eq!(crc, crc32fast::hash(&payload));
            // A flipped byte in the second record fails there: the first record was verified.
            let mut bad = body.to_vec();
            bad[RECORD_LEN + TAG_LEN + 7] ^= 1;
            let mut rx = head_opened(p, &wire);
            let err = receive(&bad, payload.len(), Some(&mut rx), &[65536]).unwrap_err();
            assert_eq!(
                err.seq, 2,
                "head is record 0, the payload's second record is 2"
            );
            // Records swapped: the first one arrives where the second should be.
            let r0 = &body[..RECORD_LEN + TAG_LEN];
            let r1 = &body[RECORD_LEN + TAG_LEN..2 * (RECORD_LEN + TAG_LEN)];
            let swapped = [r1, r0, &body[2 * (RECORD_LEN + TAG_LEN)..]].concat();
            let mut rx = head_opened(p, &wire);
            assert!(receive(&swapped, payload.len(), Some(&mut rx), &[RECORD_LEN]).is_err());
        }
    }

    proptest! {
        /// Any payload size, any split of the wire into reads: the cursor reassembles exactly the
        /// payload, with the CRC32 of the plaintext, in every protection.
        #[test]
        fn records_split_and_reassemble(
            payload_len in prop_oneof![0usize..64, (RECORD_LEN - 64)..(RECORD_LEN + 64), 0usize..(3 * RECORD_LEN + 1000)],
            seed in any::<u8>(),
            cuts in proptest::collection::vec(1usize..(RECORD_LEN + 100), 1..8),
            mode in 0u8..3,
        ) {
            let payload: Vec<u8> = (0..payload_len).map(|i| (i as u8) ^ seed).collect();
            let (wire, rx) = match mode {
                0 => (payload.clone(), None),
                m => {
                    let p = if m == 1 { Protection::Authenticate } else { Protection::Encrypt };
                    let wire = seal_block(&mut key(p), head(payload_len, true), &payload);
                    let mut rx = key(p);
                    let mut h = wire[..BLOCK_HEAD_LEN].to_vec();
                    rx.open(&mut h, HEADER_LEN, &wire[BLOCK_HEAD_LEN..head_wire_len(true)]).unwrap();
                    prop_assert_eq!(h, head(payload_len, true).to_vec());
                    prop_assert_eq!(wire.len(), 4 + block_frame_len(payload_len, true));
                    (wire[head_wire_len(true)..].to_vec(), Some(rx))
                }
            };
            let mut rx = rx;
            let (got, crc) = receive(&wire, payload_len, rx.as_mut(), &cuts).unwrap();
            prop_assert_eq!(&got, &payload);
            prop_assert_eq!(crc, crc32fast::hash(&payload));
            if let Some(rx) = rx {
                prop_assert_eq!(rx.seq(), 1 + payload_records(payload_len) as u64);
            }
        }
    }
}
