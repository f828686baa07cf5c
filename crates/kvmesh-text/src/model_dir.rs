//! Finding a model's tokenizer files the way transformers' `AutoTokenizer.from_pretrained(dir)`
//! (which vLLM calls) does for a local directory, so that `tokenizer: /models/llama` in kvmesh
//! means what `--tokenizer /models/llama` means to vLLM. Only local files: nothing is downloaded.
//!
//! - `tokenizer.json` — the fast tokenizer (required; kvmesh has no slow-tokenizer fallback);
//! - `tokenizer_config.json` — special tokens (`bos_token`, `eos_token`, ...) as strings or
//!   `AddedToken` objects, `add_bos_token`, and a `chat_template` (a string, or a list of
//!   `{name, template}` of which transformers uses the one named `"default"`);
//! - `chat_template.jinja` — the template as its own file; when present it replaces the one in
//!   `tokenizer_config.json` (transformers reads it into the same `chat_template` setting);
//! - `chat_template.json` — `{"chat_template": "..."}`, what processors (multimodal models) save;
//!   vLLM falls back to it when the tokenizer has no template, and so do we;
//! - `generation_config.json` — extra end-of-sequence ids.

use std::path::{Path, PathBuf};

use crate::TextError;

/// The fast-tokenizer file a model directory must contain.
pub const TOKENIZER_JSON: &str = "tokenizer.json";
pub const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
pub const CHAT_TEMPLATE_JINJA: &str = "chat_template.jinja";
pub const CHAT_TEMPLATE_JSON: &str = "chat_template.json";
pub const GENERATION_CONFIG: &str = "generation_config.json";

/// The tokenizer files found for a model: a directory, or a `tokenizer.json` whose siblings are
/// looked up in the same directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizerFiles {
    /// The directory the optional files were looked for in.
    pub dir: PathBuf,
    pub tokenizer_json: PathBuf,
    pub tokenizer_config: Option<PathBuf>,
    pub chat_template_jinja: Option<PathBuf>,
    pub chat_template_json: Option<PathBuf>,
    pub generation_config: Option<PathBuf>,
}

impl TokenizerFiles {
    /// Resolves `path`: a model directory (must hold `tokenizer.json`) or a tokenizer JSON file
    /// (any name). Errors name the path and the file that is missing.
    pub fn discover(path: &Path) -> Result<Self, TextError> {
        let meta = std::fs::metadata(path).map_err(|e| {
            TextError::Tokenizer(format!(
                "{}: {e} (kvmesh reads tokenizers from local files only: give a model directory \
                 holding {TOKENIZER_JSON}, or the {TOKENIZER_JSON} file itself)",
                path.display()
            ))
        })?;
        let (dir, tokenizer_json) = if meta.is_dir() {
            let file = path.join(TOKENIZER_JSON);
            if !file.is_file() {
                let slow = ["tokenizer.model", "vocab.json"]
                    .into_iter()
                    .find(|f| path.join(f).is_file());
                let why = match slow {
                    Some(f) => format!(
                        "; it has {f}, a slow-tokenizer file kvmesh cannot read (save the fast \
                         tokenizer with transformers to get {TOKENIZER_JSON})"
                    ),
                    None => String::new(),
                };
                return Err(TextError::Tokenizer(format!(
                    "{}: no {TOKENIZER_JSON} in this model directory{why}",
                    path.display()
                )));
            }
            (path.to_path_buf(), file)
        } else {
            let dir = match path.parent() {
                Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
                _ => PathBuf::from("."),
            };
            (dir, path.to_path_buf())
        };
        let optional = |name: &str| Some(dir.join(name)).filter(|p| p.is_file());
        Ok(Self {
            tokenizer_config: optional(TOKENIZER_CONFIG),
            chat_template_jinja: optional(CHAT_TEMPLATE_JINJA),
            chat_template_json: optional(CHAT_TEMPLATE_JSON),
            generation_config: optional(GENERATION_CONFIG),
            tokenizer_json,
            dir,
        })
    }
}

/// Reads a file the discovery found, naming it in the error.
pub(crate) fn read(path: &Path) -> Result<String, TextError> {
    std::fs::read_to_string(path)
        .map_err(|e| TextError::Tokenizer(format!("{}: {e}", path.display())))
}

/// Reads and parses a JSON file, naming it in the error.
pub(crate) fn read_json(path: &Path) -> Result<serde_json::Value, TextError> {
    serde_json::from_str(&read(path)?)
        .map_err(|e| TextError::Tokenizer(format!("{}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_without_tokenizer_json_is_named_in_the_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = TokenizerFiles::discover(dir.path()).expect_err("no tokenizer.json");
        let msg = err.to_string();
        assert!(msg.contains("no tokenizer.json"), "{msg}");
        assert!(msg.contains(&dir.path().display().to_string()), "{msg}");
        std::fs::write(dir.path().join("tokenizer.model"), b"x").expect("writes");
        let msg = TokenizerFiles::discover(dir.path())
            .expect_err("still none")
            .to_string();
        assert!(msg.contains("tokenizer.model"), "{msg}");
    }

    #[test]
    fn a_missing_path_says_files_are_local_only() {
        let msg = TokenizerFiles::discover(Path::new("meta-llama/Llama-3.2-1B-Instruct"))
            .expect_err("not a local path")
            .to_string();
        assert!(msg.contains("meta-llama/Llama-3.2-1B-Instruct"), "{msg}");
        assert!(msg.contains("local files only"), "{msg}");
    }

    #[test]
    fn finds_the_optional_files_beside_a_directory_or_a_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        for f in [TOKENIZER_JSON, TOKENIZER_CONFIG, CHAT_TEMPLATE_JINJA] {
            std::fs::write(dir.path().join(f), b"{}").expect("writes");
        }
        let by_dir = TokenizerFiles::discover(dir.path()).expect("found");
        let by_file = TokenizerFiles::discover(&dir.path().join(TOKENIZER_JSON)).expect("found");
        assert_eq!(by_dir, by_file);
        assert_eq!(
            by_dir.chat_template_jinja,
            Some(dir.path().join(CHAT_TEMPLATE_JINJA))
        );
        assert_eq!(by_dir.chat_template_json, None);
        assert_eq!(by_dir.generation_config, None);
    }
}
