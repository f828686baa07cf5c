//! Parsing OpenAI request bodies just enough to schedule them: the prompt's token ids (computed
//! once per request, in-process), `stream`, `max_tokens`. Everything else in the body is kept as
//! is and forwarded. Malformed input is a [`ApiError::bad_request`], never a panic.

use std::collections::BTreeMap;

use bytes::Bytes;
use kvmesh_core::TokenId;
use kvmesh_text::{ChatMessage, Tokenizer};
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

/// A request body as top-level fields kept *unparsed* (raw JSON text), plus what scheduling
/// needs. Only the fields the router reads are parsed, so a 240K-token prompt is not turned into
/// a tree of JSON values, and an unmodified body is forwarded byte for byte.
#[derive(Debug, Clone)]
pub struct ParsedRequest {
    /// The original body.
    pub raw: Bytes,
    /// Top-level fields (raw JSON values).
    pub fields: BTreeMap<String, Box<RawValue>>,
    /// Whether `fields` was changed (then the body is re-encoded from `fields`).
    pub modified: bool,
    pub tokens: Vec<TokenId>,
    pub stream: bool,
    pub max_tokens: Option<u64>,
}

impl ParsedRequest {
    /// Replaces (or adds) a top-level field.
    pub fn set_field(
        &mut self,
        key: &str,
        value: &impl serde::Serialize,
    ) -> Result<(), serde_json::Error> {
        let raw = serde_json::value::to_raw_value(value)?;
        self.fields.insert(key.to_owned(), raw);
        self.modified = true;
        Ok(())
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

/// Parses and tokenizes a request body.
pub fn parse(
    kind: ApiKind,
    bytes: Bytes,
    tokenizer: &dyn Tokenizer,
) -> Result<ParsedRequest, ApiError> {
    let fields: BTreeMap<String, Box<RawValue>> = match serde_json::from_slice(&bytes) {
        Ok(f) => f,
        Err(e) if e.is_data() => {
            return Err(ApiError::bad_request("request body must be a JSON object"));
        }
        Err(e) => return Err(ApiError::bad_request(format!("invalid JSON body: {e}"))),
    };
    let typed = |key: &str| -> Option<Result<Value, ApiError>> {
        fields.get(key).map(|r| {
            serde_json::from_str::<Value>(r.get())
                .map_err(|e| ApiError::bad_request(format!("'{key}': {e}")))
        })
    };
    if let Some(m) = fields.get("model")
        && !(m.get().starts_with('"') || m.get() == "null")
    {
        return Err(ApiError::bad_request("'model' must be a string"));
    }
    let stream = match fields
        .get("stream")
        .map(|r| serde_json::from_str::<Option<bool>>(r.get()))
    {
        None => false,
        Some(Ok(b)) => b.unwrap_or(false),
        Some(Err(_)) => return Err(ApiError::bad_request("'stream' must be a boolean")),
    };
    let mut max_tokens = None;
    for key in ["max_tokens", "max_completion_tokens"] {
        match fields
            .get(key)
            .map(|r| serde_json::from_str::<Option<u64>>(r.get()))
        {
            None | Some(Ok(None)) => {}
            Some(Ok(Some(n))) => max_tokens = Some(max_tokens.map_or(n, |m: u64| m.min(n))),
            Some(Err(_)) => {
                return Err(ApiError::bad_request(format!(
                    "'{key}' must be a non-negative integer"
                )));
            }
        }
    }
    let tokens = match kind {
        ApiKind::Completions => {
            let prompt = fields
                .get("prompt")
                .ok_or_else(|| ApiError::bad_request("'prompt' is required"))?;
            raw_prompt_tokens(prompt, tokenizer)?
        }
        ApiKind::Chat => {
            let messages = typed("messages")
                .ok_or_else(|| ApiError::bad_request("'messages' is required"))??;
            let add_generation_prompt = typed("add_generation_prompt")
                .and_then(Result::ok)
                .and_then(|v| v.as_bool())
                .unwrap_or(true);
            chat_tokens(&messages, add_generation_prompt, tokenizer)?
        }
    };
    Ok(ParsedRequest {
        raw: bytes,
        fields,
        modified: false,
        tokens,
        stream,
        max_tokens,
    })
}

/// Token ids of a raw `prompt`: a token-id list is parsed straight into integers; anything else
/// goes through [`prompt_tokens`].
fn raw_prompt_tokens(raw: &RawValue, tokenizer: &dyn Tokenizer) -> Result<Vec<TokenId>, ApiError> {
    if let Ok(ids) = serde_json::from_str::<Vec<TokenId>>(raw.get()) {
        if ids.is_empty() {
            return Err(ApiError::bad_request("'prompt' must not be empty"));
        }
        return Ok(ids);
    }
    let value: Value = serde_json::from_str(raw.get())
        .map_err(|e| ApiError::bad_request(format!("'prompt': {e}")))?;
    prompt_tokens(&value, tokenizer)
}

/// Token ids of a completions `prompt`: text, token ids, or a one-element batch of either (a
/// larger batch is scheduled by its first prompt).
pub fn prompt_tokens(prompt: &Value, tokenizer: &dyn Tokenizer) -> Result<Vec<TokenId>, ApiError> {
    match prompt {
        Value::String(s) => encode(s, tokenizer),
        Value::Array(items) if items.is_empty() => {
            Err(ApiError::bad_request("'prompt' must not be empty"))
        }
        Value::Array(items) if items[0].is_number() => token_ids(items),
        Value::Array(items) => match &items[0] {
            Value::String(s) => encode(s, tokenizer),
            Value::Array(ids) if !ids.is_empty() => token_ids(ids),
            _ => Err(ApiError::bad_request(
                "'prompt' must be a string, a list of token ids, or a list of those",
            )),
        },
        _ => Err(ApiError::bad_request(
            "'prompt' must be a string or a list of token ids",
        )),
    }
}

/// Token ids of a `messages` array rendered with the tokenizer's chat template.
pub fn chat_tokens(
    messages: &Value,
    add_generation_prompt: bool,
    tokenizer: &dyn Tokenizer,
) -> Result<Vec<TokenId>, ApiError> {
    let Value::Array(items) = messages else {
        return Err(ApiError::bad_request("'messages' must be a list"));
    };
    if items.is_empty() {
        return Err(ApiError::bad_request("'messages' must not be empty"));
    }
    let mut msgs = Vec::with_capacity(items.len());
    for (i, m) in items.iter().enumerate() {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::bad_request(format!("messages[{i}].role must be a string")))?;
        let content = match m.get("content") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for p in parts {
                    match p.get("text").and_then(Value::as_str) {
                        Some(t)
                            if p.get("type").and_then(Value::as_str).unwrap_or("text")
                                == "text" =>
                        {
                            text.push_str(t)
                        }
                        _ => {
                            return Err(ApiError::bad_request(format!(
                                "messages[{i}].content: only text parts are supported"
                            )));
                        }
                    }
                }
                text
            }
            Some(_) => {
                return Err(ApiError::bad_request(format!(
                    "messages[{i}].content must be a string or a list of parts"
                )));
            }
        };
        msgs.push(ChatMessage {
            role: role.to_owned(),
            content,
        });
    }
    let text = tokenizer
        .apply_chat_template(&msgs, add_generation_prompt)
        .map_err(|e| ApiError::bad_request(format!("chat template: {e}")))?;
    encode(&text, tokenizer)
}

fn encode(text: &str, tokenizer: &dyn Tokenizer) -> Result<Vec<TokenId>, ApiError> {
    tokenizer
        .encode(text)
        .map_err(|e| ApiError::bad_request(format!("tokenizer: {e}")))
}

fn token_ids(items: &[Value]) -> Result<Vec<TokenId>, ApiError> {
    items
        .iter()
        .map(|v| v.as_u64().and_then(|n| TokenId::try_from(n).ok()))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| ApiError::bad_request("token ids must be non-negative 32-bit integers"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_text::ByteTokenizer;

    fn b(s: &'static str) -> Bytes {
        Bytes::from_static(s.as_bytes())
    }

    #[test]
    fn modified_fields_are_re_encoded_and_others_kept() {
        let mut r = parse(
            ApiKind::Completions,
            b(r#"{"prompt":[1,2,3],"x":{"y":1}}"#),
            &ByteTokenizer,
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
        )
        .expect("ok");
        assert_eq!(r.tokens, vec![104, 105]);
        assert!(r.stream);
        assert_eq!(r.max_tokens, Some(5));
        let r = parse(
            ApiKind::Completions,
            b(r#"{"prompt":[[7,8,9]]}"#),
            &ByteTokenizer,
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
            br#"{"prompt": "x", "stream": "yes"}"#,
            br#"{"prompt": "x", "model": 3}"#,
        ] {
            let e = parse(
                ApiKind::Completions,
                Bytes::from_static(body),
                &ByteTokenizer,
            )
            .expect_err("must fail");
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
        }
        for body in [
            &br#"{"messages": []}"#[..],
            br#"{"messages": [{"content": "x"}]}"#,
            br#"{"messages": "x"}"#,
        ] {
            assert!(parse(ApiKind::Chat, Bytes::from_static(body), &ByteTokenizer).is_err());
        }
    }
}
