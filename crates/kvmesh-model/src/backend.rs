//! [`ModelBackend`]: the real model as the engine's [`ComputeBackend`].

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvmesh_core::TokenId;
use kvmesh_engine::compute::{
    BackendCapabilities, ComputeBackend, ComputeError, KvArena, KvLayout, SeqStep,
};
use kvmesh_text::{ByteTokenizer, HfTokenizer, Tokenizer};

use crate::load::{self, splitmix64};
use crate::model::{Llama, SeqInput};
use crate::paged::{BlockGeometry, KvDtype};
use crate::{LlamaConfig, ModelError, RopeStyle, sample};

/// How to load a model.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Tokens per KV block (must equal the engine's `--block-size`).
    pub block_size: usize,
    pub kv_dtype: KvDtype,
    /// Identity of the weights in the KV layout / fingerprint; default: the file or directory name.
    pub model_id: Option<String>,
    /// A model directory or `tokenizer.json` to take the tokenizer from instead of the model's own
    /// (resolved like the router's `tokenizer:`, by `HfTokenizer::load`).
    pub tokenizer: Option<PathBuf>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            block_size: 16,
            kv_dtype: KvDtype::F32,
            model_id: None,
            tokenizer: None,
        }
    }
}

/// A Llama-family model computing real KV into the engine's paged arena.
pub struct ModelBackend {
    model: Llama,
    geo: BlockGeometry,
    model_id: String,
    eos: Vec<TokenId>,
    /// Mixed into the sampling seed of requests without one, so runs differ.
    salt: u64,
}

impl std::fmt::Debug for ModelBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelBackend")
            .field("model_id", &self.model_id)
            .field("geo", &self.geo)
            .finish()
    }
}

/// Loads a GGUF file or an HF safetensors directory, with its tokenizer.
pub fn load_backend(
    path: &Path,
    opts: &LoadOptions,
) -> Result<(ModelBackend, Arc<dyn Tokenizer>), ModelError> {
    if opts.block_size == 0 {
        return Err(ModelError::Input("block size must be positive".to_owned()));
    }
    let override_tok = opts
        .tokenizer
        .as_deref()
        .map(|p| HfTokenizer::load(p, None))
        .transpose()?;
    let (model, tok, name) = if path.is_dir() {
        let model = load::load_safetensors_dir(path)?;
        let tok = match override_tok {
            Some(t) => t,
            // The directory's tokenizer.json, tokenizer_config.json and chat_template.jinja, found
            // exactly as the router finds them for `tokenizer: DIR`.
            None => HfTokenizer::load(path, None)?,
        };
        let name = path
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".to_owned());
        (model, tok, name)
    } else {
        let g = load::load_gguf(path)?;
        let tok = match override_tok {
            Some(t) => t,
            None => HfTokenizer::from_gguf_vocab(&g.vocab)?,
        };
        (g.llama, tok, g.name)
    };
    let mut eos = tok.eos_token_ids();
    if eos.is_empty() {
        tracing::warn!(
            "model declares no end-of-sequence token; generation stops only at max_tokens"
        );
    }
    eos.sort_unstable();
    let model_id = opts.model_id.clone().unwrap_or(name);
    tracing::info!(
        model_id,
        layers = model.cfg.num_layers,
        hidden = model.cfg.hidden_size,
        "model loaded"
    );
    let backend = ModelBackend::from_model(model, opts, model_id, eos);
    Ok((backend, Arc::new(tok)))
}

/// A 2-layer random-weight Llama over [`ByteTokenizer`]'s 257-token vocabulary, block size 16.
pub fn tiny_random_llama(seed: u64) -> ModelBackend {
    tiny_random_llama_with(
        seed,
        &LoadOptions {
            model_id: Some(format!("tiny-random-llama-{seed}")),
            ..LoadOptions::default()
        },
    )
}

/// [`tiny_random_llama`] with a chosen block size / KV dtype.
pub fn tiny_random_llama_with(seed: u64, opts: &LoadOptions) -> ModelBackend {
    let cfg = LlamaConfig {
        vocab_size: ByteTokenizer::VOCAB_SIZE,
        hidden_size: 64,
        intermediate_size: 128,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-5,
        max_position: 16_384,
        rope_style: RopeStyle::Half,
    };
    // Fixed, valid shapes: construction cannot fail.
    #[allow(clippy::expect_used)]
    random_llama_backend(cfg, seed, opts).expect("tiny model shapes are consistent")
}

/// A random-weight Llama of any shape `cfg` over [`ByteTokenizer`] (`cfg.vocab_size` must be
/// its 257 tokens): benchmarks size the model (layers, KV heads) to the KV they need to move.
pub fn random_llama_backend(
    cfg: LlamaConfig,
    seed: u64,
    opts: &LoadOptions,
) -> Result<ModelBackend, ModelError> {
    let model = load::random_llama(cfg, seed)?;
    let id = opts
        .model_id
        .clone()
        .unwrap_or_else(|| format!("tiny-random-llama-{seed}"));
    Ok(ModelBackend::from_model(
        model,
        opts,
        id,
        vec![ByteTokenizer::EOS],
    ))
}

impl ModelBackend {
    fn from_model(model: Llama, opts: &LoadOptions, model_id: String, eos: Vec<TokenId>) -> Self {
        let geo = BlockGeometry {
            block_size: opts.block_size.max(1),
            num_layers: model.cfg.num_layers,
            num_kv_heads: model.cfg.num_kv_heads,
            head_dim: model.cfg.head_dim,
            dtype: opts.kv_dtype,
        };
        let salt = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        Self {
            model,
            geo,
            model_id,
            eos,
            salt,
        }
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.model.cfg
    }

    pub fn geometry(&self) -> BlockGeometry {
        self.geo
    }

    /// Runs a step and returns the last-position logits of every sequence (tests and tools).
    pub fn forward_logits(
        &mut self,
        seqs: &[SeqStep<'_>],
        kv: &mut KvArena,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let inputs = model_inputs(seqs);
        let want = vec![true; seqs.len()];
        let out = self
            .model
            .forward(&inputs, &self.geo, kv, &want, &mut |_, _| {})?;
        Ok(out.into_iter().map(Option::unwrap_or_default).collect())
    }

    /// Runs a step, sampling where asked.
    pub fn run_step(
        &mut self,
        seqs: &[SeqStep<'_>],
        kv: &mut KvArena,
    ) -> Result<Vec<Option<TokenId>>, ModelError> {
        self.run_step_layered(seqs, kv, &mut |_, _| {})
    }

    /// [`ModelBackend::run_step`] with a hook before each layer
    /// ([`ComputeBackend::step_layered`]).
    pub fn run_step_layered(
        &mut self,
        seqs: &[SeqStep<'_>],
        kv: &mut KvArena,
        before_layer: &mut dyn FnMut(usize, &mut KvArena),
    ) -> Result<Vec<Option<TokenId>>, ModelError> {
        let inputs = model_inputs(seqs);
        let want: Vec<bool> = seqs.iter().map(|s| s.sample.is_some()).collect();
        let logits = self
            .model
            .forward(&inputs, &self.geo, kv, &want, before_layer)?;
        Ok(seqs
            .iter()
            .zip(logits)
            .map(|(s, l)| {
                let (params, l) = (s.sample?, l?);
                let seed = params
                    .seed
                    .unwrap_or_else(|| splitmix64(s.seq_id ^ self.salt));
                Some(sample::sample(&l, params, seed, s.num_generated as u64))
            })
            .collect())
    }
}

impl ComputeBackend for ModelBackend {
    fn name(&self) -> &str {
        "model"
    }

    fn max_context(&self) -> Option<usize> {
        Some(self.model.cfg.max_position)
    }

    fn capabilities(&self) -> BackendCapabilities {
        // paged.rs: a block is `[layer][K|V][kv_head][slot][head_dim]`, one run per layer.
        BackendCapabilities {
            layered_blocks: true,
            ..BackendCapabilities::default()
        }
    }

    fn kv_layout(&self) -> KvLayout {
        KvLayout {
            block_size: self.geo.block_size,
            bytes_per_block: self.geo.bytes_per_block(),
            num_layers: self.geo.num_layers as u32,
            num_kv_heads: self.geo.num_kv_heads as u32,
            head_dim: self.geo.head_dim as u32,
            dtype: self.geo.dtype.name().to_owned(),
            model_id: self.model_id.clone(),
        }
    }

    fn step(
        &mut self,
        seqs: &[SeqStep<'_>],
        kv: &mut KvArena,
    ) -> Result<Vec<Option<TokenId>>, ComputeError> {
        self.run_step(seqs, kv)
            .map_err(|e| ComputeError::Backend(e.to_string()))
    }

    fn step_layered(
        &mut self,
        seqs: &[SeqStep<'_>],
        kv: &mut KvArena,
        before_layer: &mut dyn FnMut(usize, &mut KvArena),
    ) -> Result<Vec<Option<TokenId>>, ComputeError> {
        self.run_step_layered(seqs, kv, before_layer)
            .map_err(|e| ComputeError::Backend(e.to_string()))
    }

    fn eos_token_ids(&self) -> Vec<TokenId> {
        self.eos.clone()
    }
}

/// The model's view of a step's sequences.
fn model_inputs<'a>(seqs: &[SeqStep<'a>]) -> Vec<SeqInput<'a>> {
    seqs.iter()
        .map(|s| SeqInput {
            tokens: s.tokens,
            start_pos: s.start_pos,
            table: s.block_table,
        })
        .collect()
}
