//! Loading weights: GGUF (dequantised to f32 at load), HF safetensors + `config.json`, or random
//! weights for tests.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::{Device, Tensor};
use kvmesh_text::GgufVocab;

use crate::config::HfConfig;
use crate::model::{Llama, RawLayer};
use crate::{LlamaConfig, ModelError, RopeStyle};

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ModelError + '_ {
    move |source| ModelError::Io {
        path: path.display().to_string(),
        source,
    }
}

fn as_usize(v: &Value) -> Option<usize> {
    match v {
        Value::U8(x) => Some(usize::from(*x)),
        Value::U16(x) => Some(usize::from(*x)),
        Value::U32(x) => usize::try_from(*x).ok(),
        Value::U64(x) => usize::try_from(*x).ok(),
        Value::I8(x) => usize::try_from(*x).ok(),
        Value::I16(x) => usize::try_from(*x).ok(),
        Value::I32(x) => usize::try_from(*x).ok(),
        Value::I64(x) => usize::try_from(*x).ok(),
        _ => None,
    }
}

fn as_f64(v: &Value) -> Option<f64> {
    match v {
        Value::F32(x) => Some(f64::from(*x)),
        Value::F64(x) => Some(*x),
        other => as_usize(other).map(|x| x as f64),
    }
}

/// What a GGUF file yields: the model, its tokenizer vocabulary, and a display name.
pub(crate) struct GgufModel {
    pub llama: Llama,
    pub vocab: GgufVocab,
    pub name: String,
}

pub(crate) fn load_gguf(path: &Path) -> Result<GgufModel, ModelError> {
    let mut reader = BufReader::new(File::open(path).map_err(io_err(path))?);
    let content = gguf_file::Content::read(&mut reader)
        .map_err(|e| ModelError::Format(format!("GGUF: {e}")))?;
    let md = &content.metadata;
    let get = |k: &str| md.get(k);
    let arch = get("general.architecture")
        .and_then(|v| v.to_string().ok())
        .cloned()
        .unwrap_or_default();
    if arch != "llama" {
        return Err(ModelError::Unsupported(format!(
            "GGUF architecture {arch:?} (need \"llama\")"
        )));
    }
    let req = |k: &str| {
        get(k).and_then(as_usize).ok_or_else(|| {
            ModelError::Format(format!("GGUF metadata {k} missing or not an integer"))
        })
    };
    let hidden = req("llama.embedding_length")?;
    let heads = req("llama.attention.head_count")?;
    let kv_heads = get("llama.attention.head_count_kv")
        .and_then(as_usize)
        .unwrap_or(heads);
    if heads == 0 {
        return Err(ModelError::Format(
            "llama.attention.head_count = 0".to_owned(),
        ));
    }
    let head_dim = get("llama.attention.key_length")
        .and_then(as_usize)
        .unwrap_or(hidden / heads);
    if let Some(rot) = get("llama.rope.dimension_count").and_then(as_usize)
        && rot != head_dim
    {
        return Err(ModelError::Unsupported(format!(
            "partial RoPE ({rot} of {head_dim} dims)"
        )));
    }
    if get("llama.rope.scaling.type")
        .and_then(|v| v.to_string().ok())
        .is_some_and(|s| s != "none")
    {
        return Err(ModelError::Unsupported(
            "RoPE scaling is not implemented".to_owned(),
        ));
    }
    // Llama 3.1-style checkpoints carry their RoPE scaling as per-dimension frequency factors
    // instead of metadata; ignoring them would load and answer, subtly wrong.
    if content.tensor_infos.contains_key("rope_freqs.weight") {
        return Err(ModelError::Unsupported(
            "RoPE frequency factors (rope_freqs.weight, Llama 3.1-style scaling) are not implemented"
                .to_owned(),
        ));
    }
    let tokens: Vec<String> = match get("tokenizer.ggml.tokens") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.to_string().cloned().unwrap_or_default())
            .collect(),
        _ => Vec::new(),
    };
    let dev = &Device::Cpu;
    let mut tensor = |name: &str| -> Result<Tensor, ModelError> {
        let q = content
            .tensor(&mut reader, name, dev)
            .map_err(|e| ModelError::Format(format!("GGUF tensor {name}: {e}")))?;
        Ok(q.dequantize(dev)?)
    };
    let embed = tensor("token_embd.weight")?;
    let vocab_size = get("llama.vocab_size")
        .and_then(as_usize)
        .unwrap_or(embed.dims().first().copied().unwrap_or(0));
    let cfg = LlamaConfig {
        vocab_size,
        hidden_size: hidden,
        intermediate_size: req("llama.feed_forward_length")?,
        num_layers: req("llama.block_count")?,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        rope_theta: get("llama.rope.freq_base")
            .and_then(as_f64)
            .unwrap_or(10_000.0),
        rms_norm_eps: get("llama.attention.layer_norm_rms_epsilon")
            .and_then(as_f64)
            .unwrap_or(1e-5),
        max_position: get("llama.context_length")
            .and_then(as_usize)
            .unwrap_or(4096),
        rope_style: RopeStyle::Interleaved,
    };
    cfg.validate()?;
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for i in 0..cfg.num_layers {
        let mut t = |s: &str| tensor(&format!("blk.{i}.{s}.weight"));
        layers.push(RawLayer {
            attn_norm: t("attn_norm")?,
            wq: t("attn_q")?,
            wk: t("attn_k")?,
            wv: t("attn_v")?,
            wo: t("attn_output")?,
            ffn_norm: t("ffn_norm")?,
            w_gate: t("ffn_gate")?,
            w_up: t("ffn_up")?,
            w_down: t("ffn_down")?,
        });
    }
    let norm = tensor("output_norm.weight")?;
    // SmolLM2 ties the LM head to the embedding: no output.weight in the file.
    let lm_head = if content.tensor_infos.contains_key("output.weight") {
        tensor("output.weight")?
    } else {
        embed.clone()
    };
    let llama = Llama::new(cfg, embed, layers, norm, lm_head)?;

    let str_list = |k: &str| match get(k) {
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|v| v.to_string().ok().cloned())
            .collect(),
        _ => Vec::new(),
    };
    let token_id = |k: &str| {
        get(k)
            .and_then(as_usize)
            .and_then(|x| u32::try_from(x).ok())
    };
    let vocab = GgufVocab {
        model: get("tokenizer.ggml.model")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_default(),
        pre: get("tokenizer.ggml.pre")
            .and_then(|v| v.to_string().ok())
            .cloned(),
        tokens,
        token_types: match get("tokenizer.ggml.token_type") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| as_usize(v).and_then(|x| i32::try_from(x).ok()).unwrap_or(1))
                .collect(),
            _ => Vec::new(),
        },
        merges: str_list("tokenizer.ggml.merges"),
        bos_token_id: token_id("tokenizer.ggml.bos_token_id"),
        eos_token_id: token_id("tokenizer.ggml.eos_token_id"),
        add_bos_token: get("tokenizer.ggml.add_bos_token")
            .and_then(|v| v.to_bool().ok())
            .unwrap_or(false),
        chat_template: get("tokenizer.chat_template")
            .and_then(|v| v.to_string().ok())
            .cloned(),
    };
    let name = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "gguf".to_owned());
    Ok(GgufModel { llama, vocab, name })
}

/// Loads an HF checkpoint directory: `config.json` and one or more `*.safetensors`.
pub(crate) fn load_safetensors_dir(dir: &Path) -> Result<Llama, ModelError> {
    let cfg_path = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(io_err(&cfg_path))?;
    let hf: HfConfig =
        serde_json::from_str(&text).map_err(|e| ModelError::Format(format!("config.json: {e}")))?;
    let cfg = hf.to_config()?;
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(io_err(dir))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(ModelError::Format(format!(
            "no .safetensors files in {}",
            dir.display()
        )));
    }
    let mut all: HashMap<String, Tensor> = HashMap::new();
    for f in &files {
        all.extend(candle_core::safetensors::load(f, &Device::Cpu)?);
    }
    let mut take = |name: &str| {
        all.remove(name)
            .ok_or_else(|| ModelError::Format(format!("tensor {name} missing")))
    };
    let embed = take("model.embed_tokens.weight")?;
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for i in 0..cfg.num_layers {
        let p = format!("model.layers.{i}");
        layers.push(RawLayer {
            attn_norm: take(&format!("{p}.input_layernorm.weight"))?,
            wq: take(&format!("{p}.self_attn.q_proj.weight"))?,
            wk: take(&format!("{p}.self_attn.k_proj.weight"))?,
            wv: take(&format!("{p}.self_attn.v_proj.weight"))?,
            wo: take(&format!("{p}.self_attn.o_proj.weight"))?,
            ffn_norm: take(&format!("{p}.post_attention_layernorm.weight"))?,
            w_gate: take(&format!("{p}.mlp.gate_proj.weight"))?,
            w_up: take(&format!("{p}.mlp.up_proj.weight"))?,
            w_down: take(&format!("{p}.mlp.down_proj.weight"))?,
        });
    }
    let norm = take("model.norm.weight")?;
    let lm_head = match take("lm_head.weight") {
        Ok(t) => t,
        Err(_) if hf.tie_word_embeddings.unwrap_or(true) => embed.clone(),
        Err(e) => return Err(e),
    };
    Llama::new(cfg, embed, layers, norm, lm_head)
}

/// Deterministic pseudo-random numbers for test weights (splitmix64).
pub(crate) fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A random-weight Llama of the given shape (tied embeddings), for tests.
pub(crate) fn random_llama(cfg: LlamaConfig, seed: u64) -> Result<Llama, ModelError> {
    let (embed, layers, norm) = random_weights(&cfg, seed)?;
    Llama::new(cfg, embed.clone(), layers, norm, embed)
}

/// Random weights in HF orientation: (embedding, layers, final norm).
pub(crate) fn random_weights(
    cfg: &LlamaConfig,
    seed: u64,
) -> Result<(Tensor, Vec<RawLayer>, Tensor), ModelError> {
    let mut state = splitmix64(seed);
    let mut rand = |shape: &[usize], scale: f32, base: f32| -> Result<Tensor, ModelError> {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| {
                state = splitmix64(state);
                let u = (state >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
                base + scale * (2.0 * u - 1.0)
            })
            .collect();
        Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
    };
    let (hid, h, kvh, d, inter) = (
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
    );
    let w = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
    // Small embeddings keep the tied LM head's logits in a range where sampling is not one-hot.
    let embed = rand(&[cfg.vocab_size, hid], 0.15, 0.0)?;
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for _ in 0..cfg.num_layers {
        layers.push(RawLayer {
            attn_norm: rand(&[hid], 0.1, 1.0)?,
            // Large Q/K weights so attention is far from uniform and position matters.
            wq: rand(&[h * d, hid], 3.0 * w(hid), 0.0)?,
            wk: rand(&[kvh * d, hid], 3.0 * w(hid), 0.0)?,
            wv: rand(&[kvh * d, hid], w(hid), 0.0)?,
            wo: rand(&[hid, h * d], w(h * d), 0.0)?,
            ffn_norm: rand(&[hid], 0.1, 1.0)?,
            w_gate: rand(&[inter, hid], w(hid), 0.0)?,
            w_up: rand(&[inter, hid], w(hid), 0.0)?,
            w_down: rand(&[hid, inter], w(inter), 0.0)?,
        });
    }
    let norm = rand(&[hid], 0.1, 1.0)?;
    Ok((embed, layers, norm))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use kvmesh_engine::compute::{BlockId, KvArena};

    use super::*;
    use crate::model::SeqInput;
    use crate::paged::{BlockGeometry, KvDtype};

    fn cfg() -> LlamaConfig {
        LlamaConfig {
            vocab_size: 40,
            hidden_size: 32,
            intermediate_size: 48,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 8,
            rope_theta: 10_000.0,
            rms_norm_eps: 1e-5,
            max_position: 512,
            rope_style: RopeStyle::Half,
        }
    }

    fn logits(m: &Llama, tokens: &[u32]) -> Vec<f32> {
        let c = &m.cfg;
        let geo = BlockGeometry {
            block_size: 4,
            num_layers: c.num_layers,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            dtype: KvDtype::F32,
        };
        let blocks = tokens.len().div_ceil(4);
        let mut arena = KvArena::new(blocks, geo.bytes_per_block());
        let table: Vec<BlockId> = (0..blocks as BlockId).collect();
        let seq = SeqInput {
            tokens,
            start_pos: 0,
            table: &table,
        };
        m.forward(&[seq], &geo, &mut arena, &[true], &mut |_, _| {})
            .unwrap()
            .remove(0)
            .unwrap()
    }

    /// llama.cpp's converter permutes Q/K rows so interleaved RoPE reproduces HF's rotate-half.
    fn permute(w: &Tensor, heads: usize) -> Tensor {
        let (rows, cols) = w.dims2().unwrap();
        w.reshape((heads, 2, rows / heads / 2, cols))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
            .reshape((rows, cols))
            .unwrap()
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    const TOKENS: [u32; 23] = [
        3, 17, 5, 9, 39, 0, 12, 12, 7, 30, 2, 8, 21, 33, 4, 6, 19, 25, 1, 11, 38, 14, 10,
    ];

    #[test]
    fn hf_layout_with_rotate_half_equals_gguf_layout_with_interleaved_rope() {
        let c = cfg();
        let (embed, layers, norm) = random_weights(&c, 9).unwrap();
        let gguf_layers: Vec<RawLayer> = layers
            .iter()
            .map(|l| RawLayer {
                attn_norm: l.attn_norm.clone(),
                wq: permute(&l.wq, c.num_heads),
                wk: permute(&l.wk, c.num_kv_heads),
                wv: l.wv.clone(),
                wo: l.wo.clone(),
                ffn_norm: l.ffn_norm.clone(),
                w_gate: l.w_gate.clone(),
                w_up: l.w_up.clone(),
                w_down: l.w_down.clone(),
            })
            .collect();
        let hf = Llama::new(
            c.clone(),
            embed.clone(),
            layers,
            norm.clone(),
            embed.clone(),
        )
        .unwrap();
        let gg_cfg = LlamaConfig {
            rope_style: RopeStyle::Interleaved,
            ..c
        };
        let gg = Llama::new(gg_cfg, embed.clone(), gguf_layers, norm, embed).unwrap();
        let (a, b) = (logits(&hf, &TOKENS), logits(&gg, &TOKENS));
        assert!(max_diff(&a, &b) < 1e-4, "diff {}", max_diff(&a, &b));
        // And the RoPE style matters (the check above can fail).
        let mut wrong = hf;
        wrong.cfg.rope_style = RopeStyle::Interleaved;
        assert!(max_diff(&a, &logits(&wrong, &TOKENS)) > 1e-3);
    }

    #[test]
    fn loads_an_hf_safetensors_directory() {
        let c = cfg();
        let (embed, layers, norm) = random_weights(&c, 4).unwrap();
        let mut tensors: HashMap<String, Tensor> = HashMap::new();
        tensors.insert("model.embed_tokens.weight".into(), embed.clone());
        tensors.insert("model.norm.weight".into(), norm.clone());
        for (i, l) in layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            for (n, t) in [
                ("input_layernorm", &l.attn_norm),
                ("self_attn.q_proj", &l.wq),
                ("self_attn.k_proj", &l.wk),
                ("self_attn.v_proj", &l.wv),
                ("self_attn.o_proj", &l.wo),
                ("post_attention_layernorm", &l.ffn_norm),
                ("mlp.gate_proj", &l.w_gate),
                ("mlp.up_proj", &l.w_up),
                ("mlp.down_proj", &l.w_down),
            ] {
                tensors.insert(format!("{p}.{n}.weight"), t.clone());
            }
        }
        let dir = tempfile::tempdir().unwrap();
        candle_core::safetensors::save(&tensors, dir.path().join("model.safetensors")).unwrap();
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"architectures":["LlamaForCausalLM"],"vocab_size":40,"hidden_size":32,"intermediate_size":48,
               "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"rope_theta":10000.0,
               "rms_norm_eps":1e-5,"max_position_embeddings":512,"tie_word_embeddings":true}"#,
        )
        .unwrap();
        let loaded = load_safetensors_dir(dir.path()).unwrap();
        assert_eq!(loaded.cfg, c);
        let reference = Llama::new(c, embed.clone(), layers, norm, embed).unwrap();
        assert_eq!(logits(&loaded, &TOKENS), logits(&reference, &TOKENS));
        // A missing tensor is a clear error.
        tensors.remove("model.layers.1.mlp.up_proj.weight");
        candle_core::safetensors::save(&tensors, dir.path().join("model.safetensors")).unwrap();
        let err = load_safetensors_dir(dir.path()).err().unwrap().to_string();
        assert!(err.contains("model.layers.1.mlp.up_proj.weight"), "{err}");
    }
}
