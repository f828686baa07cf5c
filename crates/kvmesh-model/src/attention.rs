//! Causal attention over a sequence's paged KV, tiled with an online softmax (flash-attention
//! style): queries in tiles of `Q_TILE` tokens, keys in windows of `KV_TILE` positions gathered from
//! the blocks. Q·Kᵀ and P·V are gemm calls (candle, multi-threaded SIMD); the masking, running max,
//! exponentials and rescaling are one fused pass in plain Rust over the tile's scores. Nothing
//! proportional to `queries × context` is allocated: the score tile is at most
//! `H × Q_TILE × KV_TILE`, however long the prompt.
//!
//! Key windows always start at position 0 and advance by `KV_TILE`, so every query row sees the same
//! windows whatever the step's chunking: chunked prefill, one-shot prefill and a restored prefix
//! agree to rounding.

use candle_core::{Device, Tensor};
use kvmesh_engine::compute::{BlockId, KvArena};

use crate::paged::{BlockGeometry, Kv};

/// Query tokens per tile.
const Q_TILE: usize = 256;
/// Key positions per window (rounded up to whole blocks).
const KV_TILE: usize = 1024;

/// One sequence's attention problem for one layer.
pub(crate) struct AttnProblem<'a> {
    /// Roped queries of the whole step, `[H, total, D]`.
    pub q: &'a [f32],
    pub total: usize,
    /// First row of this sequence in the step, and its number of new tokens.
    pub off: usize,
    pub n: usize,
    pub start_pos: usize,
    pub table: &'a [BlockId],
    pub layer: usize,
    pub num_heads: usize,
}

/// `exp(x)` for `x <= 0` (relative error ≈ 2e-7·(1+|x|); below -80, e^-80 ≈ 2e-35, which is
/// nothing next to the row's maximum term 1), written so loops over it vectorise (no libm call).
#[inline(always)]
fn exp_neg(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const MAGIC: f32 = 12_582_912.0; // 1.5·2^23: adding it rounds to an integer in the low mantissa bits
    let t = x.max(-80.0) * LOG2E;
    let r = t + MAGIC;
    let n = r - MAGIC;
    let f = t - n; // in [-0.5, 0.5]
    let p = 1.0
        + f * (std::f32::consts::LN_2
            + f * (0.240_226_5
                + f * (0.055_504_11
                    + f * (0.009_618_129 + f * (0.001_333_355 + f * 0.000_154_035_3)))));
    let shift = (r.to_bits() as i32).wrapping_sub(0x4B40_0000);
    f32::from_bits((p.to_bits() as i32).wrapping_add(shift << 23) as u32)
}

/// Attention output of one sequence, `[n, H·D]`.
pub(crate) fn attend(
    p: &AttnProblem<'_>,
    geo: &BlockGeometry,
    arena: &KvArena,
) -> Result<Vec<f32>, candle_core::Error> {
    attend_tiled(p, geo, arena, Q_TILE, KV_TILE)
}

fn attend_tiled(
    p: &AttnProblem<'_>,
    geo: &BlockGeometry,
    arena: &KvArena,
    q_tile: usize,
    kv_tile: usize,
) -> Result<Vec<f32>, candle_core::Error> {
    let (d, kvh, h) = (geo.head_dim, geo.num_kv_heads, p.num_heads);
    let g = h / kvh;
    let dev = &Device::Cpu;
    let scale = 1.0 / (d as f32).sqrt();
    let kv_tile = kv_tile.div_ceil(geo.block_size) * geo.block_size;
    let mut out = vec![0f32; p.n * h * d];
    let (mut kbuf, mut vbuf) = (Vec::new(), Vec::new());
    for t0 in (0..p.n).step_by(q_tile) {
        let len = q_tile.min(p.n - t0);
        let rows = g * len; // per KV head: row gi·len + t is query head kh·g + gi at token t0 + t
        let nrows = kvh * rows;
        // [H, len, D] is [KVH, rows, D] because query head h uses KV head h / g.
        let mut q = Vec::with_capacity(nrows * d);
        for head in 0..h {
            let src = &p.q[(head * p.total + p.off + t0) * d..][..len * d];
            q.extend(src.iter().map(|&x| x * scale));
        }
        let q = Tensor::from_vec(q, (kvh, rows, d), dev)?;
        let mut m = vec![f32::NEG_INFINITY; nrows];
        let mut l = vec![0f32; nrows];
        let mut corr = vec![0f32; nrows];
        let mut acc = vec![0f32; nrows * d];
        let q_first = p.start_pos + t0;
        let key_end = q_first + len;
        for k0 in (0..key_end).step_by(kv_tile) {
            let k1 = (k0 + kv_tile).min(key_end);
            let kc = k1 - k0;
            geo.gather(arena, p.table, p.layer, Kv::K, k0..k1, &mut kbuf);
            geo.gather(arena, p.table, p.layer, Kv::V, k0..k1, &mut vbuf);
            let kt = Tensor::from_slice(&kbuf, (kvh, kc, d), dev)?;
            let vt = Tensor::from_slice(&vbuf, (kvh, kc, d), dev)?;
            let mut s = q.matmul(&kt.t()?)?.flatten_all()?.to_vec1::<f32>()?; // [KVH, rows, kc]
            for (idx, row) in s.chunks_exact_mut(kc).enumerate() {
                let t = idx % len;
                let pos = q_first + t;
                // Key k0 + j is visible to the query at `pos` iff k0 + j <= pos.
                let visible = (pos + 1).saturating_sub(k0).min(kc);
                if visible == 0 {
                    row.fill(0.0);
                    corr[idx] = 1.0;
                    continue;
                }
                let mb = row[..visible]
                    .iter()
                    .copied()
                    .fold(f32::NEG_INFINITY, f32::max);
                let m_new = m[idx].max(mb);
                corr[idx] = exp_neg(m[idx] - m_new);
                m[idx] = m_new;
                let mut sum = 0.0;
                for x in &mut row[..visible] {
                    *x = exp_neg(*x - m_new);
                    sum += *x;
                }
                row[visible..].fill(0.0);
                l[idx] = l[idx] * corr[idx] + sum;
            }
            let pv = Tensor::from_vec(s, (kvh, rows, kc), dev)?
                .matmul(&vt)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            for ((a, pv), &c) in acc.chunks_exact_mut(d).zip(pv.chunks_exact(d)).zip(&corr) {
                for (a, &x) in a.iter_mut().zip(pv) {
                    *a = *a * c + x;
                }
            }
        }
        for (idx, a) in acc.chunks_exact(d).enumerate() {
            let (head, t) = (idx / len, idx % len); // idx = (kh·g + gi)·len + t
            let inv = 1.0 / l[idx];
            for (o, &x) in out[((t0 + t) * h + head) * d..][..d].iter_mut().zip(a) {
                *o = x * inv;
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::splitmix64;
    use crate::paged::KvDtype;

    /// Plain softmax(q·kᵀ/√d)·v over positions `0..=pos`, from the same stored K/V.
    #[test]
    fn matches_naive_attention() {
        let geo = BlockGeometry {
            block_size: 4,
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 8,
            dtype: KvDtype::F32,
        };
        let (h, d, ctx) = (4usize, 8usize, 300usize);
        let mut seed = 1u64;
        let mut rnd = move || {
            seed = splitmix64(seed);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        };
        let blocks = ctx.div_ceil(4);
        let mut arena = KvArena::new(blocks, geo.bytes_per_block());
        let table: Vec<BlockId> = (0..blocks as BlockId).rev().collect();
        let mut k = vec![vec![0f32; 2 * d]; ctx];
        let mut v = vec![vec![0f32; 2 * d]; ctx];
        for pos in 0..ctx {
            k[pos].iter_mut().for_each(|x| *x = rnd());
            v[pos].iter_mut().for_each(|x| *x = rnd());
            geo.write_token(&mut arena, &table, 1, Kv::K, pos, &k[pos]);
            geo.write_token(&mut arena, &table, 1, Kv::V, pos, &v[pos]);
        }
        // 120 new queries after a 180-token prefix; all 300 at once; small tiles so both the
        // query and key tiling are exercised.
        for (start, n, q_tile, kv_tile) in [
            (180usize, 120usize, 256, 1024),
            (0, 300, 256, 1024),
            (0, 300, 32, 64),
            (180, 120, 50, 36),
        ] {
            let q: Vec<f32> = (0..h * n * d).map(|_| rnd()).collect();
            let p = AttnProblem {
                q: &q,
                total: n,
                off: 0,
                n,
                start_pos: start,
                table: &table,
                layer: 1,
                num_heads: h,
            };
            let got = attend_tiled(&p, &geo, &arena, q_tile, kv_tile).unwrap();
            for t in 0..n {
                for head in 0..h {
                    let kh = head / 2;
                    let qv = &q[(head * n + t) * d..][..d];
                    let pos = start + t;
                    let scores: Vec<f64> = (0..=pos)
                        .map(|j| {
                            (0..d)
                                .map(|i| f64::from(qv[i]) * f64::from(k[j][kh * d + i]))
                                .sum::<f64>()
                                / (d as f64).sqrt()
                        })
                        .collect();
                    let mx = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let w: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
                    let z: f64 = w.iter().sum();
                    for i in 0..d {
                        let want = (0..=pos)
                            .map(|j| w[j] * f64::from(v[j][kh * d + i]))
                            .sum::<f64>()
                            / z;
                        let g = f64::from(got[(t * h + head) * d + i]);
                        assert!(
                            (g - want).abs() < 1e-4,
                            "t={t} head={head} i={i}: {g} vs {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn fast_exp_is_accurate() {
        for i in 0..1600 {
            let x = -(i as f32) * 0.05;
            let (a, b) = (exp_neg(x), x.exp());
            // Error grows with |x| only through rounding of x·log2(e); far-below-max terms barely count.
            assert!(
                (a - b).abs() <= 2e-7 * b * (1.0 + x.abs()) + 1e-38,
                "x={x}: {a} vs {b}"
            );
        }
        for x in [-80.5, -100.0, -1e6, f32::NEG_INFINITY] {
            let a = exp_neg(x);
            assert!(a.is_finite() && (0.0..1e-34).contains(&a), "x={x}: {a}");
        }
    }
}
