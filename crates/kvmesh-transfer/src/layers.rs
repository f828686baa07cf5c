//! Layer-major fetches: a consumer that computes layer by layer (vLLM's `wait_for_layer_load`)
//! asks the producer to send every requested block's first segment (e.g. layer 0's KV), then
//! every block's second, and so on, so a layer can be used while later ones are still on the
//! wire. The consumer names the block's [`SegmentLayout`] (the byte length of each segment, in
//! block order; they sum to the block size) in [`crate::message::Fetch::segments`]; an empty
//! layout is the plain block-by-block fetch.
//!
//! On the wire each segment travels as an ordinary block frame (so with a secret it is an
//! authenticated — optionally encrypted — record stream like any block) whose `index` is the
//! stream position `segment × requested + block` and whose CRC covers the segment. The producer
//! resolves (pins and reads) every block before it sends anything: a block it cannot serve ends
//! the prefix there, and the segments of the blocks before it are all sent, so a `MISS` in the
//! middle still leaves a complete, shorter prefix on every layer.
//!
//! [`SegmentCursor`] is the consumer's check of that order (pure, unit tested); [`SegmentSink`]
//! is where the segments land.

use crate::message::FetchEnd;

/// Most segments one block may be cut into: far above any model's layer count (× its K/V
/// tensors), low enough that a stream position (`segment × blocks + block`, blocks ≤ 2¹⁶ per
/// request) fits the frame's 32-bit index.
pub const MAX_SEGMENTS: usize = 4096;

/// Why a segment layout was refused (by the consumer before it asks, by the producer when asked).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("a segment layout needs at least one segment")]
    Empty,
    #[error("{n} segments per block (max {max})")]
    TooMany { n: usize, max: usize },
    #[error("segment {segment} has length 0")]
    ZeroLength { segment: usize },
    #[error("the segments sum to {sum} bytes but the block is {block_len} bytes")]
    Sum { sum: u64, block_len: u64 },
    #[error("{blocks} blocks × {segments} segments do not fit a 32-bit stream position")]
    Positions { blocks: usize, segments: usize },
}

/// How one block is cut into segments: the byte length of each, in the block's byte order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentLayout {
    lens: Vec<u32>,
    block_len: u64,
}

impl SegmentLayout {
    /// A layout of `lens`: at least one and at most [`MAX_SEGMENTS`] segments, none empty.
    pub fn new(lens: Vec<u32>) -> Result<Self, LayoutError> {
        if lens.is_empty() {
            return Err(LayoutError::Empty);
        }
        if lens.len() > MAX_SEGMENTS {
            return Err(LayoutError::TooMany {
                n: lens.len(),
                max: MAX_SEGMENTS,
            });
        }
        if let Some(segment) = lens.iter().position(|&l| l == 0) {
            return Err(LayoutError::ZeroLength { segment });
        }
        let block_len = lens.iter().map(|&l| u64::from(l)).sum();
        Ok(Self { lens, block_len })
    }

    /// Checks the layout against a block of `block_len` bytes.
    pub fn check_block(&self, block_len: usize) -> Result<(), LayoutError> {
        if self.block_len != block_len as u64 {
            return Err(LayoutError::Sum {
                sum: self.block_len,
                block_len: block_len as u64,
            });
        }
        Ok(())
    }

    /// Checks that a fetch of `blocks` blocks can number its frames.
    pub fn check_positions(&self, blocks: usize) -> Result<(), LayoutError> {
        let fits = blocks
            .checked_mul(self.lens.len())
            .is_some_and(|n| n <= u32::MAX as usize);
        if !fits {
            return Err(LayoutError::Positions {
                blocks,
                segments: self.lens.len(),
            });
        }
        Ok(())
    }

    pub fn lens(&self) -> &[u32] {
        &self.lens
    }

    pub fn segments(&self) -> usize {
        self.lens.len()
    }

    /// The block size this layout describes (the segments' sum).
    pub fn block_len(&self) -> u64 {
        self.block_len
    }

    /// `(offset, len)` of each segment inside a block.
    pub fn ranges(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.lens.iter().scan(0usize, |off, &len| {
            let start = *off;
            *off += len as usize;
            Some((start, len as usize))
        })
    }
}

/// Consumer side of a layer-major fetch: where each segment lands, and word of each segment
/// that has arrived for every block the producer serves.
pub trait SegmentSink: Send {
    /// Memory of exactly `len` bytes for segment `segment` of block `index` (the position in
    /// the pulled prefix). The client reads the segment from the socket straight into it,
    /// checking (and when encrypted decrypting) it there; until the segment is reported complete
    /// the contents are unspecified. `None` stops the pull (`SinkRejected`).
    fn destination(&mut self, index: usize, segment: usize, len: usize) -> Option<&mut [u8]>;

    /// Segment `segment` arrived, checked, for each of the first `blocks` blocks: the prefix the
    /// producer serves (fewer than requested after a miss). Called once per segment, in order.
    fn segment_complete(&mut self, segment: usize, blocks: usize) {
        let _ = (segment, blocks);
    }
}

/// A frame out of the layer-major order.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("stream position {index} out of order (expected segment {segment}, block {block})")]
pub struct OutOfOrder {
    pub index: u32,
    pub segment: usize,
    pub block: usize,
}

/// A `Done` that does not close the stream it ends: a segment of the served blocks is missing,
/// or its count or end disagrees with what arrived.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Done for {blocks} blocks does not match the layer-major stream received")]
pub struct BadDone {
    pub blocks: usize,
}

/// Where the next frame of a layer-major stream of `requested` blocks × `segments` segments
/// must go, and which segments are complete: frames come segment by segment, each segment for
/// the same leading run of blocks (its length is learnt when segment 0 ends).
#[derive(Debug, Clone)]
pub struct SegmentCursor {
    requested: usize,
    segments: usize,
    segment: usize,
    next_block: usize,
    /// Blocks per segment, known once segment 0 ended.
    blocks: Option<usize>,
    complete: usize,
}

/// A frame accepted by [`SegmentCursor::accept`]: its block and segment, and the segment it
/// completed, if any, before it (a stream moving on to segment 1 completes segment 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placed {
    pub block: usize,
    pub segment: usize,
    pub completed_before: Option<(usize, usize)>,
}

impl SegmentCursor {
    pub fn new(requested: usize, segments: usize) -> Self {
        Self {
            requested,
            segments,
            segment: 0,
            next_block: 0,
            blocks: None,
            complete: 0,
        }
    }

    /// Segments complete so far (for every block served).
    pub fn complete(&self) -> usize {
        self.complete
    }

    /// Blocks per segment, once known.
    pub fn blocks(&self) -> Option<usize> {
        self.blocks
    }

    /// The frame with stream position `index` arrived (its head): where it goes.
    pub fn accept(&mut self, index: u32) -> Result<Placed, OutOfOrder> {
        let out_of_order = OutOfOrder {
            index,
            segment: self.segment,
            block: self.next_block,
        };
        let n = self.requested.max(1);
        let (segment, block) = (index as usize / n, index as usize % n);
        if segment >= self.segments {
            return Err(out_of_order);
        }
        let mut completed_before = None;
        if segment == self.segment && block == self.next_block {
            if self.blocks.is_some_and(|k| block >= k) || block >= self.requested {
                return Err(out_of_order);
            }
        } else if segment == self.segment + 1
            && block == 0
            && self.next_block > 0
            && self.blocks.is_none_or(|k| k == self.next_block)
        {
            // Only segment 0 can end here (later ones end on their last block, below).
            let k = self.next_block;
            self.blocks = Some(k);
            self.complete = segment;
            completed_before = Some((self.segment, k));
            self.segment = segment;
            self.next_block = 0;
        } else {
            return Err(out_of_order);
        }
        Ok(Placed {
            block,
            segment,
            completed_before,
        })
    }

    /// The frame last accepted is in: the segment it ends, if it ends one (with its blocks).
    pub fn landed(&mut self) -> Option<(usize, usize)> {
        self.next_block += 1;
        if self.segment == 0 && self.next_block == self.requested {
            self.blocks = Some(self.requested);
        }
        let k = self.blocks?;
        if self.next_block == k && self.complete == self.segment {
            self.complete = self.segment + 1;
            let done = (self.segment, k);
            if self.segment + 1 < self.segments {
                self.segment += 1;
                self.next_block = 0;
            }
            return Some(done);
        }
        None
    }

    /// The producer's `Done` for `blocks` blocks: `Ok(segment completed by it)` when the stream
    /// holds every segment of those blocks, which the end must agree with.
    pub fn done(
        &mut self,
        blocks: usize,
        end: &FetchEnd,
    ) -> Result<Option<(usize, usize)>, BadDone> {
        let mut completed = None;
        if self.blocks.is_none() {
            // Only segment 0 of a stream shorter than requested ends at `Done`.
            let k = self.next_block;
            self.blocks = Some(k);
            if k > 0 && self.complete == 0 {
                self.complete = 1;
                completed = Some((0, k));
            }
        }
        let k = self.blocks.unwrap_or(0);
        let whole = k == 0 || self.complete == self.segments;
        let end_ok = match end {
            FetchEnd::Complete => k == self.requested,
            FetchEnd::Miss { index } | FetchEnd::PendingDeadline { index } => {
                *index as usize == k && k < self.requested
            }
        };
        if blocks != k || !whole || !end_ok {
            return Err(BadDone { blocks });
        }
        Ok(completed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_are_checked() {
        assert_eq!(SegmentLayout::new(vec![]), Err(LayoutError::Empty));
        assert_eq!(
            SegmentLayout::new(vec![4, 0, 4]),
            Err(LayoutError::ZeroLength { segment: 1 })
        );
        assert!(matches!(
            SegmentLayout::new(vec![1; MAX_SEGMENTS + 1]),
            Err(LayoutError::TooMany { .. })
        ));
        let l = SegmentLayout::new(vec![3, 5]).unwrap();
        assert_eq!(l.block_len(), 8);
        assert!(l.check_block(8).is_ok());
        assert_eq!(
            l.check_block(9),
            Err(LayoutError::Sum {
                sum: 8,
                block_len: 9
            })
        );
        assert_eq!(l.ranges().collect::<Vec<_>>(), [(0, 3), (3, 5)]);
        assert!(l.check_positions(1 << 16).is_ok());
        let big = SegmentLayout::new(vec![1; MAX_SEGMENTS]).unwrap();
        assert!(big.check_positions(1 << 20).is_err());
    }

    /// Feeds positions; returns the segments completed, in order.
    fn run(c: &mut SegmentCursor, positions: &[u32]) -> Result<Vec<(usize, usize)>, OutOfOrder> {
        let mut done = Vec::new();
        for &p in positions {
            let placed = c.accept(p)?;
            done.extend(placed.completed_before);
            done.extend(c.landed());
        }
        Ok(done)
    }

    #[test]
    fn full_stream_completes_each_segment_on_its_last_block() {
        let mut c = SegmentCursor::new(3, 2);
        let done = run(&mut c, &[0, 1, 2, 3, 4, 5]).unwrap();
        assert_eq!(done, [(0, 3), (1, 3)]);
        assert_eq!(c.done(3, &FetchEnd::Complete), Ok(None));
    }

    #[test]
    fn a_shorter_stream_learns_its_length_when_segment_0_ends() {
        // 4 requested, the producer serves 2 (a miss at block 2), 3 segments.
        let mut c = SegmentCursor::new(4, 3);
        let done = run(&mut c, &[0, 1, 4, 5, 8, 9]).unwrap();
        assert_eq!(done, [(0, 2), (1, 2), (2, 2)]);
        assert_eq!(c.done(2, &FetchEnd::Miss { index: 2 }), Ok(None));
        // One segment only: it ends at Done.
        let mut c = SegmentCursor::new(4, 1);
        assert_eq!(run(&mut c, &[0, 1]).unwrap(), []);
        assert_eq!(c.done(2, &FetchEnd::Miss { index: 2 }), Ok(Some((0, 2))));
    }

    #[test]
    fn out_of_order_and_short_streams_are_refused() {
        let mut c = SegmentCursor::new(3, 2);
        assert!(c.accept(1).is_err(), "block 1 before block 0");
        let mut c = SegmentCursor::new(3, 2);
        run(&mut c, &[0, 1]).unwrap();
        // Segment 1 after two blocks: segment 0 served 2 blocks, so segment 1 must too.
        run(&mut c, &[3, 4]).unwrap();
        assert!(c.accept(5).is_err(), "a third block in segment 1");
        let mut c = SegmentCursor::new(3, 2);
        assert!(c.accept(6).is_err(), "beyond the last segment");
        // Done before every segment of the served blocks arrived.
        let mut c = SegmentCursor::new(3, 2);
        run(&mut c, &[0, 1, 2, 3]).unwrap();
        assert_eq!(c.complete(), 1);
        assert!(c.done(3, &FetchEnd::Complete).is_err());
        // A Done that claims completion of a short stream.
        let mut c = SegmentCursor::new(3, 1);
        run(&mut c, &[0]).unwrap();
        assert!(c.done(1, &FetchEnd::Complete).is_err());
        // Nothing served: a miss at 0 is a clean empty stream.
        let mut c = SegmentCursor::new(3, 2);
        assert_eq!(c.done(0, &FetchEnd::Miss { index: 0 }), Ok(None));
    }
}
