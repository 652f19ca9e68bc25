//! What the OpenAI-compatible server (`fastlane llm serve`) and the router (`fastlane router`)
//! answer the same way: errors in OpenAI's shape with their status and `Retry-After`, the
//! tenant of a bearer key, the body limit, the default `max_tokens` and the fence's final
//! stream event.

use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use crate::metrics::Metrics;
use crate::protocol::{ErrorBody, ErrorDetail};
use crate::tenants::Tenants;

/// Request bodies larger than this are refused.
pub const BODY_BYTES_MAX: usize = 1 << 20;

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
}

impl ApiError {
    /// An error with this status, OpenAI `type` and message.
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, kind, message: message.into(), retry_after_s: None }
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
        let code = match self.status {
            StatusCode::UNAUTHORIZED => "invalid_api_key",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_exceeded",
            StatusCode::BAD_REQUEST => "invalid_request",
            StatusCode::NOT_FOUND => "not_found",
            StatusCode::SERVICE_UNAVAILABLE => "queue_full",
            _ => "server_error",
        };
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

/// The request's headers and its whole body, at most [`BODY_BYTES_MAX`] bytes.
pub async fn body_bytes(req: Request) -> Result<(HeaderMap, axum::body::Bytes), ApiError> {
    let (parts, body) = req.into_parts();
    let bytes = axum::body::to_bytes(body, BODY_BYTES_MAX).await.map_err(|_| {
        ApiError::bad(format!("request body over {BODY_BYTES_MAX} bytes or unreadable"))
    })?;
    Ok((parts.headers, bytes))
}
