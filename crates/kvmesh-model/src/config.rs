//! Hyper-parameters of a Llama-architecture model, read from GGUF metadata or HF `config.json`.

use serde::Deserialize;

use crate::ModelError;

/// How RoPE pairs the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs (x0,x1),(x2,x3)…: GGUF files, whose Q/K rows llama.cpp's converter permuted.
    Interleaved,
    /// First half with second half ("rotate_half"): HF safetensors checkpoints.
    Half,
}

#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    /// Longest context the model was trained for; requests beyond it are refused.
    pub max_position: usize,
    pub rope_style: RopeStyle,
}

impl LlamaConfig {
    /// Checks the shapes fit together (heads divide, GQA groups are whole).
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |m: &str| {
            Err(ModelError::Format(format!(
                "inconsistent config: {m} ({self:?})"
            )))
        };
        if self.num_heads == 0
            || self.num_kv_heads == 0
            || self.num_layers == 0
            || self.head_dim == 0
        {
            return bad("zero-sized dimension");
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad("num_heads not a multiple of num_kv_heads");
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad("odd head_dim");
        }
        Ok(())
    }
}

/// The fields of HF `config.json` a Llama needs.
#[derive(Debug, Deserialize)]
pub(crate) struct HfConfig {
    pub architectures: Option<Vec<String>>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub rope_theta: Option<f64>,
    pub rms_norm_eps: Option<f64>,
    pub max_position_embeddings: Option<usize>,
    pub tie_word_embeddings: Option<bool>,
    pub rope_scaling: Option<serde_json::Value>,
}

impl HfConfig {
    pub(crate) fn to_config(&self) -> Result<LlamaConfig, ModelError> {
        if let Some(archs) = &self.architectures
            && !archs
                .iter()
                .any(|a| a == "LlamaForCausalLM" || a == "MistralForCausalLM")
        {
            return Err(ModelError::Unsupported(format!(
                "architectures {archs:?} (need LlamaForCausalLM)"
            )));
        }
        if self.rope_scaling.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(ModelError::Unsupported(
                "rope_scaling is not implemented".to_owned(),
            ));
        }
        if self.num_attention_heads == 0 {
            return Err(ModelError::Format("num_attention_heads = 0".to_owned()));
        }
        let cfg = LlamaConfig {
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_layers: self.num_hidden_layers,
            num_heads: self.num_attention_heads,
            num_kv_heads: self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            head_dim: self
                .head_dim
                .unwrap_or(self.hidden_size / self.num_attention_heads),
            rope_theta: self.rope_theta.unwrap_or(10_000.0),
            rms_norm_eps: self.rms_norm_eps.unwrap_or(1e-5),
            max_position: self.max_position_embeddings.unwrap_or(4096),
            rope_style: RopeStyle::Half,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}
