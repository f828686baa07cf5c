//! The byte layout of one KV block and the copies in and out of it.
//!
//! A block is one contiguous byte run holding, for `block_size` token slots, the K and V of every
//! layer: `[layer][K|V][kv_head][slot][head_dim]` elements of `f32` or `bf16`. Because a block is
//! self-contained, the engine can copy it to the CPU tier or the wire as plain bytes, and a peer
//! with the same layout can use it as is. Keeping `[slot][head_dim]` innermost per head makes a
//! head's keys for a block one contiguous run, which is what attention gathers.

use kvmesh_engine::compute::{BlockId, KvArena};

use crate::ModelError;

/// Element type of KV in the blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvDtype {
    #[default]
    F32,
    /// Half the bytes per block; rounding to bf16 happens once when KV is written.
    Bf16,
}

impl KvDtype {
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
        }
    }

    pub fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16 => 2,
        }
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f32" | "float32" => Ok(Self::F32),
            "bf16" | "bfloat16" => Ok(Self::Bf16),
            other => Err(format!("unknown KV dtype {other:?} (f32 or bf16)")),
        }
    }
}

/// Round-to-nearest-even f32 → bf16 bits.
fn to_bf16(x: f32) -> u16 {
    if x.is_nan() {
        return 0x7FC0;
    }
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7FFF + ((b >> 16) & 1));
    (rounded >> 16) as u16
}

fn from_bf16(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// Geometry of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockGeometry {
    pub block_size: usize,
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub dtype: KvDtype,
}

/// Which half of a layer's KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kv {
    K = 0,
    V = 1,
}

impl BlockGeometry {
    /// Elements of one (layer, K|V, head) run: all slots of one head.
    fn run_elems(&self) -> usize {
        self.block_size * self.head_dim
    }

    pub fn elems_per_block(&self) -> usize {
        self.num_layers * 2 * self.num_kv_heads * self.run_elems()
    }

    pub fn bytes_per_block(&self) -> usize {
        self.elems_per_block() * self.dtype.size()
    }

    /// Element offset of (layer, kv, head, slot) inside a block.
    fn offset(&self, layer: usize, kv: Kv, head: usize, slot: usize) -> usize {
        ((layer * 2 + kv as usize) * self.num_kv_heads + head) * self.run_elems()
            + slot * self.head_dim
    }

    /// Checks that a sequence's block table covers `0..end` and names existing blocks.
    pub fn check_table(
        &self,
        table: &[BlockId],
        end: usize,
        arena: &KvArena,
    ) -> Result<(), ModelError> {
        let needed = end.div_ceil(self.block_size);
        if table.len() < needed {
            return Err(ModelError::Input(format!(
                "block table has {} blocks, {needed} needed for {end} positions",
                table.len()
            )));
        }
        if arena.bytes_per_block() < self.bytes_per_block() {
            return Err(ModelError::Input(format!(
                "arena blocks hold {} bytes, layout needs {}",
                arena.bytes_per_block(),
                self.bytes_per_block()
            )));
        }
        if let Some(bad) = table[..needed]
            .iter()
            .find(|&&b| b as usize >= arena.num_blocks())
        {
            return Err(ModelError::Input(format!(
                "block id {bad} out of range ({} blocks)",
                arena.num_blocks()
            )));
        }
        Ok(())
    }

    /// Writes one token's K or V of one layer (`data` = `num_kv_heads * head_dim`, head-major) at
    /// position `pos`.
    pub fn write_token(
        &self,
        arena: &mut KvArena,
        table: &[BlockId],
        layer: usize,
        kv: Kv,
        pos: usize,
        data: &[f32],
    ) {
        let block = arena.block_mut(table[pos / self.block_size]);
        let slot = pos % self.block_size;
        let d = self.head_dim;
        for head in 0..self.num_kv_heads {
            let off = self.offset(layer, kv, head, slot);
            let src = &data[head * d..(head + 1) * d];
            match self.dtype {
                KvDtype::F32 => {
                    let dst: &mut [f32] =
                        bytemuck::cast_slice_mut(&mut block[..self.bytes_per_block()]);
                    dst[off..off + d].copy_from_slice(src);
                }
                KvDtype::Bf16 => {
                    let dst: &mut [u16] =
                        bytemuck::cast_slice_mut(&mut block[..self.bytes_per_block()]);
                    for (o, &x) in dst[off..off + d].iter_mut().zip(src) {
                        *o = to_bf16(x);
                    }
                }
            }
        }
    }

    /// One (block, layer, K|V, head) run — `block_size × head_dim` values — borrowed in place when
    /// the blocks hold f32; `None` for other dtypes (use [`Self::run_to_f32`]).
    pub fn run_f32<'a>(
        &self,
        arena: &'a KvArena,
        block: BlockId,
        layer: usize,
        kv: Kv,
        head: usize,
    ) -> Option<&'a [f32]> {
        match self.dtype {
            KvDtype::F32 => {
                let all: &[f32] =
                    bytemuck::cast_slice(&arena.block(block)[..self.bytes_per_block()]);
                let off = self.offset(layer, kv, head, 0);
                Some(&all[off..off + self.run_elems()])
            }
            KvDtype::Bf16 => None,
        }
    }

    /// The same run converted to f32 into `out`.
    pub fn run_to_f32(
        &self,
        arena: &KvArena,
        block: BlockId,
        layer: usize,
        kv: Kv,
        head: usize,
        out: &mut Vec<f32>,
    ) {
        let block = &arena.block(block)[..self.bytes_per_block()];
        let off = self.offset(layer, kv, head, 0);
        out.clear();
        match self.dtype {
            KvDtype::F32 => out.extend_from_slice(
                &bytemuck::cast_slice::<u8, f32>(block)[off..off + self.run_elems()],
            ),
            KvDtype::Bf16 => out.extend(
                bytemuck::cast_slice::<u8, u16>(block)[off..off + self.run_elems()]
                    .iter()
                    .map(|&h| from_bf16(h)),
            ),
        }
    }

    /// Gathers K or V of `positions` of one layer into `out` laid out
    /// `[kv_head][positions.len()][head_dim]` (what attention multiplies with).
    pub fn gather(
        &self,
        arena: &KvArena,
        table: &[BlockId],
        layer: usize,
        kv: Kv,
        positions: std::ops::Range<usize>,
        out: &mut Vec<f32>,
    ) {
        let (start, end) = (positions.start, positions.end);
        let n = end - start;
        let d = self.head_dim;
        out.clear();
        out.resize(self.num_kv_heads * n * d, 0.0);
        let mut pos = start;
        while pos < end {
            let slot = pos % self.block_size;
            let take = (self.block_size - slot).min(end - pos);
            let block = &arena.block(table[pos / self.block_size])[..self.bytes_per_block()];
            for head in 0..self.num_kv_heads {
                let off = self.offset(layer, kv, head, slot);
                let dst =
                    &mut out[(head * n + pos - start) * d..(head * n + pos - start + take) * d];
                match self.dtype {
                    KvDtype::F32 => {
                        let src: &[f32] = bytemuck::cast_slice(block);
                        dst.copy_from_slice(&src[off..off + take * d]);
                    }
                    KvDtype::Bf16 => {
                        let src: &[u16] = bytemuck::cast_slice(block);
                        for (o, &h) in dst.iter_mut().zip(&src[off..off + take * d]) {
                            *o = from_bf16(h);
                        }
                    }
                }
            }
            pos += take;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_reads_back_what_was_written_across_blocks() {
        for dtype in [KvDtype::F32, KvDtype::Bf16] {
            let g = BlockGeometry {
                block_size: 4,
                num_layers: 2,
                num_kv_heads: 3,
                head_dim: 2,
                dtype,
            };
            let mut arena = KvArena::new(8, g.bytes_per_block());
            let table = [5, 1, 7];
            for pos in 0..10 {
                let data: Vec<f32> = (0..6).map(|i| (pos * 10 + i) as f32).collect();
                g.write_token(&mut arena, &table, 1, Kv::V, pos, &data);
            }
            let mut out = Vec::new();
            g.gather(&arena, &table, 1, Kv::V, 3..9, &mut out);
            assert_eq!(out.len(), 3 * 6 * 2);
            // head 2, position 5 (index 2 in the window), dim 1 → value 5*10 + 2*2 + 1.
            assert_eq!(out[(2 * 6 + 2) * 2 + 1], 55.0);
            g.gather(&arena, &table, 0, Kv::V, 0..4, &mut out);
            assert!(out.iter().all(|&x| x == 0.0), "other layers untouched");
        }
    }

    #[test]
    fn bf16_rounds_to_nearest() {
        assert_eq!(from_bf16(to_bf16(1.0)), 1.0);
        assert!((from_bf16(to_bf16(0.1)) - 0.1).abs() < 1e-3);
    }
}
