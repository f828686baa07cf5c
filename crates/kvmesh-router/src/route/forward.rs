//! Forwarding to engines: the engine-bound request, the bounded wait for its answer, the headers a
//! client sees, and the one tap every engine response streams through.
//!
//! The tap ([`tap_body`]) owns the request's [`LoadGuard`], so load is released on success, engine
//! error, timeout, stream end and client disconnect alike; dropping the body also drops the
//! upstream response, which closes the engine connection and cancels the request there. The first
//! chunk marks the prefill as done (the engine's queue moved on); optional parts learn pull/compute
//! rates, wake the admission queue, and capture the engine's final `kv_transfer_params`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderName, HeaderValue, header};
use futures::StreamExt;
use kvmesh_core::KvTransferParams;
use kvmesh_core::load_report::{ROUTER_MARK_HEADER, RouterMark};
use kvmesh_core::sse::SseDataReader;
use kvmesh_index::EndpointId;
use kvmesh_sched::cost_model::{CostModel, Observation};
use serde_json::Value;

use crate::error::ApiError;
use crate::fleet::endpoints::Endpoint;
use crate::fleet::load::LoadGuard;
use crate::http::request::ApiKind;
use crate::metrics::RouterMetrics;
use crate::route::admission_queue::AdmissionQueue;
use crate::state::{RequestHook, RouterState};

/// llm-d's header naming the P2P source (stripped inbound; optionally set outbound).
pub const SOURCE_HEADER: &str = "x-kv-cache-source-host-port";
/// Request header asking for the decision summary in the response.
pub const EXPLAIN_HEADER: &str = "x-kvmesh-explain";
/// Response header with the decision summary (JSON).
pub const DECISION_HEADER: &str = "x-kvmesh-decision";
/// Response header naming the endpoint that served the request.
pub const ENDPOINT_HEADER: &str = "x-kvmesh-endpoint";

/// The request id a client sent (`x-request-id`, if printable and at most 128 bytes), or a new one.
pub(crate) fn request_id(headers: &HeaderMap) -> String {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty() && s.len() <= 128 && s.bytes().all(|b| b.is_ascii_graphic()))
        .map_or_else(|| format!("kvmesh-{}", uuid::Uuid::new_v4()), str::to_owned)
}

/// Whether the client asked for the routing decision in a response header (`x-kvmesh-explain`).
pub(crate) fn wants_explanation(headers: &HeaderMap) -> bool {
    headers
        .get(EXPLAIN_HEADER)
        .is_some_and(|v| v.as_bytes() == b"1" || v.as_bytes() == b"true")
}

/// The engine-bound POST of one client request: its body re-encoded, its id and its
/// credentials passed on, this replica's mark from the request's load `guard` (so the engine's
/// load report can tell every replica what it holds), and llm-d's source header when configured
/// and a source was named.
#[allow(clippy::too_many_arguments)]
pub(crate) fn engine_request(
    s: &RouterState,
    ep: &Endpoint,
    kind: ApiKind,
    request_id: &str,
    client_headers: &HeaderMap,
    payload: Bytes,
    guard: &LoadGuard,
    source_host_port: Option<&str>,
) -> reqwest::RequestBuilder {
    let (seq, uncached_tokens) = guard.mark();
    let mark = RouterMark {
        router: s.replica_id.to_string(),
        seq,
        uncached_tokens,
    };
    let mut req = s
        .client
        .post(ep.url(kind.path()))
        .header(header::CONTENT_TYPE, "application/json")
        .header("x-request-id", request_id)
        .header(ROUTER_MARK_HEADER, mark.to_header())
        .body(payload);
    if let Some(auth) = client_headers.get(header::AUTHORIZATION) {
        req = req.header(header::AUTHORIZATION, auth);
    }
    if s.config.source_header
        && let Some(hp) = source_host_port
    {
        req = req.header(SOURCE_HEADER, hp);
    }
    req
}

/// Engine path of the prefetch API (`POST /kvmesh/prefetch`; `DELETE …/{id}` cancels one): how
/// prefetch and hot-prefix replication ask an engine to pull blocks ahead of demand.
pub(crate) const PREFETCH_PATH: &str = "/kvmesh/prefetch";

/// Asks an engine to pull blocks ahead of demand (`POST /kvmesh/prefetch` with `body`) and waits
/// for its report: the report (None when the engine refused or did not answer in `timeout`), the
/// blocks that landed and the engine's block size (`default_block_size` when it did not say).
pub(crate) async fn send_prefetch(
    s: &RouterState,
    url: String,
    body: &Value,
    timeout: Duration,
    default_block_size: usize,
) -> (Option<Value>, u64, u64) {
    let reply = s.client.post(url).json(body).timeout(timeout).send().await;
    let report: Option<Value> = match reply {
        Ok(r) if r.status().is_success() => r.json().await.ok(),
        _ => None,
    };
    let field = |k: &str| {
        report
            .as_ref()
            .and_then(|r| r.get(k))
            .and_then(Value::as_u64)
    };
    let blocks = field("blocks").unwrap_or(0);
    let block_size = field("block_size").unwrap_or(default_block_size as u64);
    (report, blocks, block_size)
}

/// Why an engine request produced no response.
pub(crate) struct SendFailure {
    pub error: ApiError,
    /// Nothing reached the client and the engine sent no byte: another endpoint may take it.
    pub retryable: bool,
}

/// An attempt that produced no response, and the endpoint it failed on (if it got that far).
pub(crate) type Failed = (SendFailure, Option<Arc<Endpoint>>);

/// A failure before any engine was tried (nothing to retry elsewhere).
pub(crate) fn refused(error: ApiError) -> Failed {
    (
        SendFailure {
            error,
            retryable: false,
        },
        None,
    )
}

/// Sends a request to an engine within the router's request timeout. An engine that cannot be
/// reached becomes a counted OpenAI-style 502 (and, when it refused the connection, is ejected at
/// once: the health loop returns it), one that does not answer in time a 504.
///
/// A refused connection means no process listens there: the engine died or is restarting, and its
/// KV cache went with it. Its index entries are dropped at the ejection, so when the health loop
/// readmits the new process the router does not place requests on it, or name it as a P2P
/// source, for blocks it no longer holds (before, they stayed until the new process's first
/// event batch; the chaos run measured 40,960 such tokens for up to 0.5 s).
pub(crate) async fn send_to_engine(
    s: &RouterState,
    ep: &Endpoint,
    req: reqwest::RequestBuilder,
) -> Result<reqwest::Response, SendFailure> {
    match tokio::time::timeout(s.config.request_timeout, req.send()).await {
        Ok(Ok(r)) => Ok(r),
        Ok(Err(e)) => {
            s.metrics.error("upstream_connect");
            tracing::warn!(endpoint = %ep.name, error = %error_chain(&e), "engine request failed");
            if e.is_connect() && ep.eject() {
                s.prefix.remove_endpoint(ep.id);
                tracing::warn!(endpoint = %ep.name, "endpoint refused a connection; ejected until it passes health checks, its index entries dropped");
                s.metrics
                    .endpoint_changes
                    .get_or_create(&crate::metrics::Kind { kind: "ejected" })
                    .inc();
            }
            Err(SendFailure {
                error: ApiError::bad_gateway(format!("endpoint {} failed: {e}", ep.name)),
                retryable: true,
            })
        }
        Err(_) => {
            s.metrics.error("upstream_timeout");
            // The time budget is spent (and the engine may have been computing): no retry.
            Err(SendFailure {
                error: ApiError::gateway_timeout(format!(
                    "endpoint {} did not answer in time",
                    ep.name
                )),
                retryable: false,
            })
        }
    }
}

/// An error with its causes (`reqwest`'s message alone is "error sending request for url"; the
/// cause — connect timeout, reset, closed connection — is in its source chain).
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cur = c.source();
    }
    out
}

/// The engine's response headers a client should see (hop-by-hop ones dropped), plus which
/// endpoint served it.
pub(crate) fn forwarded_headers(upstream: &reqwest::Response, ep: &Endpoint) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (k, v) in upstream.headers() {
        if !is_hop_by_hop(k) {
            headers.append(k.clone(), v.clone());
        }
    }
    if let Ok(v) = HeaderValue::from_str(&ep.name) {
        headers.insert(HeaderName::from_static(ENDPOINT_HEADER), v);
    }
    headers
}

pub(crate) fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
    )
}

/// A clean sample for the cost model: the endpoint, the tokens it computed, the pull it made
/// (source, tokens), timed from sending to the first byte.
pub(crate) struct Learn {
    pub cost_model: Arc<CostModel>,
    pub endpoint: EndpointId,
    pub computed_tokens: u64,
    pub pulled: Option<(EndpointId, u64)>,
    /// Transfers already sharing the pull's links when it was named.
    pub pull_sharing: u64,
    pub dispatched: Instant,
}

/// Where captured `kv_transfer_params` go (P/D: the conversation cache).
pub(crate) type ParamsSink = Box<dyn Fn(KvTransferParams) + Send + Sync>;

/// How long the tap waits for an engine's next chunk, and how it ends a body that stalls: a
/// frozen engine (SIGSTOP, a wedged GPU) keeps its connection open and sends nothing, and its
/// health checks eject it for new requests but cannot end the streams already on it.
pub(crate) struct StallCut {
    /// The first chunk must arrive by then: `request_timeout` after the request was sent, the
    /// same budget as the response headers (an engine answers a stream's headers at once and
    /// its first chunk after the prefill, which may queue).
    first_chunk_by: tokio::time::Instant,
    /// The longest gap between later chunks (`stream_idle_timeout`).
    idle: Duration,
    /// The body is SSE: it ends with an error event rather than a cut connection.
    sse: bool,
    endpoint: Arc<str>,
    metrics: Arc<RouterMetrics>,
}

impl StallCut {
    /// The router's bounds for a request to `ep` sent at `sent`; `sse` when the client asked
    /// for a stream.
    pub(crate) fn new(s: &RouterState, ep: &Endpoint, sent: Instant, sse: bool) -> Self {
        StallCut {
            first_chunk_by: tokio::time::Instant::from_std(sent + s.config.request_timeout),
            idle: s.config.stream_idle_timeout,
            sse,
            endpoint: Arc::clone(&ep.name),
            metrics: Arc::clone(&s.metrics),
        }
    }

    /// The next chunk, or `None` (the stall is counted) when it does not come in time.
    async fn next<S: futures::Stream + Unpin>(
        &self,
        chunks: &mut S,
        first: bool,
    ) -> Option<Option<S::Item>> {
        let next = chunks.next();
        let got = if first {
            tokio::time::timeout_at(self.first_chunk_by, next).await
        } else {
            tokio::time::timeout(self.idle, next).await
        };
        if got.is_err() {
            self.metrics.error("upstream_stalled");
            tracing::warn!(endpoint = %self.endpoint, first_chunk = first, "engine response stalled; ending it");
        }
        got.ok()
    }

    /// What ends a stalled body: an SSE error event (after a blank line unless the body so far
    /// ended at an event boundary), or an I/O error that cuts a non-stream one.
    fn ending(&self, at_event_boundary: bool) -> Result<Bytes, std::io::Error> {
        if !self.sse {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("endpoint {} stalled", self.endpoint),
            ));
        }
        let error = ApiError::gateway_timeout(format!(
            "endpoint {} stalled: no data for longer than the router's stream_idle_timeout",
            self.endpoint
        ));
        let event = error.sse_event();
        Ok(Bytes::from(if at_event_boundary {
            event
        } else {
            format!("\n\n{event}")
        }))
    }
}

/// What the tap does besides passing bytes through.
pub(crate) struct Tap {
    /// Bounds the waits for the engine's chunks.
    pub stall: StallCut,
    /// Released when the body ends, however it ends.
    pub guard: LoadGuard,
    /// Learn rates from this response's first byte.
    pub learn: Option<Learn>,
    /// Woken when the prefill is over (first byte) and when the body ends.
    pub admission_queue: Option<Arc<AdmissionQueue>>,
    /// Capture the engine's final `kv_transfer_params`: `stream` says whether the body is SSE.
    pub capture: Option<(bool, ParamsSink)>,
    /// The features following the request ([`RequestHook::on_end`]): told when the body ends,
    /// however it ends, if the engine sent at least one byte (its prefill ran: the prompt's
    /// blocks exist there).
    pub on_end: Vec<Box<dyn RequestHook>>,
}

/// Tells its hooks the body ended when dropped, if `armed` (see [`Tap::on_end`]). A drop, not
/// code after the stream's loop: hyper drops a body with a `Content-Length` once that many bytes
/// are out.
struct EndHook {
    hooks: Vec<Box<dyn RequestHook>>,
    armed: bool,
}

impl Drop for EndHook {
    fn drop(&mut self) {
        if self.armed {
            for h in std::mem::take(&mut self.hooks) {
                h.on_end();
            }
        }
    }
}

/// Largest non-stream body kept to read its `kv_transfer_params`.
const MAX_CAPTURE_BYTES: usize = 16 << 20;

/// Finds a non-null `kv_transfer_params` in one JSON document.
fn params_in(doc: &[u8]) -> Option<KvTransferParams> {
    let v: Value = serde_json::from_slice(doc).ok()?;
    let p = v.get("kv_transfer_params")?;
    if p.is_null() {
        return None;
    }
    serde_json::from_value(p.clone()).ok()
}

/// The engine's body passed through unchanged, doing what `tap` asks (see the module docs).
pub(crate) fn tap_body(upstream: reqwest::Response, tap: Tap) -> Body {
    let Tap {
        stall,
        mut guard,
        learn,
        admission_queue,
        capture,
        on_end,
    } = tap;
    let mut capture = capture.map(|(stream, sink)| Capturer::new(stream, sink));
    let mut end_hook = EndHook {
        hooks: on_end,
        armed: false,
    };
    // Held requests re-check when this one's prefill is over and when it ends (however it ends).
    let wake = WakeOnDrop(admission_queue.clone());
    let out = async_stream::stream! {
        let mut chunks = upstream.bytes_stream();
        let (mut first, mut cut) = (true, false);
        // Whether the bytes passed on so far end between two SSE events.
        let mut at_event_boundary = true;
        loop {
            let Some(next) = stall.next(&mut chunks, first).await else {
                if let Some(prev) = capture.as_mut().and_then(Capturer::cut) {
                    at_event_boundary = prev.ends_with(b"\n\n");
                    yield Ok(prev);
                }
                cut = true;
                yield stall.ending(at_event_boundary);
                break;
            };
            let Some(chunk) = next else { break };
            match chunk {
                Ok(bytes) => {
                    if first {
                        first = false;
                        end_hook.armed = true;
                        prefill_over(&mut guard, admission_queue.as_deref(), learn.as_ref());
                    } else {
                        guard.output_continues();
                    }
                    let now = match &mut capture {
                        None => Some(bytes),
                        Some(c) => c.chunk(bytes),
                    };
                    if let Some(b) = now {
                        if !b.is_empty() {
                            at_event_boundary = b.ends_with(b"\n\n");
                        }
                        yield Ok::<Bytes, std::io::Error>(b);
                    }
                }
                Err(e) => {
                    // The body is cut short: hand on what arrived, capture nothing.
                    if let Some(prev) = capture.as_mut().and_then(Capturer::cut) {
                        yield Ok(prev);
                    }
                    cut = true;
                    yield Err(std::io::Error::other(e));
                    break;
                }
            }
        }
        if !first && !cut {
            guard.output_done();
        }
        if let Some(last) = capture.as_mut().and_then(Capturer::end) {
            yield Ok(last);
        }
        drop(guard);
        drop(wake);
        drop(end_hook);
    };
    Body::from_stream(out)
}

/// The first byte: the engine's prefill is over. Its queue moved on (held requests re-check),
/// and a clean sample teaches the cost model.
fn prefill_over(
    guard: &mut LoadGuard,
    admission_queue: Option<&AdmissionQueue>,
    learn: Option<&Learn>,
) {
    guard.prefill_done();
    if let Some(d) = admission_queue {
        d.wake();
    }
    if let Some(l) = learn {
        l.cost_model.observe(Observation {
            endpoint: l.endpoint,
            computed_tokens: l.computed_tokens,
            pulled: l.pulled,
            pull_sharing: l.pull_sharing,
            ttft: l.dispatched.elapsed(),
        });
    }
}

/// Reads an engine's final `kv_transfer_params` out of the body passing through.
///
/// Captured params are handed on before the chunk that completes them: a non-stream body comes
/// with the engine's `Content-Length`, and hyper drops the body stream as soon as that many bytes
/// are written, so code after the last chunk never runs. A captured non-stream body therefore
/// holds back its latest chunk until the next one (or the end) arrives — its client reads the
/// whole document anyway — and an SSE stream hands the params on as soon as their line is complete.
struct Capturer {
    /// SSE (`data:` lines) or one JSON document.
    stream: bool,
    sink: ParamsSink,
    sse: SseDataReader,
    /// The document so far (non-stream), unless it outgrew [`MAX_CAPTURE_BYTES`].
    buf: Vec<u8>,
    overflow: bool,
    /// The latest chunk of a non-stream body, held back.
    held: Option<Bytes>,
}

impl Capturer {
    fn new(stream: bool, sink: ParamsSink) -> Self {
        Capturer {
            stream,
            sink,
            sse: SseDataReader::new(),
            buf: Vec::new(),
            overflow: false,
            held: None,
        }
    }

    /// A chunk arrived: what to pass on now.
    fn chunk(&mut self, bytes: Bytes) -> Option<Bytes> {
        if self.stream {
            self.sse.push(&bytes);
            while let Some(doc) = self.sse.next_data() {
                if let Some(p) = params_in(doc.trim_ascii()) {
                    (self.sink)(p);
                }
            }
            return Some(bytes);
        }
        if !self.overflow {
            self.buf.extend_from_slice(&bytes);
            if self.buf.len() > MAX_CAPTURE_BYTES {
                self.overflow = true;
                self.buf = Vec::new();
            }
        }
        self.held.replace(bytes)
    }

    /// The body was cut short: what was held back, nothing captured.
    fn cut(&mut self) -> Option<Bytes> {
        self.held.take()
    }

    /// The body ended: the document's params handed on, then its last chunk.
    fn end(&mut self) -> Option<Bytes> {
        let last = self.held.take()?;
        if !self.overflow
            && let Some(p) = params_in(&self.buf)
        {
            (self.sink)(p);
        }
        Some(last)
    }
}

/// Wakes the admission queue when dropped (after the load guard it follows).
struct WakeOnDrop(Option<Arc<AdmissionQueue>>);

impl Drop for WakeOnDrop {
    fn drop(&mut self) {
        if let Some(d) = &self.0 {
            d.wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::registry::Registry;

    #[test]
    fn errors_name_their_cause() {
        #[derive(Debug, thiserror::Error)]
        #[error("error sending request for url (http://p0/v1/completions)")]
        struct Send(#[source] std::io::Error);
        let e = Send(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "connection reset by peer",
        ));
        assert_eq!(
            error_chain(&e),
            "error sending request for url (http://p0/v1/completions): connection reset by peer"
        );
    }

    fn stall_cut(sse: bool) -> (StallCut, Registry) {
        let mut registry = Registry::default();
        let metrics = Arc::new(RouterMetrics::register(&mut registry));
        let cut = StallCut {
            first_chunk_by: tokio::time::Instant::now() + Duration::from_secs(600),
            idle: Duration::from_secs(60),
            sse,
            endpoint: "e0".into(),
            metrics,
        };
        (cut, registry)
    }

    fn stalls_counted(registry: &Registry) -> bool {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
        text.contains(r#"kvmesh_router_errors_total{kind="upstream_stalled"} 1"#)
    }

    #[tokio::test(start_paused = true)]
    async fn the_first_chunk_may_take_the_request_timeout_later_ones_the_idle_timeout() {
        let (cut, registry) = stall_cut(true);
        let t0 = tokio::time::Instant::now();
        // A prefill of 5 minutes is waited for.
        let mut slow_first = Box::pin(futures::stream::once(async {
            tokio::time::sleep(Duration::from_secs(300)).await;
            1
        }));
        assert_eq!(cut.next(&mut slow_first, true).await, Some(Some(1)));
        // A gap of 61 s after it is a stall, cut at 60 s.
        let t1 = tokio::time::Instant::now();
        let mut frozen = futures::stream::pending::<u8>();
        assert_eq!(cut.next(&mut frozen, false).await, None);
        assert_eq!(t1.elapsed(), Duration::from_secs(60));
        assert!(stalls_counted(&registry));
        // The first chunk too is bounded: by the request timeout.
        let (cut, _) = stall_cut(true);
        assert_eq!(cut.next(&mut frozen, true).await, None);
        assert_eq!(t0.elapsed(), Duration::from_secs(300 + 60 + 600));
    }

    #[test]
    fn a_stalled_stream_ends_with_an_error_event_openai_clients_raise() {
        let (cut, _) = stall_cut(true);
        let event = cut.ending(true).unwrap();
        let text = std::str::from_utf8(&event).unwrap();
        let doc: Value = serde_json::from_str(
            text.strip_prefix("data: ")
                .and_then(|t| t.strip_suffix("\n\n"))
                .unwrap(),
        )
        .unwrap();
        assert_eq!(doc["error"]["code"], 504);
        assert!(
            doc["error"]["message"]
                .as_str()
                .unwrap()
                .contains("e0 stalled")
        );
        // Mid-event, the event starts after a blank line, so it is not glued to the cut one.
        assert!(cut.ending(false).unwrap().starts_with(b"\n\ndata: {"));
        // A non-stream body is cut with an error (the client sees a truncated body).
        let (cut, _) = stall_cut(false);
        assert_eq!(
            cut.ending(true).unwrap_err().kind(),
            std::io::ErrorKind::TimedOut
        );
    }

    #[test]
    fn only_non_null_params_are_captured() {
        assert!(params_in(br#"{"kv_transfer_params": null}"#).is_none());
        assert!(params_in(b"not json").is_none());
        let p = params_in(br#"{"kv_transfer_params": {"remote_num_tokens": 7}}"#);
        assert_eq!(p.and_then(|p| p.remote_num_tokens), Some(7));
    }
}
