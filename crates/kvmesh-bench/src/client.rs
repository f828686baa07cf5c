//! One streaming `/v1/completions` request, timed at the first SSE chunk. The prompt goes out as
//! text (default: what cache-aware peer routers match on, and the only form smg accepts) or as
//! token ids.

use std::time::{Duration, Instant};

use futures::StreamExt;
use kvmesh_core::sse::SseDataReader;
use kvmesh_core::{KvTransferParams, TokenId};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// How a request ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "status", content = "detail")]
pub enum Outcome {
    Ok,
    /// HTTP status or transport error, or an error event in the stream.
    Error(String),
    /// The client gave up (workload timeout).
    Timeout,
}

/// What the client saw for one request. Times are wall seconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Completion {
    pub outcome: Outcome,
    pub ttft_s: Option<f64>,
    pub e2e_s: f64,
    pub output_tokens: usize,
    /// `usage.prompt_tokens_details.cached_tokens` when the server reports it.
    pub cached_tokens: Option<u64>,
    /// Generated token ids when the server returns them (`return_token_ids`).
    #[serde(skip)]
    pub token_ids: Option<Vec<TokenId>>,
    /// Generated text (concatenated chunks).
    #[serde(skip)]
    pub text: String,
}

/// How the prompt travels in the request body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PromptFormat {
    /// A JSON string: the prompt's token ids as bytes. The `sim` engines (and `kvmesh router`'s
    /// `tokenizer: byte`) map byte `b` to token `b`, so the text tokenizes back to exactly the
    /// same ids; a prompt with an id that is not ASCII is sent as ids instead.
    #[default]
    Text,
    /// A JSON list of token ids.
    Tokens,
}

impl std::str::FromStr for PromptFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "text" => Ok(Self::Text),
            "tokens" => Ok(Self::Tokens),
            other => Err(format!("prompt format {other:?} (text|tokens)")),
        }
    }
}

impl std::fmt::Display for PromptFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Text => "text",
            Self::Tokens => "tokens",
        })
    }
}

/// The prompt as the text a byte tokenizer turns back into exactly `ids`, when every id is an
/// ASCII byte (a longer id, or a byte ≥ 128 alone, has no such text).
pub fn prompt_text(ids: &[TokenId]) -> Option<String> {
    ids.iter()
        .map(|&t| u8::try_from(t).ok().filter(u8::is_ascii).map(char::from))
        .collect()
}

/// The request body's `prompt` value for `format`.
fn prompt_value(ids: &[TokenId], format: PromptFormat) -> Value {
    match format {
        PromptFormat::Text => match prompt_text(ids) {
            Some(t) => Value::String(t),
            None => json!(ids),
        },
        PromptFormat::Tokens => json!(ids),
    }
}

/// Parameters of one request.
#[derive(Debug, Clone)]
pub struct CompletionRequest<'a> {
    pub base_url: &'a str,
    pub model: &'a str,
    pub prompt: &'a [TokenId],
    /// Text or token ids on the wire (the same tokens either way).
    pub prompt_format: PromptFormat,
    pub max_tokens: u32,
    pub kv_transfer_params: Option<KvTransferParams>,
    /// Sent as `X-Session-ID` (multi-turn conversations).
    pub session_id: Option<String>,
    /// Sent as `x-request-id`, so the router's decision record can be joined with this request.
    pub request_id: Option<String>,
    /// Ask for the generated token ids (to build the next turn's history exactly).
    pub want_token_ids: bool,
    pub timeout: Duration,
}

/// Sends one streaming completion; never panics on server input.
pub async fn complete(http: &reqwest::Client, req: CompletionRequest<'_>) -> Completion {
    let start = Instant::now();
    let fut = complete_inner(http, &req, start);
    match tokio::time::timeout(req.timeout, fut).await {
        Ok(c) => c,
        Err(_) => Completion {
            outcome: Outcome::Timeout,
            ttft_s: None,
            e2e_s: start.elapsed().as_secs_f64(),
            output_tokens: 0,
            cached_tokens: None,
            token_ids: None,
            text: String::new(),
        },
    }
}

async fn complete_inner(
    http: &reqwest::Client,
    req: &CompletionRequest<'_>,
    start: Instant,
) -> Completion {
    let mut body = json!({
        "model": req.model,
        "prompt": prompt_value(req.prompt, req.prompt_format),
        "max_tokens": req.max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
        "ignore_eos": true,
        "temperature": 0.0,
    });
    if req.want_token_ids {
        body["return_token_ids"] = Value::Bool(true);
    }
    if let Some(p) = &req.kv_transfer_params {
        body["kv_transfer_params"] = serde_json::to_value(p).unwrap_or(Value::Null);
    }
    let url = format!("{}/v1/completions", req.base_url.trim_end_matches('/'));
    let mut rb = http.post(url).json(&body);
    if let Some(s) = &req.session_id {
        rb = rb.header("X-Session-ID", s);
    }
    if let Some(id) = &req.request_id {
        rb = rb.header("x-request-id", id);
    }
    let mut out = Completion {
        outcome: Outcome::Ok,
        ttft_s: None,
        e2e_s: 0.0,
        output_tokens: 0,
        cached_tokens: None,
        token_ids: None,
        text: String::new(),
    };
    let resp = match rb.send().await {
        Ok(r) => r,
        Err(e) => {
            out.outcome = Outcome::Error(format!("send: {e}"));
            out.e2e_s = start.elapsed().as_secs_f64();
            return out;
        }
    };
    let status = resp.status();
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        out.outcome = Outcome::Error(format!(
            "HTTP {}: {}",
            status.as_u16(),
            truncate(&text, 300)
        ));
        out.e2e_s = start.elapsed().as_secs_f64();
        return out;
    }
    let mut stream = resp.bytes_stream();
    let mut sse = SseDataReader::new();
    let mut done = false;
    let mut chunks = 0usize;
    let mut ids: Vec<TokenId> = Vec::new();
    let mut got_ids = false;
    while let Some(item) = stream.next().await {
        let bytes = match item {
            Ok(b) => b,
            Err(e) => {
                out.outcome = Outcome::Error(format!("stream: {e}"));
                break;
            }
        };
        sse.push(&bytes);
        while let Some(data) = sse.next_data() {
            let data = String::from_utf8_lossy(&data);
            let data = data.trim();
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let Ok(v) = serde_json::from_str::<Value>(data) else {
                out.outcome = Outcome::Error(format!("bad SSE data: {}", truncate(data, 200)));
                continue;
            };
            if let Some(err) = v.get("error") {
                out.outcome =
                    Outcome::Error(format!("stream error: {}", truncate(&err.to_string(), 300)));
                continue;
            }
            if let Some(choices) = v.get("choices").and_then(Value::as_array)
                && !choices.is_empty()
            {
                if out.ttft_s.is_none() {
                    out.ttft_s = Some(start.elapsed().as_secs_f64());
                }
                chunks += 1;
                for c in choices {
                    if let Some(t) = c.get("text").and_then(Value::as_str) {
                        out.text.push_str(t);
                    }
                    if let Some(t) = c.get("token_ids").and_then(Value::as_array) {
                        got_ids = true;
                        ids.extend(
                            t.iter()
                                .filter_map(Value::as_u64)
                                .filter_map(|x| TokenId::try_from(x).ok()),
                        );
                    }
                }
            }
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                if let Some(n) = u.get("completion_tokens").and_then(Value::as_u64) {
                    out.output_tokens = n as usize;
                }
                out.cached_tokens = u
                    .get("prompt_tokens_details")
                    .and_then(|d| d.get("cached_tokens"))
                    .and_then(Value::as_u64);
            }
        }
    }
    if out.outcome == Outcome::Ok && !done {
        out.outcome = Outcome::Error("stream ended without [DONE]".into());
    }
    if out.output_tokens == 0 {
        out.output_tokens = chunks;
    }
    if got_ids {
        out.token_ids = Some(ids);
    }
    out.e2e_s = start.elapsed().as_secs_f64();
    out
}

fn truncate(s: &str, n: usize) -> String {
    if s.len() <= n {
        s.to_owned()
    } else {
        let mut end = n;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        format!("{}…", &s[..end])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use axum::response::IntoResponse;

    #[test]
    fn text_prompts_are_the_ids_as_ascii_else_ids() {
        assert_eq!(prompt_text(&[33, 65, 126, 10]).as_deref(), Some("!A~\n"));
        assert_eq!(prompt_text(&[65, 200]), None);
        assert_eq!(prompt_text(&[65, 1000]), None);
        assert_eq!(prompt_value(&[72, 105], PromptFormat::Text), json!("Hi"));
        assert_eq!(
            prompt_value(&[72, 105], PromptFormat::Tokens),
            json!([72, 105])
        );
        assert_eq!(
            prompt_value(&[72, 300], PromptFormat::Text),
            json!([72, 300])
        );
        assert_eq!("tokens".parse::<PromptFormat>(), Ok(PromptFormat::Tokens));
        assert!("ids".parse::<PromptFormat>().is_err());
    }

    async fn fake(body: axum::body::Bytes) -> axum::response::Response {
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["stream"], true);
        assert!(v["prompt"].is_array() || v["prompt"] == "!A~", "{v}");
        let chunks = "data: {\"choices\":[{\"index\":0,\"text\":\"a\",\"token_ids\":[97]}]}\n\n\
                      data: {\"choices\":[{\"index\":0,\"text\":\"b\",\"token_ids\":[98]}]}\n\n\
                      data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":16}}}\n\n\
                      data: [DONE]\n\n";
        ([("content-type", "text/event-stream")], chunks).into_response()
    }

    #[tokio::test]
    async fn streams_and_measures_against_a_fake_server() {
        let app = axum::Router::new()
            .route("/v1/completions", axum::routing::post(fake))
            .route(
                "/bad/v1/completions",
                axum::routing::post(|| async { (axum::http::StatusCode::BAD_REQUEST, "nope") }),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        let http = reqwest::Client::new();
        let base = format!("http://{addr}");
        let req = |base: &'static str| CompletionRequest {
            base_url: base,
            model: "m",
            prompt: &[1, 2, 3],
            prompt_format: PromptFormat::Tokens,
            max_tokens: 2,
            kv_transfer_params: None,
            session_id: Some("s".into()),
            request_id: None,
            want_token_ids: true,
            timeout: Duration::from_secs(5),
        };
        let base: &'static str = Box::leak(base.into_boxed_str());
        let c = complete(&http, req(base)).await;
        assert_eq!(c.outcome, Outcome::Ok);
        assert!(c.ttft_s.unwrap() <= c.e2e_s);
        assert_eq!(c.output_tokens, 2);
        assert_eq!(c.cached_tokens, Some(16));
        assert_eq!(c.token_ids, Some(vec![97, 98]));
        let text = complete(
            &http,
            CompletionRequest {
                prompt: &[33, 65, 126],
                prompt_format: PromptFormat::Text,
                ..req(base)
            },
        )
        .await;
        assert_eq!(text.outcome, Outcome::Ok);
        let bad: &'static str = Box::leak(format!("{base}/bad").into_boxed_str());
        let e = complete(&http, req(bad)).await;
        assert!(
            matches!(e.outcome, Outcome::Error(ref m) if m.contains("400")),
            "{e:?}"
        );
    }
}
