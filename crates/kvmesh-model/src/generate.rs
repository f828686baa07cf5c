//! A self-contained generation loop (own arena, sequential block table) for the CLI, benchmarks
//! and tests — the engine has its own scheduler and does not use this.

use std::time::{Duration, Instant};

use kvmesh_core::TokenId;
use kvmesh_engine::compute::{BlockId, KvArena, SamplingParams, SeqStep};

use crate::{ModelBackend, ModelError};

/// Timings of one [`generate`] call.
#[derive(Debug, Clone, Default)]
pub struct GenerateStats {
    pub prompt_tokens: usize,
    pub prefill: Duration,
    pub generated: usize,
    /// Time of the decode steps (after the first token).
    pub decode: Duration,
}

/// Prefills `prompt` in chunks of `chunk` tokens, then decodes up to `max_tokens` tokens, stopping
/// after an EOS token (included in the output).
pub fn generate(
    backend: &mut ModelBackend,
    prompt: &[TokenId],
    max_tokens: usize,
    params: &SamplingParams,
    chunk: usize,
    eos: &[TokenId],
) -> Result<(Vec<TokenId>, GenerateStats), ModelError> {
    if prompt.is_empty() {
        return Err(ModelError::Input("empty prompt".to_owned()));
    }
    let geo = backend.geometry();
    let total = prompt.len() + max_tokens;
    let blocks = total.div_ceil(geo.block_size);
    let mut arena = KvArena::new(blocks, geo.bytes_per_block());
    let table: Vec<BlockId> = (0..blocks as BlockId).collect();
    let chunk = chunk.max(1);
    let mut stats = GenerateStats {
        prompt_tokens: prompt.len(),
        ..GenerateStats::default()
    };
    let t0 = Instant::now();
    let mut next = None;
    let mut pos = 0;
    while pos < prompt.len() {
        let end = (pos + chunk).min(prompt.len());
        let last = end == prompt.len();
        let step = SeqStep {
            seq_id: 0,
            tokens: &prompt[pos..end],
            start_pos: pos,
            block_table: &table,
            sample: last.then_some(params),
            num_generated: 0,
        };
        next = backend.run_step(&[step], &mut arena)?.pop().flatten();
        pos = end;
    }
    stats.prefill = t0.elapsed();
    let mut out = Vec::with_capacity(max_tokens);
    let t1 = Instant::now();
    while let Some(tok) = next {
        out.push(tok);
        if out.len() >= max_tokens || eos.contains(&tok) {
            break;
        }
        let step = SeqStep {
            seq_id: 0,
            tokens: std::slice::from_ref(&tok),
            start_pos: prompt.len() + out.len() - 1,
            block_table: &table,
            sample: Some(params),
            num_generated: out.len(),
        };
        next = backend.run_step(&[step], &mut arena)?.pop().flatten();
    }
    stats.decode = t1.elapsed();
    stats.generated = out.len();
    Ok((out, stats))
}
