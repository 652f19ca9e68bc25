//! `fastlane router`: the multi-tenant front end as a proxy before any OpenAI-compatible
//! server (ours with `--policy fifo`, vLLM, SGLang, llama.cpp's server).
//!
//! Per request: the tenant from its bearer key (401), the body checked as JSON (400 naming
//! what is wrong), admission through the [`Gate`] (429 / 503), then the request is sent
//! upstream unchanged and the response streamed back frame by frame, never buffered. The
//! slot is held until the response's last byte. TTFT is measured at the router: request
//! arrival to the first body bytes written towards the client; inter-token latency is the
//! gap between body frames (one SSE event each from our server and from vLLM's).
//!
//! The fence (`max_stream_seconds`) ends a stream with a final SSE error event and
//! `data: [DONE]`, then drops the upstream response, which closes that upstream connection:
//! the upstream server sees a disconnected client and aborts the request (ours within one
//! step). A client that disconnects drops the response body here, with the same effect.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

use crate::api::{
    fence_event, tenant_body, tenant_of_headers, ApiError, BodyLimits, DEFAULT_MAX_TOKENS,
};
use crate::gate::{Gate, GateError, Permit};
use crate::protocol::Health;
use crate::{Metrics, Router, TenantLatency, Tenants};

/// Router settings.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// Base URL of the upstream, `http://HOST:PORT` (no TLS).
    pub upstream: Uri,
    /// Requests in flight at the upstream at most (the dispatch slots).
    pub upstream_slots: usize,
    /// Of those, kept for the interactive tier (the batch tier holds the rest at most).
    pub interactive_slots: usize,
    /// Streamed batch-tier requests dispatched whose first bytes have not come back, at most
    /// (0: no limit); see [`Gate`]. A non-streamed one is not counted: its prompt's progress
    /// cannot be seen from here.
    pub batch_prefills: usize,
    /// Sent upstream as `Authorization: Bearer KEY` (the client's own key is not forwarded).
    pub upstream_key: Option<String>,
    /// Sent instead of `upstream_key` with batch-tier tenants' requests: an upstream that
    /// has tenants of its own (ours with a tenants file) then sees the router's tiers.
    pub upstream_batch_key: Option<String>,
    /// Time to get the upstream's response headers; beyond, 504.
    pub upstream_timeout: Duration,
    /// DRR quantum, estimated tokens.
    pub quantum_tokens: u64,
    /// Request bodies' size and time limits.
    pub body_limits: BodyLimits,
}

/// What the proxy's handlers share.
pub struct ProxyState {
    gate: Arc<Gate>,
    tenants: Tenants,
    metrics: Metrics,
    client: Client<HttpConnector, Full<Bytes>>,
    cfg: ProxyConfig,
}

impl std::fmt::Debug for ProxyState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyState").field("cfg", &self.cfg).field("gate", &self.gate).finish()
    }
}

impl ProxyState {
    /// The state; call inside a tokio runtime (the gate spawns its refill task).
    pub fn new(cfg: ProxyConfig, tenants: Tenants, metrics: Metrics) -> Arc<ProxyState> {
        let gate = Gate::new(
            &tenants,
            cfg.upstream_slots,
            cfg.interactive_slots,
            cfg.batch_prefills,
            cfg.quantum_tokens,
            Some(metrics.queue_depth.clone()),
        );
        let mut conn = HttpConnector::new();
        conn.set_nodelay(true);
        conn.set_connect_timeout(Some(cfg.upstream_timeout));
        let client = Client::builder(TokioExecutor::new()).build(conn);
        Arc::new(ProxyState { gate, tenants, metrics, client, cfg })
    }

    /// The gate (for tests and logs).
    pub fn gate(&self) -> &Arc<Gate> {
        &self.gate
    }
}

/// The router's endpoints: the two generation endpoints gated and proxied, `/v1/models`
/// proxied, `/metrics` its own, and health: `/livez` (the router answers), `/readyz` and
/// `/health` (503 unless the upstream's `/health` answers 200 within 2 s).
pub fn router(state: Arc<ProxyState>) -> Router {
    Router::new()
        .route("/health", get(ready))
        .route("/readyz", get(ready))
        .route("/livez", get(|| async { Health::ok().response() }))
        .route("/metrics", get(metrics_text))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(generate))
        .route("/v1/chat/completions", post(generate))
        .fallback(|| async {
            ApiError::new(StatusCode::NOT_FOUND, "not_found_error", "no such endpoint")
        })
        .with_state(state)
}

async fn metrics_text(State(st): State<Arc<ProxyState>>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, fastlane_daemon::metrics::TEXT_FORMAT)], st.metrics.render())
}

fn upstream_uri(st: &ProxyState, path: &str) -> Result<Uri, ApiError> {
    let base = st.cfg.upstream.to_string();
    format!("{}{path}", base.trim_end_matches('/')).parse().map_err(|_| {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "bad upstream URL")
    })
}

fn upstream_error(e: impl std::fmt::Display) -> ApiError {
    ApiError::new(StatusCode::BAD_GATEWAY, "upstream_error", format!("upstream: {e}"))
}

async fn send(
    st: &ProxyState,
    method: axum::http::Method,
    path: &str,
    body: Bytes,
    batch: bool,
) -> Result<Response<hyper::body::Incoming>, ApiError> {
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(upstream_uri(st, path)?)
        .header(header::CONTENT_TYPE, "application/json");
    let key = match &st.cfg.upstream_batch_key {
        Some(k) if batch => Some(k),
        _ => st.cfg.upstream_key.as_ref(),
    };
    if let Some(k) = key {
        req = req.header(header::AUTHORIZATION, format!("Bearer {k}"));
    }
    let req = req.body(Full::new(body)).map_err(upstream_error)?;
    match tokio::time::timeout(st.cfg.upstream_timeout, st.client.request(req)).await {
        Ok(Ok(r)) => Ok(r),
        Ok(Err(e)) => Err(upstream_error(e)),
        Err(_) => Err(ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "upstream_error",
            format!("upstream sent no response headers within {:?}", st.cfg.upstream_timeout),
        )),
    }
}

/// How long readiness waits for the upstream's `/health`.
const UPSTREAM_HEALTH_TIMEOUT: Duration = Duration::from_secs(2);

async fn ready(State(st): State<Arc<ProxyState>>) -> Response {
    let check = send(&st, axum::http::Method::GET, "/health", Bytes::new(), false);
    let h = match tokio::time::timeout(UPSTREAM_HEALTH_TIMEOUT, check).await {
        Ok(Ok(r)) if r.status().is_success() => Health::ok(),
        Ok(Ok(r)) => Health::bad(
            "upstream_unavailable",
            format!("upstream /health answered {}", r.status().as_u16()),
        ),
        Ok(Err(e)) => {
            Health::bad("upstream_unavailable", format!("upstream /health: {}", e.message()))
        }
        Err(_) => Health::bad(
            "upstream_unavailable",
            format!("upstream /health: no answer within {UPSTREAM_HEALTH_TIMEOUT:?}"),
        ),
    };
    h.response()
}

async fn models(State(st): State<Arc<ProxyState>>) -> Response {
    match send(&st, axum::http::Method::GET, "/v1/models", Bytes::new(), false).await {
        Ok(r) => {
            let (parts, body) = r.into_parts();
            Response::from_parts(parts, Body::new(body))
        }
        Err(e) => e.into_response(),
    }
}

/// A rough token count for DRR's cost: 4 bytes a token (the estimate only orders tenants).
pub fn estimate_tokens(v: &Value) -> u64 {
    let text_len = |v: &Value| -> usize {
        match v {
            Value::String(s) => s.len(),
            Value::Array(a) => a.len() * 4,
            _ => 0,
        }
    };
    let prompt = match (v.get("prompt"), v.get("messages")) {
        (Some(p), _) => text_len(p),
        (None, Some(Value::Array(ms))) => {
            ms.iter().map(|m| m.get("content").map_or(0, text_len)).sum()
        }
        _ => 0,
    };
    // `max_completion_tokens` is the newer name of the same limit (the engine takes either).
    let max_tokens = ["max_completion_tokens", "max_tokens"]
        .iter()
        .find_map(|k| v.get(*k).and_then(Value::as_u64))
        .unwrap_or(u64::from(DEFAULT_MAX_TOKENS));
    (prompt as u64).div_ceil(4).saturating_add(max_tokens)
}

async fn generate(State(st): State<Arc<ProxyState>>, req: Request) -> Response {
    let arrived = Instant::now();
    let path = req.uri().path().to_string();
    let r = async {
        // The key first: a request without a valid one costs no body read.
        let t = tenant_of_headers(&st.tenants, &st.metrics, req.headers())?;
        let tname = st.tenants.get(t).name.clone();
        let bytes = tenant_body(&st.metrics, &tname, req, st.cfg.body_limits).await?;
        let v: Value = serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::bad(format!("request body: {e}")))?;
        if !v.is_object() {
            return Err(ApiError::bad("request body: a JSON object"));
        }
        match v.get("stream") {
            None | Some(Value::Bool(_)) | Some(Value::Null) => {}
            Some(_) => return Err(ApiError::bad("stream: a boolean")),
        }
        match v.get("max_tokens") {
            None | Some(Value::Null) => {}
            Some(m) if m.as_u64().is_some() => {}
            Some(_) => return Err(ApiError::bad("max_tokens: a non-negative integer")),
        }
        let streaming = v.get("stream").and_then(Value::as_bool).unwrap_or(false);
        let mut permit = match st.gate.acquire(t, estimate_tokens(&v)).await {
            Ok(p) => p,
            Err(GateError::RateLimited { retry_after_s }) => {
                st.metrics.requests.with_label_values(&[&tname, "rejected_rate"]).inc();
                let e = ApiError::rate_limited(&tname, st.tenants.get(t).rpm);
                return Err(e.retry_after(retry_after_s));
            }
            Err(GateError::QueueFull) => {
                st.metrics.requests.with_label_values(&[&tname, "rejected_queue_full"]).inc();
                return Err(ApiError::queue_full(&tname));
            }
        };
        st.metrics.requests.with_label_values(&[&tname, "admitted"]).inc();
        // `scripts/router-floor.sh` reads these events (`--log-format json`).
        tracing::trace!(
            event = "dispatched",
            tenant = %tname,
            after_us = arrived.elapsed().as_micros() as u64,
            "router: request dispatched"
        );
        let fence = st.tenants.get(t).max_stream_seconds.map(Duration::from_secs_f64);
        let batch = st.tenants.get(t).is_batch();
        if batch && !streaming {
            // Its first bytes come with its whole body: not counted against the batch
            // prefill limit (it would hold the batch tier for its whole run).
            permit.first_bytes();
        }
        let sent = send(&st, axum::http::Method::POST, &path, bytes, batch);
        // The fence counts from arrival, the wait for the upstream's headers included (a
        // non-streamed response has them only at its end); dropping the request on the
        // fence closes the upstream connection, which aborts the request there.
        let sent = match fence {
            None => sent.await,
            Some(f) => match tokio::time::timeout_at((arrived + f).into(), sent).await {
                Ok(r) => r,
                Err(_) => {
                    st.metrics.requests.with_label_values(&[&tname, "fenced"]).inc();
                    return Err(ApiError::fenced());
                }
            },
        };
        let upstream = match sent {
            Ok(r) => r,
            Err(e) => {
                st.metrics.requests.with_label_values(&[&tname, "upstream_error"]).inc();
                return Err(e);
            }
        };
        Ok(relay(st.clone(), tname, arrived, fence, streaming, permit, upstream).await)
    }
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

/// One relayed response: counts, the fence, the slot.
struct Relay {
    st: Arc<ProxyState>,
    tenant: String,
    lat: TenantLatency,
    arrived: Instant,
    deadline: Option<Instant>,
    streaming: bool,
    ok: bool,
    body: hyper::body::Incoming,
    last: Option<Instant>,
    ended: bool,
    /// The fence ended it.
    fenced: bool,
    permit: Permit,
}

impl Relay {
    fn end(&mut self, outcome: &str) {
        self.ended = true;
        let m = &self.st.metrics;
        self.lat.e2e.observe(self.arrived.elapsed().as_secs_f64());
        m.requests.with_label_values(&[&self.tenant, outcome]).inc();
    }

    /// The next bytes towards the client; `None` at the end.
    async fn next(&mut self) -> Option<Result<Bytes, std::io::Error>> {
        if self.ended {
            return None;
        }
        // Bounded by the upstream body: each turn reads one frame.
        loop {
            let frame = match self.deadline {
                None => self.body.frame().await,
                Some(d) => match tokio::time::timeout_at(d.into(), self.body.frame()).await {
                    Ok(f) => f,
                    Err(_) => {
                        self.end("fenced");
                        self.fenced = true;
                        let msg = if self.streaming { fence_event() } else { String::new() };
                        return Some(Ok(Bytes::from(msg)));
                    }
                },
            };
            match frame {
                None => {
                    self.end(if self.ok { "finished" } else { "upstream_error" });
                    return None;
                }
                Some(Err(e)) => {
                    self.end("upstream_error");
                    return Some(Err(std::io::Error::other(e)));
                }
                Some(Ok(f)) => {
                    let Ok(data) = f.into_data() else { continue };
                    if data.is_empty() {
                        continue;
                    }
                    if self.last.is_none() {
                        // Batch dispatch no longer waits for this request.
                        self.permit.first_bytes();
                        tracing::trace!(
                            event = "first_bytes",
                            tenant = %self.tenant,
                            after_us = self.arrived.elapsed().as_micros() as u64,
                            "router: first bytes"
                        );
                    }
                    if self.ok {
                        let now = Instant::now();
                        match self.last {
                            None => self.lat.ttft.observe(self.arrived.elapsed().as_secs_f64()),
                            Some(l) => {
                                self.lat.inter_token.observe(now.duration_since(l).as_secs_f64())
                            }
                        }
                        self.last = Some(now);
                    }
                    return Some(Ok(data));
                }
            }
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.st.metrics.streams_open.with_label_values(&[&self.tenant]).dec();
        if !self.ended {
            // The client went away first: dropping the upstream body closes that connection.
            self.st.metrics.requests.with_label_values(&[&self.tenant, "aborted"]).inc();
        }
    }
}

async fn relay(
    st: Arc<ProxyState>,
    tenant: String,
    arrived: Instant,
    fence: Option<Duration>,
    streaming: bool,
    permit: Permit,
    upstream: Response<hyper::body::Incoming>,
) -> Response {
    let (parts, body) = upstream.into_parts();
    st.metrics.streams_open.with_label_values(&[&tenant]).inc();
    let relay = Relay {
        lat: st.metrics.tenant_latency(&tenant),
        ok: parts.status.is_success(),
        st,
        tenant,
        arrived,
        deadline: fence.map(|f| arrived + f),
        streaming,
        body,
        last: None,
        ended: false,
        fenced: false,
        permit,
    };
    if !streaming && fence.is_some() {
        // A whole response under a fence is collected here first, so that a fence that
        // fires ends it with an error status (504, as `llm serve` answers) instead of a
        // cut body after a 200. The upstream sends such a body only at its end anyway.
        return whole(relay, parts).await;
    }
    let stream =
        futures_util::stream::unfold(relay, |mut r| async move { r.next().await.map(|b| (b, r)) });
    let mut resp = Response::new(Body::from_stream(stream));
    *resp.status_mut() = parts.status;
    copy_headers(&parts, &mut resp);
    resp
}

/// A non-streamed response under a fence: the upstream's body collected, then sent whole;
/// the fence firing first gives a 504 with an OpenAI error body.
async fn whole(mut relay: Relay, parts: axum::http::response::Parts) -> Response {
    let mut buf = Vec::new();
    // Bounded by the upstream body and the fence: each turn reads one frame.
    while let Some(chunk) = relay.next().await {
        match chunk {
            Ok(b) if relay.fenced => {
                debug_assert!(b.is_empty());
                return ApiError::fenced().into_response();
            }
            Ok(b) => buf.extend_from_slice(&b),
            Err(e) => return upstream_error(e).into_response(),
        }
    }
    let mut resp = Response::new(Body::from(buf));
    *resp.status_mut() = parts.status;
    copy_headers(&parts, &mut resp);
    resp
}

/// The upstream's content type and cache control, or JSON's content type.
fn copy_headers(parts: &axum::http::response::Parts, resp: &mut Response) {
    for name in [header::CONTENT_TYPE, header::CACHE_CONTROL] {
        if let Some(v) = parts.headers.get(&name) {
            resp.headers_mut().insert(name, v.clone());
        }
    }
    if !resp.headers().contains_key(header::CONTENT_TYPE) {
        resp.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::estimate_tokens;

    #[test]
    fn the_cost_estimate_reads_either_limit_and_never_overflows() {
        let prompt = "x".repeat(40); // 10 tokens
        assert_eq!(estimate_tokens(&json!({"prompt": prompt, "max_tokens": 5})), 15);
        assert_eq!(estimate_tokens(&json!({"prompt": prompt, "max_completion_tokens": 7})), 17);
        let chat = json!({"messages": [{"role": "user", "content": prompt}]});
        assert_eq!(estimate_tokens(&chat), 10 + u64::from(super::DEFAULT_MAX_TOKENS));
        let huge = json!({"prompt": prompt, "max_tokens": u64::MAX});
        assert_eq!(estimate_tokens(&huge), u64::MAX);
    }
}
