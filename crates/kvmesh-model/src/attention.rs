//! Causal attention straight over a sequence's paged KV, flash-attention style: queries are
//! processed in tiles, keys one block at a time, with a running max / denominator / accumulator per
//! query row (online softmax). Nothing proportional to `queries × context` is ever allocated, and
//! keys are read in place from the arena (f32) — no gather of the whole context.
//!
//! Every query row visits the key blocks in the same order whatever the step's chunking, so a
//! chunked prefill, a one-shot prefill and a restored prefix produce the same arithmetic.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use kvmesh_engine::compute::{BlockId, KvArena};

use crate::paged::{BlockGeometry, Kv};

/// Query tokens per work item (each item covers one KV head and its whole query-head group).
const TILE: usize = 32;
/// Below this many score elements a call runs on the calling thread (decode steps).
const PARALLEL_MIN_SCORES: usize = 1 << 18;

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

#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// K or V of one (block, layer, head) as f32: borrowed from the arena, or converted into `buf`.
fn kv_run<'a>(
    geo: &BlockGeometry,
    arena: &'a KvArena,
    block: BlockId,
    layer: usize,
    kv: Kv,
    head: usize,
    buf: &'a mut Vec<f32>,
) -> &'a [f32] {
    if let Some(s) = geo.run_f32(arena, block, layer, kv, head) {
        return s;
    }
    geo.run_to_f32(arena, block, layer, kv, head, buf);
    buf
}

/// Computes one work item: KV head `kh`, query tokens `t0..t0+len`. Returns `[g][len][D]`.
fn tile(
    p: &AttnProblem<'_>,
    geo: &BlockGeometry,
    arena: &KvArena,
    kh: usize,
    t0: usize,
    len: usize,
) -> Vec<f32> {
    let (d, bs) = (geo.head_dim, geo.block_size);
    let g = p.num_heads / geo.num_kv_heads;
    let rows = g * len;
    let scale = 1.0 / (d as f32).sqrt();
    // Scaled queries of the tile, row r = gi·len + t.
    let mut q = vec![0f32; rows * d];
    for gi in 0..g {
        let h = kh * g + gi;
        for t in 0..len {
            let src = &p.q[(h * p.total + p.off + t0 + t) * d..][..d];
            for (o, &x) in q[(gi * len + t) * d..][..d].iter_mut().zip(src) {
                *o = x * scale;
            }
        }
    }
    let mut m = vec![f32::NEG_INFINITY; rows];
    let mut l = vec![0f32; rows];
    let mut acc = vec![0f32; rows * d];
    let mut s = vec![0f32; bs];
    let (mut kbuf, mut vbuf) = (Vec::new(), Vec::new());
    let key_end = p.start_pos + t0 + len; // exclusive: the last query sees itself
    for (b, &block) in p.table[..key_end.div_ceil(bs)].iter().enumerate() {
        let k0 = b * bs;
        let keys = kv_run(geo, arena, block, p.layer, Kv::K, kh, &mut kbuf);
        let vals = kv_run(geo, arena, block, p.layer, Kv::V, kh, &mut vbuf);
        for gi in 0..g {
            for t in 0..len {
                let pos = p.start_pos + t0 + t;
                if pos < k0 {
                    continue; // the whole block is in this query's future
                }
                let visible = (pos + 1 - k0).min(bs);
                let r = gi * len + t;
                let qr = &q[r * d..][..d];
                let mut mb = f32::NEG_INFINITY;
                for (j, sj) in s[..visible].iter_mut().enumerate() {
                    *sj = dot(qr, &keys[j * d..][..d]);
                    mb = mb.max(*sj);
                }
                let ar = &mut acc[r * d..][..d];
                if mb > m[r] {
                    let corr = exp_neg(m[r] - mb);
                    l[r] *= corr;
                    ar.iter_mut().for_each(|a| *a *= corr);
                    m[r] = mb;
                }
                let mr = m[r];
                s[..visible]
                    .iter_mut()
                    .for_each(|sj| *sj = exp_neg(*sj - mr));
                l[r] += s[..visible].iter().sum::<f32>();
                for (j, &pj) in s[..visible].iter().enumerate() {
                    for (a, &v) in ar.iter_mut().zip(&vals[j * d..][..d]) {
                        *a += pj * v;
                    }
                }
            }
        }
    }
    for (r, ar) in acc.chunks_exact_mut(d).enumerate() {
        let inv = 1.0 / l[r];
        ar.iter_mut().for_each(|a| *a *= inv);
    }
    acc
}

/// Attention output of one sequence, `[n, H·D]`.
pub(crate) fn attend(p: &AttnProblem<'_>, geo: &BlockGeometry, arena: &KvArena) -> Vec<f32> {
    let (d, kvh) = (geo.head_dim, geo.num_kv_heads);
    let g = p.num_heads / kvh;
    let items: Vec<(usize, usize, usize)> = (0..p.n)
        .step_by(TILE)
        .rev() // later tiles see more keys: start them first for balance
        .flat_map(|t0| (0..kvh).map(move |kh| (kh, t0, TILE.min(p.n - t0))))
        .collect();
    let mut out = vec![0f32; p.n * p.num_heads * d];
    let mut place = |kh: usize, t0: usize, len: usize, res: &[f32]| {
        for gi in 0..g {
            let h = kh * g + gi;
            for t in 0..len {
                out[((t0 + t) * p.num_heads + h) * d..][..d]
                    .copy_from_slice(&res[(gi * len + t) * d..][..d]);
            }
        }
    };
    let scores = p.n * (p.start_pos + p.n) * p.num_heads;
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(items.len());
    if scores < PARALLEL_MIN_SCORES || threads <= 1 {
        for &(kh, t0, len) in &items {
            place(kh, t0, len, &tile(p, geo, arena, kh, t0, len));
        }
        return out;
    }
    let next = AtomicUsize::new(0);
    let done = Mutex::new(Vec::with_capacity(items.len()));
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&(kh, t0, len)) = items.get(i) else {
                        break;
                    };
                    let res = tile(p, geo, arena, kh, t0, len);
                    done.lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push((kh, t0, len, res));
                }
            });
        }
    });
    for (kh, t0, len, res) in done
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
    {
        place(kh, t0, len, &res);
    }
    out
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
        // 120 new queries after a 180-token prefix (one thread); all 300 at once (threaded path).
        for (start, n) in [(180usize, 120usize), (0, 300)] {
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
            let got = attend(&p, &geo, &arena);
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
