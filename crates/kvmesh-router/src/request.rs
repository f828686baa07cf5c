//! Parsing OpenAI request bodies just enough to schedule them: the prompt's token ids (computed
//! once per request, in-process), `stream`, `max_tokens`. Everything else in the body is kept as
//! is and forwarded. Malformed input is a [`ApiError::bad_request`], never a panic.

use kvmesh_core::TokenId;
use kvmesh_text::{ChatMessage, Tokenizer};
use serde_json::{Map, Value};

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

#[derive(Debug, Clone)]
pub struct ParsedRequest {
    pub body: Map<String, Value>,
    pub tokens: Vec<TokenId>,
    pub stream: bool,
    pub max_tokens: Option<u64>,
}

/// Parses and tokenizes a request body.
pub fn parse(
    kind: ApiKind,
    bytes: &[u8],
    tokenizer: &dyn Tokenizer,
) -> Result<ParsedRequest, ApiError> {
    let value: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))?;
    let Value::Object(body) = value else {
        return Err(ApiError::bad_request("request body must be a JSON object"));
    };
    if let Some(m) = body.get("model")
        && !m.is_string()
        && !m.is_null()
    {
        return Err(ApiError::bad_request("'model' must be a string"));
    }
    let stream = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::bad_request("'stream' must be a boolean")),
    };
    let mut max_tokens = None;
    for key in ["max_tokens", "max_completion_tokens"] {
        match body.get(key) {
            None | Some(Value::Null) => {}
            Some(v) => {
                let n = v.as_u64().ok_or_else(|| {
                    ApiError::bad_request(format!("'{key}' must be a non-negative integer"))
                })?;
                max_tokens = Some(max_tokens.map_or(n, |m: u64| m.min(n)));
            }
        }
    }
    let tokens = match kind {
        ApiKind::Completions => {
            let prompt = body
                .get("prompt")
                .ok_or_else(|| ApiError::bad_request("'prompt' is required"))?;
            prompt_tokens(prompt, tokenizer)?
        }
        ApiKind::Chat => {
            let messages = body
                .get("messages")
                .ok_or_else(|| ApiError::bad_request("'messages' is required"))?;
            let add_generation_prompt = body
                .get("add_generation_prompt")
                .and_then(Value::as_bool)
                .unwrap_or(true);
            chat_tokens(messages, add_generation_prompt, tokenizer)?
        }
    };
    Ok(ParsedRequest {
        body,
        tokens,
        stream,
        max_tokens,
    })
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

    #[test]
    fn completions_text_and_token_ids() {
        let r = parse(
            ApiKind::Completions,
            br#"{"model":"m","prompt":"hi","max_tokens":5,"stream":true}"#,
            &ByteTokenizer,
        )
        .expect("ok");
        assert_eq!(r.tokens, vec![104, 105]);
        assert!(r.stream);
        assert_eq!(r.max_tokens, Some(5));
        let r = parse(
            ApiKind::Completions,
            br#"{"prompt":[[7,8,9]]}"#,
            &ByteTokenizer,
        )
        .expect("ok");
        assert_eq!(r.tokens, vec![7, 8, 9]);
        assert_eq!(r.body.get("prompt"), Some(&serde_json::json!([[7, 8, 9]])));
    }

    #[test]
    fn chat_uses_the_template() {
        let r = parse(
            ApiKind::Chat,
            br#"{"messages":[{"role":"user","content":[{"type":"text","text":"x"}]}]}"#,
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
            let e = parse(ApiKind::Completions, body, &ByteTokenizer).expect_err("must fail");
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
        }
        for body in [
            &br#"{"messages": []}"#[..],
            br#"{"messages": [{"content": "x"}]}"#,
            br#"{"messages": "x"}"#,
        ] {
            assert!(parse(ApiKind::Chat, body, &ByteTokenizer).is_err());
        }
    }
}
