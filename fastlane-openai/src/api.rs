//! What the OpenAI-compatible server (`fastlane llm serve`) and the router (`fastlane router`)
//! answer the same way: errors in OpenAI's shape with their status and `Retry-After`, the
//! tenant of a bearer key, the body's size and time limits, the limits on what a request may
//! ask of the engine per token, the default `max_tokens` and the fence's final stream event.

use std::time::Duration;

use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use crate::metrics::Metrics;
use crate::protocol::{ErrorBody, ErrorDetail};
use crate::tenants::Tenants;

/// Request bodies larger than this are refused with 413 (the default of `--max-body-bytes`).
pub const BODY_BYTES_MAX: usize = 1 << 20;

/// A request's body must arrive within this many seconds of its headers, else 408 (the
/// default of `--body-timeout-seconds`).
pub const BODY_TIMEOUT_SECONDS: f64 = 10.0;

/// `stop`: at most this many strings (OpenAI's own limit) ...
pub const STOP_STRINGS_MAX: usize = 4;

/// ... of at most this many bytes each: every generated token is checked against each of
/// them, so together they bound that work.
pub const STOP_STRING_BYTES_MAX: usize = 256;

/// `stop_token_ids`: at most this many ids.
pub const STOP_TOKEN_IDS_MAX: usize = 64;

/// The longest duration any `--…-seconds` flag or tenants-file field takes: a week (a
/// larger one would overflow the clock arithmetic it feeds).
pub const SECONDS_MAX: f64 = 7.0 * 86_400.0;

/// How a request's body is read: size and time limits.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimits {
    /// Bytes at most (413 beyond; a `Content-Length` over it is refused before any byte).
    pub max_bytes: usize,
    /// The whole body within this time from the handler's start (408 beyond).
    pub timeout: Duration,
}

impl Default for BodyLimits {
    fn default() -> Self {
        BodyLimits {
            max_bytes: BODY_BYTES_MAX,
            timeout: Duration::from_secs_f64(BODY_TIMEOUT_SECONDS),
        }
    }
}

/// `max_tokens` when a request gives neither it nor `max_completion_tokens` (OpenAI's
/// completions default).
pub const DEFAULT_MAX_TOKENS: u32 = 16;

/// The last events of a stream the fence (`max_stream_seconds`) ended: an error event, then
/// `[DONE]`.
pub fn fence_event() -> String {
    let e = ErrorBody {
        error: ErrorDetail {
            message: "the stream ran past its tenant's max_stream_seconds",
            kind: "timeout_error",
            code: "max_stream_seconds",
        },
    };
    format!("{}data: [DONE]\n\n", e.sse())
}

/// An error with its HTTP status, in OpenAI's shape.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
    retry_after_s: Option<u64>,
    /// OpenAI's `code`, where the status alone does not say it.
    code: Option<&'static str>,
}

impl ApiError {
    /// An error with this status, OpenAI `type` and message.
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, kind, message: message.into(), retry_after_s: None, code: None }
    }

    /// 400 `invalid_request_error`.
    pub fn bad(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 429: the tenant's bucket is empty; `Retry-After` is one refill (60 / rpm, rounded up).
    pub fn rate_limited(tenant: &str, rpm: f64) -> ApiError {
        let mut e = ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            format!("tenant {tenant:?} is over its request rate (rpm)"),
        );
        e.retry_after_s = Some((60.0 / rpm).ceil().max(1.0) as u64);
        e
    }

    /// 503: the tenant's router queue is full; try again in a second.
    pub fn queue_full(tenant: &str) -> ApiError {
        let mut e = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_overloaded",
            format!("tenant {tenant:?} has its router queue full (all slots busy)"),
        );
        e.retry_after_s = Some(1);
        e
    }

    /// The same error with `Retry-After: seconds`.
    pub fn retry_after(mut self, seconds: u64) -> ApiError {
        self.retry_after_s = Some(seconds);
        self
    }

    /// 503 `engine_unavailable`: the engine (or the router's upstream) cannot take requests;
    /// `Retry-After: 5`.
    pub fn unavailable(message: impl Into<String>) -> ApiError {
        let mut e = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message);
        e.code = Some("engine_unavailable");
        e.retry_after_s = Some(5);
        e
    }

    /// 413: the body is over `max` bytes.
    pub fn too_large(max: usize) -> ApiError {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("request body over {max} bytes (--max-body-bytes)"),
        )
    }

    /// 408: the body did not arrive in time.
    pub fn too_slow(timeout: Duration) -> ApiError {
        ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            format!(
                "request body not received within {:.1}s (--body-timeout-seconds)",
                timeout.as_secs_f64()
            ),
        )
    }

    /// The status (for logs and tests).
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// 504: a non-streamed request ran past its tenant's fence (`max_stream_seconds`).
    pub fn fenced() -> ApiError {
        ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "timeout_error",
            "the request ran past its tenant's max_stream_seconds",
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let code = self.code.unwrap_or(match self.status {
            StatusCode::UNAUTHORIZED => "invalid_api_key",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_exceeded",
            StatusCode::BAD_REQUEST => "invalid_request",
            StatusCode::NOT_FOUND => "not_found",
            StatusCode::SERVICE_UNAVAILABLE => "queue_full",
            StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
            StatusCode::REQUEST_TIMEOUT => "request_timeout",
            StatusCode::GATEWAY_TIMEOUT => "timeout",
            _ => "server_error",
        });
        let body =
            ErrorBody { error: ErrorDetail { message: &self.message, kind: self.kind, code } };
        let mut r = (self.status, axum::Json(body)).into_response();
        if let Some(s) = self.retry_after_s {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                r.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        r
    }
}

/// Parses JSON into `T`; the 400's message names the field serde complained about.
pub fn parse<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(bytes).map_err(|e| ApiError::bad(format!("request body: {e}")))
}

/// The tenant of a request's bearer key; 401 (counted) when there is none or it is unknown.
pub fn tenant_of_headers(
    tenants: &Tenants,
    metrics: &Metrics,
    headers: &HeaderMap,
) -> Result<usize, ApiError> {
    let key = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    tenants.tenant_of(key).ok_or_else(|| {
        metrics.requests.with_label_values(&["unknown", "unauthorized"]).inc();
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "unknown or missing API key",
        )
    })
}

/// [`body_bytes`], counting a refusal as the tenant's `rejected_body`.
pub async fn tenant_body(
    metrics: &Metrics,
    tenant: &str,
    req: Request,
    limits: BodyLimits,
) -> Result<axum::body::Bytes, ApiError> {
    body_bytes(req, limits).await.inspect_err(|_| {
        metrics.requests.with_label_values(&[tenant, "rejected_body"]).inc();
    })
}

/// The request's whole body within `limits`: 413 when its `Content-Length` or what arrives is
/// over the size (nothing more is read), 408 when it has not all arrived within the time, 400
/// when the connection fails under it.
pub async fn body_bytes(req: Request, limits: BodyLimits) -> Result<axum::body::Bytes, ApiError> {
    use http_body_util::BodyExt;
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limits.max_bytes as u64) {
        return Err(ApiError::too_large(limits.max_bytes));
    }
    let limited = http_body_util::Limited::new(req.into_body(), limits.max_bytes);
    match tokio::time::timeout(limits.timeout, limited.collect()).await {
        Err(_) => Err(ApiError::too_slow(limits.timeout)),
        Ok(Ok(c)) => Ok(c.to_bytes()),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            Err(ApiError::too_large(limits.max_bytes))
        }
        Ok(Err(e)) => Err(ApiError::bad(format!("request body unreadable: {e}"))),
    }
}
