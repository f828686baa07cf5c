//! Why a config could not be loaded (every section's `validate` answers with it).

use std::path::PathBuf;

/// Why a config could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("parsing {path}: {source}")]
    Parse {
        path: PathBuf,
        source: serde_norway::Error,
    },
    #[error("invalid config: {0}")]
    Invalid(String),
}
