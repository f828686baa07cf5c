//! Building the configured tokenizer (startup only; file I/O runs on a blocking thread). The
//! discovery of a model directory's files lives in `kvmesh_text::HfTokenizer::load`, shared with
//! the engine, so router and engines resolve the same directory to the same tokenizer and template.

use std::path::Path;
use std::sync::Arc;

use kvmesh_text::{HfTokenizer, TextError, Tokenizer};

use crate::error::RouterError;

/// A HF tokenizer from a model directory or a `tokenizer.json`. Its chat template is
/// `chat_template` (a Jinja file) when given, else the model's own (`chat_template.jinja`, then
/// `tokenizer_config.json`) — rendered with the model's special tokens either way. Errors name
/// the file that is missing or broken.
pub fn hf(path: &Path, chat_template: Option<&Path>) -> Result<Arc<dyn Tokenizer>, RouterError> {
    // `RouterError::Tokenizer` prints "tokenizer: " itself; keep a template error's own prefix.
    let tok = HfTokenizer::load(path, chat_template).map_err(|e| match e {
        TextError::Tokenizer(msg) => RouterError::Tokenizer(msg),
        other => RouterError::Tokenizer(other.to_string()),
    })?;
    Ok(Arc::new(tok))
}

#[cfg(test)]
mod tests {
    use kvmesh_text::ChatMessage;

    use super::*;

    /// A word-level `tokenizer.json` small enough to write by hand, with ChatML specials.
    const TOKENIZER_JSON: &str = r#"{
      "version": "1.0", "truncation": null, "padding": null,
      "added_tokens": [
        {"id": 0, "content": "<|im_start|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
        {"id": 1, "content": "<|im_end|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
      ],
      "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
      "model": {"type": "WordLevel", "unk_token": "[UNK]",
                "vocab": {"<|im_start|>": 0, "<|im_end|>": 1, "[UNK]": 2, "user": 3, "assistant": 4, "hi": 5}}
    }"#;

    const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    #[test]
    fn a_vllm_style_model_directory_gives_a_chat_template() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("tokenizer.json"), TOKENIZER_JSON).expect("writes");
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"eos_token": "<|im_end|>", "bos_token": null}"#,
        )
        .expect("writes");
        std::fs::write(dir.path().join("chat_template.jinja"), CHATML).expect("writes");
        let tok = hf(dir.path(), None).expect("a directory is accepted");
        let msgs = [ChatMessage {
            role: "user".into(),
            content: "hi".into(),
        }];
        let prompt = tok.apply_chat_template(&msgs, true).expect("renders");
        assert_eq!(
            prompt,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            tok.encode(&prompt).expect("encodes"),
            vec![0, 3, 5, 1, 0, 4]
        );
        assert_eq!(tok.eos_token_ids(), vec![1]);
    }

    #[test]
    fn a_directory_without_tokenizer_json_is_refused_by_name() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("chat_template.jinja"), CHATML).expect("writes");
        let Err(err) = hf(dir.path(), None) else {
            panic!("no tokenizer.json")
        };
        let msg = err.to_string();
        assert!(msg.contains("no tokenizer.json"), "{msg}");
    }
}
