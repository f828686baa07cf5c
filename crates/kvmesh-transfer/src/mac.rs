//! Per-frame authentication after the handshake: session keys and the frame MAC.
//!
//! The challenge–response of [`crate::auth`] proves that both ends know the shared secret, but on
//! its own it authenticates only the handshake: anyone on the path could then inject or alter
//! frames (forge KV blocks, flip bits that keep the CRC32 right). So when a secret is set, every
//! frame after `HelloOk` carries an HMAC-SHA256 tag under a key of its own connection and
//! direction, over an implicit sequence number and the whole frame as sent:
//!
//! - **keys** (NIST SP 800-108 counter-mode KDF, PRF = HMAC-SHA256 keyed by the secret):
//!   `K_dir = HMAC(secret, 00 00 00 01 | label_dir | 00 | consumer_nonce | producer_nonce |
//!   SHA-256(Hello body) | 00 00 01 00)` with `label_dir` = `"kvmesh-p2p/v2 consumer->producer"`
//!   or `"kvmesh-p2p/v2 producer->consumer"`. Fresh nonces from both sides make the keys unique per
//!   connection; the label separates the directions (a frame cannot be reflected back); hashing
//!   the `Hello` binds the version and fingerprint the producer checked (an on-path rewrite of
//!   them yields different keys, so the first authenticated frame fails).
//! - **tag**: `HMAC(K_dir, seq u64 BE | len u32 BE | tag u8 | body)`, appended after the body and
//!   counted in `len`. `seq` counts the frames sent in that direction since `HelloOk`, from 0; it
//!   never travels, so a replayed, dropped or reordered frame fails verification.
//!
//! The MAC is computed progressively as bytes arrive (like the block CRC) and verified before the
//! frame is decoded or acted on. Tags are compared in constant time.

use std::fmt;

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::auth::Secret;
use crate::message::Nonce;

/// Bytes of the tag appended to every authenticated frame.
pub const MAC_LEN: usize = 32;

const LABEL_C2P: &[u8] = b"kvmesh-p2p/v2 consumer->producer";
const LABEL_P2C: &[u8] = b"kvmesh-p2p/v2 producer->consumer";

/// Which end of the connection we are (decides which key sends and which receives).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Consumer,
    Producer,
}

/// The two direction keys of one connection, seen from one end.
#[derive(Clone, PartialEq, Eq)]
pub struct SessionKeys {
    pub send: [u8; 32],
    pub recv: [u8; 32],
}

impl fmt::Debug for SessionKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SessionKeys(<redacted>)")
    }
}

/// SHA-256 of the `Hello` as encoded on the wire (the transcript the keys are bound to).
pub fn transcript_hash(hello_body: &[u8]) -> [u8; 32] {
    Sha256::digest(hello_body).into()
}

impl SessionKeys {
    /// Derive both direction keys (see the module docs) and orient them for `role`.
    pub fn derive(
        secret: &Secret,
        role: Role,
        consumer_nonce: &Nonce,
        producer_nonce: &Nonce,
        transcript: &[u8; 32],
    ) -> Self {
        let kdf = |label: &[u8]| {
            secret.prf(&[
                &1u32.to_be_bytes(),
                label,
                &[0],
                consumer_nonce,
                producer_nonce,
                transcript,
                &256u32.to_be_bytes(),
            ])
        };
        let (c2p, p2c) = (kdf(LABEL_C2P), kdf(LABEL_P2C));
        match role {
            Role::Consumer => Self {
                send: c2p,
                recv: p2c,
            },
            Role::Producer => Self {
                send: p2c,
                recv: c2p,
            },
        }
    }
}

/// One direction's MAC state: its key and the sequence number of the next frame.
#[derive(Clone)]
pub struct FrameMac {
    key: [u8; 32],
    seq: u64,
}

impl fmt::Debug for FrameMac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FrameMac").field("seq", &self.seq).finish()
    }
}

impl FrameMac {
    pub fn new(key: [u8; 32]) -> Self {
        Self { key, seq: 0 }
    }

    /// Sequence number of the next frame.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// A MAC over the next frame, already fed its sequence number; feed the frame bytes (length
    /// prefix included, tag excluded) with `update`, then [`FrameMac::finish`] or
    /// [`FrameMac::verify`].
    pub fn begin(&self) -> Hmac<Sha256> {
        // HMAC accepts keys of any length; `new_from_slice` cannot fail for it.
        let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(&self.key) else {
            unreachable!("HMAC takes keys of any length")
        };
        mac.update(&self.seq.to_be_bytes());
        mac
    }

    /// The tag of a frame being sent; advances the sequence number.
    pub fn finish(&mut self, mac: Hmac<Sha256>) -> [u8; MAC_LEN] {
        self.seq = self.seq.wrapping_add(1);
        mac.finalize().into_bytes().into()
    }

    /// Checks a received frame's tag (constant time); advances the sequence number only if it
    /// matches (a mismatch closes the connection anyway).
    pub fn verify(&mut self, mac: Hmac<Sha256>, tag: &[u8]) -> bool {
        let ok = mac.verify_slice(tag).is_ok();
        if ok {
            self.seq = self.seq.wrapping_add(1);
        }
        ok
    }

    /// Tag of a whole frame in one call (tests and small frames).
    pub fn seal(&mut self, frame: &[u8]) -> [u8; MAC_LEN] {
        let mut mac = self.begin();
        mac.update(frame);
        self.finish(mac)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(role: Role, secret: &str, t: u8) -> SessionKeys {
        SessionKeys::derive(&Secret::from(secret), role, &[1; 16], &[2; 16], &[t; 32])
    }

    #[test]
    fn the_two_ends_agree_and_directions_are_separate() {
        let c = keys(Role::Consumer, "s", 0);
        let p = keys(Role::Producer, "s", 0);
        assert_eq!(c.send, p.recv);
        assert_eq!(c.recv, p.send);
        assert_ne!(
            c.send, c.recv,
            "a frame must not verify in the other direction"
        );
        assert_eq!(format!("{c:?}"), "SessionKeys(<redacted>)");
    }

    #[test]
    fn keys_depend_on_secret_nonces_and_transcript() {
        let base = keys(Role::Consumer, "s", 0);
        assert_ne!(base, keys(Role::Consumer, "t", 0));
        assert_ne!(
            base,
            keys(Role::Consumer, "s", 1),
            "transcript binds the Hello"
        );
        let other_nonce = SessionKeys::derive(
            &Secret::from("s"),
            Role::Consumer,
            &[9; 16],
            &[2; 16],
            &[0; 32],
        );
        assert_ne!(base, other_nonce);
        // Swapping the nonces is a different connection, not the same keys.
        let swapped = SessionKeys::derive(
            &Secret::from("s"),
            Role::Consumer,
            &[2; 16],
            &[1; 16],
            &[0; 32],
        );
        assert_ne!(base, swapped);
    }

    fn verify(rx: &mut FrameMac, frame: &[u8], tag: &[u8]) -> bool {
        let mut m = rx.begin();
        m.update(frame);
        rx.verify(m, tag)
    }

    #[test]
    fn a_sealed_frame_verifies_once_in_order() {
        let k = keys(Role::Consumer, "s", 0);
        let (mut tx, mut rx) = (FrameMac::new(k.send), FrameMac::new(k.send));
        let t0 = tx.seal(b"frame zero");
        let t1 = tx.seal(b"frame one");
        assert!(verify(&mut rx, b"frame zero", &t0));
        assert!(verify(&mut rx, b"frame one", &t1));
        assert_eq!((tx.seq(), rx.seq()), (2, 2));
    }

    #[test]
    fn forged_flipped_replayed_and_reordered_frames_fail() {
        let k = keys(Role::Consumer, "s", 0);
        let mut tx = FrameMac::new(k.send);
        let t0 = tx.seal(b"frame zero");
        let t1 = tx.seal(b"frame one");
        // Bit flip in the body.
        assert!(!verify(&mut FrameMac::new(k.send), b"frame zeri", &t0));
        // Bit flip in the tag.
        let mut bad = t0;
        bad[31] ^= 1;
        assert!(!verify(&mut FrameMac::new(k.send), b"frame zero", &bad));
        // Truncated tag.
        assert!(!verify(
            &mut FrameMac::new(k.send),
            b"frame zero",
            &t0[..16]
        ));
        // Reordered: frame one arriving first.
        assert!(!verify(&mut FrameMac::new(k.send), b"frame one", &t1));
        // Replayed: frame zero twice.
        let mut rx = FrameMac::new(k.send);
        assert!(verify(&mut rx, b"frame zero", &t0));
        assert!(!verify(&mut rx, b"frame zero", &t0));
        // Reflected: a frame we sent does not verify as one we receive.
        assert!(!verify(&mut FrameMac::new(k.recv), b"frame zero", &t0));
        // Forged without the key.
        let mut forger = FrameMac::new([0; 32]);
        let forged = forger.seal(b"frame zero");
        assert!(!verify(&mut FrameMac::new(k.send), b"frame zero", &forged));
    }
}
