//! Building the configured tokenizer.

use std::path::Path;
use std::sync::Arc;

use kvmesh_text::Tokenizer;

use crate::error::RouterError;

/// A HF `tokenizer.json` tokenizer with an optional chat template file.
pub fn hf(_path: &Path, _chat_template: Option<&Path>) -> Result<Arc<dyn Tokenizer>, RouterError> {
    Err(RouterError::Tokenizer(
        "HF tokenizers are not available in this build yet; use `tokenizer: byte`".into(),
    ))
}
