//! The OpenAI-compatible front end of `fastlane llm serve`: tenants from bearer keys,
//! admission by the scheduler (token bucket, slots, router queue, DRR, tiers), streaming over
//! server-sent events, TTFT measured where the client sees it, Prometheus metrics.
//!
//! Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream: true`
//! as SSE ending in `data: [DONE]`, with `usage`), `GET /v1/models`, `GET /health`,
//! `GET /metrics`. Errors are OpenAI-shaped: `{"error": {"message", "type", "code"}}`.
//!
//! Chat template (the random models have none of their own): each message becomes
//! `<|ROLE|>\nCONTENT\n`, and `<|assistant|>\n` follows the last one.

pub mod metrics;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
pub use axum::http::Uri;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
pub use axum::Router;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::engine::{Engine, FinishReason, Finished, GenRequest, Stream, StreamEvent};
use crate::sampling::SamplingParams;
use fastlane_openai::api::{
    body_bytes, fence_event, parse, tenant_of_headers, ApiError, DEFAULT_MAX_TOKENS,
};
pub use fastlane_openai::{gate, tenants, Metrics, TenantLatency, Tenants};
pub use metrics::EngineMetrics;

/// What the handlers share.
#[derive(Debug)]
pub struct AppState {
    /// The engine.
    pub engine: Arc<Engine>,
    /// Tenants and keys.
    pub tenants: Tenants,
    /// The front end's metrics.
    pub metrics: Metrics,
    /// The engine's metrics, in the same registry.
    pub engine_metrics: EngineMetrics,
    /// The model id `/v1/models` reports.
    pub model_id: String,
}

/// The router with every endpoint.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .fallback(|| async {
            ApiError::new(StatusCode::NOT_FOUND, "not_found_error", "no such endpoint")
        })
        .with_state(state)
}

async fn health() -> impl IntoResponse {
    axum::Json(json!({"status": "ok"}))
}

async fn metrics_text(State(st): State<Arc<AppState>>) -> impl IntoResponse {
    let names: Vec<&str> = st.tenants.entries().iter().map(|t| t.name.as_str()).collect();
    let text = st.engine_metrics.render(&st.engine.counters(), &names);
    ([(header::CONTENT_TYPE, fastlane_daemon::metrics::TEXT_FORMAT)], text)
}

async fn models(State(st): State<Arc<AppState>>) -> impl IntoResponse {
    axum::Json(
        json!({"object": "list", "data": [{"id": st.model_id, "object": "model", "owned_by": "fastlane"}]}),
    )
}

/// A string or a list of strings (`stop`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

/// A prompt: text, or token ids.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

/// Fields both endpoints share (OpenAI's names; vLLM's extensions `top_k`, `ignore_eos`,
/// `stop_token_ids`, `return_token_ids`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CompletionBody {
    #[serde(default)]
    model: Option<String>,
    prompt: Prompt,
    #[serde(flatten)]
    common: Common,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ChatBody {
    #[serde(default)]
    model: Option<String>,
    messages: Vec<Message>,
    #[serde(flatten)]
    common: Common,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Message {
    role: String,
    content: String,
}

#[derive(Debug, Default, Deserialize)]
struct Common {
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    top_k: Option<usize>,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    stop: Option<OneOrMany>,
    #[serde(default)]
    stop_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    ignore_eos: Option<bool>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    return_token_ids: Option<bool>,
    #[serde(default)]
    n: Option<u32>,
    #[serde(default)]
    user: Option<String>,
    // What OpenAI's SDKs and the tooling built on them (LangChain, LlamaIndex) send by default.
    // Accepted as long as they ask for nothing we do not do (`refuse_unsupported`): the neutral
    // value passes, anything else is a 400 that names the field.
    /// `{"include_usage": true}`: the last chunk of a stream carries `usage` (it always does
    /// here).
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    /// The chat API's newer name for `max_tokens`.
    #[serde(default)]
    max_completion_tokens: Option<u32>,
    #[serde(default)]
    frequency_penalty: Option<f32>,
    #[serde(default)]
    presence_penalty: Option<f32>,
    /// Chat: a bool; completions: a count. Only off (false, 0, null) is served.
    #[serde(default)]
    logprobs: Option<Value>,
    #[serde(default)]
    top_logprobs: Option<u32>,
    #[serde(default)]
    logit_bias: Option<serde_json::Map<String, Value>>,
    #[serde(default)]
    response_format: Option<Value>,
    #[serde(default)]
    echo: Option<bool>,
    #[serde(default)]
    best_of: Option<u32>,
    #[serde(default)]
    suffix: Option<String>,
}

/// `stream_options`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamOptions {
    // Accepted and not read: the final event of a stream always carries `usage`.
    #[allow(dead_code)]
    #[serde(default)]
    include_usage: Option<bool>,
    #[serde(default)]
    continuous_usage_stats: Option<bool>,
}

impl Common {
    /// A 400 naming the first field that asks for something this server does not do.
    fn refuse_unsupported(&self) -> Result<(), ApiError> {
        let unsupported = |field: &str, what: &str| {
            Err(ApiError::bad(format!("{field}: {what} is not supported by this server")))
        };
        if self.frequency_penalty.is_some_and(|p| p != 0.0) {
            return unsupported("frequency_penalty", "a value other than 0");
        }
        if self.presence_penalty.is_some_and(|p| p != 0.0) {
            return unsupported("presence_penalty", "a value other than 0");
        }
        match &self.logprobs {
            None | Some(Value::Null) | Some(Value::Bool(false)) => {}
            Some(Value::Number(n)) if n.as_u64() == Some(0) => {}
            Some(_) => return unsupported("logprobs", "returning log probabilities"),
        }
        if self.top_logprobs.is_some_and(|n| n != 0) {
            return unsupported("top_logprobs", "returning log probabilities");
        }
        if self.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
            return unsupported("logit_bias", "a non-empty bias");
        }
        match &self.response_format {
            None | Some(Value::Null) => {}
            Some(f) if f.get("type").and_then(Value::as_str) == Some("text") => {}
            Some(_) => return unsupported("response_format", "a format other than text"),
        }
        if self.echo == Some(true) {
            return unsupported("echo", "echoing the prompt");
        }
        if self.best_of.is_some_and(|n| n != 1) {
            return unsupported("best_of", "a value other than 1");
        }
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return unsupported("suffix", "a suffix");
        }
        if self.stream_options.as_ref().is_some_and(|o| o.continuous_usage_stats == Some(true)) {
            return unsupported("stream_options.continuous_usage_stats", "usage in every chunk");
        }
        if let (Some(a), Some(b)) = (self.max_tokens, self.max_completion_tokens) {
            if a != b {
                return Err(ApiError::bad(
                    "max_tokens and max_completion_tokens: give one, or the same value",
                ));
            }
        }
        Ok(())
    }
}

fn tenant(st: &AppState, headers: &HeaderMap) -> Result<usize, ApiError> {
    tenant_of_headers(&st.tenants, &st.metrics, headers)
}

async fn completions(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let arrived = Instant::now();
    let r = async {
        let (headers, bytes) = body_bytes(req).await?;
        let t = tenant(&st, &headers)?;
        let b: CompletionBody = parse(&bytes)?;
        check_model(&st, b.model.as_deref())?;
        let prompt = match b.prompt {
            Prompt::Text(s) => st
                .engine
                .model()
                .tokenizer()
                .encode(&s)
                .map_err(|e| ApiError::bad(e.to_string()))?,
            Prompt::Ids(ids) => ids,
        };
        run(st.clone(), t, prompt, b.common, arrived, Kind::Completion).await
    }
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

async fn chat(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let arrived = Instant::now();
    let r = async {
        let (headers, bytes) = body_bytes(req).await?;
        let t = tenant(&st, &headers)?;
        let b: ChatBody = parse(&bytes)?;
        check_model(&st, b.model.as_deref())?;
        if b.messages.is_empty() {
            return Err(ApiError::bad("messages: at least one message"));
        }
        let mut text = String::new();
        for m in &b.messages {
            if !matches!(m.role.as_str(), "system" | "user" | "assistant") {
                return Err(ApiError::bad(format!(
                    "messages: role {:?}: system, user or assistant",
                    m.role
                )));
            }
            text.push_str(&format!("<|{}|>\n{}\n", m.role, m.content));
        }
        text.push_str("<|assistant|>\n");
        let prompt = st
            .engine
            .model()
            .tokenizer()
            .encode(&text)
            .map_err(|e| ApiError::bad(e.to_string()))?;
        run(st.clone(), t, prompt, b.common, arrived, Kind::Chat).await
    }
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

fn check_model(st: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != st.model_id => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("model {m:?} is not served here (GET /v1/models)"),
        )),
        _ => Ok(()),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

/// Counts a stream that ends before its last event (the client went away) as aborted. The
/// engine request itself ends with the [`Stream`], dropped with the response body beside this
/// guard: its drop aborts a live request and frees the slot.
struct AbortOnDrop {
    done: bool,
    metrics: Metrics,
    tenant: String,
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.metrics.streams_open.with_label_values(&[&self.tenant]).dec();
        if !self.done {
            self.metrics.requests.with_label_values(&[&self.tenant, "aborted"]).inc();
        }
    }
}

fn finish_reason(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Length => "length",
        FinishReason::Stop => "stop",
        FinishReason::Abort => "abort",
        FinishReason::Fenced => "length",
        FinishReason::Rejected
        | FinishReason::RateLimited
        | FinishReason::QueueFull
        | FinishReason::Error => "error",
    }
}

async fn run(
    st: Arc<AppState>,
    t: usize,
    prompt: Vec<u32>,
    c: Common,
    arrived: Instant,
    kind: Kind,
) -> Result<Response, ApiError> {
    let tname = st.tenants.get(t).name.clone();
    if c.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad("n: only 1 is supported"));
    }
    c.refuse_unsupported()?;
    let _ = &c.user;
    let req = GenRequest {
        prompt,
        max_tokens: c.max_tokens.or(c.max_completion_tokens).unwrap_or(DEFAULT_MAX_TOKENS),
        sampling: SamplingParams {
            temperature: c.temperature.unwrap_or(1.0),
            top_p: c.top_p.unwrap_or(1.0),
            top_k: c.top_k.unwrap_or(0),
            // Without a seed of its own, a request samples from a seed the OS RNG seeded
            // (rand's thread RNG): identical prompts get independent completions. (This was
            // the time since arrival, nearly the same for every request.)
            seed: c.seed.unwrap_or_else(rand::random::<u64>),
        },
        stop: match c.stop {
            None => Vec::new(),
            Some(OneOrMany::One(s)) => vec![s],
            Some(OneOrMany::Many(v)) => v,
        },
        stop_token_ids: c.stop_token_ids.unwrap_or_default(),
        ignore_eos: c.ignore_eos.unwrap_or(false),
        tenant: t,
        digest_logits: false,
    };
    let prompt_tokens = req.prompt.len();
    let stream = st.engine.submit(req).map_err(|e| {
        st.metrics.requests.with_label_values(&[&tname, "rejected_invalid"]).inc();
        ApiError::bad(e.to_string())
    })?;
    // The first event says whether the request was admitted.
    let first = stream.next_async().await;
    if let Some(StreamEvent::Done(f)) = &first {
        match f.reason {
            FinishReason::Rejected => {
                st.metrics.requests.with_label_values(&[&tname, "rejected_invalid"]).inc();
                return Err(ApiError::bad(f.text.clone()));
            }
            FinishReason::RateLimited => {
                st.metrics.requests.with_label_values(&[&tname, "rejected_rate"]).inc();
                return Err(ApiError::rate_limited(&tname, st.tenants.get(t).rpm));
            }
            FinishReason::QueueFull => {
                st.metrics.requests.with_label_values(&[&tname, "rejected_queue_full"]).inc();
                return Err(ApiError::queue_full(&tname));
            }
            _ => {}
        }
    }
    st.metrics.requests.with_label_values(&[&tname, "admitted"]).inc();
    st.metrics.streams_open.with_label_values(&[&tname]).inc();
    let guard = AbortOnDrop { done: false, metrics: st.metrics.clone(), tenant: tname.clone() };
    let fence = st.tenants.get(t).max_stream_seconds.map(Duration::from_secs_f64);
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let ctx = Ctx {
        lat: st.metrics.tenant_latency(&tname),
        st,
        tname,
        arrived,
        kind,
        id: format!("cmpl-{}", stream.id),
        created,
        prompt_tokens,
        fence,
    };
    if c.stream.unwrap_or(false) {
        Ok(sse(ctx, stream, first, guard, c.return_token_ids.unwrap_or(false)))
    } else {
        whole(ctx, stream, first, guard, c.return_token_ids.unwrap_or(false)).await
    }
}

struct Ctx {
    st: Arc<AppState>,
    tname: String,
    lat: TenantLatency,
    arrived: Instant,
    kind: Kind,
    id: String,
    created: u64,
    prompt_tokens: usize,
    fence: Option<Duration>,
}

impl Ctx {
    fn usage(&self, completion: usize) -> Value {
        json!({"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
               "total_tokens": self.prompt_tokens + completion})
    }

    fn model(&self) -> &str {
        &self.st.model_id
    }

    fn record_end(&self, outcome: &str) {
        self.lat.e2e.observe(self.arrived.elapsed().as_secs_f64());
        self.st.metrics.requests.with_label_values(&[&self.tname, outcome]).inc();
    }
}

/// Waits for the next event within the fence.
async fn next_event(stream: &Stream, deadline: Option<Instant>) -> Option<Result<StreamEvent, ()>> {
    match deadline {
        None => stream.next_async().await.map(Ok),
        Some(d) => match tokio::time::timeout_at(d.into(), stream.next_async()).await {
            Ok(ev) => ev.map(Ok),
            Err(_) => Some(Err(())),
        },
    }
}

async fn whole(
    ctx: Ctx,
    stream: Stream,
    first: Option<StreamEvent>,
    mut guard: AbortOnDrop,
    return_ids: bool,
) -> Result<Response, ApiError> {
    let deadline = ctx.fence.map(|f| ctx.arrived + f);
    let mut pending = first;
    let mut first_seen = false;
    let finished: Finished = loop {
        let ev = match pending.take() {
            Some(ev) => ev,
            None => match next_event(&stream, deadline).await {
                Some(Ok(ev)) => ev,
                Some(Err(())) => {
                    ctx.record_end("fenced");
                    return Err(ApiError::fenced());
                }
                None => {
                    return Err(ApiError::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "server_error",
                        "engine stopped",
                    ))
                }
            },
        };
        match ev {
            StreamEvent::Token { .. } => {
                if !first_seen {
                    first_seen = true;
                    ctx.lat.ttft.observe(ctx.arrived.elapsed().as_secs_f64());
                }
            }
            StreamEvent::Done(f) => break f,
        }
    };
    guard.done = true;
    if matches!(finished.reason, FinishReason::Error | FinishReason::Abort) {
        ctx.record_end("error");
        return Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            finished.text,
        ));
    }
    ctx.record_end("finished");
    let n = finished.token_ids.len();
    let mut choice = match ctx.kind {
        Kind::Completion => {
            json!({"index": 0, "text": finished.text, "finish_reason": finish_reason(finished.reason), "logprobs": null})
        }
        Kind::Chat => {
            json!({"index": 0, "message": {"role": "assistant", "content": finished.text},
                             "finish_reason": finish_reason(finished.reason)})
        }
    };
    if return_ids {
        choice["token_ids"] = json!(finished.token_ids);
    }
    let object = if ctx.kind == Kind::Chat { "chat.completion" } else { "text_completion" };
    let body = json!({"id": ctx.id, "object": object, "created": ctx.created, "model": ctx.model(),
                      "choices": [choice], "usage": ctx.usage(n)});
    Ok(axum::Json(body).into_response())
}

/// State of an SSE body.
struct Sse {
    ctx: Ctx,
    stream: Stream,
    pending: Option<StreamEvent>,
    guard: AbortOnDrop,
    return_ids: bool,
    last_token: Option<Instant>,
    tokens: usize,
    deadline: Option<Instant>,
    ended: bool,
}

fn chunk(v: &Value) -> axum::body::Bytes {
    axum::body::Bytes::from(format!("data: {v}\n\n"))
}

impl Sse {
    fn token_chunk(&self, id: u32, text: &str) -> Value {
        let mut choice = match self.ctx.kind {
            Kind::Completion => {
                json!({"index": 0, "text": text, "finish_reason": null, "logprobs": null})
            }
            Kind::Chat => json!({"index": 0, "delta": {"content": text}, "finish_reason": null}),
        };
        if self.return_ids {
            choice["token_ids"] = json!([id]);
        }
        let object =
            if self.ctx.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
        json!({"id": self.ctx.id, "object": object, "created": self.ctx.created, "model": self.ctx.model(),
               "choices": [choice]})
    }

    fn final_chunk(&self, f: &Finished) -> Value {
        let choice = match self.ctx.kind {
            Kind::Completion => {
                json!({"index": 0, "text": "", "finish_reason": finish_reason(f.reason), "logprobs": null})
            }
            Kind::Chat => {
                json!({"index": 0, "delta": {}, "finish_reason": finish_reason(f.reason)})
            }
        };
        let object =
            if self.ctx.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
        json!({"id": self.ctx.id, "object": object, "created": self.ctx.created, "model": self.ctx.model(),
               "choices": [choice], "usage": self.ctx.usage(f.token_ids.len())})
    }

    /// The next bytes of the body, `None` at its end.
    async fn next_bytes(&mut self) -> Option<axum::body::Bytes> {
        if self.ended {
            return None;
        }
        let ev = match self.pending.take() {
            Some(ev) => Ok(ev),
            None => match next_event(&self.stream, self.deadline).await {
                Some(r) => r,
                None => {
                    self.ended = true;
                    return Some(chunk(
                        &json!({"error": {"message": "engine stopped", "type": "server_error", "code": "server_error"}}),
                    ));
                }
            },
        };
        match ev {
            Ok(StreamEvent::Token { id, text }) => {
                let now = Instant::now();
                let lat = &self.ctx.lat;
                match self.last_token {
                    None => lat.ttft.observe(self.ctx.arrived.elapsed().as_secs_f64()),
                    Some(t) => lat.inter_token.observe(now.duration_since(t).as_secs_f64()),
                }
                self.last_token = Some(now);
                self.tokens += 1;
                Some(chunk(&self.token_chunk(id, &text)))
            }
            Ok(StreamEvent::Done(f)) => {
                self.ended = true;
                self.guard.done = true;
                let outcome = if f.reason == FinishReason::Fenced { "fenced" } else { "finished" };
                self.ctx.record_end(outcome);
                let mut out = String::from_utf8_lossy(&chunk(&self.final_chunk(&f))).into_owned();
                out.push_str("data: [DONE]\n\n");
                Some(axum::body::Bytes::from(out))
            }
            Err(()) => {
                // The fence: a final error event, then the end; the guard aborts the request
                // in the engine, which frees its slot and blocks.
                self.ended = true;
                self.ctx.record_end("fenced");
                Some(axum::body::Bytes::from(fence_event()))
            }
        }
    }
}

fn sse(
    ctx: Ctx,
    stream: Stream,
    first: Option<StreamEvent>,
    guard: AbortOnDrop,
    return_ids: bool,
) -> Response {
    let deadline = ctx.fence.map(|f| ctx.arrived + f);
    let state = Sse {
        ctx,
        stream,
        pending: first,
        guard,
        return_ids,
        last_token: None,
        tokens: 0,
        deadline,
        ended: false,
    };
    let body = futures_util::stream::unfold(state, |mut s| async move {
        s.next_bytes().await.map(|b| (Ok::<_, std::convert::Infallible>(b), s))
    });
    let mut r = Response::new(Body::from_stream(body));
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    r.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}
