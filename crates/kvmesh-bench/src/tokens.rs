//! Deterministic token sequences.
//!
//! Every prompt is a list of [`Segment`]s; a segment's tokens are a pure function of
//! `(workload seed, segment key)`, and a shorter segment with the same key is a prefix of a longer
//! one. Two prompts that share a segment therefore share those tokens token-for-token, which is
//! exactly what prefix caching (and P2P pulls) need — without materialising whole corpora in memory.

use std::sync::Arc;

use kvmesh_core::TokenId;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// The range token ids are drawn from: `[lo, hi)`.
///
/// The default, printable ASCII, is valid for the byte tokenizer the `sim` engines use; a real
/// model needs a range inside its vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenSpace {
    pub lo: TokenId,
    pub hi: TokenId,
}

impl Default for TokenSpace {
    fn default() -> Self {
        Self { lo: 33, hi: 127 }
    }
}

/// A run of prompt tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    /// `len` tokens generated from `key` (same key ⇒ same tokens; shorter ⇒ prefix).
    Seeded { key: u64, len: usize },
    /// Literal tokens, e.g. the previous turn's generated answer captured at run time.
    Literal(Arc<Vec<TokenId>>),
}

impl Segment {
    pub fn seeded(key: u64, len: usize) -> Self {
        Self::Seeded { key, len }
    }

    pub fn len(&self) -> usize {
        match self {
            Self::Seeded { len, .. } => *len,
            Self::Literal(t) => t.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Generates segment tokens for one workload seed.
#[derive(Debug, Clone, Copy)]
pub struct TokenGen {
    seed: u64,
    space: TokenSpace,
}

impl TokenGen {
    pub fn new(seed: u64, space: TokenSpace) -> Self {
        Self { seed, space }
    }

    pub fn space(&self) -> TokenSpace {
        self.space
    }

    /// Appends the tokens of `segment` to `out`.
    pub fn extend(&self, segment: &Segment, out: &mut Vec<TokenId>) {
        match segment {
            Segment::Seeded { key, len } => {
                let mut rng = ChaCha8Rng::seed_from_u64(mix(self.seed, *key));
                let (lo, hi) = (self.space.lo, self.space.hi.max(self.space.lo + 1));
                out.extend((0..*len).map(|_| rng.random_range(lo..hi)));
            }
            Segment::Literal(tokens) => out.extend_from_slice(tokens),
        }
    }

    /// Materialises a whole prompt.
    pub fn render(&self, segments: &[Segment]) -> Vec<TokenId> {
        let mut out = Vec::with_capacity(segments.iter().map(Segment::len).sum());
        for s in segments {
            self.extend(s, &mut out);
        }
        out
    }
}

/// splitmix64-style mixing so nearby keys give unrelated streams.
pub fn mix(a: u64, b: u64) -> u64 {
    let mut z = a ^ b
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(0x6A09_E667_F3BC_C909);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_key_same_tokens_and_prefix_property() {
        let g = TokenGen::new(7, TokenSpace::default());
        let long = g.render(&[Segment::seeded(1, 1000)]);
        let short = g.render(&[Segment::seeded(1, 300)]);
        assert_eq!(&long[..300], &short[..]);
        let other = g.render(&[Segment::seeded(2, 300)]);
        assert_ne!(short, other);
        assert!(long.iter().all(|&t| (33..127).contains(&t)));
    }

    #[test]
    fn different_seed_different_tokens() {
        let a = TokenGen::new(1, TokenSpace::default()).render(&[Segment::seeded(1, 64)]);
        let b = TokenGen::new(2, TokenSpace::default()).render(&[Segment::seeded(1, 64)]);
        assert_ne!(a, b);
    }

    #[test]
    fn literal_segments_are_copied() {
        let g = TokenGen::new(1, TokenSpace { lo: 0, hi: 5 });
        let p = g.render(&[
            Segment::Literal(Arc::new(vec![9, 9])),
            Segment::seeded(3, 4),
        ]);
        assert_eq!(&p[..2], &[9, 9]);
        assert_eq!(p.len(), 6);
        assert!(p[2..].iter().all(|&t| t < 5));
    }
}
