//! Shared-secret authentication of peers (mutual challenge–response).
//!
//! The secret never crosses the wire. Each side sends a fresh random nonce; the consumer proves
//! knowledge of the secret with `HMAC-SHA256(secret, "kvmesh-p2p/consumer" | producer_nonce |
//! consumer_nonce)`, the producer answers with the same construction under the label
//! `"kvmesh-p2p/producer"` and the nonces swapped, so neither proof can be replayed or reflected.
//! Proofs are compared in constant time. HMAC-SHA256 comes from the `hmac` crate (checked against
//! the RFC 4231 test vectors below). What protects the frames after the handshake is in
//! [`crate::mac`].

use std::fmt;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::message::Nonce;

const CONSUMER_LABEL: &[u8] = b"kvmesh-p2p/consumer";
const PRODUCER_LABEL: &[u8] = b"kvmesh-p2p/producer";

/// A shared secret. `Debug` never prints it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl Secret {
    pub fn new(bytes: impl Into<Vec<u8>>) -> Self {
        Self(bytes.into())
    }

    /// Proof the consumer sends after the producer's challenge.
    pub fn consumer_proof(&self, producer_nonce: &Nonce, consumer_nonce: &Nonce) -> [u8; 32] {
        hmac_sha256(&self.0, &[CONSUMER_LABEL, producer_nonce, consumer_nonce])
    }

    /// Proof the producer returns in `HelloOk`.
    pub fn producer_proof(&self, producer_nonce: &Nonce, consumer_nonce: &Nonce) -> [u8; 32] {
        hmac_sha256(&self.0, &[PRODUCER_LABEL, consumer_nonce, producer_nonce])
    }

    /// HMAC-SHA256 keyed by the secret: the PRF of the session-key derivation ([`crate::mac`]).
    pub(crate) fn prf(&self, parts: &[&[u8]]) -> [u8; 32] {
        hmac_sha256(&self.0, parts)
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl From<&str> for Secret {
    fn from(s: &str) -> Self {
        Self::new(s.as_bytes())
    }
}

/// A fresh random nonce (OS-seeded thread RNG).
pub fn nonce() -> Nonce {
    rand::random()
}

/// HMAC-SHA256 of the concatenation of `parts`.
pub fn hmac_sha256(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    // HMAC accepts keys of any length; `new_from_slice` cannot fail for it.
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(key) else {
        unreachable!("HMAC takes keys of any length")
    };
    for p in parts {
        mac.update(p);
    }
    mac.finalize().into_bytes().into()
}

/// Equality whose running time does not depend on where the inputs differ.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn rfc4231_vectors() {
        // Test case 1.
        assert_eq!(
            hex(&hmac_sha256(&[0x0b; 20], &[b"Hi There"])),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
        );
        // Test case 2, message split across parts.
        assert_eq!(
            hex(&hmac_sha256(
                b"Jefe",
                &[b"what do ya want ", b"for nothing?"]
            )),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        // Test case 6: key longer than the block size.
        assert_eq!(
            hex(&hmac_sha256(
                &[0xaa; 131],
                &[b"Test Using Larger Than Block-Size Key - Hash Key First"]
            )),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }

    #[test]
    fn proofs_differ_by_role_secret_and_nonce() {
        let s = Secret::from("s3cret");
        let (p, c) = ([1u8; 16], [2u8; 16]);
        assert_ne!(s.consumer_proof(&p, &c), s.producer_proof(&p, &c));
        assert_ne!(
            s.consumer_proof(&p, &c),
            Secret::from("other").consumer_proof(&p, &c)
        );
        assert_ne!(s.consumer_proof(&p, &c), s.consumer_proof(&[3u8; 16], &c));
        assert!(constant_time_eq(
            &s.consumer_proof(&p, &c),
            &s.consumer_proof(&p, &c)
        ));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
        assert_eq!(format!("{s:?}"), "Secret(<redacted>)");
    }
}
