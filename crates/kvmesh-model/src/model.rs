//! The Llama forward pass over paged KV.
//!
//! All tokens of all sequences in a step go through the dense layers as one matrix (that is the
//! batching); attention is per sequence and reads the sequence's KV in place from its blocks
//! ([`crate::attention`]: query tiles × key blocks with an online softmax, so no score matrix is
//! ever built, however long the prompt).
//!
//! The KV of the tokens being processed is written to the blocks *before* attention reads them, so
//! every step, whatever its chunking, reads the same stored values: a prefix restored from the CPU
//! tier or a peer is indistinguishable from one computed here.

use candle_core::{DType, Device, Tensor};
use kvmesh_core::TokenId;
use kvmesh_engine::compute::{BlockId, KvArena};

use crate::attention::{self, AttnProblem};
use crate::paged::{BlockGeometry, Kv};
use crate::{LlamaConfig, ModelError, RopeStyle};

/// One transformer block's weights; matrices are stored `[in, out]` so `x.matmul(w)` needs no transpose.
pub(crate) struct Layer {
    pub attn_norm: Tensor,
    /// Q, K and V projections fused: `[hidden, (H + 2·KVH)·D]`.
    pub wqkv: Tensor,
    pub wo: Tensor,
    pub ffn_norm: Tensor,
    /// Gate and up projections fused: `[hidden, 2·I]`.
    pub w_gate_up: Tensor,
    pub w_down: Tensor,
}

pub(crate) struct Llama {
    pub cfg: LlamaConfig,
    /// `[vocab, hidden]`.
    pub embed: Tensor,
    pub layers: Vec<Layer>,
    pub norm: Tensor,
    /// `[hidden, vocab]` (the transposed embedding when tied).
    pub lm_head: Tensor,
    /// Inverse RoPE frequencies, one per dimension pair.
    inv_freq: Vec<f64>,
}

/// Raw per-layer weights in HF orientation (`[out, in]`), before fusing.
pub(crate) struct RawLayer {
    pub attn_norm: Tensor,
    pub wq: Tensor,
    pub wk: Tensor,
    pub wv: Tensor,
    pub wo: Tensor,
    pub ffn_norm: Tensor,
    pub w_gate: Tensor,
    pub w_up: Tensor,
    pub w_down: Tensor,
}

fn expect_shape(name: &str, t: &Tensor, dims: &[usize]) -> Result<(), ModelError> {
    if t.dims() != dims {
        return Err(ModelError::Format(format!(
            "tensor {name} has shape {:?}, expected {dims:?}",
            t.dims()
        )));
    }
    Ok(())
}

/// A sequence's share of a forward pass.
pub(crate) struct SeqInput<'a> {
    pub tokens: &'a [TokenId],
    pub start_pos: usize,
    pub table: &'a [BlockId],
}

impl Llama {
    /// Checks shapes and fuses/transposes the weights for the forward pass. `lm_head` is `[vocab,
    /// hidden]`; pass the embedding for tied models.
    pub fn new(
        cfg: LlamaConfig,
        embed: Tensor,
        raw: Vec<RawLayer>,
        norm: Tensor,
        lm_head: Tensor,
    ) -> Result<Self, ModelError> {
        cfg.validate()?;
        let (h, kvh, d, hid, inter) = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.hidden_size,
            cfg.intermediate_size,
        );
        expect_shape("embedding", &embed, &[cfg.vocab_size, hid])?;
        expect_shape("lm_head", &lm_head, &[cfg.vocab_size, hid])?;
        expect_shape("norm", &norm, &[hid])?;
        if raw.len() != cfg.num_layers {
            return Err(ModelError::Format(format!(
                "{} layers found, config says {}",
                raw.len(),
                cfg.num_layers
            )));
        }
        let mut layers = Vec::with_capacity(raw.len());
        for (i, l) in raw.into_iter().enumerate() {
            let n = |s: &str| format!("layer {i} {s}");
            expect_shape(&n("attn_norm"), &l.attn_norm, &[hid])?;
            expect_shape(&n("ffn_norm"), &l.ffn_norm, &[hid])?;
            expect_shape(&n("q"), &l.wq, &[h * d, hid])?;
            expect_shape(&n("k"), &l.wk, &[kvh * d, hid])?;
            expect_shape(&n("v"), &l.wv, &[kvh * d, hid])?;
            expect_shape(&n("o"), &l.wo, &[hid, h * d])?;
            expect_shape(&n("gate"), &l.w_gate, &[inter, hid])?;
            expect_shape(&n("up"), &l.w_up, &[inter, hid])?;
            expect_shape(&n("down"), &l.w_down, &[hid, inter])?;
            layers.push(Layer {
                attn_norm: l.attn_norm.to_dtype(DType::F32)?,
                wqkv: Tensor::cat(&[&l.wq, &l.wk, &l.wv], 0)?
                    .to_dtype(DType::F32)?
                    .t()?
                    .contiguous()?,
                wo: l.wo.to_dtype(DType::F32)?.t()?.contiguous()?,
                ffn_norm: l.ffn_norm.to_dtype(DType::F32)?,
                w_gate_up: Tensor::cat(&[&l.w_gate, &l.w_up], 0)?
                    .to_dtype(DType::F32)?
                    .t()?
                    .contiguous()?,
                w_down: l.w_down.to_dtype(DType::F32)?.t()?.contiguous()?,
            });
        }
        let inv_freq = (0..d / 2)
            .map(|i| 1.0 / cfg.rope_theta.powf(2.0 * i as f64 / d as f64))
            .collect();
        Ok(Self {
            embed: embed.to_dtype(DType::F32)?.contiguous()?,
            norm: norm.to_dtype(DType::F32)?,
            lm_head: lm_head.to_dtype(DType::F32)?.t()?.contiguous()?,
            layers,
            inv_freq,
            cfg,
        })
    }

    /// cos/sin tables `[T, D/2]` for the given positions.
    fn rope_tables(&self, positions: &[usize]) -> Result<(Tensor, Tensor), ModelError> {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for &f in &self.inv_freq {
                let a = p as f64 * f;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        let dev = &Device::Cpu;
        Ok((
            Tensor::from_vec(cos, (positions.len(), half), dev)?,
            Tensor::from_vec(sin, (positions.len(), half), dev)?,
        ))
    }

    fn rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor, ModelError> {
        Ok(match self.cfg.rope_style {
            RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(x, cos, sin)?,
            RopeStyle::Half => candle_nn::rotary_emb::rope(x, cos, sin)?,
        })
    }

    /// Runs the layers over `seqs`, writing their KV to the blocks, and returns the last-position
    /// logits of each sequence for which `want_logits` is set.
    pub fn forward(
        &self,
        seqs: &[SeqInput<'_>],
        geo: &BlockGeometry,
        arena: &mut KvArena,
        want_logits: &[bool],
        before_layer: &mut dyn FnMut(usize, &mut KvArena),
    ) -> Result<Vec<Option<Vec<f32>>>, ModelError> {
        let cfg = &self.cfg;
        // Validate everything derived from requests before touching memory.
        let mut ids: Vec<u32> = Vec::new();
        let mut positions: Vec<usize> = Vec::new();
        let mut offsets = Vec::with_capacity(seqs.len());
        for (i, s) in seqs.iter().enumerate() {
            let end = s.start_pos + s.tokens.len();
            if end > cfg.max_position {
                return Err(ModelError::Input(format!(
                    "sequence reaches position {end}, beyond the model's context {}",
                    cfg.max_position
                )));
            }
            if want_logits.get(i).copied().unwrap_or(false) && s.tokens.is_empty() {
                return Err(ModelError::Input(
                    "logits requested for a step without tokens".to_owned(),
                ));
            }
            if let Some(&bad) = s.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                return Err(ModelError::Input(format!(
                    "token id {bad} outside vocabulary of {}",
                    cfg.vocab_size
                )));
            }
            geo.check_table(s.table, end, arena)?;
            offsets.push(ids.len());
            ids.extend_from_slice(s.tokens);
            positions.extend(s.start_pos..end);
        }
        let total = ids.len();
        if total == 0 {
            return Ok(vec![None; seqs.len()]);
        }
        let dev = &Device::Cpu;
        let (h, kvh, d) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let eps = cfg.rms_norm_eps as f32;
        let (cos, sin) = self.rope_tables(&positions)?;
        let mut x = self
            .embed
            .index_select(&Tensor::from_vec(ids, total, dev)?, 0)?;
        let mut kbuf = vec![0f32; kvh * d];
        for (li, layer) in self.layers.iter().enumerate() {
            // A prefix still arriving from a peer gets this layer's KV in place now, before
            // anything of the layer is read: earlier layers computed while it was on the wire.
            before_layer(li, arena);
            let hn = candle_nn::ops::rms_norm(&x, &layer.attn_norm, eps)?;
            let qkv = hn.matmul(&layer.wqkv)?;
            let to_heads = |start: usize, heads: usize| -> Result<Tensor, ModelError> {
                Ok(qkv
                    .narrow(1, start * d, heads * d)?
                    .reshape((total, heads, d))?
                    .transpose(0, 1)?
                    .contiguous()?
                    .unsqueeze(0)?)
            };
            let q = self.rope(&to_heads(0, h)?, &cos, &sin)?;
            let k = self.rope(&to_heads(h, kvh)?, &cos, &sin)?;
            // K host layout [KVH, T, D]; V host layout [T, KVH·D].
            let k_host = k.flatten_all()?.to_vec1::<f32>()?;
            let v_host = qkv
                .narrow(1, (h + kvh) * d, kvh * d)?
                .contiguous()?
                .flatten_all()?
                .to_vec1::<f32>()?;
            for (s, &off) in seqs.iter().zip(&offsets) {
                for t in 0..s.tokens.len() {
                    let row = off + t;
                    for head in 0..kvh {
                        kbuf[head * d..(head + 1) * d]
                            .copy_from_slice(&k_host[(head * total + row) * d..][..d]);
                    }
                    geo.write_token(arena, s.table, li, Kv::K, s.start_pos + t, &kbuf);
                    geo.write_token(
                        arena,
                        s.table,
                        li,
                        Kv::V,
                        s.start_pos + t,
                        &v_host[row * kvh * d..][..kvh * d],
                    );
                }
            }
            let q_host = q.flatten_all()?.to_vec1::<f32>()?; // [H, T, D]
            let mut attn = Vec::with_capacity(total * h * d);
            for (s, &off) in seqs.iter().zip(&offsets) {
                let problem = AttnProblem {
                    q: &q_host,
                    total,
                    off,
                    n: s.tokens.len(),
                    start_pos: s.start_pos,
                    table: s.table,
                    layer: li,
                    num_heads: h,
                };
                attn.extend(attention::attend(&problem, geo, arena)?);
            }
            let attn = Tensor::from_vec(attn, (total, h * d), dev)?;
            x = (x + attn.matmul(&layer.wo)?)?;
            let hn = candle_nn::ops::rms_norm(&x, &layer.ffn_norm, eps)?;
            let gu = hn.matmul(&layer.w_gate_up)?;
            let inter = cfg.intermediate_size;
            let act =
                (candle_nn::ops::silu(&gu.narrow(1, 0, inter)?)? * gu.narrow(1, inter, inter)?)?;
            x = (x + act.matmul(&layer.w_down)?)?;
        }
        // Logits only for the rows that need them: the LM head is the largest matmul per token.
        let mut rows = Vec::new();
        for (i, (s, &off)) in seqs.iter().zip(&offsets).enumerate() {
            if want_logits.get(i).copied().unwrap_or(false) {
                rows.push((off + s.tokens.len() - 1) as u32);
            }
        }
        let mut out = vec![None; seqs.len()];
        if rows.is_empty() {
            return Ok(out);
        }
        let n_rows = rows.len();
        let xs = x.index_select(&Tensor::from_vec(rows, n_rows, dev)?, 0)?;
        let logits = candle_nn::ops::rms_norm(&xs, &self.norm, eps)?
            .matmul(&self.lm_head)?
            .to_vec2::<f32>()?;
        let mut it = logits.into_iter();
        for (i, slot) in out.iter_mut().enumerate() {
            if want_logits.get(i).copied().unwrap_or(false) {
                *slot = it.next();
            }
        }
        Ok(out)
    }
}
