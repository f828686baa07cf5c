//! The OpenAI-compatible HTTP API, shaped like vLLM's (see `tests/fixtures/vllm/completion.json`,
//! `chat_stream.txt`): `/v1/completions`, `/v1/chat/completions` (SSE or not), `/v1/models`,
//! `/health`, `/metrics`, `/tokenize`, `/reset_prefix_cache`.
//!
//! Handlers validate, tokenize and submit to the compute loop; they never block. A dropped
//! response stream (client gone) drops the [`SeqStream`], which aborts the request.

use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kvmesh_core::chat::Messages;
use kvmesh_core::load_report::{ROUTER_MARK_HEADER, RouterMark};
use kvmesh_core::prompt::{
    self, BoundedValue, BoundedVec, MAX_STOP, MAX_TRANSFER_VALUES, Prompt, PromptError,
    StringOrList,
};
use kvmesh_core::{KvTransferParams, PULL_FEEDBACK_HEADER, TokenId};
use kvmesh_text::{ChatMessage, Tokenizer};
use serde::Deserialize;
use serde_json::{Value, json};

use kvmesh_core::lax;

use crate::compute::SamplingParams;
use crate::engine::{EngineHandle, EngineRequest, FinishInfo, SeqOutput, SeqStream, SubmitError};
use crate::load_report::{LoadTracker, RequestLoad};
use crate::prefetch::{PrefetchRequest, Prefetcher};
use crate::request_hook::RequestHook;

/// Shared state of the HTTP layer.
#[derive(Clone)]
pub struct ApiState {
    pub engine: EngineHandle,
    pub request_hook: Option<Arc<dyn RequestHook>>,
    /// Runs `POST /kvmesh/prefetch` (None: the route answers 404, e.g. no P2P consumer).
    pub prefetcher: Option<Arc<Prefetcher>>,
    pub created: u64,
    /// An upper bound on the UTF-8 bytes of text one token stands for (see [`check_text_fits`]).
    pub max_token_bytes: usize,
    /// The HTTP server's own counters (`kvmesh_http_*`), appended to `/metrics`.
    pub http_stats: Option<kvmesh_http::HttpStats>,
    /// The work in flight, as published to the routers (`crate::load_report`).
    pub load: Arc<LoadTracker>,
}

impl ApiState {
    pub fn new(engine: EngineHandle) -> Self {
        let max_token_bytes = max_token_bytes(engine.tokenizer().as_ref());
        Self {
            engine,
            request_hook: None,
            prefetcher: None,
            created: unix_now(),
            max_token_bytes,
            http_stats: None,
            load: Arc::default(),
        }
    }
}

/// The engine's router (all routes).
pub fn router(state: ApiState) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/ping", get(health))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/tokenize", post(tokenize))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/kvmesh/prefetch", post(prefetch))
        .route(
            "/kvmesh/prefetch/{id}",
            axum::routing::delete(cancel_prefetch),
        )
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        // Long prompts as token-id arrays exceed axum's 2 MB default.
        .layer(axum::extract::DefaultBodyLimit::max(64 << 20))
        .with_state(state)
}

/// How many bytes of prompt text one token can stand for, at most: the longest token string of
/// the vocabulary (a token's display string is never shorter than the text it encodes: byte-level
/// BPE shows a byte as one or two UTF-8 bytes, SentencePiece a space as `▁`, byte fallback as
/// `<0x0A>`), times [`NORMALIZER_SLACK`]. Computed once, at startup.
fn max_token_bytes(tok: &dyn Tokenizer) -> usize {
    let vocab = TokenId::try_from(tok.vocab_size()).unwrap_or(TokenId::MAX);
    let longest = (0..vocab).map(|t| tok.token_str(t).len()).max();
    longest.unwrap_or(1).max(1).saturating_mul(NORMALIZER_SLACK)
}

/// A tokenizer's normalizer can shrink text before it is split (NFKC turns a 3-byte fullwidth
/// letter into one ASCII byte), so text may hold more bytes per token than the vocabulary's
/// longest token; 4x covers the Unicode normalizations LLM tokenizers use.
const NORMALIZER_SLACK: usize = 4;

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn system_fingerprint() -> String {
    format!("kvmesh-{}", env!("CARGO_PKG_VERSION"))
}

/// An OpenAI-style error response.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
    param: Option<&'static str>,
    reason: &'static str,
}

impl ApiError {
    fn bad_request(
        reason: &'static str,
        message: impl Into<String>,
        param: Option<&'static str>,
    ) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "BadRequestError",
            message: message.into(),
            param,
            reason,
        }
    }
    fn not_found_model(model: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            kind: "NotFoundError",
            message: format!("The model `{model}` does not exist."),
            param: Some("model"),
            reason: "unknown_model",
        }
    }
    fn not_found(message: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            kind: "NotFoundError",
            message: message.to_owned(),
            param: None,
            reason: "not_found",
        }
    }
    fn overloaded(waiting: usize) -> Self {
        Self {
            status: StatusCode::TOO_MANY_REQUESTS,
            kind: "TooManyRequestsError",
            message: format!("engine overloaded: {waiting} requests waiting; retry later"),
            param: None,
            reason: "overloaded",
        }
    }
    fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "ServiceUnavailableError",
            message: message.into(),
            param: None,
            reason: "unavailable",
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status.as_u16()}});
        let mut resp = (self.status, axum::Json(body)).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS
            || self.status == StatusCode::SERVICE_UNAVAILABLE
        {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}

/// Counts the error in `/metrics` and turns it into a response.
fn fail(state: &ApiState, e: ApiError) -> Response {
    state.engine.metrics().error(e.reason);
    e.into_response()
}

/// The request fields as `T`, read straight from the body (no JSON tree of it is built; fields
/// `T` does not name are skipped unread). Malformed JSON is not a field's fault (no `param`); a
/// field of the wrong type, or over a bound, is a 400 naming it.
fn typed_body<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, ApiError> {
    let malformed = |e: &serde_json::Error| {
        ApiError::bad_request("malformed_json", format!("invalid request body: {e}"), None)
    };
    let mut de = serde_json::Deserializer::from_slice(body);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let inner = e.inner();
        if !inner.is_data() {
            return malformed(inner);
        }
        let param = match e.path().iter().next() {
            Some(serde_path_to_error::Segment::Map { key }) => known_param(key),
            _ => None,
        };
        ApiError::bad_request(
            "bad_param",
            format!("invalid request body: {}: {inner}", e.path()),
            param,
        )
    })?;
    de.end().map_err(|e| malformed(&e))?;
    Ok(value)
}

/// The request fields a `param` may name (static, so a client cannot put arbitrary text there
/// through an unknown key).
fn known_param(key: &str) -> Option<&'static str> {
    const KNOWN: &[&str] = &[
        "model",
        "prompt",
        "messages",
        "add_generation_prompt",
        "return_token_strs",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "stream",
        "stream_options",
        "n",
        "kv_transfer_params",
        "logprobs",
        "top_logprobs",
        "prompt_logprobs",
    ];
    KNOWN.iter().copied().find(|k| *k == key)
}

/// 200 while the compute loop runs; 503 with the reason once it has ended (a panicked loop
/// leaves a process that accepts connections but can compute nothing: routers and load
/// balancers must see it as down).
async fn health(State(s): State<ApiState>) -> Response {
    match s.engine.loop_stopped() {
        None => StatusCode::OK.into_response(),
        Some(why) => ApiError::unavailable(why).into_response(),
    }
}

async fn models(State(s): State<ApiState>) -> Response {
    let name = &s.engine.config().served_model_name;
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": name, "object": "model", "created": s.created, "owned_by": "kvmesh", "root": name,
            "parent": null, "max_model_len": s.engine.config().max_model_len,
            "permission": [],
        }]
    }))
    .into_response()
}

async fn metrics(State(s): State<ApiState>) -> Response {
    let m = s.engine.metrics();
    m.set_cpu_stats(&s.engine.cpu_tier().stats());
    let mut text = m.encode();
    if let Some(http) = &s.http_stats {
        http.append_to(&mut text);
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn reset_prefix_cache(State(s): State<ApiState>) -> Response {
    if s.engine.reset_prefix_cache().await {
        StatusCode::OK.into_response()
    } else {
        fail(&s, ApiError::unavailable("engine stopped"))
    }
}

/// `POST /kvmesh/prefetch`: pull a history from a peer now, or without `remote_kv_source` restore
/// it from this engine's CPU tier into its GPU tier (see [`crate::prefetch`]); answers
/// when the prefetch ended (200 with its report, whatever its outcome) or 400 when malformed.
async fn prefetch(State(s): State<ApiState>, body: Bytes) -> Response {
    let Some(prefetcher) = s.prefetcher.clone() else {
        return fail(&s, ApiError::not_found("this engine runs no prefetches"));
    };
    let req: PrefetchRequest = match typed_body(&body) {
        Ok(r) => r,
        Err(e) => return fail(&s, e),
    };
    match prefetcher.run(&s.engine, req).await {
        Ok(report) => axum::Json(report).into_response(),
        Err(e) => fail(
            &s,
            ApiError::bad_request("invalid_prefetch", e.to_string(), None),
        ),
    }
}

/// `DELETE /kvmesh/prefetch/{id}`: stop a running prefetch (404 when none runs with that id).
async fn cancel_prefetch(
    State(s): State<ApiState>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    match &s.prefetcher {
        Some(p) if p.cancel(&id) => StatusCode::NO_CONTENT.into_response(),
        _ => fail(&s, ApiError::not_found("no prefetch running with this id")),
    }
}

/// The chat messages as the template takes them. The bounded reading (at most
/// [`kvmesh_core::chat::MAX_MESSAGES`] messages and [`kvmesh_core::chat::MAX_CONTENT_PARTS`]
/// parts per request, parts flattened to text as read) is shared with the router, so both render
/// the same prompt. Text without escapes stays borrowed from the body: the rendered prompt is its
/// only copy.
fn chat_messages(m: Messages<'_>) -> Vec<ChatMessage<'_>> {
    m.0.into_iter()
        .map(|m| ChatMessage {
            role: m.role,
            content: m.content,
        })
        .collect()
}

#[derive(Debug, Deserialize)]
struct TokenizeRequest<'a> {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default, borrow)]
    messages: Option<Messages<'a>>,
    #[serde(default = "yes", deserialize_with = "lax::bool_or_true")]
    add_generation_prompt: bool,
    #[serde(default, deserialize_with = "lax::bool_or_false")]
    return_token_strs: bool,
}

fn yes() -> bool {
    true
}

async fn tokenize(State(s): State<ApiState>, body: Bytes) -> Response {
    let r = (|| {
        let req: TokenizeRequest = typed_body(&body)?;
        check_model(&s, req.model.as_deref())?;
        let tok = s.engine.tokenizer();
        let text = match (req.prompt, req.messages) {
            (Some(p), _) => p,
            (None, Some(m)) => render_chat(&s, m, req.add_generation_prompt)?,
            (None, None) => {
                return Err(ApiError::bad_request(
                    "bad_param",
                    "`prompt` or `messages` is required",
                    Some("prompt"),
                ));
            }
        };
        check_text_fits(&s, &text, "prompt")?;
        let tokens = tok
            .encode(&text)
            .map_err(|e| ApiError::bad_request("bad_param", e.to_string(), Some("prompt")))?;
        let strs: Option<Vec<String>> = req
            .return_token_strs
            .then(|| tokens.iter().map(|&t| tok.token_str(t)).collect());
        Ok(
            json!({"count": tokens.len(), "max_model_len": s.engine.config().max_model_len, "tokens": tokens, "token_strs": strs}),
        )
    })();
    match r {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => fail(&s, e),
    }
}

fn check_model(s: &ApiState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != s.engine.config().served_model_name => Err(ApiError::not_found_model(m)),
        _ => Ok(()),
    }
}

#[derive(Debug, Deserialize, Default)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// Fields shared by both generation endpoints.
#[derive(Debug, Deserialize)]
struct GenParams {
    #[serde(default)]
    model: Option<String>,
    #[serde(default, deserialize_with = "lax::opt_int")]
    max_tokens: Option<i64>,
    #[serde(default, deserialize_with = "lax::opt_int")]
    max_completion_tokens: Option<i64>,
    #[serde(default, deserialize_with = "lax::opt_float")]
    temperature: Option<f64>,
    #[serde(default, deserialize_with = "lax::opt_float")]
    top_p: Option<f64>,
    #[serde(default, deserialize_with = "lax::opt_int")]
    seed: Option<i64>,
    /// At most [`MAX_STOP`] strings / ids (`kvmesh_core::prompt`), refused as the next starts.
    #[serde(default)]
    stop: Option<StringOrList<MAX_STOP>>,
    #[serde(default)]
    stop_token_ids: Option<BoundedVec<TokenId, MAX_STOP>>,
    #[serde(default, deserialize_with = "lax::bool_or_false")]
    ignore_eos: bool,
    #[serde(default, deserialize_with = "lax::bool_or_false")]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default, deserialize_with = "lax::opt_int")]
    n: Option<i64>,
    /// Completions: how many logprobs per token; chat: whether to return them. Checked against
    /// vLLM's limits in [`check_logprobs`] (logprobs themselves are not returned).
    #[serde(default, deserialize_with = "lax::opt_scalar")]
    logprobs: Option<Value>,
    #[serde(default, deserialize_with = "lax::opt_scalar")]
    top_logprobs: Option<Value>,
    #[serde(default, deserialize_with = "lax::opt_scalar")]
    prompt_logprobs: Option<Value>,
    /// Parsed in [`transfer_params`], so a malformed P2P hint cannot fail the request; at most
    /// `MAX_TRANSFER_VALUES` JSON values (`kvmesh_core::prompt`).
    #[serde(default)]
    kv_transfer_params: Option<BoundedValue<MAX_TRANSFER_VALUES>>,
    /// vLLM's per-tenant prefix-cache isolation: hashed into the prompt's first block.
    #[serde(default)]
    cache_salt: Option<String>,
}

/// The chat-only fields (the shared ones are read as [`GenParams`] from the same object).
#[derive(Debug, Deserialize)]
struct ChatFields<'a> {
    #[serde(default, borrow)]
    messages: Option<Messages<'a>>,
    #[serde(default = "yes", deserialize_with = "lax::bool_or_true")]
    add_generation_prompt: bool,
}

/// A validated generation job.
struct Job {
    chat: bool,
    id: String,
    model: String,
    prompt: Vec<TokenId>,
    stop: Vec<String>,
    stream: bool,
    include_usage: bool,
    req: EngineRequest,
}

/// The request's `prompt` read straight from the body (no JSON tree; `kvmesh_core::prompt`), a
/// token-id list bounded by `max_model_len` (a longer one is counted unread and refused with
/// vLLM's context-length 400), then tokenized or checked against the vocabulary.
fn prompt_tokens(s: &ApiState, body: &[u8]) -> Result<Vec<TokenId>, ApiError> {
    let bad = |m: &str| ApiError::bad_request("bad_param", m.to_owned(), Some("prompt"));
    let max_model_len = s.engine.config().max_model_len;
    let input = prompt::read_body(body, max_model_len).map_err(|e| match e {
        PromptError::Malformed(e) => {
            ApiError::bad_request("malformed_json", format!("invalid request body: {e}"), None)
        }
        PromptError::NotObject => ApiError::bad_request(
            "malformed_json",
            "invalid request body: expected a JSON object",
            None,
        ),
        PromptError::Missing => bad("`prompt` is required"),
        PromptError::Empty => bad("prompt is empty"),
        PromptError::TooLong { tokens, max } => ApiError::bad_request(
            "prompt_too_long",
            prompt::too_long(max, tokens),
            Some("prompt"),
        ),
        PromptError::Invalid(m) => bad(&format!("invalid request body: prompt: {m}")),
    })?;
    if input.count > 1 {
        return Err(bad(
            "only one prompt per request is supported (batch prompts: send separate requests)",
        ));
    }
    match input.first {
        Prompt::Text(t) => {
            check_text_fits(s, &t, "prompt")?;
            s.engine
                .tokenizer()
                .encode(&t)
                .map_err(|e| bad(&e.to_string()))
        }
        Prompt::Ids(ids) => {
            // The model indexes its embedding with these: an id past the vocabulary is bad input.
            let vocab = s.engine.tokenizer().vocab_size();
            match ids.iter().find(|&&t| t as usize >= vocab) {
                Some(t) => Err(bad(&format!(
                    "token id {t} is out of vocabulary (size {vocab})"
                ))),
                None => Ok(ids),
            }
        }
    }
}

/// The request's `kv_transfer_params`. A malformed `remote_kv_source` (a router's hint that a
/// peer holds the prefix) is dropped — counted and logged, the prompt is computed locally: a
/// pull is an optimisation and must never fail the request. Malformed P/D keys are the
/// client's error (400).
fn transfer_params(s: &ApiState, raw: Option<Value>) -> Result<Option<KvTransferParams>, ApiError> {
    let Some(raw) = raw.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let invalid = |e: serde_json::Error| {
        ApiError::bad_request(
            "bad_param",
            format!("invalid kv_transfer_params: {e}"),
            Some("kv_transfer_params"),
        )
    };
    // Deserialized from a reference: the common (valid) case copies nothing.
    match KvTransferParams::deserialize(&raw) {
        Ok(p) => Ok(Some(p)),
        Err(e) => {
            let mut without_source = raw;
            let dropped = without_source
                .as_object_mut()
                .and_then(|o| o.remove("remote_kv_source"));
            if dropped.is_none() {
                return Err(invalid(e));
            }
            let params = serde_json::from_value(without_source).map_err(invalid)?;
            s.engine.metrics().error("malformed_remote_kv_source");
            tracing::warn!(error = %e, "ignoring a malformed remote_kv_source; computing the prefix locally");
            Ok(Some(params))
        }
    }
}

fn build_job(
    s: &ApiState,
    chat: bool,
    prompt: Vec<TokenId>,
    p: GenParams,
) -> Result<Job, ApiError> {
    let cfg = s.engine.config();
    check_model(s, p.model.as_deref())?;
    if prompt.is_empty() {
        return Err(ApiError::bad_request(
            "bad_param",
            "prompt is empty",
            Some("prompt"),
        ));
    }
    if prompt.len() > cfg.max_model_len {
        return Err(ApiError::bad_request(
            "prompt_too_long",
            format!(
                "This model's maximum context length is {} tokens. However, your request has {} input tokens. Please reduce the length of the input messages.",
                cfg.max_model_len,
                prompt.len()
            ),
            Some("prompt"),
        ));
    }
    // A prompt needing more GPU blocks than exist could never be scheduled.
    if (prompt.len() + 1).div_ceil(cfg.block_size) > cfg.num_gpu_blocks {
        return Err(ApiError::bad_request(
            "prompt_too_long",
            format!(
                "prompt of {} tokens needs more than the {} KV blocks this engine has",
                prompt.len(),
                cfg.num_gpu_blocks
            ),
            Some("prompt"),
        ));
    }
    if let Some(n) = p.n
        && n != 1
    {
        return Err(ApiError::bad_request(
            "bad_param",
            "only n=1 is supported",
            Some("n"),
        ));
    }
    let room = cfg.max_model_len - prompt.len();
    // vLLM reads `max_completion_tokens` first; errors name the field that was used.
    let max_key = if p.max_completion_tokens.is_some() {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    let max_tokens = match p.max_completion_tokens.or(p.max_tokens) {
        Some(m) if m < 1 => {
            return Err(ApiError::bad_request(
                "bad_param",
                format!("{max_key} must be at least 1, got {m}."),
                Some(max_key),
            ));
        }
        Some(m) if m as u64 > room as u64 => {
            return Err(ApiError::bad_request(
                "prompt_too_long",
                format!(
                    "'max_tokens' or 'max_completion_tokens' is too large: {m}. This model's maximum context length is {} tokens and your request has {} input tokens ({m} > {} - {}).",
                    cfg.max_model_len,
                    prompt.len(),
                    cfg.max_model_len,
                    prompt.len()
                ),
                Some(max_key),
            ));
        }
        Some(m) => m as usize,
        None if chat => room,
        None => 16.min(room),
    };
    if room == 0 {
        return Err(ApiError::bad_request(
            "prompt_too_long",
            "prompt fills the model length; no room to generate",
            Some("prompt"),
        ));
    }
    let temperature = p.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) || !temperature.is_finite() {
        return Err(ApiError::bad_request(
            "bad_param",
            format!("temperature must be in [0, 2], got {temperature}."),
            Some("temperature"),
        ));
    }
    let top_p = p.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::bad_request(
            "bad_param",
            format!("top_p must be in (0, 1], got {top_p}."),
            Some("top_p"),
        ));
    }
    let stop = p.stop.map(StringOrList::into_vec).unwrap_or_default();
    let stop: Vec<String> = stop.into_iter().filter(|s| !s.is_empty()).collect();
    let id = format!(
        "{}-{}",
        if chat { "chatcmpl" } else { "cmpl" },
        &uuid::Uuid::new_v4().simple().to_string()[..16]
    );
    let include_usage = p.stream_options.as_ref().is_some_and(|o| o.include_usage);
    if p.cache_salt.as_deref() == Some("") {
        // vLLM's wording: an empty salt would silently share the unsalted space.
        return Err(ApiError::bad_request(
            "bad_param",
            "Parameter 'cache_salt' must be a non-empty string if provided.".to_owned(),
            Some("cache_salt"),
        ));
    }
    let req = EngineRequest {
        request_id: id.clone(),
        prompt: prompt.clone(),
        sampling: SamplingParams {
            temperature: temperature as f32,
            top_p: top_p as f32,
            seed: p.seed.map(|s| s as u64),
        },
        max_tokens,
        ignore_eos: p.ignore_eos,
        stop_token_ids: p.stop_token_ids.unwrap_or_default().0,
        kv_transfer_params: transfer_params(s, p.kv_transfer_params.map(|v| v.0))?,
        cache_salt: p.cache_salt,
        arrival: std::time::Instant::now(),
        external_hashes: Vec::new(),
        pull_pinned_hashes: Vec::new(),
        external_query_tokens: 0,
        pull_feedback: None,
        layered_pull: None,
    };
    Ok(Job {
        chat,
        id,
        model: cfg.served_model_name.clone(),
        prompt,
        stop,
        stream: p.stream,
        include_usage,
        req,
    })
}

/// vLLM's default `--max-logprobs`: the most logprobs a request may ask for per token (-1, "the
/// whole vocabulary", counts as the vocabulary size).
const MAX_LOGPROBS: i128 = 20;

/// A logprobs count as vLLM's `mode="before"` validator reads it: a number (or a boolean, an
/// `int` in Python), else "must be an integer".
fn logprobs_count(param: &'static str, v: Option<&Value>) -> Result<Option<i128>, ApiError> {
    match v {
        None => Ok(None),
        Some(n @ (Value::Number(_) | Value::Bool(_))) => lax::int(n).map(Some).ok_or_else(|| {
            ApiError::bad_request(
                "bad_param",
                format!(
                    "{param}: Input should be a valid integer, got a number with a fractional part"
                ),
                Some(param),
            )
        }),
        Some(_) => Err(ApiError::bad_request(
            "bad_param",
            format!("`{param}` must be an integer."),
            Some(param),
        )),
    }
}

/// vLLM's request validators for the logprobs fields: a count is a positive value or -1, chat's
/// `top_logprobs` needs `logprobs: true`, prompt logprobs cannot stream. Returns the sample and
/// prompt counts asked for.
fn logprobs_asked(chat: bool, p: &GenParams) -> Result<(Option<i128>, Option<i128>), ApiError> {
    let bad = |param: &'static str, m: &str| ApiError::bad_request("bad_param", m, Some(param));
    let prompt = logprobs_count("prompt_logprobs", p.prompt_logprobs.as_ref())?;
    if let Some(n) = prompt {
        if p.stream && (n > 0 || n == -1) {
            let m = "`prompt_logprobs` are not available when `stream=True`.";
            return Err(bad("prompt_logprobs", m));
        }
        if n < -1 {
            let m = "`prompt_logprobs` must be a positive value or -1.";
            return Err(bad("prompt_logprobs", m));
        }
    }
    let key = if chat { "top_logprobs" } else { "logprobs" };
    let raw = if chat { &p.top_logprobs } else { &p.logprobs };
    let sample = logprobs_count(key, raw.as_ref())?;
    if sample.is_some_and(|n| n < -1) {
        return Err(bad(
            key,
            &format!("`{key}` must be a positive value or -1."),
        ));
    }
    if !chat {
        return Ok((sample, prompt));
    }
    let on = p.logprobs.as_ref().and_then(lax::boolean).unwrap_or(false);
    if sample.is_some_and(|n| n == -1 || n > 0) && !on {
        let m = "when using `top_logprobs`, `logprobs` must be set to true.";
        return Err(bad("top_logprobs", m));
    }
    Ok((sample.filter(|_| on), prompt))
}

/// vLLM's sampling-parameter check: no more logprobs than `--max-logprobs` allows.
fn check_logprobs(s: &ApiState, chat: bool, p: &GenParams) -> Result<(), ApiError> {
    let (sample, prompt) = logprobs_asked(chat, p)?;
    let vocab = i128::try_from(s.engine.tokenizer().vocab_size()).unwrap_or(i128::MAX);
    for (n, param, what) in [
        (sample, "logprobs", "sample"),
        (prompt, "prompt_logprobs", "prompt"),
    ] {
        let Some(n) = n.map(|n| if n == -1 { vocab } else { n }) else {
            continue;
        };
        if n > MAX_LOGPROBS {
            return Err(ApiError::bad_request(
                "bad_param",
                format!(
                    "Requested {what} logprobs of {n}, which is greater than max allowed: {MAX_LOGPROBS}"
                ),
                Some(param),
            ));
        }
    }
    Ok(())
}

/// Bodies above this are parsed, tokenized and validated on the blocking pool: a long prompt's
/// JSON and tokenization take milliseconds that must not stall the async workers.
const INLINE_PARSE_LIMIT: usize = 16 * 1024;

async fn parse_off_thread(
    s: &ApiState,
    body: Bytes,
    parse: fn(&ApiState, &[u8]) -> Result<Job, ApiError>,
) -> Result<Job, ApiError> {
    if body.len() <= INLINE_PARSE_LIMIT {
        return parse(s, &body);
    }
    let s2 = s.clone();
    tokio::task::spawn_blocking(move || parse(&s2, &body))
        .await
        .unwrap_or_else(|e| {
            Err(ApiError::unavailable(format!(
                "request parsing failed: {e}"
            )))
        })
}

fn parse_completion(s: &ApiState, body: &[u8]) -> Result<Job, ApiError> {
    // Read straight from the body, twice, as chat is: the prompt (bounded), then the other
    // fields (skipping the prompt unread). No JSON tree of the body is built: one of a 64 MiB
    // list of token ids took ~1 GiB.
    let prompt = prompt_tokens(s, body)?;
    let params: GenParams = typed_body(body)?;
    check_logprobs(s, false, &params)?;
    build_job(s, false, prompt, params)
}

fn parse_chat(s: &ApiState, body: &[u8]) -> Result<Job, ApiError> {
    // Read straight from the body, twice, into the two field sets: no JSON tree of the body is
    // built (a tree of 1.9 million messages took ~1.4 GiB), and each pass skips the other's
    // fields unread. `messages` is bounded while it is read (see `kvmesh_core::chat`).
    let r: ChatFields = typed_body(body)?;
    let params: GenParams = typed_body(body)?;
    let Some(messages) = r.messages else {
        return Err(ApiError::bad_request(
            "bad_param",
            "`messages` is required",
            Some("messages"),
        ));
    };
    if messages.0.is_empty() {
        return Err(ApiError::bad_request(
            "bad_param",
            "messages must not be empty",
            Some("messages"),
        ));
    }
    check_logprobs(s, true, &params)?;
    let text = render_chat(s, messages, r.add_generation_prompt)?;
    check_text_fits(s, &text, "messages")?;
    let prompt = s
        .engine
        .tokenizer()
        .encode(&text)
        .map_err(|e| ApiError::bad_request("bad_param", e.to_string(), Some("messages")))?;
    build_job(s, true, prompt, params)
}

/// The chat template applied to `messages`.
fn render_chat(
    s: &ApiState,
    m: Messages<'_>,
    add_generation_prompt: bool,
) -> Result<String, ApiError> {
    s.engine
        .tokenizer()
        .apply_chat_template(&chat_messages(m), add_generation_prompt)
        .map_err(|e| ApiError::bad_request("bad_param", e.to_string(), Some("messages")))
}

/// Refuses, before tokenizing it, a prompt text that cannot fit `max_model_len` tokens even if
/// every token were the vocabulary's longest ([`ApiState::max_token_bytes`]): tokenizing tens
/// of MiB of text only to answer "too long" costs far more memory than the text itself.
fn check_text_fits(s: &ApiState, text: &str, param: &'static str) -> Result<(), ApiError> {
    let max_model_len = s.engine.config().max_model_len;
    let limit = max_model_len.saturating_mul(s.max_token_bytes);
    if text.len() <= limit {
        // A vocabulary of long tokens proves little from the length: a text of more than any
        // real context is counted a piece at a time before it is encoded whole.
        if text.len() > kvmesh_text::COUNT_IN_PIECES_ABOVE
            && let Some(n) =
                kvmesh_text::count_past(&**s.engine.tokenizer(), text, max_model_len)
                    .map_err(|e| ApiError::bad_request("bad_param", e.to_string(), Some(param)))?
        {
            return Err(ApiError::bad_request(
                "prompt_too_long",
                format!(
                    "This model's maximum context length is {max_model_len} tokens. However, your request has at least {n} input tokens. Please reduce the length of the input messages."
                ),
                Some(param),
            ));
        }
        return Ok(());
    }
    Err(ApiError::bad_request(
        "prompt_too_long",
        format!(
            "This model's maximum context length is {max_model_len} tokens. However, your request's prompt is {} bytes of text, more than {max_model_len} tokens of at most {} bytes each can hold. Please reduce the length of the input messages.",
            text.len(),
            s.max_token_bytes
        ),
        Some(param),
    ))
}

async fn completions(State(s): State<ApiState>, headers: HeaderMap, body: Bytes) -> Response {
    match parse_off_thread(&s, body, parse_completion).await {
        Ok(job) => run_job(s, job, &headers).await,
        Err(e) => fail(&s, e),
    }
}

async fn chat_completions(State(s): State<ApiState>, headers: HeaderMap, body: Bytes) -> Response {
    match parse_off_thread(&s, body, parse_chat).await {
        Ok(job) => run_job(s, job, &headers).await,
        Err(e) => fail(&s, e),
    }
}

/// The router replica's mark on a request, if it carries a valid one (a bad one only costs the
/// replica its share of the load report: the request is served).
fn router_mark(headers: &HeaderMap) -> Option<RouterMark> {
    let value = headers.get(ROUTER_MARK_HEADER)?.to_str().ok()?;
    RouterMark::parse(value)
        .inspect_err(|e| tracing::debug!(error = %e, "ignoring a bad router mark"))
        .ok()
}

/// Incremental detokenization with stop strings: text is released only when it can no longer
/// become part of a stop string, and never ends in a partial UTF-8 sequence.
struct Detok {
    tokens: Vec<TokenId>,
    text: String,
    emitted: usize,
    stop: Vec<String>,
    holdback: usize,
    /// The stop string that matched.
    matched: Option<String>,
    /// vLLM's incremental detokenization window: `tokens[prefix_offset..read_offset]` is context
    /// already turned into text; only the tokens after it produce new text.
    prefix_offset: usize,
    read_offset: usize,
}

impl Detok {
    fn new(stop: Vec<String>) -> Self {
        let holdback = stop
            .iter()
            .map(|s| s.len())
            .max()
            .unwrap_or(1)
            .saturating_sub(1);
        Self {
            tokens: Vec::new(),
            text: String::new(),
            emitted: 0,
            stop,
            holdback,
            matched: None,
            prefix_offset: 0,
            read_offset: 0,
        }
    }

    /// Appends the text of tokens not yet decoded, unless it ends in an incomplete character
    /// (then waits for more tokens, or `last`).
    fn advance(&mut self, tok: &dyn Tokenizer, last: bool) {
        let prefix = tok
            .decode(&self.tokens[self.prefix_offset..self.read_offset])
            .unwrap_or_default();
        let full = tok
            .decode(&self.tokens[self.prefix_offset..])
            .unwrap_or_default();
        if full.len() <= prefix.len() || (!last && full.ends_with('\u{FFFD}')) {
            return;
        }
        if full.starts_with(&prefix) {
            self.text.push_str(&full[prefix.len()..]);
        } else {
            // The context re-tokenized differently: fall back to the whole decode.
            let all = tok.decode(&self.tokens).unwrap_or_default();
            if all.len() > self.text.len() && all.is_char_boundary(self.text.len()) {
                let tail = all[self.text.len()..].to_owned();
                self.text.push_str(&tail);
            }
        }
        self.prefix_offset = self.read_offset;
        self.read_offset = self.tokens.len();
    }

    /// Adds a token; returns newly releasable text.
    fn push(&mut self, tok: &dyn Tokenizer, token: TokenId) -> String {
        self.tokens.push(token);
        self.advance(tok, false);
        // Text before `emitted` was checked already and a stop string cannot start there
        // (the holdback keeps its possible beginnings unreleased).
        for s in &self.stop {
            if let Some(pos) = self.text[self.emitted..].find(s.as_str()) {
                self.text.truncate(self.emitted + pos);
                self.matched = Some(s.clone());
                return self.release(true);
            }
        }
        self.release(false)
    }

    /// Flushes everything at the end of the sequence.
    fn finish(&mut self, tok: &dyn Tokenizer) -> String {
        self.advance(tok, true);
        self.release(true)
    }

    fn release(&mut self, all: bool) -> String {
        let mut end = if all {
            self.text.len()
        } else {
            // The holdback counts bytes of the longest stop string; with multi-byte text the cut
            // can land inside a character, so round down to a boundary *before* slicing (holding
            // back a little more is harmless, slicing mid-character panics).
            floor_char_boundary(&self.text, self.text.len().saturating_sub(self.holdback))
        };
        if !all && self.text[..end].ends_with('\u{FFFD}') {
            end -= '\u{FFFD}'.len_utf8();
        }
        if end <= self.emitted {
            return String::new();
        }
        let out = self.text[self.emitted..end].to_owned();
        self.emitted = end;
        out
    }
}

/// The largest char boundary of `s` at or below `i` (`str::floor_char_boundary` is unstable).
fn floor_char_boundary(s: &str, i: usize) -> usize {
    let mut i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

fn usage_json(info: &FinishInfo, completion_tokens: usize, stream: bool) -> Value {
    let created = (info.created_cache_tokens > 0).then_some(info.created_cache_tokens);
    let details = if stream {
        json!({"cached_tokens": info.cached_tokens, "created_cache_tokens": created})
    } else {
        json!({"cached_tokens": info.cached_tokens, "created_cache_tokens": created, "multimodal_tokens": null})
    };
    let mut usage = json!({
        "prompt_tokens": info.prompt_tokens,
        "total_tokens": info.prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": details,
    });
    if !stream {
        usage["completion_tokens_details"] = Value::Null;
    }
    usage
}

fn stop_reason(info: &FinishInfo, detok: &Detok) -> Value {
    if let Some(s) = &detok.matched {
        json!(s)
    } else if let Some(t) = info.stop_token {
        json!(t)
    } else {
        Value::Null
    }
}

fn finish_reason_str(info: &FinishInfo, detok: &Detok) -> &'static str {
    if detok.matched.is_some() {
        "stop"
    } else {
        info.reason.as_str()
    }
}

async fn submit(s: &ApiState, mut job: Job) -> Result<(Job, SeqStream), ApiError> {
    // An engine that will refuse the request anyway must not first spend a pull on it.
    if let Some(why) = s.engine.loop_stopped() {
        return Err(ApiError::unavailable(why));
    }
    if let Some(waiting) = s.engine.waiting_at_capacity() {
        return Err(ApiError::overloaded(waiting));
    }
    if let Some(hook) = &s.request_hook {
        hook.before_submit(&s.engine, &mut job.req).await;
    }
    let refused = match s.engine.submit(job.req.clone()) {
        Ok(stream) => return Ok((job, stream)),
        Err(SubmitError::Overloaded(n)) => ApiError::overloaded(n),
        Err(SubmitError::Stopped) => ApiError::unavailable(stopped_reason(&s.engine)),
    };
    if let Some(hook) = &s.request_hook {
        hook.on_not_submitted(&s.engine, &job.req);
    }
    Err(refused)
}

/// Why the loop is gone, for a request it dropped (its output channel closed without a finish).
fn stopped_reason(engine: &EngineHandle) -> String {
    engine
        .loop_stopped()
        .unwrap_or_else(|| "engine compute loop stopped".to_owned())
}

async fn run_job(s: ApiState, job: Job, headers: &HeaderMap) -> Response {
    // Counted from here, before any pull: a router deciding now must see this request.
    let load = s.load.begin(
        router_mark(headers).as_ref(),
        job.prompt.len(),
        job.req.max_tokens,
        Instant::now(),
    );
    let (job, stream) = match submit(&s, job).await {
        Ok(x) => x,
        Err(e) => return fail(&s, e),
    };
    // The pull, if any, ended before submission: its outcome goes out as a header, before the
    // first token, streamed or not (`kvmesh_core::pull_feedback`).
    // A layer-wise pull ends before the first token too (the first step waits for every
    // layer), so waiting for its outcome here delays nothing the client sees.
    let feedback = match &job.req.layered_pull {
        Some(pull) => pull.feedback().await,
        None => job.req.pull_feedback.clone(),
    };
    let feedback = feedback.and_then(|f| HeaderValue::from_str(&f.to_string()).ok());
    let mut resp = if job.stream {
        stream_response(s, job, stream, load)
    } else {
        full_response(s, job, stream, load).await
    };
    if let Some(v) = feedback {
        resp.headers_mut()
            .insert(HeaderName::from_static(PULL_FEEDBACK_HEADER), v);
    }
    resp
}

/// Drives one sequence to the end, calling `on_text` for released text. Returns the finish info
/// (None if the engine failed) and the detokenizer.
async fn drive(
    engine: &EngineHandle,
    stream: &mut SeqStream,
    detok: &mut Detok,
    load: &mut RequestLoad,
    mut on_text: impl FnMut(String),
) -> Result<(FinishInfo, usize), String> {
    let mut completion_tokens = 0usize;
    loop {
        match stream.recv().await {
            Some(SeqOutput::Started { cached_tokens, .. }) => load.started(cached_tokens),
            Some(SeqOutput::Token(t)) => {
                load.first_token();
                completion_tokens += 1;
                let text = detok.push(engine.tokenizer().as_ref(), t);
                if !text.is_empty() {
                    on_text(text);
                }
                if detok.matched.is_some() {
                    // Stop string: end here and tell the engine to free the sequence.
                    stream.finish_stopped();
                    let info = FinishInfo {
                        reason: crate::engine::FinishReason::Stop,
                        stop_token: None,
                        prompt_tokens: 0,
                        completion_tokens,
                        cached_tokens: 0,
                        created_cache_tokens: 0,
                        kv_transfer_params: None,
                        block_hashes: Vec::new(),
                    };
                    return Ok((info, completion_tokens));
                }
            }
            Some(SeqOutput::Finished(info)) => {
                let info = *info;
                let rest = detok.finish(engine.tokenizer().as_ref());
                if !rest.is_empty() {
                    on_text(rest);
                }
                return Ok((info, completion_tokens));
            }
            Some(SeqOutput::Error(e)) => return Err(e),
            None => return Err(stopped_reason(engine)),
        }
    }
}

async fn full_response(
    s: ApiState,
    job: Job,
    mut stream: SeqStream,
    mut load: RequestLoad,
) -> Response {
    let mut detok = Detok::new(job.stop.clone());
    let mut text = String::new();
    let (mut info, completion_tokens) =
        match drive(&s.engine, &mut stream, &mut detok, &mut load, |t| {
            text.push_str(&t)
        })
        .await
        {
            Ok(x) => x,
            Err(e) => return fail(&s, ApiError::unavailable(e)),
        };
    fix_stop_info(&mut info, &job, &stream);
    if let Some(hook) = &s.request_hook {
        hook.on_finish(&s.engine, &job.req, &mut info);
    }
    let usage = usage_json(&info, completion_tokens, false);
    let kvp = info.kv_transfer_params.as_ref().map_or(Value::Null, |p| {
        serde_json::to_value(p).unwrap_or(Value::Null)
    });
    let created = unix_now();
    let body = if job.chat {
        json!({
            "id": job.id, "object": "chat.completion", "created": created, "model": job.model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": null, "annotations": null, "audio": null,
                            "function_call": null, "tool_calls": [], "reasoning": null},
                "logprobs": null, "finish_reason": finish_reason_str(&info, &detok), "stop_reason": stop_reason(&info, &detok),
                "token_ids": null,
            }],
            "service_tier": null, "system_fingerprint": system_fingerprint(), "usage": usage,
            "prompt_logprobs": null, "prompt_token_ids": null, "kv_transfer_params": kvp,
        })
    } else {
        json!({
            "id": job.id, "object": "text_completion", "created": created, "model": job.model,
            "choices": [{
                "index": 0, "text": text, "logprobs": null, "finish_reason": finish_reason_str(&info, &detok),
                "stop_reason": stop_reason(&info, &detok), "token_ids": null, "prompt_logprobs": null,
                "prompt_token_ids": null, "routed_experts": null,
            }],
            "service_tier": null, "system_fingerprint": system_fingerprint(), "usage": usage,
            "kv_transfer_params": kvp, "ec_transfer_params": null, "metrics": null,
        })
    };
    axum::Json(body).into_response()
}

/// A stop-string finish is decided here, not in the engine: fill in what the engine knew.
fn fix_stop_info(info: &mut FinishInfo, job: &Job, stream: &SeqStream) {
    if info.prompt_tokens == 0 {
        info.prompt_tokens = job.prompt.len();
        info.cached_tokens = stream.cached_tokens().unwrap_or(0);
    }
}

fn stream_response(
    s: ApiState,
    job: Job,
    mut stream: SeqStream,
    mut load: RequestLoad,
) -> Response {
    let engine = s.engine.clone();
    let hook = s.request_hook.clone();
    let events = async_stream::stream! {
        let created = unix_now();
        let mut detok = Detok::new(job.stop.clone());
        let object = if job.chat { "chat.completion.chunk" } else { "text_completion" };
        let chunk = |choice: Value| -> Value {
            json!({"id": job.id, "object": object, "created": created, "model": job.model, "choices": [choice]})
        };
        if job.chat {
            let mut first = chunk(json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}));
            first["prompt_token_ids"] = Value::Null;
            first["prompt_text"] = Value::Null;
            yield Ok::<Event, std::convert::Infallible>(Event::default().data(first.to_string()));
        }
        let mut pending: Vec<String> = Vec::new();
        let mut completion_tokens = 0usize;
        let result: Result<FinishInfo, String> = loop {
            match stream.recv().await {
                Some(SeqOutput::Started { cached_tokens, .. }) => load.started(cached_tokens),
                Some(SeqOutput::Token(t)) => {
                    load.first_token();
                    completion_tokens += 1;
                    let text = detok.push(engine.tokenizer().as_ref(), t);
                    if detok.matched.is_some() {
                        stream.finish_stopped();
                        pending.push(text);
                        break Ok(FinishInfo {
                            reason: crate::engine::FinishReason::Stop, stop_token: None, prompt_tokens: job.prompt.len(),
                            completion_tokens, cached_tokens: stream.cached_tokens().unwrap_or(0), created_cache_tokens: 0,
                            kv_transfer_params: None, block_hashes: Vec::new(),
                        });
                    }
                    // Hold the text until we know whether the next output is the finish, so the
                    // last text chunk carries `finish_reason` as vLLM's does.
                    if let Some(prev) = pending.pop()
                        && !prev.is_empty()
                    {
                        yield Ok(Event::default().data(text_chunk(&chunk, job.chat, &prev, None).to_string()));
                    }
                    pending.push(text);
                }
                Some(SeqOutput::Finished(info)) => {
                    pending.push(detok.finish(engine.tokenizer().as_ref()));
                    break Ok(*info);
                }
                Some(SeqOutput::Error(e)) => break Err(e),
                None => break Err(stopped_reason(&engine)),
            }
        };
        match result {
            Ok(mut info) => {
                if let Some(hook) = &hook {
                    hook.on_finish(&engine, &job.req, &mut info);
                }
                let text: String = pending.concat();
                let fin = (finish_reason_str(&info, &detok), stop_reason(&info, &detok));
                let mut last = text_chunk(&chunk, job.chat, &text, Some(fin.0));
                last["choices"][0]["stop_reason"] = fin.1;
                if let Some(p) = &info.kv_transfer_params {
                    last["kv_transfer_params"] = serde_json::to_value(p).unwrap_or(Value::Null);
                }
                yield Ok(Event::default().data(last.to_string()));
                if job.include_usage {
                    let usage = json!({
                        "id": job.id, "object": object, "created": created, "model": job.model, "choices": [],
                        "usage": usage_json(&info, completion_tokens, true), "system_fingerprint": system_fingerprint(),
                    });
                    yield Ok(Event::default().data(usage.to_string()));
                }
            }
            Err(e) => {
                let err = json!({"error": {"message": e, "type": "InternalServerError", "param": null, "code": 500}});
                yield Ok(Event::default().data(err.to_string()));
            }
        }
        yield Ok(Event::default().data("[DONE]"));
    };
    Sse::new(events).into_response()
}

fn text_chunk(
    chunk: &impl Fn(Value) -> Value,
    chat: bool,
    text: &str,
    finish: Option<&str>,
) -> Value {
    if chat {
        let mut c = json!({"index": 0, "delta": {"content": text}, "logprobs": null, "finish_reason": finish, "token_ids": null});
        if finish.is_some() {
            c["stop_reason"] = Value::Null;
        }
        chunk(c)
    } else {
        chunk(
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish, "stop_reason": null}),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_text::ByteTokenizer;

    fn run(stop: &[&str], text: &str) -> (String, Vec<String>, Option<String>) {
        let mut d = Detok::new(stop.iter().map(|s| s.to_string()).collect());
        let mut pieces = Vec::new();
        for b in text.bytes() {
            let p = d.push(&ByteTokenizer, TokenId::from(b));
            if !p.is_empty() {
                pieces.push(p);
            }
            if d.matched.is_some() {
                return (pieces.concat(), pieces, d.matched);
            }
        }
        let rest = d.finish(&ByteTokenizer);
        if !rest.is_empty() {
            pieces.push(rest);
        }
        (pieces.concat(), pieces, d.matched)
    }

    /// The chat body is read with the shared bounds: one message over is a 400 naming
    /// `messages` and the bound, as is one content part over; exactly at them is accepted.
    #[test]
    fn chat_messages_and_parts_are_bounded() {
        use kvmesh_core::chat::{MAX_CONTENT_PARTS, MAX_MESSAGES};
        let body = |messages: String| format!(r#"{{"model":"m","messages":[{messages}]}}"#);
        let empty = |n: usize| body(vec![r#"{"role":"user","content":""}"#; n].join(","));
        let at = empty(MAX_MESSAGES);
        let r: ChatFields = typed_body(at.as_bytes()).expect("at the bound");
        assert_eq!(r.messages.map(|m| m.0.len()), Some(MAX_MESSAGES));
        let e = typed_body::<ChatFields>(empty(MAX_MESSAGES + 1).as_bytes()).expect_err("over");
        assert_eq!(
            (e.status, e.param),
            (StatusCode::BAD_REQUEST, Some("messages"))
        );
        assert!(
            e.message.contains("at most 65536 messages"),
            "{}",
            e.message
        );
        let parts = |n: usize| {
            body(format!(
                r#"{{"role":"user","content":[{}]}}"#,
                vec![r#""a""#; n].join(",")
            ))
        };
        let at = parts(MAX_CONTENT_PARTS);
        let r: ChatFields = typed_body(at.as_bytes()).expect("at the bound");
        let content = r.messages.map(|m| m.0[0].content.len());
        assert_eq!(content, Some(2 * MAX_CONTENT_PARTS - 1));
        let e =
            typed_body::<ChatFields>(parts(MAX_CONTENT_PARTS + 1).as_bytes()).expect_err("over");
        assert_eq!(e.param, Some("messages"));
        assert!(
            e.message.contains("at most 65536 content parts"),
            "{}",
            e.message
        );
        // The generation fields are read from the same body, skipping `messages` unread.
        let p: GenParams = typed_body(empty(3).as_bytes()).expect("params");
        assert_eq!(p.model.as_deref(), Some("m"));
        // Malformed JSON is nobody's field; trailing bytes are malformed too.
        for bad in [&b"{\"messages\": ["[..], b"{} x"] {
            let e = typed_body::<ChatFields>(bad).expect_err("malformed");
            assert_eq!((e.reason, e.param), ("malformed_json", None));
        }
    }

    /// `stop` and `stop_token_ids` hold at most `MAX_STOP` (1024) items each: one more is a 400
    /// naming the field; exactly the bound is accepted. A one-string `stop` still works.
    /// `kv_transfer_params` holds at most `MAX_TRANSFER_VALUES` JSON values.
    #[test]
    fn stop_lists_and_transfer_params_are_bounded() {
        let strs = |n: usize| vec![r#""a""#; n].join(",");
        let ids = |n: usize| vec!["7"; n].join(",");
        let p: GenParams = typed_body(
            format!(
                r#"{{"stop":[{}],"stop_token_ids":[{}]}}"#,
                strs(MAX_STOP),
                ids(MAX_STOP)
            )
            .as_bytes(),
        )
        .expect("at the bound");
        assert_eq!(p.stop.map(|s| s.into_vec().len()), Some(MAX_STOP));
        assert_eq!(p.stop_token_ids.map(|s| s.0.len()), Some(MAX_STOP));
        let p: GenParams = typed_body(br#"{"stop":"x"}"#).expect("one string");
        assert_eq!(
            p.stop.map(StringOrList::into_vec),
            Some(vec!["x".to_owned()])
        );
        for (key, list) in [
            ("stop", strs(MAX_STOP + 1)),
            ("stop_token_ids", ids(100 * MAX_STOP)),
        ] {
            let e = typed_body::<GenParams>(format!(r#"{{"{key}":[{list}]}}"#).as_bytes())
                .expect_err("over the bound");
            assert_eq!(
                (e.reason, e.param),
                ("bad_param", Some(key)),
                "{}",
                e.message
            );
            assert!(
                e.message.contains("at most 1024 per request"),
                "{}",
                e.message
            );
        }
        // `kv_transfer_params` is bounded in JSON values, counted over its whole tree.
        let big = format!(
            r#"{{"kv_transfer_params":{{"remote_block_ids":[{}]}}}}"#,
            ids(MAX_TRANSFER_VALUES)
        );
        let e = typed_body::<GenParams>(big.as_bytes()).expect_err("over the bound");
        assert_eq!(e.param, Some("kv_transfer_params"), "{}", e.message);
        assert!(
            e.message.contains("at most 262144 per field"),
            "{}",
            e.message
        );
        let p: GenParams = typed_body(br#"{"kv_transfer_params":{"do_remote_decode":true}}"#)
            .expect("small params");
        assert_eq!(
            p.kv_transfer_params.map(|v| v.0),
            Some(json!({"do_remote_decode": true}))
        );
        // The prompt is not one of these fields: skipped unread.
        let p: GenParams = typed_body(br#"{"prompt":[1,2,3],"stop":["s"]}"#).expect("params");
        assert_eq!(
            p.stop.map(StringOrList::into_vec),
            Some(vec!["s".to_owned()])
        );
    }

    fn logprobs(chat: bool, body: &str) -> Result<(Option<i128>, Option<i128>), ApiError> {
        let p: GenParams = typed_body(body.as_bytes())?;
        logprobs_asked(chat, &p)
    }

    /// vLLM 0.32's request validators for the logprobs fields (the count limit itself,
    /// `MAX_LOGPROBS`, is checked against the engine's vocabulary in `check_logprobs`).
    #[test]
    fn logprobs_fields_are_validated_like_vllm() {
        assert_eq!(
            logprobs(false, r#"{"logprobs": 5}"#).ok(),
            Some((Some(5), None))
        );
        assert_eq!(
            logprobs(false, r#"{"logprobs": 1000000000}"#).ok(),
            Some((Some(1_000_000_000), None))
        );
        assert_eq!(
            logprobs(true, r#"{"logprobs": true, "top_logprobs": 3}"#).ok(),
            Some((Some(3), None))
        );
        // Without `logprobs: true` chat asks for none (a 0 is allowed).
        assert_eq!(
            logprobs(true, r#"{"top_logprobs": 0}"#).ok(),
            Some((None, None))
        );
        for (chat, body, param, msg) in [
            (
                false,
                r#"{"logprobs": "5"}"#,
                "logprobs",
                "`logprobs` must be an integer.",
            ),
            (
                false,
                r#"{"logprobs": -2}"#,
                "logprobs",
                "`logprobs` must be a positive value or -1.",
            ),
            (
                false,
                r#"{"prompt_logprobs": 1, "stream": true}"#,
                "prompt_logprobs",
                "`prompt_logprobs` are not available when `stream=True`.",
            ),
            (
                true,
                r#"{"top_logprobs": 2}"#,
                "top_logprobs",
                "when using `top_logprobs`, `logprobs` must be set to true.",
            ),
            (
                true,
                r#"{"top_logprobs": -5, "logprobs": true}"#,
                "top_logprobs",
                "`top_logprobs` must be a positive value or -1.",
            ),
        ] {
            let e = logprobs(chat, body).expect_err(body);
            assert_eq!((e.param, e.message.as_str()), (Some(param), msg), "{body}");
        }
        // A list where a count belongs is refused before it is read into a tree.
        let e = logprobs(false, r#"{"logprobs": [1, 2, 3]}"#).expect_err("list");
        assert_eq!(e.param, Some("logprobs"));
    }

    #[test]
    fn incremental_text_never_splits_a_character() {
        let (all, pieces, _) = run(&[], "héllo wörld ✓");
        assert_eq!(all, "héllo wörld ✓");
        assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')));
    }

    #[test]
    fn stop_strings_cut_the_text_even_across_tokens() {
        let (all, _, m) = run(&["STOP"], "abc dSTOPxyz");
        assert_eq!(all, "abc d");
        assert_eq!(m.as_deref(), Some("STOP"));
        // A partial match is held back and released when it turns out not to be a stop.
        let (all, _, m) = run(&["STOP"], "abSTOxSTO");
        assert_eq!(all, "abSTOxSTO");
        assert_eq!(m, None);
    }

    /// Multi-byte output with multi-byte stop strings: the holdback is counted in bytes, so the
    /// release point used to land inside a character and panic on the slice.
    #[test]
    fn multi_byte_text_and_stop_strings_never_split_a_character() {
        let (all, _, m) = run(&["日本"], "ééé日本x");
        assert_eq!((all.as_str(), m.as_deref()), ("ééé", Some("日本")));
        let (all, _, m) = run(&["é"], "café au lait");
        assert_eq!((all.as_str(), m.as_deref()), ("caf", Some("é")));
        let (all, _, m) = run(&["🛑"], "a😀bç🛑c");
        assert_eq!((all.as_str(), m.as_deref()), ("a😀bç", Some("🛑")));
        let (all, _, m) = run(&["日本語"], "日本日本人😀");
        assert_eq!((all.as_str(), m), ("日本日本人😀", None));
    }

    /// Every prefix of multi-byte texts against multi-byte stops: no panic, released pieces are
    /// whole characters, the output is the text up to the first stop (or all of it).
    #[test]
    fn any_cut_of_multi_byte_text_is_released_whole() {
        let texts = ["é日本😀aé", "ééééé", "😀😀日😀", "aé日b😀c本", "日本é"];
        let stops: [&[&str]; 5] = [
            &["日本"],
            &["é"],
            &["😀", "本"],
            &["xyz😀"],
            &["ab", "日本é"],
        ];
        for text in texts {
            for stop in stops {
                for n in 0..=text.len() {
                    let Some(prefix) = text.get(..n) else {
                        continue;
                    };
                    let (all, pieces, m) = run(stop, prefix);
                    assert!(
                        pieces.iter().all(|p| !p.contains('\u{FFFD}')),
                        "{prefix:?} {stop:?}: {pieces:?}"
                    );
                    let first = stop
                        .iter()
                        .filter_map(|s| prefix.find(s).map(|i| (i + s.len(), i)))
                        .min();
                    match first {
                        Some((_, start)) => {
                            assert!(m.is_some(), "{prefix:?} {stop:?}");
                            assert_eq!(all, prefix[..start], "{prefix:?} {stop:?}");
                        }
                        None => assert_eq!((all.as_str(), m), (prefix, None), "{stop:?}"),
                    }
                }
            }
        }
    }
}
