//! Request bodies are read whole, before the handler runs, under three bounds:
//!
//! - **A deadline that bytes cannot keep pushing back.** A body must be complete within
//!   [`HttpLimits::body_timeout`] of its headers, plus `1 / body_min_rate` seconds per byte
//!   received. A large prompt arriving at a reasonable rate always gets through (64 MiB at the
//!   default 256 KiB/s minimum earns 256 s on top of the 30 s), while a client trickling one byte
//!   every few seconds is cut after `body_timeout`; no body can take longer than
//!   `body_timeout + max_body_bytes / body_min_rate`. Two chunks may also be no further apart
//!   than [`HttpLimits::header_read_timeout`] (a stall is cut early). Before this, a 10 s timer
//!   restarted on every chunk, and one byte every 5 s held a connection forever (issue 37).
//! - **A size bound**: [`HttpLimits::max_body_bytes`], checked against `Content-Length` before
//!   anything is read, and against the bytes received for chunked bodies (413).
//! - **A memory budget shared by all requests**: [`HttpLimits::body_memory`] bytes of bodies held
//!   at once, reserved as bytes arrive and released when the handler has produced its response.
//!   Past it the request is answered 503 with `Retry-After` at once. Reserving as bytes arrive
//!   (not on the strength of a declared `Content-Length`) means a client must really send the
//!   bytes it holds: 16 connections declaring 64 MiB and sending nothing cannot take the budget.
//!
//! The body lands in one buffer that grows as bytes arrive (never allocated from a declared
//! length beyond 1 MiB) and reaches the handler as a single `Bytes`, so axum's extractors take
//! it without another copy.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, HttpBody};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use bytes::BytesMut;
use http_body_util::BodyExt;
use prometheus_client::metrics::gauge::Gauge;
use tokio::time::Instant;

use crate::HttpLimits;
use crate::stats::HttpStats;

/// Largest buffer allocated up front from a declared `Content-Length`; beyond it the buffer grows
/// with the bytes that actually arrive.
const PREALLOCATE_MAX: usize = 1 << 20;

/// Bytes of request bodies held at once, across all connections. Its counter is the
/// `kvmesh_http_body_bytes_in_flight` gauge.
#[derive(Debug, Clone)]
pub(crate) struct BodyBudget {
    used: Gauge,
    cap: usize,
}

/// Bytes reserved from a [`BodyBudget`]; given back when dropped.
#[derive(Debug)]
pub(crate) struct Reservation {
    bytes: usize,
    budget: BodyBudget,
}

impl BodyBudget {
    pub(crate) fn new(cap: usize, used: Gauge) -> BodyBudget {
        BodyBudget { used, cap }
    }

    /// An empty reservation, grown as bytes arrive.
    pub(crate) fn reservation(&self) -> Reservation {
        Reservation {
            bytes: 0,
            budget: self.clone(),
        }
    }
}

impl Reservation {
    /// Reserves `more` bytes; false (and nothing reserved) when the budget has no room.
    pub(crate) fn try_grow(&mut self, more: usize) -> bool {
        let more_i = i64::try_from(more).unwrap_or(i64::MAX);
        let before = self.budget.used.inc_by(more_i);
        let after = usize::try_from(before.saturating_add(more_i)).unwrap_or(usize::MAX);
        if after > self.budget.cap {
            self.budget.used.dec_by(more_i);
            return false;
        }
        self.bytes += more;
        true
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget
            .used
            .dec_by(i64::try_from(self.bytes).unwrap_or(i64::MAX));
    }
}

/// When a body whose headers ended at `started` and which has delivered `received` bytes must be
/// complete: `body_timeout` plus the time `received` bytes earn at the minimum rate.
pub(crate) fn body_deadline(started: Instant, received: usize, limits: &HttpLimits) -> Instant {
    let earned = received as f64 / limits.body_min_rate.max(1) as f64;
    started + limits.body_timeout + Duration::from_secs_f64(earned.min(1e9))
}

/// Why a body was not read to its end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodyRefusal {
    TooLarge,
    MemoryBudget,
    Deadline,
    Stalled,
    ReadError,
}

impl BodyRefusal {
    fn label(self) -> &'static str {
        match self {
            BodyRefusal::TooLarge => "too_large",
            BodyRefusal::MemoryBudget => "memory_budget",
            BodyRefusal::Deadline => "deadline",
            BodyRefusal::Stalled => "stalled",
            BodyRefusal::ReadError => "read_error",
        }
    }

    /// The OpenAI-style error the servers answer (`{"error": {message, type, param, code}}`);
    /// the connection is closed after it, since the rest of the body is never read.
    fn response(self, limits: &HttpLimits) -> Response {
        let (status, kind, message) = match self {
            BodyRefusal::TooLarge => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "BadRequestError",
                format!("request body larger than {} bytes", limits.max_body_bytes),
            ),
            BodyRefusal::MemoryBudget => (
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailableError",
                "too many request bodies in flight; retry shortly".to_owned(),
            ),
            BodyRefusal::Deadline => (
                StatusCode::REQUEST_TIMEOUT,
                "TimeoutError",
                format!(
                    "request body not received in time ({} s plus 1 s per {} bytes received)",
                    limits.body_timeout.as_secs_f64(),
                    limits.body_min_rate
                ),
            ),
            BodyRefusal::Stalled => (
                StatusCode::REQUEST_TIMEOUT,
                "TimeoutError",
                format!(
                    "request body stalled for {} s",
                    limits.header_read_timeout.as_secs_f64()
                ),
            ),
            BodyRefusal::ReadError => (
                StatusCode::BAD_REQUEST,
                "BadRequestError",
                "request body could not be read".to_owned(),
            ),
        };
        let body = serde_json::json!({"error": {"message": message, "type": kind, "param": null, "code": status.as_u16()}});
        let mut resp = (status, axum::Json(body)).into_response();
        let headers = resp.headers_mut();
        headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        if self == BodyRefusal::MemoryBudget {
            headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}

/// What the body-reading middleware needs.
#[derive(Debug)]
pub(crate) struct BodyGuard {
    pub(crate) limits: HttpLimits,
    pub(crate) budget: BodyBudget,
    pub(crate) stats: HttpStats,
}

/// Axum middleware: reads the request body whole under the bounds above, hands it to the
/// handler as one buffer, and keeps its bytes reserved until the handler has answered.
pub(crate) async fn read_whole_body(
    State(guard): State<Arc<BodyGuard>>,
    req: Request,
    next: Next,
) -> Response {
    let (parts, body) = req.into_parts();
    if HttpBody::is_end_stream(&body) {
        return next.run(Request::from_parts(parts, body)).await;
    }
    match read_body(&guard, body).await {
        Ok((bytes, reservation)) => {
            let response = next
                .run(Request::from_parts(parts, Body::from(bytes)))
                .await;
            drop(reservation);
            response
        }
        Err(refusal) => {
            guard.stats.refuse_body(refusal.label());
            tracing::debug!(reason = refusal.label(), "request body refused");
            refusal.response(&guard.limits)
        }
    }
}

async fn read_body(
    guard: &BodyGuard,
    mut body: Body,
) -> Result<(bytes::Bytes, Reservation), BodyRefusal> {
    let limits = &guard.limits;
    let started = Instant::now();
    let declared = HttpBody::size_hint(&body).exact();
    if declared.is_some_and(|n| n > limits.max_body_bytes as u64) {
        return Err(BodyRefusal::TooLarge);
    }
    let declared = declared.map_or(0, |n| usize::try_from(n).unwrap_or(usize::MAX));
    let mut reservation = guard.budget.reservation();
    let mut buf = BytesMut::with_capacity(declared.min(PREALLOCATE_MAX));
    let mut last_chunk = started;
    loop {
        let complete_by = body_deadline(started, buf.len(), limits);
        let stalls_at = last_chunk + limits.header_read_timeout;
        let frame = match tokio::time::timeout_at(complete_by.min(stalls_at), body.frame()).await {
            Err(_) if stalls_at < complete_by => return Err(BodyRefusal::Stalled),
            Err(_) => return Err(BodyRefusal::Deadline),
            Ok(None) => break,
            Ok(Some(Err(_))) => return Err(BodyRefusal::ReadError),
            Ok(Some(Ok(frame))) => frame,
        };
        // Trailers carry nothing a handler reads.
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if buf.len() + data.len() > limits.max_body_bytes {
            return Err(BodyRefusal::TooLarge);
        }
        if !reservation.try_grow(data.len()) {
            return Err(BodyRefusal::MemoryBudget);
        }
        buf.extend_from_slice(&data);
        last_chunk = Instant::now();
    }
    Ok((buf.freeze(), reservation))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_is_shared_and_given_back() {
        let budget = BodyBudget::new(100, Gauge::default());
        let mut a = budget.reservation();
        let mut b = budget.reservation();
        assert!(a.try_grow(60));
        assert!(!b.try_grow(41), "60 + 41 > 100");
        assert!(b.try_grow(40));
        assert_eq!(budget.used.get(), 100);
        drop(a);
        assert_eq!(budget.used.get(), 40);
        assert!(b.try_grow(60));
        drop(b);
        assert_eq!(budget.used.get(), 0);
    }

    #[test]
    fn bytes_earn_time_at_the_minimum_rate_only() {
        let limits = HttpLimits {
            body_timeout: Duration::from_secs(30),
            body_min_rate: 1 << 20,
            ..HttpLimits::default()
        };
        let t0 = Instant::now();
        assert_eq!(body_deadline(t0, 0, &limits), t0 + Duration::from_secs(30));
        // 64 MiB at the minimum rate earns 64 s on top: a slow but steady upload gets through.
        assert_eq!(
            body_deadline(t0, 64 << 20, &limits),
            t0 + Duration::from_secs(94)
        );
        // A trickle earns nothing to speak of: one byte every 5 s is cut after ~30 s.
        let trickle = body_deadline(t0, 6, &limits);
        assert!(trickle < t0 + Duration::from_millis(30_001));
    }
}
