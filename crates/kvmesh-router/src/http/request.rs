//! Parsing OpenAI request bodies just enough to schedule them: the prompt's token ids (computed
//! once per request, in-process), `stream`, `max_tokens`. Everything else in the body is kept as
//! is and forwarded. Malformed input is a [`ApiError::bad_request`], never a panic.
//!
//! Memory: the body is the only copy of what it carries. Fields are slices of it, messages
//! borrow their text from it, so a large chat body costs the body plus its rendered prompt
//! (issue 37: 4x the body while fields, messages and prompt each held their own copy).

use std::collections::BTreeMap;

use bytes::Bytes;
use kvmesh_core::chat::Messages;
use kvmesh_core::prompt::{self, Prompt, PromptError};
use kvmesh_core::{TokenId, lax};
use kvmesh_text::{ChatMessage, Tokenizer};
use serde::Deserialize;
use serde_json::Value;
use serde_json::value::RawValue;

use crate::error::ApiError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiKind {
    Completions,
    Chat,
}

impl ApiKind {
    pub fn path(self) -> &'static str {
        match self {
            ApiKind::Completions => "/v1/completions",
            ApiKind::Chat => "/v1/chat/completions",
        }
    }
}

/// One top-level field's JSON text: a slice of the request body (sharing its buffer, so a
/// 60 MiB `messages` is not held twice), or a value the router set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawField(Bytes);

impl RawField {
    /// The field `raw`, read from `body`, as a slice of it. A `raw` from anywhere else (never the
    /// case in this module) is copied rather than trusted.
    fn of_body(body: &Bytes, raw: &RawValue) -> Self {
        let text = raw.get().as_bytes();
        let start = (text.as_ptr() as usize).wrapping_sub(body.as_ptr() as usize);
        if start <= body.len() && text.len() <= body.len() - start {
            RawField(body.slice(start..start + text.len()))
        } else {
            RawField(Bytes::copy_from_slice(text))
        }
    }

    /// `value` as JSON.
    pub fn from_value(value: &impl serde::Serialize) -> Result<Self, serde_json::Error> {
        serde_json::to_vec(value).map(|v| RawField(Bytes::from(v)))
    }

    /// The JSON text.
    pub fn get(&self) -> &str {
        // Always UTF-8: the text of a `RawValue` or serde_json's output. Checking again costs
        // time only, and keeps the field a slice of the body (`Bytes` has no `str` twin here).
        std::str::from_utf8(&self.0).unwrap_or("null")
    }
}

impl serde::Serialize for RawField {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        // Written verbatim (re-validated, not re-encoded), as a `RawValue` is.
        let raw: &RawValue = serde_json::from_str(self.get()).map_err(serde::ser::Error::custom)?;
        raw.serialize(s)
    }
}

/// A request body as top-level fields kept *unparsed* (raw JSON text), plus what scheduling
/// needs. Only the fields the router reads are parsed, so a 240K-token prompt is not turned into
/// a tree of JSON values, and an unmodified body is forwarded byte for byte.
#[derive(Debug, Clone)]
pub struct ParsedRequest {
    /// The original body.
    pub raw: Bytes,
    /// Top-level fields (raw JSON values, slices of `raw` unless the router set them).
    pub fields: BTreeMap<String, RawField>,
    /// Whether `fields` was changed (then the body is re-encoded from `fields`).
    pub modified: bool,
    pub tokens: Vec<TokenId>,
    pub stream: bool,
    pub max_tokens: Option<u64>,
    /// `model`, when the body names one (a LoRA adapter's name puts the request in its key
    /// space).
    pub model: Option<String>,
    /// vLLM's `cache_salt` (a top-level string): the tenant whose blocks the request may use.
    pub cache_salt: Option<String>,
}

impl ParsedRequest {
    /// Replaces (or adds) a top-level field.
    pub fn set_field(
        &mut self,
        key: &str,
        value: &impl serde::Serialize,
    ) -> Result<(), serde_json::Error> {
        let raw = RawField::from_value(value)?;
        self.fields.insert(key.to_owned(), raw);
        self.modified = true;
        Ok(())
    }

    /// The request's key space: its LoRA adapter (when `model` names one of `config`'s) and its
    /// `cache_salt`.
    pub fn tenant(&self, config: &crate::config::RouterConfig) -> kvmesh_core::TenantKeys {
        config.tenant_keys(self.model.as_deref(), self.cache_salt.as_deref())
    }

    /// The chain keys of the prompt's full blocks in the request's key space.
    pub fn chain_keys(&self, config: &crate::config::RouterConfig) -> Vec<kvmesh_core::ChainKey> {
        kvmesh_core::chain::chain_keys_from(
            self.tenant(config).chain_root(),
            &self.tokens,
            config.block_size,
        )
    }

    /// A top-level field parsed as `T` (None if absent or not a `T`).
    pub fn field<T: serde::de::DeserializeOwned>(&self, key: &str) -> Option<T> {
        self.fields
            .get(key)
            .and_then(|r| serde_json::from_str(r.get()).ok())
    }

    /// The body to forward.
    pub fn body(&self) -> Result<Bytes, serde_json::Error> {
        if self.modified {
            serde_json::to_vec(&self.fields).map(Bytes::from)
        } else {
            Ok(self.raw.clone())
        }
    }
}

/// The most top-level fields a request body may have (vLLM's request models have far fewer): a
/// body of millions of keys would otherwise fill the field map (tens of bytes a key). One more
/// is a 400 as soon as its key is read.
pub const MAX_FIELDS: usize = 256;

/// The error text for one top-level field too many.
fn too_many_fields() -> String {
    format!("too many fields: at most {MAX_FIELDS} top-level fields per request")
}

/// A body's top-level fields, at most [`MAX_FIELDS`] of them, kept as raw JSON text borrowed
/// from the body.
struct Fields<'a>(FieldMap<'a>);

impl<'de: 'a, 'a> Deserialize<'de> for Fields<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(FieldsVisitor(std::marker::PhantomData))
    }
}

struct FieldsVisitor<'a>(std::marker::PhantomData<&'a ()>);

impl<'de: 'a, 'a> serde::de::Visitor<'de> for FieldsVisitor<'a> {
    type Value = Fields<'a>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Fields<'a>, A::Error> {
        let mut out = BTreeMap::new();
        while let Some(key) = map.next_key::<String>()? {
            // A repeated key replaces its value (the last one wins, as in vLLM's dict).
            if out.len() == MAX_FIELDS && !out.contains_key(&key) {
                return Err(serde::de::Error::custom(too_many_fields()));
            }
            let value: &'de RawValue = map.next_value()?;
            out.insert(key, value);
        }
        Ok(Fields(out))
    }
}

/// A request body's top-level fields (raw JSON values borrowed from it), at most [`MAX_FIELDS`]
/// of them.
pub fn read_fields(bytes: &[u8]) -> Result<FieldMap<'_>, ApiError> {
    match serde_json::from_slice::<Fields>(bytes) {
        Ok(f) => Ok(f.0),
        Err(e) if e.is_data() && e.to_string().starts_with(&too_many_fields()) => {
            Err(ApiError::bad_request(too_many_fields()))
        }
        Err(e) if e.is_data() => Err(ApiError::bad_request("request body must be a JSON object")),
        Err(e) => Err(ApiError::bad_request(format!("invalid JSON body: {e}"))),
    }
}

/// Parses and tokenizes a request body. Fields are read as vLLM's pydantic models read them in
/// lax mode (`"16"` or `16.0` for an integer, `"true"` or `1` for a boolean), so a body vLLM
/// accepts is never refused here; a 400 names the field in `param`.
pub fn parse(
    kind: ApiKind,
    bytes: Bytes,
    tokenizer: &dyn Tokenizer,
    max_prompt_tokens: usize,
) -> Result<ParsedRequest, ApiError> {
    let fields = read_fields(&bytes)?;
    if let Some(m) = fields.get("model")
        && !(m.get().starts_with('"') || m.get() == "null")
    {
        return Err(ApiError::bad_param(
            "model",
            "model: Input should be a valid string",
        ));
    }
    let stream = match scalar(&fields, "stream")? {
        None => false,
        Some(v) => lax::boolean(&v).ok_or_else(|| invalid("stream", "a valid boolean", &v))?,
    };
    let max_tokens = max_tokens(&fields)?;
    let model = opt_string(&fields, "model")?;
    let cache_salt = opt_string(&fields, "cache_salt")?;
    let tokens = match kind {
        ApiKind::Completions => {
            let prompt = fields
                .get("prompt")
                .ok_or_else(|| ApiError::bad_param("prompt", "'prompt' is required"))?;
            raw_prompt_tokens(prompt, tokenizer, max_prompt_tokens)?
        }
        ApiKind::Chat => chat_tokens(&fields, tokenizer, max_prompt_tokens)?,
    };
    let fields = fields
        .into_iter()
        .map(|(k, v)| (k, RawField::of_body(&bytes, v)))
        .collect();
    Ok(ParsedRequest {
        raw: bytes,
        fields,
        modified: false,
        tokens,
        stream,
        max_tokens,
        model,
        cache_salt,
    })
}

/// A top-level string field (absent or null = None); anything else is vLLM's 400.
pub fn opt_string(fields: &FieldMap<'_>, key: &'static str) -> Result<Option<String>, ApiError> {
    match fields.get(key) {
        None => Ok(None),
        Some(r) if r.get() == "null" => Ok(None),
        Some(r) => serde_json::from_str::<String>(r.get())
            .map(Some)
            .map_err(|_| {
                ApiError::bad_param(key, format!("{key}: Input should be a valid string"))
            }),
    }
}

/// A request's top-level fields, each a raw JSON value borrowed from the body.
pub type FieldMap<'a> = BTreeMap<String, &'a RawValue>;

/// A scalar field as a JSON value; `None` when absent or null (pydantic's `X | None`). A list or
/// an object is refused unparsed: as a `Value` tree a 64 MiB list would take ~30x that.
fn scalar(fields: &FieldMap<'_>, key: &'static str) -> Result<Option<Value>, ApiError> {
    match fields.get(key) {
        None => Ok(None),
        Some(r) if r.get().starts_with(['[', '{']) => Err(ApiError::bad_param(
            key,
            format!("{key}: Input should be a single value, got a list or an object"),
        )),
        Some(r) => serde_json::from_str::<Value>(r.get())
            .map(|v| Some(v).filter(|v| !v.is_null()))
            .map_err(|e| ApiError::bad_param(key, format!("{key}: {e}"))),
    }
}

/// The decode length the request asks for: the smaller of `max_tokens` and
/// `max_completion_tokens` when both are given.
fn max_tokens(fields: &FieldMap<'_>) -> Result<Option<u64>, ApiError> {
    let mut max_tokens = None;
    for key in ["max_tokens", "max_completion_tokens"] {
        let Some(v) = scalar(fields, key)? else {
            continue;
        };
        let n = lax::int(&v).ok_or_else(|| invalid(key, "a valid integer", &v))?;
        if n < 0 {
            // What the engine (and vLLM's sampling parameters) answer for it.
            return Err(ApiError::bad_param(
                key,
                format!("{key} must be at least 1, got {n}."),
            ));
        }
        let n = u64::try_from(n).unwrap_or(u64::MAX);
        max_tokens = Some(max_tokens.map_or(n, |m: u64| m.min(n)));
    }
    Ok(max_tokens)
}

/// A chat request's prompt tokens: its `messages` through the chat template.
fn chat_tokens(
    fields: &FieldMap<'_>,
    tokenizer: &dyn Tokenizer,
    max_prompt_tokens: usize,
) -> Result<Vec<TokenId>, ApiError> {
    // Read with the shared bounds (kvmesh_core::chat): never a JSON tree of the list.
    let messages = match fields.get("messages") {
        Some(r) if r.get() != "null" => raw_messages(r)?,
        _ => return Err(ApiError::bad_param("messages", "'messages' is required")),
    };
    let add_generation_prompt = match scalar(fields, "add_generation_prompt")? {
        None => true,
        Some(v) => lax::boolean(&v)
            .ok_or_else(|| invalid("add_generation_prompt", "a valid boolean", &v))?,
    };
    chat_messages_tokens(
        messages,
        add_generation_prompt,
        tokenizer,
        max_prompt_tokens,
    )
    .map_err(|e| e.with_param("messages"))
}

/// pydantic's wording for a value of the wrong type, naming the field.
fn invalid(key: &'static str, expected: &str, got: &Value) -> ApiError {
    ApiError::bad_param(key, format!("{key}: Input should be {expected}, got {got}"))
}

/// Token ids of a raw `prompt`, read with `kvmesh_core::prompt` (never a JSON tree of it): text,
/// token ids, or a batch of either (a larger batch is scheduled by its first prompt; the others
/// are skipped unread and forwarded).
pub fn raw_prompt_tokens(
    raw: &RawValue,
    tokenizer: &dyn Tokenizer,
    max_prompt_tokens: usize,
) -> Result<Vec<TokenId>, ApiError> {
    // The engine knows its `max_model_len` and refuses beyond it; `max_prompt_tokens` bounds what
    // the router itself holds for one request (ids take 4 bytes per token).
    match prompt::read_value(raw.get(), max_prompt_tokens) {
        Ok(p) => match p.first {
            Prompt::Text(t) => {
                encode(&t, tokenizer, max_prompt_tokens).map_err(|e| e.with_param("prompt"))
            }
            Prompt::Ids(ids) => Ok(ids),
        },
        Err(PromptError::Empty) => Err(ApiError::bad_param("prompt", "'prompt' must not be empty")),
        Err(PromptError::Missing) => Err(ApiError::bad_param("prompt", "'prompt' is required")),
        Err(PromptError::TooLong { tokens, max }) => {
            Err(ApiError::bad_param("prompt", prompt::too_long(max, tokens)))
        }
        Err(PromptError::Invalid(m) | PromptError::Malformed(m)) => {
            Err(ApiError::bad_param("prompt", format!("'prompt': {m}")))
        }
        Err(PromptError::NotObject) => Err(ApiError::bad_param("prompt", "'prompt': invalid")),
    }
}

/// A raw `messages` read with the shared bounds (`kvmesh_core::chat`): never a JSON tree.
fn raw_messages(raw: &RawValue) -> Result<Messages<'_>, ApiError> {
    serde_json::from_str::<Messages<'_>>(raw.get())
        .map_err(|e| ApiError::bad_param("messages", format!("messages: {e}")))
}

/// Token ids of a raw `messages` array rendered with the tokenizer's chat template.
pub fn raw_chat_tokens(
    raw: &RawValue,
    add_generation_prompt: bool,
    tokenizer: &dyn Tokenizer,
    max_prompt_tokens: usize,
) -> Result<Vec<TokenId>, ApiError> {
    chat_messages_tokens(
        raw_messages(raw)?,
        add_generation_prompt,
        tokenizer,
        max_prompt_tokens,
    )
    .map_err(|e| e.with_param("messages"))
}

fn chat_messages_tokens(
    messages: Messages<'_>,
    add_generation_prompt: bool,
    tokenizer: &dyn Tokenizer,
    max_prompt_tokens: usize,
) -> Result<Vec<TokenId>, ApiError> {
    if messages.0.is_empty() {
        return Err(ApiError::bad_request("'messages' must not be empty"));
    }
    let msgs: Vec<ChatMessage<'_>> = messages
        .0
        .into_iter()
        .map(|m| ChatMessage {
            role: m.role,
            content: m.content,
        })
        .collect();
    let text = tokenizer
        .apply_chat_template(&msgs, add_generation_prompt)
        .map_err(|e| ApiError::bad_request(format!("chat template: {e}")))?;
    // The messages' text is in `text` now: free what of it was not borrowed from the body (text
    // with escapes, joined parts) before the ids take their 4 bytes per token.
    drop(msgs);
    encode(&text, tokenizer, max_prompt_tokens)
}

/// `text`'s token ids, refused (as vLLM words it) past `max_prompt_tokens` — before encoding
/// when the text alone proves it has more tokens than that.
fn encode(
    text: &str,
    tokenizer: &dyn Tokenizer,
    max_prompt_tokens: usize,
) -> Result<Vec<TokenId>, ApiError> {
    let at_least = text.len() / tokenizer.max_text_bytes_per_token().max(1);
    if at_least > max_prompt_tokens {
        return Err(ApiError::bad_request(prompt::too_long(
            max_prompt_tokens,
            at_least,
        )));
    }
    // More than any real context: counted a piece at a time before a whole encode (kvmesh_text::count_past).
    if text.len() > kvmesh_text::COUNT_IN_PIECES_ABOVE
        && let Some(counted) = kvmesh_text::count_past(tokenizer, text, max_prompt_tokens)
            .map_err(|e| ApiError::bad_request(format!("tokenizer: {e}")))?
    {
        return Err(ApiError::bad_request(prompt::too_long(
            max_prompt_tokens,
            counted,
        )));
    }
    let tokens = tokenizer
        .encode(text)
        .map_err(|e| ApiError::bad_request(format!("tokenizer: {e}")))?;
    if tokens.len() > max_prompt_tokens {
        return Err(ApiError::bad_request(prompt::too_long(
            max_prompt_tokens,
            tokens.len(),
        )));
    }
    Ok(tokens)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_text::ByteTokenizer;

    const MAX: usize = 1 << 20;

    fn b(s: &'static str) -> Bytes {
        Bytes::from_static(s.as_bytes())
    }

    #[test]
    fn a_huge_text_is_refused_as_too_long_without_a_whole_encode() {
        let huge = "ab ".repeat(kvmesh_text::COUNT_IN_PIECES_ABOVE);
        let err = encode(&huge, &ByteTokenizer, kvmesh_text::COUNT_IN_PIECES_ABOVE)
            .expect_err("too long");
        assert!(
            err.message.contains("maximum context length"),
            "{}",
            err.message
        );
    }

    #[test]
    fn modified_fields_are_re_encoded_and_others_kept() {
        let mut r = parse(
            ApiKind::Completions,
            b(r#"{"prompt":[1,2,3],"x":{"y":1}}"#),
            &ByteTokenizer,
            MAX,
        )
        .expect("ok");
        r.set_field("kv_transfer_params", &serde_json::json!({"a": 1}))
            .expect("set");
        let v: Value = serde_json::from_slice(&r.body().expect("body")).expect("json");
        assert_eq!(
            v,
            serde_json::json!({"prompt": [1, 2, 3], "x": {"y": 1}, "kv_transfer_params": {"a": 1}})
        );
    }

    #[test]
    fn completions_text_and_token_ids() {
        let r = parse(
            ApiKind::Completions,
            b(r#"{"model":"m","prompt":"hi","max_tokens":5,"stream":true}"#),
            &ByteTokenizer,
            MAX,
        )
        .expect("ok");
        assert_eq!(r.tokens, vec![104, 105]);
        assert!(r.stream);
        assert_eq!(r.max_tokens, Some(5));
        let r = parse(
            ApiKind::Completions,
            b(r#"{"prompt":[[7,8,9]]}"#),
            &ByteTokenizer,
            MAX,
        )
        .expect("ok");
        assert_eq!(r.tokens, vec![7, 8, 9]);
        assert_eq!(
            r.field::<Value>("prompt"),
            Some(serde_json::json!([[7, 8, 9]]))
        );
        assert_eq!(
            r.body().expect("body"),
            Bytes::from_static(br#"{"prompt":[[7,8,9]]}"#),
            "unchanged body forwarded verbatim"
        );
    }

    #[test]
    fn chat_uses_the_template() {
        let r = parse(
            ApiKind::Chat,
            b(r#"{"messages":[{"role":"user","content":[{"type":"text","text":"x"}]}]}"#),
            &ByteTokenizer,
            MAX,
        )
        .expect("ok");
        let expected = ByteTokenizer
            .apply_chat_template(
                &[ChatMessage {
                    role: "user".into(),
                    content: "x".into(),
                }],
                true,
            )
            .expect("template");
        assert_eq!(r.tokens, ByteTokenizer.encode(&expected).expect("encode"));
    }

    /// What vLLM's pydantic models accept in lax mode is accepted here too (and forwarded as
    /// sent: the engine reads it the same way).
    #[test]
    fn lax_numbers_and_booleans_are_accepted_like_vllm() {
        for (max_tokens, want) in [
            (r#""16""#, 16),
            ("16.0", 16),
            (r#"" 1_6.00 ""#, 16),
            (r#""+16""#, 16),
            ("true", 1),
        ] {
            let body = format!(r#"{{"prompt":"hi","max_tokens":{max_tokens},"stream":"yes"}}"#);
            let r = parse(
                ApiKind::Completions,
                Bytes::from(body.clone()),
                &ByteTokenizer,
                MAX,
            )
            .unwrap_or_else(|e| panic!("{body}: {e:?}"));
            assert_eq!(r.max_tokens, Some(want), "{body}");
            assert!(r.stream);
            assert_eq!(
                r.body().expect("body"),
                Bytes::from(body),
                "forwarded as sent"
            );
        }
        for (stream, want) in [
            (r#""false""#, false),
            ("0", false),
            (r#""On""#, true),
            ("null", false),
        ] {
            let body = format!(r#"{{"prompt":"hi","stream":{stream}}}"#);
            let r =
                parse(ApiKind::Completions, Bytes::from(body), &ByteTokenizer, MAX).expect("ok");
            assert_eq!(r.stream, want, "{stream}");
        }
        let r = parse(
            ApiKind::Chat,
            b(r#"{"messages":[{"role":"user","content":"x"}],"add_generation_prompt":"false","max_completion_tokens":"3"}"#),
            &ByteTokenizer,
            MAX,
        )
        .expect("ok");
        assert_eq!(r.max_tokens, Some(3));
    }

    /// A 400 names the field it is about (`param`), as the engine's do.
    #[test]
    fn bad_fields_are_named_in_param() {
        for (body, param) in [
            (r#"{"prompt":"x","max_tokens":"abc"}"#, "max_tokens"),
            (r#"{"prompt":"x","max_tokens":16.5}"#, "max_tokens"),
            (r#"{"prompt":"x","max_tokens":-1}"#, "max_tokens"),
            (
                r#"{"prompt":"x","max_completion_tokens":[1]}"#,
                "max_completion_tokens",
            ),
            (r#"{"prompt":"x","stream":"maybe"}"#, "stream"),
            (r#"{"prompt":"x","stream":2}"#, "stream"),
            (r#"{"prompt":"x","model":3}"#, "model"),
            (r#"{"prompt":[]}"#, "prompt"),
            (r#"{"prompt":[1,-2]}"#, "prompt"),
            (r#"{"prompt":5}"#, "prompt"),
            (r#"{}"#, "prompt"),
        ] {
            let e = parse(ApiKind::Completions, Bytes::from(body), &ByteTokenizer, MAX)
                .expect_err(body);
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(e.param, Some(param), "{body}: {e:?}");
        }
        let e = parse(
            ApiKind::Completions,
            b(r#"{"prompt":"x","max_tokens":-1}"#),
            &ByteTokenizer,
            MAX,
        )
        .expect_err("negative");
        assert_eq!(e.message, "max_tokens must be at least 1, got -1.");
        for (body, param) in [
            (r#"{"messages":[]}"#, "messages"),
            (r#"{"messages":"x"}"#, "messages"),
            (r#"{"messages":[{"content":"x"}]}"#, "messages"),
            (r#"{}"#, "messages"),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"add_generation_prompt":"nope"}"#,
                "add_generation_prompt",
            ),
        ] {
            let e = parse(ApiKind::Chat, Bytes::from(body), &ByteTokenizer, MAX).expect_err(body);
            assert_eq!(e.param, Some(param), "{body}: {e:?}");
        }
        // Not about one field: no param.
        let e = parse(ApiKind::Completions, b("not json"), &ByteTokenizer, MAX).expect_err("json");
        assert_eq!(e.param, None);
    }

    /// The message and content-part bounds: exactly at the bound passes, one over is a 400
    /// naming `messages` and the bound (issue 15: 1.9M messages took the router to 1.4 GiB).
    #[test]
    fn message_and_part_counts_are_bounded() {
        use kvmesh_core::chat::{MAX_CONTENT_PARTS, MAX_MESSAGES};
        let chat = |messages: String| {
            parse(
                ApiKind::Chat,
                Bytes::from(format!(r#"{{"model":"m","messages":[{messages}]}}"#)),
                &ByteTokenizer,
                // 65,536 empty messages render to ~1.6 M template tokens: not the bound tested.
                usize::MAX,
            )
        };
        let empty = |n: usize| vec![r#"{"role":"user","content":""}"#; n].join(",");
        assert!(chat(empty(MAX_MESSAGES)).is_ok());
        for n in [MAX_MESSAGES + 1, 1_000_000] {
            let e = chat(empty(n)).expect_err("over the bound");
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
            assert_eq!(e.param, Some("messages"));
            assert!(
                e.message.contains("at most 65536 messages"),
                "{}",
                e.message
            );
        }
        let parts = |n: usize| {
            format!(
                r#"{{"role":"user","content":[{}]}}"#,
                vec![r#"{"type":"text","text":"a"}"#; n].join(",")
            )
        };
        let r = chat(parts(MAX_CONTENT_PARTS)).expect("at the bound");
        assert!(r.tokens.len() >= 2 * MAX_CONTENT_PARTS - 1);
        let e = chat(parts(MAX_CONTENT_PARTS + 1)).expect_err("one part over");
        assert_eq!(e.param, Some("messages"));
        assert!(
            e.message.contains("at most 65536 content parts"),
            "{}",
            e.message
        );
    }

    /// At most `MAX_FIELDS` (256) top-level fields: exactly the bound parses, one more is a 400
    /// naming the bound (issue 15: millions of keys filled the field map). A repeated key does
    /// not count twice.
    #[test]
    fn top_level_fields_are_bounded() {
        let body = |n: usize, extra: &str| {
            let keys: Vec<String> = (1..n).map(|i| format!(r#""k{i}":0"#)).collect();
            Bytes::from(format!(r#"{{"prompt":[1],{}{extra}}}"#, keys.join(",")))
        };
        let r = parse(
            ApiKind::Completions,
            body(MAX_FIELDS, ""),
            &ByteTokenizer,
            MAX,
        )
        .expect("at");
        assert_eq!(r.fields.len(), MAX_FIELDS);
        let r = parse(
            ApiKind::Completions,
            body(MAX_FIELDS, r#","k1":1"#),
            &ByteTokenizer,
            MAX,
        );
        assert_eq!(r.expect("repeat").fields.len(), MAX_FIELDS);
        for n in [MAX_FIELDS + 1, 1_000_000] {
            let e =
                parse(ApiKind::Completions, body(n, ""), &ByteTokenizer, MAX).expect_err("over");
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
            assert!(
                e.message.contains("at most 256 top-level fields"),
                "{}",
                e.message
            );
        }
    }

    /// `prompt` in all of vLLM's forms, read without a JSON tree; a batch is scheduled by its
    /// first prompt and forwarded whole.
    #[test]
    fn prompt_forms_and_batches() {
        for (body, want) in [
            (r#"{"prompt":["hi",[1]]}"#, vec![104, 105]),
            (r#"{"prompt":[[5,6],"x"]}"#, vec![5, 6]),
            (r#"{"prompt":[9]}"#, vec![9]),
        ] {
            let r =
                parse(ApiKind::Completions, Bytes::from(body), &ByteTokenizer, MAX).expect(body);
            assert_eq!(r.tokens, want, "{body}");
            assert_eq!(r.body().expect("body"), Bytes::from(body));
        }
        for body in [
            r#"{"prompt":[[]]}"#,
            r#"{"prompt":null}"#,
            r#"{"prompt":[1.5]}"#,
        ] {
            let e = parse(ApiKind::Completions, Bytes::from(body), &ByteTokenizer, MAX)
                .expect_err(body);
            assert_eq!(e.param, Some("prompt"), "{body}");
        }
    }

    /// A list where one value belongs is refused without building a JSON tree of it.
    #[test]
    fn lists_in_scalar_fields_are_refused_unparsed() {
        let big = vec!["0"; 100_000].join(",");
        for key in ["stream", "max_tokens", "max_completion_tokens"] {
            let body = format!(r#"{{"prompt":"x","{key}":[{big}]}}"#);
            let e =
                parse(ApiKind::Completions, Bytes::from(body), &ByteTokenizer, MAX).expect_err(key);
            assert_eq!(e.param, Some(key));
        }
    }

    #[test]
    fn lax_int_matches_pydantic_on_strings() {
        for (s, want) in [
            ("16", Some(16)),
            ("016", Some(16)),
            ("-0", Some(0)),
            ("1_6", Some(16)),
            ("16.00", Some(16)),
            ("1__6", None),
            ("_16", None),
            ("16_", None),
            ("16.5", None),
            ("1e1", None),
            ("0x10", None),
            ("", None),
            ("-", None),
        ] {
            assert_eq!(lax::int(&Value::String(s.to_owned())), want, "{s:?}");
        }
    }

    #[test]
    fn malformed_bodies_are_bad_requests() {
        for body in [
            &b"not json"[..],
            br#"[1,2]"#,
            br#"{}"#,
            br#"{"prompt": 5}"#,
            br#"{"prompt": []}"#,
            br#"{"prompt": [1, -2]}"#,
            br#"{"prompt": "x", "max_tokens": -1}"#,
            br#"{"prompt": "x", "stream": "maybe"}"#,
            br#"{"prompt": "x", "model": 3}"#,
        ] {
            let e = parse(
                ApiKind::Completions,
                Bytes::from_static(body),
                &ByteTokenizer,
                MAX,
            )
            .expect_err("must fail");
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
        }
        for body in [
            &br#"{"messages": []}"#[..],
            br#"{"messages": [{"content": "x"}]}"#,
            br#"{"messages": "x"}"#,
        ] {
            assert!(parse(ApiKind::Chat, Bytes::from_static(body), &ByteTokenizer, MAX).is_err());
        }
    }

    /// A tokenizer that must not be asked to encode: the prompt's length alone refuses it.
    struct RefusesToEncode;

    impl Tokenizer for RefusesToEncode {
        fn encode(&self, _: &str) -> Result<Vec<TokenId>, kvmesh_text::TextError> {
            panic!("an over-long prompt was encoded")
        }
        fn decode(&self, t: &[TokenId]) -> Result<String, kvmesh_text::TextError> {
            ByteTokenizer.decode(t)
        }
        fn token_str(&self, t: TokenId) -> String {
            ByteTokenizer.token_str(t)
        }
        fn apply_chat_template(
            &self,
            m: &[kvmesh_text::ChatMessage],
            g: bool,
        ) -> Result<String, kvmesh_text::TextError> {
            ByteTokenizer.apply_chat_template(m, g)
        }
        fn eos_token_ids(&self) -> Vec<TokenId> {
            ByteTokenizer.eos_token_ids()
        }
        fn vocab_size(&self) -> usize {
            ByteTokenizer.vocab_size()
        }
        fn max_text_bytes_per_token(&self) -> usize {
            2
        }
    }

    #[test]
    fn prompts_past_max_prompt_tokens_get_vllms_context_length_answer() {
        let long = "a".repeat(1_000);
        // Text: refused before encoding when bytes / max-bytes-per-token already exceed the cap.
        let chat = Bytes::from(format!(
            r#"{{"messages":[{{"role":"user","content":"{long}"}}]}}"#
        ));
        let e = parse(ApiKind::Chat, chat, &RefusesToEncode, 400).expect_err("too long");
        assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
        assert_eq!(e.param, Some("messages"));
        assert!(
            e.message.contains("maximum context length is 400 tokens"),
            "{e:?}"
        );
        let body = Bytes::from(format!(r#"{{"prompt":"{long}"}}"#));
        let e = parse(ApiKind::Completions, body, &RefusesToEncode, 400).expect_err("too long");
        assert_eq!(e.param, Some("prompt"));
        // Past the cap only once encoded: the exact count is checked too.
        let body = Bytes::from(format!(r#"{{"prompt":"{long}"}}"#));
        let e = parse(ApiKind::Completions, body, &ByteTokenizer, 999).expect_err("1000 > 999");
        assert!(
            e.message.contains("your request has 1000 input tokens"),
            "{e:?}"
        );
        let body = Bytes::from(format!(r#"{{"prompt":"{long}"}}"#));
        let r = parse(ApiKind::Completions, body, &ByteTokenizer, 1_000).expect("at the cap");
        assert_eq!(r.tokens.len(), 1_000);
        // Token ids: the list stops being read past the cap.
        let ids: Vec<String> = (0..50).map(|i| i.to_string()).collect();
        let body = Bytes::from(format!(r#"{{"prompt":[{}]}}"#, ids.join(",")));
        let e = parse(ApiKind::Completions, body, &ByteTokenizer, 49).expect_err("50 ids");
        assert_eq!(e.param, Some("prompt"));
    }
}
