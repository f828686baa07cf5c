//! Errors of loading and running a real model.

use kvmesh_text::TextError;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("reading {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("model file: {0}")]
    Format(String),
    #[error("unsupported model: {0}")]
    Unsupported(String),
    #[error("tensor op: {0}")]
    Tensor(#[from] candle_core::Error),
    #[error("tokenizer: {0}")]
    Text(#[from] TextError),
    #[error("invalid step input: {0}")]
    Input(String),
    #[error("fetch: {0}")]
    Fetch(String),
}
