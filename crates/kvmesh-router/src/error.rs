//! OpenAI-style error responses, built by constructors named after the status, and the router's
//! library error type.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An error answered to the client as `{"error": {"message", "type", "param", "code"}}` (vLLM's shape).
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
    /// Seconds a client should wait before retrying (sent as `Retry-After`), for overload answers.
    pub retry_after_secs: Option<u64>,
    /// The request field a 400 is about (`max_tokens`, `messages`, ...), sent as `param`.
    pub param: Option<&'static str>,
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "BadRequestError",
            message: message.into(),
            retry_after_secs: None,
            param: None,
        }
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "NotFoundError",
            message: message.into(),
            retry_after_secs: None,
            param: None,
        }
    }
    pub fn bad_gateway(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_GATEWAY,
            kind: "BadGatewayError",
            message: message.into(),
            retry_after_secs: None,
            param: None,
        }
    }
    pub fn gateway_timeout(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::GATEWAY_TIMEOUT,
            kind: "TimeoutError",
            message: message.into(),
            retry_after_secs: None,
            param: None,
        }
    }
    pub fn service_unavailable(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "ServiceUnavailableError",
            message: message.into(),
            retry_after_secs: None,
            param: None,
        }
    }
}

impl ApiError {
    /// A 400 about one request field, named in `param` (OpenAI's error shape).
    pub fn bad_param(param: &'static str, message: impl Into<String>) -> Self {
        ApiError::bad_request(message).with_param(param)
    }

    /// The same error, naming the request field it is about.
    pub fn with_param(self, param: &'static str) -> Self {
        ApiError {
            param: Some(param),
            ..self
        }
    }

    /// 503 with `Retry-After`: the router is at its in-flight bound.
    pub fn overloaded(message: impl Into<String>, retry_after_secs: u64) -> Self {
        ApiError {
            retry_after_secs: Some(retry_after_secs),
            ..ApiError::service_unavailable(message)
        }
    }
}

impl ApiError {
    /// The JSON body: `{"error": {"message", "type", "param", "code"}}`.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status.as_u16()}})
    }

    /// The error as the last event of an SSE stream already under way (its status line is long
    /// sent): `data: <body>` and a blank line. OpenAI's clients raise an event with an `error`
    /// field as an `APIError`, as they do vLLM's own mid-stream errors.
    pub fn sse_event(&self) -> String {
        format!("data: {}\n\n", self.body())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = self.body();
        let mut resp = (self.status, axum::Json(body)).into_response();
        if let Some(secs) = self.retry_after_secs {
            resp.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, secs.into());
        }
        resp
    }
}

/// Errors starting or running the router.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error(transparent)]
    Config(#[from] crate::config::error::ConfigError),
    #[error(transparent)]
    Plugin(#[from] kvmesh_sched::plugins::PluginError),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("http client: {0}")]
    Http(String),
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    #[error("watching endpoints file: {0}")]
    Watch(String),
    #[error(transparent)]
    Discovery(#[from] crate::fleet::discovery::DiscoveryError),
}
