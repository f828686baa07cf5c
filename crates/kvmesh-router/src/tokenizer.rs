//! Building the configured tokenizer (startup only; file I/O runs on a blocking thread).

use std::path::Path;
use std::sync::Arc;

use kvmesh_text::{HfTokenizer, Tokenizer};

use crate::error::RouterError;

/// A HF `tokenizer.json` tokenizer. Its chat template comes from a `tokenizer_config.json` beside
/// it, or from `chat_template` (a Jinja file) when given — rendered with the same `bos_token` /
/// `eos_token` either way.
pub fn hf(path: &Path, chat_template: Option<&Path>) -> Result<Arc<dyn Tokenizer>, RouterError> {
    let err =
        |e: &dyn std::fmt::Display| RouterError::Tokenizer(format!("{}: {e}", path.display()));
    let mut tok = HfTokenizer::from_file(path).map_err(|e| err(&e))?;
    if let Some(tpl) = chat_template {
        let src = std::fs::read_to_string(tpl)
            .map_err(|e| RouterError::Tokenizer(format!("{}: {e}", tpl.display())))?;
        tok.set_chat_template_source(&src)
            .map_err(|e| RouterError::Tokenizer(format!("{}: {e}", tpl.display())))?;
    }
    Ok(Arc::new(tok))
}
