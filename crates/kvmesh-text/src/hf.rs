//! Real-model tokenizers on top of the `tokenizers` crate: from a HF `tokenizer.json` (+ the
//! `tokenizer_config.json` beside it for the chat template and special tokens), or rebuilt from a
//! GGUF file's vocabulary (`tokenizer.ggml.*` metadata, GPT-2-style byte-level BPE).

use std::path::Path;

use kvmesh_core::TokenId;
use serde_json::{Value as Json, json};

use crate::{ChatMessage, ChatTemplate, TextError, Tokenizer};

/// GGUF `tokenizer.ggml.token_type` values that mark special tokens.
const GGUF_TOKEN_CONTROL: i32 = 3;
const GGUF_TOKEN_USER_DEFINED: i32 = 4;

/// Llama-3's pre-tokenizer split pattern (GGUF `tokenizer.ggml.pre = "llama-bpe"`).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The tokenizer-related metadata of a GGUF file (read by the model crate, which owns GGUF I/O).
#[derive(Debug, Clone, Default)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`, e.g. "gpt2" (byte-level BPE).
    pub model: String,
    /// `tokenizer.ggml.pre`, the pre-tokenizer flavour (e.g. "smollm", "llama-bpe").
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type` (1 normal, 3 control, 4 user-defined, 6 byte, ...); may be empty.
    pub token_types: Vec<i32>,
    /// `tokenizer.ggml.merges`, each "left right".
    pub merges: Vec<String>,
    pub bos_token_id: Option<TokenId>,
    pub eos_token_id: Option<TokenId>,
    pub add_bos_token: bool,
    /// `tokenizer.chat_template`.
    pub chat_template: Option<String>,
}

/// A `tokenizers`-backed tokenizer with the model's chat template and end-of-sequence ids.
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    template: Option<ChatTemplate>,
    eos: Vec<TokenId>,
    /// Prepended by `encode` when the model asks for it and the text does not start with it.
    bos: Option<(TokenId, String)>,
    /// The model's `bos_token` / `eos_token` strings, as chat templates see them.
    template_tokens: (String, String),
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("eos", &self.eos)
            .field("template", &self.template)
            .finish()
    }
}

fn tok_err(e: impl std::fmt::Display) -> TextError {
    TextError::Tokenizer(e.to_string())
}

/// `"<s>"` or `{"content": "<s>", ...}` as found in `tokenizer_config.json`.
fn token_string(v: Option<&Json>) -> Option<String> {
    match v? {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content").and_then(Json::as_str).map(str::to_owned),
        _ => None,
    }
}

impl HfTokenizer {
    /// Loads `tokenizer.json`; if a `tokenizer_config.json` (and `generation_config.json`) sits beside
    /// it, takes the chat template, BOS/EOS tokens and extra EOS ids from there.
    pub fn from_file(tokenizer_json: &Path) -> Result<Self, TextError> {
        let inner = tokenizers::Tokenizer::from_file(tokenizer_json).map_err(tok_err)?;
        let dir = tokenizer_json.parent().unwrap_or_else(|| Path::new("."));
        let config: Json = match std::fs::read_to_string(dir.join("tokenizer_config.json")) {
            Ok(s) => serde_json::from_str(&s).map_err(tok_err)?,
            Err(_) => Json::Null,
        };
        let bos_str = token_string(config.get("bos_token"));
        let eos_str = token_string(config.get("eos_token"));
        let mut eos: Vec<TokenId> = eos_str
            .as_deref()
            .and_then(|s| inner.token_to_id(s))
            .into_iter()
            .collect();
        if let Ok(s) = std::fs::read_to_string(dir.join("generation_config.json")) {
            let gen_cfg: Json = serde_json::from_str(&s).map_err(tok_err)?;
            match gen_cfg.get("eos_token_id") {
                Some(Json::Number(n)) => eos.extend(n.as_u64().and_then(|n| u32::try_from(n).ok())),
                Some(Json::Array(a)) => {
                    eos.extend(
                        a.iter()
                            .filter_map(Json::as_u64)
                            .filter_map(|n| u32::try_from(n).ok()),
                    );
                }
                _ => {}
            }
        }
        eos.sort_unstable();
        eos.dedup();
        let template_src = match config.get("chat_template") {
            Some(Json::String(s)) => Some(s.clone()),
            // Newer configs list named templates; use the default one.
            Some(Json::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                .or_else(|| list.first())
                .and_then(|t| t.get("template"))
                .and_then(Json::as_str)
                .map(str::to_owned),
            _ => None,
        };
        // Without an `eos_token` string, the first EOS id's token (e.g. from generation_config).
        let eos_str = eos_str.or_else(|| eos.first().and_then(|&id| inner.id_to_token(id)));
        let template_tokens = (
            bos_str.clone().unwrap_or_default(),
            eos_str.unwrap_or_default(),
        );
        let template = template_src
            .map(|src| ChatTemplate::new(&src, &template_tokens.0, &template_tokens.1))
            .transpose()?;
        let add_bos = config
            .get("add_bos_token")
            .and_then(Json::as_bool)
            .unwrap_or(false);
        let bos = if add_bos {
            bos_str.and_then(|s| inner.token_to_id(&s).map(|id| (id, s)))
        } else {
            None
        };
        Ok(Self {
            inner,
            template,
            eos,
            bos,
            template_tokens,
        })
    }

    /// Rebuilds a byte-level BPE tokenizer from GGUF vocabulary metadata.
    pub fn from_gguf_vocab(v: &GgufVocab) -> Result<Self, TextError> {
        if v.model != "gpt2" {
            return Err(TextError::Tokenizer(format!(
                "GGUF tokenizer model {:?} is not supported (only byte-level BPE \"gpt2\")",
                v.model
            )));
        }
        let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
        let pre_tokenizer = match v.pre.as_deref() {
            Some("llama-bpe" | "llama3" | "llama-v3") => {
                json!({"type": "Sequence", "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": false},
                    byte_level(false)
                ]})
            }
            // SmolLM (and StarCoder-style) vocabularies split every digit before the GPT-2 regex.
            Some("smollm" | "starcoder" | "refact") => {
                json!({"type": "Sequence", "pretokenizers": [
                    {"type": "Digits", "individual_digits": true},
                    byte_level(true)
                ]})
            }
            _ => byte_level(true),
        };
        let mut vocab = serde_json::Map::with_capacity(v.tokens.len());
        let mut added = Vec::new();
        for (id, tok) in v.tokens.iter().enumerate() {
            vocab.insert(tok.clone(), json!(id));
            let ty = v.token_types.get(id).copied().unwrap_or(1);
            if ty == GGUF_TOKEN_CONTROL || ty == GGUF_TOKEN_USER_DEFINED {
                added.push(json!({
                    "id": id, "content": tok, "single_word": false, "lstrip": false, "rstrip": false,
                    "normalized": false, "special": ty == GGUF_TOKEN_CONTROL
                }));
            }
        }
        let spec = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": pre_tokenizer,
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": v.merges,
            }
        });
        let inner: tokenizers::Tokenizer = spec.to_string().parse().map_err(tok_err)?;
        let name = |id: Option<TokenId>| id.and_then(|i| v.tokens.get(i as usize)).cloned();
        let bos_str = name(v.bos_token_id);
        let eos_str = name(v.eos_token_id);
        let template_tokens = (
            bos_str.clone().unwrap_or_default(),
            eos_str.unwrap_or_default(),
        );
        let template = v
            .chat_template
            .as_deref()
            .map(|src| ChatTemplate::new(src, &template_tokens.0, &template_tokens.1))
            .transpose()?;
        let bos = match (v.add_bos_token, v.bos_token_id, bos_str) {
            (true, Some(id), Some(s)) => Some((id, s)),
            _ => None,
        };
        Ok(Self {
            inner,
            template,
            eos: v.eos_token_id.into_iter().collect(),
            bos,
            template_tokens,
        })
    }

    /// Replaces the chat template with `source` (e.g. a `chat_template` file), rendered with
    /// this model's `bos_token` and `eos_token` — as the engine's own template sees them, so
    /// both sides produce the same token ids.
    pub fn set_chat_template_source(&mut self, source: &str) -> Result<(), TextError> {
        let (bos, eos) = &self.template_tokens;
        self.template = Some(ChatTemplate::new(source, bos, eos)?);
        Ok(())
    }

    /// The id of a token string, if it is in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<TokenId> {
        self.inner.token_to_id(token)
    }
}

impl Tokenizer for HfTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<TokenId>, TextError> {
        let enc = self.inner.encode(text, false).map_err(tok_err)?;
        let ids = enc.get_ids();
        match &self.bos {
            Some((id, s)) if !text.starts_with(s.as_str()) => {
                Ok(std::iter::once(*id).chain(ids.iter().copied()).collect())
            }
            _ => Ok(ids.to_vec()),
        }
    }

    fn decode(&self, tokens: &[TokenId]) -> Result<String, TextError> {
        self.inner.decode(tokens, true).map_err(tok_err)
    }

    fn token_str(&self, token: TokenId) -> String {
        self.inner
            .id_to_token(token)
            .unwrap_or_else(|| format!("<{token}>"))
    }

    fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TextError> {
        match &self.template {
            Some(t) => t.render(messages, add_generation_prompt),
            None => Err(TextError::Template(
                "the model has no chat template".to_owned(),
            )),
        }
    }

    fn eos_token_ids(&self) -> Vec<TokenId> {
        self.eos.clone()
    }

    fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny byte-level BPE vocabulary: the 256 byte symbols, two merges, and two control tokens.
    fn tiny_vocab() -> GgufVocab {
        let mut tokens = vec![
            "<|endoftext|>".to_owned(),
            "<|im_start|>".to_owned(),
            "<|im_end|>".to_owned(),
        ];
        let mut token_types = vec![3, 3, 3];
        // GPT-2's byte → printable-char map, as byte-level BPE vocabularies store it.
        let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32)
            .chain(0xA1..=0xAC)
            .chain(0xAE..=0xFF)
            .collect();
        let mut extra = 0;
        let mut map = [0u32; 256];
        for b in 0..256u32 {
            if printable.contains(&b) {
                map[b as usize] = b;
            } else {
                map[b as usize] = 256 + extra;
                extra += 1;
            }
        }
        printable.sort_unstable();
        for m in map {
            tokens.push(char::from_u32(m).expect("valid char").to_string());
            token_types.push(1);
        }
        tokens.push("he".to_owned());
        tokens.push("hel".to_owned());
        token_types.extend([1, 1]);
        GgufVocab {
            model: "gpt2".to_owned(),
            pre: Some("smollm".to_owned()),
            tokens,
            token_types,
            merges: vec!["h e".to_owned(), "he l".to_owned()],
            bos_token_id: Some(1),
            eos_token_id: Some(2),
            add_bos_token: false,
            chat_template: Some("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}".to_owned()),
        }
    }

    #[test]
    fn gguf_vocab_tokenizer_merges_and_round_trips() {
        let t = HfTokenizer::from_gguf_vocab(&tiny_vocab()).expect("builds");
        let ids = t.encode("hello 12").expect("encodes");
        let hel = t.token_to_id("hel").expect("merged token exists");
        assert_eq!(ids[0], hel, "BPE merges applied: {ids:?}");
        assert_eq!(t.decode(&ids).expect("decodes"), "hello 12");
        assert_eq!(t.eos_token_ids(), vec![2]);
    }

    #[test]
    fn special_tokens_in_rendered_chat_become_single_ids() {
        let t = HfTokenizer::from_gguf_vocab(&tiny_vocab()).expect("builds");
        let msgs = [ChatMessage {
            role: "user".to_owned(),
            content: "hi".to_owned(),
        }];
        let prompt = t.apply_chat_template(&msgs, true).expect("renders");
        let ids = t.encode(&prompt).expect("encodes");
        assert_eq!(ids[0], 1);
        assert_eq!(ids.iter().filter(|&&i| i == 1).count(), 2, "{ids:?}");
        assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 1, "{ids:?}");
        // Special tokens are skipped when decoding generated text.
        assert_eq!(t.decode(&ids).expect("decodes"), "user\nhi\nassistant\n");
    }

    #[test]
    fn unsupported_gguf_tokenizer_model_is_an_error() {
        let v = GgufVocab {
            model: "llama".to_owned(),
            ..tiny_vocab()
        };
        assert!(HfTokenizer::from_gguf_vocab(&v).is_err());
    }

    #[test]
    fn loads_tokenizer_json_with_config_beside_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let t = HfTokenizer::from_gguf_vocab(&tiny_vocab()).expect("builds");
        t.inner
            .save(dir.path().join("tokenizer.json"), false)
            .expect("saves");
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"eos_token": "<|im_end|>", "bos_token": {"content": "<|im_start|>"}, "chat_template": "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}"}"#,
        )
        .expect("writes");
        let t2 = HfTokenizer::from_file(&dir.path().join("tokenizer.json")).expect("loads");
        assert_eq!(t2.eos_token_ids(), vec![2]);
        let msgs = [ChatMessage {
            role: "user".to_owned(),
            content: "hello".to_owned(),
        }];
        assert_eq!(
            t2.apply_chat_template(&msgs, false).expect("renders"),
            "<|im_start|>hello<|im_end|>"
        );
        assert_eq!(
            t2.encode("hello").expect("encodes"),
            t.encode("hello").expect("encodes")
        );
        // A replacement template sees the same special tokens.
        let mut t3 = t2;
        t3.set_chat_template_source(
            "[{{ bos_token }}|{{ messages[0]['content'] }}|{{ eos_token }}]",
        )
        .expect("parses");
        assert_eq!(
            t3.apply_chat_template(&msgs, false).expect("renders"),
            "[<|im_start|>|hello|<|im_end|>]"
        );
    }
}
