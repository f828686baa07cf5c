//! Real-model tokenizers on top of the `tokenizers` crate: from a HF model directory or
//! `tokenizer.json` (with `tokenizer_config.json`, `chat_template.jinja`, ... beside it, found as
//! transformers finds them: `model_dir.rs`), or rebuilt from a GGUF file's vocabulary
//! (`tokenizer.ggml.*` metadata, GPT-2-style byte-level BPE).

use std::path::Path;

use kvmesh_core::TokenId;
use serde_json::{Value as Json, json};

use crate::model_dir::{
    self, CHAT_TEMPLATE_JINJA, CHAT_TEMPLATE_JSON, TOKENIZER_CONFIG, TokenizerFiles,
};
use crate::template::SpecialTokens;
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
    /// The model's special-token strings, as chat templates see them.
    special: SpecialTokens,
    /// What `apply_chat_template` says when there is no template: where it was looked for.
    no_template: String,
    /// [`Tokenizer::max_text_bytes_per_token`], from the vocabulary.
    max_text_bytes_per_token: usize,
}

/// A bound on the input bytes one token stands for: the longest vocabulary entry (added tokens
/// included) in UTF-8 bytes, which is at least the bytes it decodes to (byte-level BPE spends one
/// or two bytes of entry per byte of text; SentencePiece's `▁` three per space), times 4 because a
/// normalizer may shrink the input first (NFKC folds a 3-byte full-width letter into 1 byte).
fn text_bytes_bound(inner: &tokenizers::Tokenizer) -> usize {
    let longest = inner
        .get_vocab(true)
        .keys()
        .map(String::len)
        .max()
        .unwrap_or(1);
    longest.max(1) * 4
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

/// The inner message of a template error (its `Display` repeats the "chat template:" prefix).
fn template_msg(e: TextError) -> String {
    match e {
        TextError::Template(m) | TextError::Tokenizer(m) => m,
    }
}

/// `"<s>"` or `{"content": "<s>", ...}` (an `AddedToken`, with or without `"__type"`) as found in
/// `tokenizer_config.json`.
fn token_string(v: Option<&Json>) -> Option<String> {
    match v? {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content").and_then(Json::as_str).map(str::to_owned),
        _ => None,
    }
}

/// The chat template `tokenizer_config.json` declares: a string, or transformers' list of
/// `{name, template}`, of which the one named `"default"` is what `apply_chat_template` uses
/// without a name. `Err` explains why a declared template cannot be used (no `"default"`).
fn config_template(config: &Json) -> Result<Option<String>, String> {
    match config.get("chat_template") {
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Array(list)) => {
            let named = |t: &&Json| t.get("name").and_then(Json::as_str) == Some("default");
            match list.iter().find(named).and_then(|t| t.get("template")) {
                Some(Json::String(s)) => Ok(Some(s.clone())),
                _ => {
                    let names: Vec<&str> = list
                        .iter()
                        .filter_map(|t| t.get("name").and_then(Json::as_str))
                        .collect();
                    Err(format!(
                        "its chat_template list has no template named \"default\" (it has {names:?})"
                    ))
                }
            }
        }
        _ => Ok(None),
    }
}

impl HfTokenizer {
    /// Loads a tokenizer from a model directory or a `tokenizer.json` file, finding the files
    /// around it as transformers does ([`TokenizerFiles`]). The chat template is, first match:
    /// `chat_template` (a Jinja file given explicitly, like vLLM's `--chat-template`),
    /// `chat_template.jinja`, `tokenizer_config.json`'s `chat_template`, `chat_template.json`.
    /// Every template is rendered with the special tokens of `tokenizer_config.json` (or, without
    /// an `eos_token` there, the token of the first `generation_config.json` EOS id).
    ///
    /// This is the one loader the router (`tokenizer:`) and the engine (`--backend model`) use.
    pub fn load(path: &Path, chat_template: Option<&Path>) -> Result<Self, TextError> {
        let files = TokenizerFiles::discover(path)?;
        let inner = tokenizers::Tokenizer::from_file(&files.tokenizer_json).map_err(|e| {
            TextError::Tokenizer(format!("{}: {e}", files.tokenizer_json.display()))
        })?;
        let config = match &files.tokenizer_config {
            Some(p) => model_dir::read_json(p)?,
            None => Json::Null,
        };
        let bos_str = token_string(config.get("bos_token"));
        let eos_str = token_string(config.get("eos_token"));
        let mut eos: Vec<TokenId> = eos_str
            .as_deref()
            .and_then(|s| inner.token_to_id(s))
            .into_iter()
            .collect();
        if let Some(p) = &files.generation_config {
            match model_dir::read_json(p)?.get("eos_token_id") {
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
        // Without an `eos_token` string, the first EOS id's token (e.g. from generation_config).
        let eos_str = eos_str.or_else(|| eos.first().and_then(|&id| inner.id_to_token(id)));
        let special = SpecialTokens {
            bos: bos_str.clone().unwrap_or_default(),
            eos: eos_str.unwrap_or_default(),
            unk: token_string(config.get("unk_token")),
            pad: token_string(config.get("pad_token")),
        };

        let from_config = config_template(&config);
        let (template_src, origin) = if let Some(p) = chat_template {
            (Some(model_dir::read(p)?), p.to_path_buf())
        } else if let Some(p) = &files.chat_template_jinja {
            (Some(model_dir::read(p)?), p.clone())
        } else if let (Ok(Some(src)), Some(p)) = (&from_config, &files.tokenizer_config) {
            (Some(src.clone()), p.clone())
        } else if let Some(p) = &files.chat_template_json {
            let src = model_dir::read_json(p)?
                .get("chat_template")
                .and_then(Json::as_str)
                .map(str::to_owned);
            (src, p.clone())
        } else {
            (None, files.dir.clone())
        };
        let template = template_src
            .map(|src| {
                ChatTemplate::with_tokens(&src, special.clone()).map_err(|e| {
                    TextError::Template(format!("{}: {}", origin.display(), template_msg(e)))
                })
            })
            .transpose()?;
        let no_template = match from_config {
            Err(why) => format!(
                "the model has no usable chat template: {} {why}; give one with `chat_template: FILE`",
                files
                    .tokenizer_config
                    .as_deref()
                    .unwrap_or(&files.dir)
                    .display()
            ),
            Ok(_) => format!(
                "the model has no chat template (none in {CHAT_TEMPLATE_JINJA}, {TOKENIZER_CONFIG} \
                 or {CHAT_TEMPLATE_JSON} in {}); give one with `chat_template: FILE`",
                files.dir.display()
            ),
        };

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
            max_text_bytes_per_token: text_bytes_bound(&inner),
            inner,
            template,
            eos,
            bos,
            special,
            no_template,
        })
    }

    /// [`HfTokenizer::load`] without an explicit chat template.
    pub fn from_file(path: &Path) -> Result<Self, TextError> {
        Self::load(path, None)
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
        let special = SpecialTokens {
            bos: bos_str.clone().unwrap_or_default(),
            eos: eos_str.unwrap_or_default(),
            ..SpecialTokens::default()
        };
        let template = v
            .chat_template
            .as_deref()
            .map(|src| ChatTemplate::with_tokens(src, special.clone()))
            .transpose()?;
        let bos = match (v.add_bos_token, v.bos_token_id, bos_str) {
            (true, Some(id), Some(s)) => Some((id, s)),
            _ => None,
        };
        Ok(Self {
            max_text_bytes_per_token: text_bytes_bound(&inner),
            inner,
            template,
            eos: v.eos_token_id.into_iter().collect(),
            bos,
            special,
            no_template: "the GGUF file has no tokenizer.chat_template; give one with a chat \
                          template file"
                .to_owned(),
        })
    }

    /// Replaces the chat template with `source` (e.g. a `chat_template` file), rendered with
    /// this model's `bos_token` and `eos_token` — as the engine's own template sees them, so
    /// both sides produce the same token ids.
    pub fn set_chat_template_source(&mut self, source: &str) -> Result<(), TextError> {
        self.template = Some(ChatTemplate::with_tokens(source, self.special.clone())?);
        Ok(())
    }

    /// The id of a token string, if it is in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<TokenId> {
        self.inner.token_to_id(token)
    }
}

impl Tokenizer for HfTokenizer {
    fn max_text_bytes_per_token(&self) -> usize {
        self.max_text_bytes_per_token
    }

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
            None => Err(TextError::Template(self.no_template.clone())),
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
            role: "user".into(),
            content: "hi".into(),
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
            role: "user".into(),
            content: "hello".into(),
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

    /// Meta-Llama-3-8B-Instruct's chat template (it prints `bos_token` first).
    const LLAMA3: &str = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

    /// SmolLM2-135M-Instruct's chat template, as its `chat_template.jinja` would hold it.
    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    /// A model directory: the tiny vocabulary's `tokenizer.json` plus `files`.
    fn model_dir(files: &[(&str, String)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        let t = HfTokenizer::from_gguf_vocab(&tiny_vocab()).expect("builds");
        t.inner
            .save(dir.path().join("tokenizer.json"), false)
            .expect("saves");
        for (name, body) in files {
            std::fs::write(dir.path().join(name), body).expect("writes");
        }
        dir
    }

    fn user(content: &str) -> [ChatMessage<'_>; 1] {
        [ChatMessage {
            role: "user".into(),
            content: content.into(),
        }]
    }

    /// `tokenizer_config.json` with AddedToken-object special tokens and `template`.
    fn config_with(template: Json) -> String {
        json!({
            "add_bos_token": false,
            "bos_token": {"__type": "AddedToken", "content": "<|endoftext|>", "lstrip": false,
                          "normalized": false, "rstrip": false, "single_word": false},
            "eos_token": "<|im_end|>",
            "pad_token": "<|im_end|>",
            "chat_template": template,
        })
        .to_string()
    }

    #[test]
    fn a_model_directory_loads_with_the_template_in_tokenizer_config() {
        let dir = model_dir(&[("tokenizer_config.json", config_with(json!(LLAMA3)))]);
        let t = HfTokenizer::load(dir.path(), None).expect("loads a directory");
        assert_eq!(t.eos_token_ids(), vec![2]);
        assert_eq!(
            t.apply_chat_template(&user(" hi "), true).expect("renders"),
            "<|endoftext|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );
    }

    #[test]
    fn chat_template_jinja_beside_it_wins_over_tokenizer_config() {
        let dir = model_dir(&[
            ("tokenizer_config.json", config_with(json!(LLAMA3))),
            ("chat_template.jinja", SMOLLM2.to_owned()),
        ]);
        let want = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by \
                    Hugging Face<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
        let by_dir = HfTokenizer::load(dir.path(), None).expect("loads");
        assert_eq!(
            by_dir
                .apply_chat_template(&user("hi"), true)
                .expect("renders"),
            want
        );
        // Naming the tokenizer.json finds the same siblings.
        let by_file = HfTokenizer::load(&dir.path().join("tokenizer.json"), None).expect("loads");
        assert_eq!(
            by_file
                .apply_chat_template(&user("hi"), true)
                .expect("renders"),
            want
        );
        // The rendered special tokens are single ids.
        let ids = by_dir.encode(want).expect("encodes");
        assert_eq!(ids.iter().filter(|&&i| i == 1).count(), 3, "{ids:?}");

        // An explicit template file wins over both, and sees the config's special tokens.
        let explicit = dir.path().join("mine.jinja");
        std::fs::write(
            &explicit,
            "{{ bos_token }}|{{ messages[0].content }}|{{ eos_token }}|{{ pad_token }}\
             {% if unk_token is defined %}|unk{% endif %}",
        )
        .expect("writes");
        let t = HfTokenizer::load(dir.path(), Some(&explicit)).expect("loads");
        assert_eq!(
            t.apply_chat_template(&user("hi"), false).expect("renders"),
            "<|endoftext|>|hi|<|im_end|>|<|im_end|>"
        );
    }

    #[test]
    fn named_template_lists_use_default_as_transformers_does() {
        let list = json!([
            {"name": "tool_use", "template": "TOOLS {{ messages[0].content }}"},
            {"name": "default", "template": "DEFAULT {{ messages[0].content }}"},
        ]);
        let dir = model_dir(&[("tokenizer_config.json", config_with(list))]);
        let t = HfTokenizer::load(dir.path(), None).expect("loads");
        assert_eq!(
            t.apply_chat_template(&user("x"), false).expect("renders"),
            "DEFAULT x"
        );

        let no_default = json!([{"name": "tool_use", "template": "TOOLS"}]);
        let dir = model_dir(&[("tokenizer_config.json", config_with(no_default))]);
        let t = HfTokenizer::load(dir.path(), None).expect("loads: the template is per request");
        let msg = t
            .apply_chat_template(&user("x"), false)
            .expect_err("no default template")
            .to_string();
        assert!(
            msg.contains("\"default\"") && msg.contains("tool_use"),
            "{msg}"
        );
    }

    #[test]
    fn chat_template_json_is_the_last_resort_and_absence_is_explained() {
        let dir = model_dir(&[(
            "chat_template.json",
            json!({"chat_template": "P {{ messages[0].content }}"}).to_string(),
        )]);
        let t = HfTokenizer::load(dir.path(), None).expect("loads");
        assert_eq!(
            t.apply_chat_template(&user("x"), false).expect("renders"),
            "P x"
        );

        let dir = model_dir(&[]);
        let t = HfTokenizer::load(dir.path(), None).expect("a template is optional");
        let msg = t
            .apply_chat_template(&user("x"), false)
            .expect_err("none")
            .to_string();
        assert!(msg.contains("chat_template.jinja"), "{msg}");
        assert!(msg.contains(&dir.path().display().to_string()), "{msg}");
    }

    #[test]
    fn broken_files_are_named_in_the_error() {
        let dir = model_dir(&[("tokenizer_config.json", "{not json".to_owned())]);
        let msg = HfTokenizer::load(dir.path(), None)
            .expect_err("bad json")
            .to_string();
        assert!(msg.contains("tokenizer_config.json"), "{msg}");

        let dir = model_dir(&[("chat_template.jinja", "{% for %}".to_owned())]);
        let msg = HfTokenizer::load(dir.path(), None)
            .expect_err("bad template")
            .to_string();
        assert!(msg.contains("chat_template.jinja"), "{msg}");

        let dir = model_dir(&[]);
        let missing = dir.path().join("nope.jinja");
        let msg = HfTokenizer::load(dir.path(), Some(&missing))
            .expect_err("missing template file")
            .to_string();
        assert!(msg.contains("nope.jinja"), "{msg}");
    }
}
