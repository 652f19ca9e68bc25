//! The OpenAI-compatible front end of `fastlane llm serve`: tenants from bearer keys,
//! admission by the scheduler (token bucket, slots, router queue, DRR, tiers), streaming over
//! server-sent events, TTFT measured where the client sees it, Prometheus metrics.
//!
//! Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream: true`
//! as SSE ending in `data: [DONE]`, with `usage`; `n` choices, log-probabilities, presence and
//! frequency penalties), `GET /v1/models`, `GET /metrics`, and
//! health: `GET /readyz` and `GET /health` (503 when the engine thread has ended, or when
//! requests are live and no step has begun for [`crate::STALL_AFTER`]: send me nothing) and
//! `GET /livez` (503 when the engine thread has ended or stalled for [`LIVENESS_STALL`]:
//! restart me). Errors are OpenAI-shaped: `{"error": {"message", "type", "code"}}`.
//!
//! Chat template (the random models have none of their own): each message becomes
//! `<|ROLE|>\nCONTENT\n`, and `<|assistant|>\n` follows the last one.

pub mod admit;
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

use crate::engine::{
    Engine, EngineHealth, FinishReason, Finished, GenRequest, Stream, StreamEvent,
};
use crate::error::LlmError;
use crate::sampling::{SamplingParams, TokenLogprobs};
use crate::tokenizer::Tokenizer;
use fastlane_openai::api::{
    fence_event, parse, tenant_body, tenant_of_headers, ApiError, BodyLimits, DEFAULT_MAX_TOKENS,
    STOP_STRINGS_MAX, STOP_STRING_BYTES_MAX, STOP_TOKEN_IDS_MAX,
};
use fastlane_openai::protocol::{
    json_text, sse_event, ChatChunkChoice, ChatLogprobs, ChatRequest, ChatTokenLogprob, Completion,
    CompletionLogprobs, CompletionRequest, Delta, ErrorBody, ErrorDetail, Health, Message,
    ModelList, OneOrMany, Prompt, SamplingFields, TextChoice, TopLogprob, TopMap, Usage,
};
pub use fastlane_openai::{gate, tenants, Metrics, TenantLatency, Tenants};
use futures_util::stream::{BoxStream, SelectAll};
use futures_util::StreamExt;
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
    /// Request bodies' size and time limits.
    pub body_limits: BodyLimits,
    /// Admission before tokenization, and the tokenizer pool.
    pub admit: admit::Admit,
}

/// The router with every endpoint.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(ready))
        .route("/readyz", get(ready))
        .route("/livez", get(live))
        .route("/metrics", get(metrics_text))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .fallback(|| async {
            ApiError::new(StatusCode::NOT_FOUND, "not_found_error", "no such endpoint")
        })
        .with_state(state)
}

/// The engine's health in OpenAI-server terms.
fn engine_health(engine: &Engine) -> Health {
    match engine.health() {
        EngineHealth::Ok => Health::ok(),
        EngineHealth::Dead => Health::bad("dead", "the engine thread has ended"),
        EngineHealth::Stalled(d) => Health::bad(
            "stalled",
            format!("requests live and no engine step for {:.0}s", d.as_secs_f64()),
        ),
    }
}

/// A stall this long fails liveness too (a restart is the way out).
pub const LIVENESS_STALL: Duration = Duration::from_secs(120);

async fn live(State(st): State<Arc<AppState>>) -> Response {
    match st.engine.health() {
        EngineHealth::Stalled(d) if d < LIVENESS_STALL => Health::ok(),
        _ => engine_health(&st.engine),
    }
    .response()
}

async fn ready(State(st): State<Arc<AppState>>) -> Response {
    engine_health(&st.engine).response()
}

async fn metrics_text(State(st): State<Arc<AppState>>) -> impl IntoResponse {
    let names: Vec<&str> = st.tenants.entries().iter().map(|t| t.name.as_str()).collect();
    let text = st.engine_metrics.render(&st.engine.counters(), &names);
    ([(header::CONTENT_TYPE, fastlane_daemon::metrics::TEXT_FORMAT)], text)
}

async fn models(State(st): State<Arc<AppState>>) -> impl IntoResponse {
    axum::Json(ModelList::one(&st.model_id)).into_response()
}

fn tenant(st: &AppState, headers: &HeaderMap) -> Result<usize, ApiError> {
    tenant_of_headers(&st.tenants, &st.metrics, headers)
}

async fn completions(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let arrived = Instant::now();
    let r = async {
        // The key first: a request without a valid one costs no body read.
        let t = tenant(&st, req.headers())?;
        let bytes = tenant_body(&st.metrics, &st.tenants.get(t).name, req, st.body_limits).await?;
        let CompletionRequest { model, prompt, common } = parse(&bytes)?;
        check_model(&st, model.as_deref())?;
        // The tenant's bucket and slots before any tokenization, which runs off the HTTP
        // workers unless the body is short.
        let pass = st.admit.admit(t, &st.tenants.get(t).name, &st.metrics)?;
        let m = st.engine.model().clone();
        let n = bytes.len();
        let prompt =
            st.admit.tokenize(n, move || completion_prompt(m.tokenizer(), prompt)).await??;
        run(st.clone(), t, prompt, common, arrived, Kind::Completion, pass).await
    }
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

async fn chat(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let arrived = Instant::now();
    let r = async {
        // The key first: a request without a valid one costs no body read.
        let t = tenant(&st, req.headers())?;
        let bytes = tenant_body(&st.metrics, &st.tenants.get(t).name, req, st.body_limits).await?;
        let ChatRequest { model, messages, common } = parse(&bytes)?;
        check_model(&st, model.as_deref())?;
        let pass = st.admit.admit(t, &st.tenants.get(t).name, &st.metrics)?;
        let m = st.engine.model().clone();
        let n = bytes.len();
        let prompt = st.admit.tokenize(n, move || chat_prompt(m.tokenizer(), &messages)).await??;
        run(st.clone(), t, prompt, common, arrived, Kind::Chat, pass).await
    }
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

/// The prompt of a completion request: its text tokenized, or its token ids.
fn completion_prompt(tokenizer: &Tokenizer, prompt: Prompt) -> Result<Vec<u32>, ApiError> {
    match prompt {
        Prompt::Text(s) => tokenizer.encode(&s).map_err(|e| ApiError::bad(e.to_string())),
        Prompt::Ids(ids) => Ok(ids),
    }
}

/// The prompt of a chat request: its messages in the chat template (the module's doc),
/// tokenized.
fn chat_prompt(tokenizer: &Tokenizer, messages: &[Message]) -> Result<Vec<u32>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad("messages: at least one message"));
    }
    let mut text = String::new();
    for m in messages {
        if !matches!(m.role.as_str(), "system" | "user" | "assistant") {
            return Err(ApiError::bad(format!(
                "messages: role {:?}: system, user or assistant",
                m.role
            )));
        }
        text.push_str(&format!("<|{}|>\n{}\n", m.role, m.content));
    }
    text.push_str("<|assistant|>\n");
    tokenizer.encode(&text).map_err(|e| ApiError::bad(e.to_string()))
}

/// The engine's request for `prompt` with the fields a completion and a chat request share:
/// the one place OpenAI's sampling fields (with vLLM's extensions) become the engine's, and
/// where those the engine does not do are refused.
fn engine_request(
    c: &SamplingFields,
    kind: Kind,
    prompt: Vec<u32>,
    tenant: usize,
) -> Result<GenRequest, ApiError> {
    c.refuse_unsupported()?;
    let logprobs = c.logprobs_wanted(kind == Kind::Chat)?;
    let _ = &c.user;
    let stop = match &c.stop {
        None => Vec::new(),
        Some(OneOrMany::One(s)) => vec![s.clone()],
        Some(OneOrMany::Many(v)) => v.clone(),
    };
    // Every generated token is checked against every stop string and id: the limits keep
    // that work per token constant, whatever a client sends.
    if stop.len() > STOP_STRINGS_MAX {
        return Err(ApiError::bad(format!("stop: at most {STOP_STRINGS_MAX} strings")));
    }
    if stop.iter().any(|s| s.is_empty() || s.len() > STOP_STRING_BYTES_MAX) {
        return Err(ApiError::bad(format!("stop: each string 1 to {STOP_STRING_BYTES_MAX} bytes")));
    }
    let stop_token_ids = c.stop_token_ids.clone().unwrap_or_default();
    if stop_token_ids.len() > STOP_TOKEN_IDS_MAX {
        return Err(ApiError::bad(format!("stop_token_ids: at most {STOP_TOKEN_IDS_MAX} ids")));
    }
    Ok(GenRequest {
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
            presence_penalty: c.presence_penalty.unwrap_or(0.0),
            frequency_penalty: c.frequency_penalty.unwrap_or(0.0),
            logprobs,
        },
        stop,
        stop_token_ids,
        ignore_eos: c.ignore_eos.unwrap_or(false),
        tenant,
        digest_logits: false,
    })
}

/// The engine requests of the request's `n` choices: choice `i` samples from `seed + i`
/// when the request has a seed (so `n` choices with a seed reproduce), else each from its
/// own seed from the OS RNG.
fn engine_requests(
    c: &SamplingFields,
    kind: Kind,
    prompt: Vec<u32>,
    tenant: usize,
) -> Result<Vec<GenRequest>, ApiError> {
    let n = c.choices()?;
    let mut reqs = Vec::with_capacity(n as usize);
    reqs.push(engine_request(c, kind, prompt, tenant)?);
    for i in 1..n {
        let mut r = reqs[0].clone();
        r.sampling.seed = match c.seed {
            Some(s) => s.wrapping_add(u64::from(i)),
            None => rand::random::<u64>(),
        };
        reqs.push(r);
    }
    Ok(reqs)
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
    fence: Arc<Fence>,
    _watchdog: Watchdog,
    /// The request's place among its tenant's open ones, held to the response's end.
    _pass: admit::Pass,
}

/// Who counts a request as fenced: the first of its watchdog and its response to see the
/// deadline pass (each may, and the count must be one).
#[derive(Debug, Default)]
struct Fence {
    fired: std::sync::atomic::AtomicBool,
}

impl Fence {
    /// `true` for the first caller only.
    fn claim(&self) -> bool {
        !self.fired.swap(true, std::sync::atomic::Ordering::AcqRel)
    }

    fn fired(&self) -> bool {
        self.fired.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// The fence's timer task, cancelled when the request's response ends.
struct Watchdog(Option<tokio::task::JoinHandle<()>>);

impl Drop for Watchdog {
    fn drop(&mut self) {
        if let Some(t) = self.0.take() {
            t.abort();
        }
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.metrics.streams_open.with_label_values(&[&self.tenant]).dec();
        if !self.done && !self.fence.fired() {
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

/// The refusal a choice's first event carries, counted (`None`: not a refusal).
fn refusal(st: &AppState, tname: &str, t: usize, f: &Finished) -> Option<ApiError> {
    let (outcome, e) = match f.reason {
        FinishReason::Rejected => ("rejected_invalid", ApiError::bad(f.text.clone())),
        FinishReason::RateLimited => {
            ("rejected_rate", ApiError::rate_limited(tname, st.tenants.get(t).rpm))
        }
        FinishReason::QueueFull => ("rejected_queue_full", ApiError::queue_full(tname)),
        _ => return None,
    };
    st.metrics.requests.with_label_values(&[tname, outcome]).inc();
    Some(e)
}

fn unavailable(st: &AppState, tname: &str, why: &str) -> ApiError {
    st.metrics.requests.with_label_values(&[tname, "unavailable"]).inc();
    ApiError::unavailable(format!("the engine cannot take requests: {why}"))
}

/// A choice's first event, which says whether it was admitted: a refusal (counted), the
/// fence or the engine's end is the error.
async fn first_event(
    st: &AppState,
    t: usize,
    stream: &Stream,
    deadline: Option<Instant>,
    fence: &Fence,
) -> Result<StreamEvent, ApiError> {
    let tname = &st.tenants.get(t).name;
    match next_event(stream, deadline).await {
        Some(Ok(StreamEvent::Done(f))) => match refusal(st, tname, t, &f) {
            Some(e) => Err(e),
            None => Ok(StreamEvent::Done(f)),
        },
        Some(Ok(ev)) => Ok(ev),
        Some(Err(())) => {
            if fence.claim() {
                st.metrics.requests.with_label_values(&[tname, "fenced"]).inc();
            }
            Err(ApiError::fenced())
        }
        None => Err(unavailable(st, tname, "it stopped")),
    }
}

async fn run(
    st: Arc<AppState>,
    t: usize,
    prompt: Vec<u32>,
    c: SamplingFields,
    arrived: Instant,
    kind: Kind,
    pass: admit::Pass,
) -> Result<Response, ApiError> {
    // Called once the prompt is tokenized: the end of the TTFT's `admit` stage.
    let tokenized = Instant::now();
    let tname = st.tenants.get(t).name.clone();
    let reqs = engine_requests(&c, kind, prompt, t)?;
    let max_concurrent = st.tenants.get(t).max_concurrent as usize;
    if reqs.len() > 1 && reqs.len() > max_concurrent {
        // The n choices run side by side, each in one of the tenant's slots.
        return Err(ApiError::bad(format!(
            "n: {} choices need as many concurrent streams; tenant {tname:?} has {max_concurrent}",
            reqs.len()
        )));
    }
    let prompt_tokens = reqs[0].prompt.len();
    let logprobs = reqs[0].sampling.logprobs.is_some();
    if st.engine.health() == EngineHealth::Dead {
        return Err(unavailable(&st, &tname, "its thread has ended"));
    }
    // Each choice is one engine request, admitted like any other (its tenant's bucket, slots
    // and queue): a refusal of any refuses the whole request, and the streams already
    // submitted end (aborted) when dropped. Choice 0 is submitted last: the engine takes
    // commands in order and refuses at submission, so once choice 0 has an event, the
    // others' refusals are in their streams.
    let mut streams = Vec::with_capacity(reqs.len());
    for req in reqs.into_iter().rev() {
        streams.push(st.engine.submit(req).map_err(|e| match e {
            LlmError::Stopped { .. } => unavailable(&st, &tname, &e.to_string()),
            e => {
                st.metrics.requests.with_label_values(&[&tname, "rejected_invalid"]).inc();
                ApiError::bad(e.to_string())
            }
        })?);
    }
    streams.reverse();
    let fence = st.tenants.get(t).max_stream_seconds.map(Duration::from_secs_f64);
    let deadline = fence.map(|f| arrived + f);
    // The fence holds even while nothing reads this request's events (queued, waiting for
    // its first token, or a client that does not read): at the deadline the engine aborts
    // the requests and gives their slots back, within one step.
    let fence_state = Arc::new(Fence::default());
    let watchdog = deadline.map(|d| {
        let engine = Arc::downgrade(&st.engine);
        let ids: Vec<u64> = streams.iter().map(|s| s.id).collect();
        let (fence, metrics, tname) = (fence_state.clone(), st.metrics.clone(), tname.clone());
        tokio::spawn(async move {
            tokio::time::sleep_until(d.into()).await;
            if fence.claim() {
                metrics.requests.with_label_values(&[&tname, "fenced"]).inc();
            }
            if let Some(e) = engine.upgrade() {
                for id in ids {
                    e.abort_and_release(id);
                }
            }
        })
    });
    let watchdog = Watchdog(watchdog);
    // The first choice's first event says whether the request was admitted, and then the
    // others' refusals are there to see.
    let mut firsts = vec![Some(first_event(&st, t, &streams[0], deadline, &fence_state).await?)];
    let first_event_at = Instant::now();
    for s in &streams[1..] {
        let ev = s.try_next();
        if let Some(StreamEvent::Done(f)) = &ev {
            if let Some(e) = refusal(&st, &tname, t, f) {
                return Err(e);
            }
        }
        firsts.push(ev);
    }
    st.metrics.requests.with_label_values(&[&tname, "admitted"]).inc();
    st.metrics.streams_open.with_label_values(&[&tname]).inc();
    let guard = AbortOnDrop {
        done: false,
        metrics: st.metrics.clone(),
        tenant: tname.clone(),
        fence: fence_state.clone(),
        _watchdog: watchdog,
        _pass: pass,
    };
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let ctx = Ctx {
        lat: st.metrics.tenant_latency_with_stages(&tname),
        id: format!("cmpl-{}", streams[0].id),
        st,
        t,
        tname,
        arrived,
        tokenized,
        first_event_at,
        kind,
        created,
        prompt_tokens,
        deadline,
        fence: fence_state,
        return_ids: c.return_token_ids.unwrap_or(false),
        logprobs,
    };
    if c.stream.unwrap_or(false) {
        Ok(sse(ctx, streams, firsts, guard))
    } else {
        whole(ctx, streams, firsts, guard).await
    }
}

struct Ctx {
    st: Arc<AppState>,
    t: usize,
    tname: String,
    lat: TenantLatency,
    arrived: Instant,
    /// When the prompt was tokenized and when the first event came from the engine (the
    /// TTFT's stages: [`Ctx::observe_first_token`]).
    tokenized: Instant,
    first_event_at: Instant,
    kind: Kind,
    id: String,
    created: u64,
    prompt_tokens: usize,
    /// The fence: arrival + the tenant's `max_stream_seconds`.
    deadline: Option<Instant>,
    fence: Arc<Fence>,
    /// vLLM's `return_token_ids`.
    return_ids: bool,
    /// Whether the tokens come with log-probabilities.
    logprobs: bool,
}

impl Ctx {
    /// The first token is handed to the connection now: its TTFT and the TTFT's stages.
    fn observe_first_token(&self) {
        let now = Instant::now();
        self.lat.ttft.observe(now.duration_since(self.arrived).as_secs_f64());
        if let Some([admit, engine, respond]) = &self.lat.stages {
            admit.observe(self.tokenized.duration_since(self.arrived).as_secs_f64());
            engine.observe(self.first_event_at.duration_since(self.tokenized).as_secs_f64());
            respond.observe(now.duration_since(self.first_event_at).as_secs_f64());
        }
    }

    fn usage(&self, completion: usize) -> Usage {
        Usage::new(self.prompt_tokens, completion)
    }

    /// A response or chunk of this request carrying `choices`.
    fn completion<C>(
        &self,
        object: &'static str,
        choices: Vec<C>,
        usage: Option<Usage>,
    ) -> Completion<'_, C> {
        Completion {
            id: &self.id,
            object,
            created: self.created,
            model: self.model(),
            choices,
            usage,
        }
    }

    fn model(&self) -> &str {
        &self.st.model_id
    }

    fn tokenizer(&self) -> &Tokenizer {
        self.st.engine.model().tokenizer()
    }

    fn record_end(&self, outcome: &str) {
        self.lat.e2e.observe(self.arrived.elapsed().as_secs_f64());
        if outcome == "fenced" && !self.fence.claim() {
            return; // the watchdog counted it
        }
        self.st.metrics.requests.with_label_values(&[&self.tname, outcome]).inc();
    }
}

/// Log-probabilities below this are reported as it (JSON has no -∞; OpenAI's floor).
const LOGPROB_FLOOR: f32 = -9999.0;

/// The log-probabilities of one choice's tokens in the endpoint's shape, as they arrive.
#[derive(Debug, Default)]
struct ChoiceLogprobs {
    text: CompletionLogprobs,
    chat: ChatLogprobs,
}

impl ChoiceLogprobs {
    /// Adds token `id`, whose text starts at character `offset` of the choice's text.
    fn push(&mut self, kind: Kind, tok: &Tokenizer, id: u32, lp: &TokenLogprobs, offset: usize) {
        let text = |id: u32| {
            let bytes = tok.token_bytes(id);
            (String::from_utf8_lossy(&bytes).into_owned(), bytes)
        };
        let (token, bytes) = text(id);
        match kind {
            Kind::Completion => {
                let top = lp.top.iter().map(|&(t, l)| (text(t).0, l.max(LOGPROB_FLOOR)));
                self.text.tokens.push(token);
                self.text.token_logprobs.push(lp.logprob.max(LOGPROB_FLOOR));
                self.text.top_logprobs.push(TopMap(top.collect()));
                self.text.text_offset.push(offset);
            }
            Kind::Chat => {
                let top_logprobs = lp
                    .top
                    .iter()
                    .map(|&(t, l)| {
                        let (token, bytes) = text(t);
                        TopLogprob { token, logprob: l.max(LOGPROB_FLOOR), bytes }
                    })
                    .collect();
                self.chat.content.push(ChatTokenLogprob {
                    token,
                    logprob: lp.logprob.max(LOGPROB_FLOOR),
                    bytes,
                    top_logprobs,
                });
            }
        }
    }
}

/// Whether the fence's deadline has passed.
fn past(deadline: Option<Instant>) -> bool {
    deadline.is_some_and(|d| Instant::now() >= d)
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
    streams: Vec<Stream>,
    firsts: Vec<Option<StreamEvent>>,
    mut guard: AbortOnDrop,
) -> Result<Response, ApiError> {
    let deadline = ctx.deadline;
    let mut first_seen = false;
    let mut choices: Vec<(Finished, ChoiceLogprobs)> = Vec::with_capacity(streams.len());
    // The choices are read one after the other (they run side by side in the engine); each
    // stream is dropped at its end, which gives its slot back.
    for (stream, mut pending) in streams.into_iter().zip(firsts) {
        let mut lps = ChoiceLogprobs::default();
        let mut chars = 0;
        let finished: Finished = loop {
            let ev = match pending.take() {
                Some(ev) => ev,
                None => match next_event(&stream, deadline).await {
                    Some(Ok(ev)) => ev,
                    Some(Err(())) => {
                        ctx.record_end("fenced");
                        return Err(ApiError::fenced());
                    }
                    None => return Err(ApiError::unavailable("the engine stopped")),
                },
            };
            match ev {
                StreamEvent::Token { id, text, logprobs } => {
                    if !first_seen {
                        first_seen = true;
                        ctx.observe_first_token();
                    }
                    if let Some(lp) = logprobs {
                        lps.push(ctx.kind, ctx.tokenizer(), id, &lp, chars);
                    }
                    chars += text.chars().count();
                }
                StreamEvent::Done(f) => break f,
            }
        };
        if let Some(e) = refusal(&ctx.st, &ctx.tname, ctx.t, &finished) {
            // Not expected (refusals come at submission, seen in `run`), but handled.
            guard.done = true;
            ctx.lat.e2e.observe(ctx.arrived.elapsed().as_secs_f64());
            return Err(e);
        }
        choices.push((finished, lps));
    }
    guard.done = true;
    for (finished, _) in &choices {
        if finished.reason == FinishReason::Abort && past(deadline) {
            // The fence's watchdog aborted it.
            ctx.record_end("fenced");
            return Err(ApiError::fenced());
        }
        if matches!(finished.reason, FinishReason::Error | FinishReason::Abort) {
            ctx.record_end("error");
            return Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                finished.text.clone(),
            ));
        }
    }
    ctx.record_end("finished");
    let completion_tokens = choices.iter().map(|(f, _)| f.token_ids.len()).sum();
    let usage = Some(ctx.usage(completion_tokens));
    let parts = choices.into_iter().enumerate().map(|(i, (f, lps))| {
        let ids = ctx.return_ids.then_some(f.token_ids);
        (i as u32, f.text, Some(finish_reason(f.reason)), lps, ids)
    });
    let parts: Vec<_> = parts.collect();
    let body = match ctx.kind {
        Kind::Completion => {
            let choices = parts
                .into_iter()
                .map(|(index, text, finish_reason, lps, ids)| OwnedText {
                    index,
                    text,
                    finish_reason,
                    logprobs: ctx.logprobs.then_some(lps.text),
                    token_ids: ids,
                })
                .collect();
            json_text(&ctx.completion("text_completion", choices, usage))
        }
        Kind::Chat => {
            let choices = parts
                .into_iter()
                .map(|(index, content, finish_reason, lps, ids)| OwnedChat {
                    index,
                    message: OwnedMessage { role: "assistant", content },
                    finish_reason,
                    logprobs: ctx.logprobs.then_some(lps.chat),
                    token_ids: ids,
                })
                .collect();
            json_text(&ctx.completion("chat.completion", choices, usage))
        }
    };
    let mut r = Response::new(Body::from(body));
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    Ok(r)
}

/// [`TextChoice`] owning its text and ids (a whole response's choices outlive their loop).
#[derive(Debug, serde::Serialize)]
struct OwnedText {
    index: u32,
    text: String,
    finish_reason: Option<&'static str>,
    logprobs: Option<CompletionLogprobs>,
    #[serde(skip_serializing_if = "Option::is_none")]
    token_ids: Option<Vec<u32>>,
}

/// [`fastlane_openai::protocol::ChatChoice`] owning its text and ids.
#[derive(Debug, serde::Serialize)]
struct OwnedChat {
    index: u32,
    message: OwnedMessage,
    finish_reason: Option<&'static str>,
    logprobs: Option<ChatLogprobs>,
    #[serde(skip_serializing_if = "Option::is_none")]
    token_ids: Option<Vec<u32>>,
}

/// [`fastlane_openai::protocol::ChatMessage`] owning its text.
#[derive(Debug, serde::Serialize)]
struct OwnedMessage {
    role: &'static str,
    content: String,
}

/// One choice's events, `first` (already read) first, tagged with its index; `None` once if
/// its stream ends without its last event (the engine stopped). The engine stream lives until
/// the merged stream drops it after its last event.
fn choice_events(
    index: u32,
    s: Stream,
    first: Option<StreamEvent>,
) -> BoxStream<'static, (u32, Option<StreamEvent>)> {
    futures_util::stream::unfold((s, first, false), move |(s, first, ended)| async move {
        if ended {
            return None;
        }
        let ev = match first {
            Some(ev) => Some(ev),
            None => s.next_async().await,
        };
        let s = (s, None);
        match ev {
            Some(StreamEvent::Done(f)) => {
                Some(((index, Some(StreamEvent::Done(f))), (s.0, s.1, true)))
            }
            Some(ev) => Some(((index, Some(ev)), (s.0, s.1, false))),
            None => Some(((index, None), (s.0, s.1, true))),
        }
    })
    .boxed()
}

/// State of an SSE body.
struct Sse {
    ctx: Ctx,
    events: SelectAll<BoxStream<'static, (u32, Option<StreamEvent>)>>,
    guard: AbortOnDrop,
    last_token: Option<Instant>,
    deadline: Option<Instant>,
    ended: bool,
    /// Choices not yet ended.
    open: usize,
    /// Each choice's text sent so far, in characters (completions' `text_offset`) and bytes.
    chars: Vec<usize>,
    sent_bytes: Vec<usize>,
    completion_tokens: usize,
    fenced: bool,
}

impl Sse {
    /// The SSE event of one generated token of choice `index`.
    fn token_event(
        &mut self,
        index: u32,
        id: u32,
        text: &str,
        lp: Option<TokenLogprobs>,
    ) -> String {
        let ids = [id];
        let ids = self.ctx.return_ids.then_some(&ids[..]);
        let chars = &mut self.chars[index as usize];
        let mut lps = ChoiceLogprobs::default();
        if let Some(lp) = &lp {
            lps.push(self.ctx.kind, self.ctx.tokenizer(), id, lp, *chars);
        }
        *chars += text.chars().count();
        self.sent_bytes[index as usize] += text.len();
        let on = self.ctx.logprobs;
        match self.ctx.kind {
            Kind::Completion => {
                let choice = TextChoice {
                    index,
                    text,
                    finish_reason: None,
                    logprobs: on.then_some(lps.text),
                    token_ids: ids,
                };
                sse_event(&self.ctx.completion("text_completion", vec![choice], None))
            }
            Kind::Chat => {
                let choice = ChatChunkChoice {
                    index,
                    delta: Delta { content: Some(text) },
                    finish_reason: None,
                    logprobs: on.then_some(lps.chat),
                    token_ids: ids,
                };
                sse_event(&self.ctx.completion("chat.completion.chunk", vec![choice], None))
            }
        }
    }

    /// The last SSE event of choice `index`: the text held back at its end (an incomplete
    /// UTF-8 sequence, replaced), its finish reason, and the usage of all choices when it is
    /// the last to end.
    fn final_event(&self, index: u32, f: &Finished, usage: Option<Usage>) -> String {
        let reason = Some(finish_reason(f.reason));
        let tail = f.text.get(self.sent_bytes[index as usize]..).unwrap_or("");
        match self.ctx.kind {
            Kind::Completion => {
                let choice = TextChoice {
                    index,
                    text: tail,
                    finish_reason: reason,
                    logprobs: None,
                    token_ids: None,
                };
                sse_event(&self.ctx.completion("text_completion", vec![choice], usage))
            }
            Kind::Chat => {
                let choice = ChatChunkChoice {
                    index,
                    delta: Delta { content: (!tail.is_empty()).then_some(tail) },
                    finish_reason: reason,
                    logprobs: None,
                    token_ids: None,
                };
                sse_event(&self.ctx.completion("chat.completion.chunk", vec![choice], usage))
            }
        }
    }

    /// The next event of any choice within the fence.
    async fn next_event(&mut self) -> Option<Result<(u32, Option<StreamEvent>), ()>> {
        match self.deadline {
            None => self.events.next().await.map(Ok),
            Some(d) => match tokio::time::timeout_at(d.into(), self.events.next()).await {
                Ok(ev) => ev.map(Ok),
                Err(_) => Some(Err(())),
            },
        }
    }

    fn error_event(&mut self, message: &str) -> Option<axum::body::Bytes> {
        self.ended = true;
        let e = ErrorDetail { message, kind: "server_error", code: "server_error" };
        Some(axum::body::Bytes::from(ErrorBody { error: e }.sse()))
    }

    /// The next bytes of the body, `None` at its end.
    async fn next_bytes(&mut self) -> Option<axum::body::Bytes> {
        if self.ended {
            return None;
        }
        let ev = match self.next_event().await {
            Some(r) => r,
            None => return self.error_event("engine stopped"),
        };
        match ev {
            Ok((_, None)) => self.error_event("engine stopped"),
            Ok((i, Some(StreamEvent::Token { id, text, logprobs }))) => {
                let now = Instant::now();
                let lat = &self.ctx.lat;
                match self.last_token {
                    None => self.ctx.observe_first_token(),
                    Some(t) => lat.inter_token.observe(now.duration_since(t).as_secs_f64()),
                }
                self.last_token = Some(now);
                Some(axum::body::Bytes::from(self.token_event(i, id, &text, logprobs)))
            }
            Ok((_, Some(StreamEvent::Done(f))))
                if f.reason == FinishReason::Abort && past(self.deadline) =>
            {
                // The fence's watchdog aborted it in the engine.
                self.ended = true;
                self.ctx.record_end("fenced");
                Some(axum::body::Bytes::from(fence_event()))
            }
            Ok((i, Some(StreamEvent::Done(f)))) => {
                if let Some(e) = refusal(&self.ctx.st, &self.ctx.tname, self.ctx.t, &f) {
                    // A later choice refused at admission: the whole request is.
                    self.guard.done = true;
                    self.ctx.lat.e2e.observe(self.ctx.arrived.elapsed().as_secs_f64());
                    let message = e.message().to_string();
                    return self.error_event(&message);
                }
                self.completion_tokens += f.token_ids.len();
                self.fenced |= f.reason == FinishReason::Fenced;
                self.open -= 1;
                let usage = (self.open == 0).then(|| self.ctx.usage(self.completion_tokens));
                let mut out = self.final_event(i, &f, usage);
                if self.open == 0 {
                    self.ended = true;
                    self.guard.done = true;
                    self.ctx.record_end(if self.fenced { "fenced" } else { "finished" });
                    out.push_str("data: [DONE]\n\n");
                }
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
    streams: Vec<Stream>,
    firsts: Vec<Option<StreamEvent>>,
    guard: AbortOnDrop,
) -> Response {
    let deadline = ctx.deadline;
    let n = streams.len();
    let events = futures_util::stream::select_all(
        streams
            .into_iter()
            .zip(firsts)
            .enumerate()
            .map(|(i, (s, f))| choice_events(i as u32, s, f)),
    );
    let state = Sse {
        ctx,
        events,
        guard,
        last_token: None,
        deadline,
        ended: false,
        open: n,
        chars: vec![0; n],
        sent_bytes: vec![0; n],
        completion_tokens: 0,
        fenced: false,
    };
    let body = futures_util::stream::unfold(state, |mut s| async move {
        s.next_bytes().await.map(|b| (Ok::<_, std::convert::Infallible>(b), s))
    });
    let mut r = Response::new(Body::from_stream(body));
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    r.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

#[cfg(test)]
mod tests;
