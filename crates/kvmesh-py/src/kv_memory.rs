//! vLLM's KV tensors as the destination of a layer-major pull: each segment of each pulled block
//! is read from the socket straight into the tensor memory of its layer and block (no staging
//! buffer, no copy on this side beyond the kernel's).
//!
//! The memory is given as raw addresses (a tensor's `data_ptr()`), so building a
//! [`KvDestination`] is `unsafe`: the caller promises what the bounds checks here cannot see —
//! the memory stays allocated, and nothing else reads or writes the destination blocks, until
//! the pull has ended ([`crate::node::Node::end_layer_pull`] returned). The connector keeps a
//! reference to every KV tensor for the engine's lifetime and hands a pull only blocks vLLM
//! allocated for that request's load. Everything else is checked: every byte a segment can land
//! on lies inside its layer's region.
#![allow(unsafe_code)]

use kvmesh_transfer::{LayoutError, SegmentLayout, SegmentSink};

/// One layer's KV tensor: where a block's bytes of this layer live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerTarget {
    /// Address of the tensor's first byte (its `data_ptr()`).
    pub base: usize,
    /// Bytes from `base` that belong to the tensor (its storage from `base` on).
    pub len: usize,
    /// Bytes between block `i` and block `i + 1` along the block dimension.
    pub block_stride: usize,
    /// Each contiguous run of one block's bytes in this layer, `(offset from the block's start,
    /// length)`, in the order the CPU tier stores them (e.g. K then V).
    pub chunks: Vec<(usize, usize)>,
}

/// Why a destination was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DestinationError {
    #[error("no layers")]
    NoLayers,
    #[error("layer {layer} has no chunks")]
    NoChunks { layer: usize },
    #[error("layer {layer}: chunk {chunk} of block {block} ends beyond the tensor's {len} bytes")]
    OutOfBounds {
        layer: usize,
        chunk: usize,
        block: usize,
        len: usize,
    },
    #[error("layer {layer}: chunk {chunk} is longer than 4 GiB")]
    ChunkTooLong { layer: usize, chunk: usize },
    #[error(transparent)]
    Layout(#[from] LayoutError),
}

/// Where each segment of each block of a layer-major pull lands, checked.
#[derive(Debug)]
pub struct KvDestination {
    layers: Vec<LayerTarget>,
    block_ids: Vec<usize>,
    /// Per segment: its layer and chunk.
    segments: Vec<(usize, usize)>,
    layout: SegmentLayout,
}

impl KvDestination {
    /// The destination of a pull whose block `i` lands in vLLM's block `block_ids[i]` of every
    /// layer. Segments are the layers' chunks, layer by layer.
    ///
    /// # Safety
    /// For every layer, `base..base + len` is memory that stays allocated and writable, and that
    /// nothing else reads or writes in the blocks `block_ids` names, until the pull that uses
    /// this destination has ended ([`crate::node::Node::end_layer_pull`]).
    pub unsafe fn new(
        layers: Vec<LayerTarget>,
        block_ids: Vec<usize>,
    ) -> Result<Self, DestinationError> {
        if layers.is_empty() {
            return Err(DestinationError::NoLayers);
        }
        let highest = block_ids.iter().copied().max().unwrap_or(0);
        let mut segments = Vec::new();
        let mut lens = Vec::new();
        for (l, layer) in layers.iter().enumerate() {
            if layer.chunks.is_empty() {
                return Err(DestinationError::NoChunks { layer: l });
            }
            for (c, &(offset, len)) in layer.chunks.iter().enumerate() {
                let end = highest
                    .checked_mul(layer.block_stride)
                    .and_then(|start| start.checked_add(offset))
                    .and_then(|start| start.checked_add(len));
                if end.is_none_or(|end| end > layer.len) {
                    return Err(DestinationError::OutOfBounds {
                        layer: l,
                        chunk: c,
                        block: highest,
                        len: layer.len,
                    });
                }
                let len = u32::try_from(len)
                    .map_err(|_| DestinationError::ChunkTooLong { layer: l, chunk: c })?;
                lens.push(len);
                segments.push((l, c));
            }
        }
        let layout = SegmentLayout::new(lens)?;
        layout.check_positions(block_ids.len())?;
        Ok(Self {
            layers,
            block_ids,
            segments,
            layout,
        })
    }

    pub fn layout(&self) -> &SegmentLayout {
        &self.layout
    }

    pub fn blocks(&self) -> usize {
        self.block_ids.len()
    }

    /// The layer segment `segment` belongs to, and whether it is that layer's last.
    pub fn layer_of(&self, segment: usize) -> Option<(usize, bool)> {
        let &(layer, chunk) = self.segments.get(segment)?;
        let last = self.layers.get(layer).map(|l| l.chunks.len() - 1) == Some(chunk);
        Some((layer, last))
    }

    /// The memory of segment `segment` of the pull's block `index`, if it is `len` bytes.
    fn memory(&mut self, index: usize, segment: usize, len: usize) -> Option<&mut [u8]> {
        let &(layer, chunk) = self.segments.get(segment)?;
        let target = self.layers.get(layer)?;
        let &(offset, chunk_len) = target.chunks.get(chunk)?;
        let block = *self.block_ids.get(index)?;
        if chunk_len != len {
            return None;
        }
        // In bounds: `new` checked the highest block id's end against the region, with
        // overflow checks, so this sum neither overflows nor leaves the region.
        let start = target.base + block * target.block_stride + offset;
        // SAFETY: `start..start + len` lies inside the layer's region (checked in `new`), which
        // the constructor's caller keeps allocated, writable and unshared for the pull's life;
        // the `&mut self` borrow makes this the only slice of it handed out at a time.
        Some(unsafe { std::slice::from_raw_parts_mut(start as *mut u8, len) })
    }
}

/// A layer-major pull's sink: segments into the KV tensors, and word of each layer completed.
pub struct KvSink<F: FnMut(usize, usize) + Send> {
    pub destination: KvDestination,
    /// Called with (layers complete, blocks) when a layer's last segment completes.
    pub on_layer: F,
}

impl<F: FnMut(usize, usize) + Send> SegmentSink for KvSink<F> {
    fn destination(&mut self, index: usize, segment: usize, len: usize) -> Option<&mut [u8]> {
        self.destination.memory(index, segment, len)
    }

    fn segment_complete(&mut self, segment: usize, blocks: usize) {
        if let Some((layer, true)) = self.destination.layer_of(segment) {
            (self.on_layer)(layer + 1, blocks);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_land_in_their_layer_and_block_and_bounds_are_checked() {
        // Two layers of 4 blocks: layer 0 one 8-byte chunk per block; layer 1 K/V halves
        // ([2, blocks, 4] bytes: K of block b at b*4, V at 16 + b*4).
        let mut l0 = vec![0u8; 32];
        let mut l1 = vec![0u8; 32];
        let layers = vec![
            LayerTarget {
                base: l0.as_mut_ptr() as usize,
                len: 32,
                block_stride: 8,
                chunks: vec![(0, 8)],
            },
            LayerTarget {
                base: l1.as_mut_ptr() as usize,
                len: 32,
                block_stride: 4,
                chunks: vec![(0, 4), (16, 4)],
            },
        ];
        // SAFETY: the vectors outlive the destination and nothing else touches them meanwhile.
        let mut d = unsafe { KvDestination::new(layers.clone(), vec![3, 1]) }.unwrap();
        assert_eq!(d.layout().lens(), [8, 4, 4]);
        assert_eq!(d.layer_of(0), Some((0, true)));
        assert_eq!(d.layer_of(1), Some((1, false)));
        assert_eq!(d.layer_of(2), Some((1, true)));
        d.memory(0, 0, 8).unwrap().fill(1);
        d.memory(1, 2, 4).unwrap().fill(2);
        assert!(d.memory(0, 1, 8).is_none(), "wrong length");
        assert!(d.memory(2, 0, 8).is_none(), "no such block");
        drop(d);
        assert_eq!(&l0[24..32], &[1; 8]);
        assert_eq!(&l1[20..24], &[2; 4], "V of block 1");
        assert!(l1[..20].iter().all(|&b| b == 0));
        // Block 4 of layer 1 would end at 16 + 4*4 + 4 = 36 > 32.
        // SAFETY: refused before any memory is touched.
        let err = unsafe { KvDestination::new(layers, vec![4]) }.unwrap_err();
        assert!(
            matches!(err, DestinationError::OutOfBounds { layer: 0, .. }),
            "{err}"
        );
    }
}
