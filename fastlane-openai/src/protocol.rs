//! The OpenAI completions and chat-completions protocol as `llm serve` speaks it: every
//! request, response, stream chunk, usage and error is a type here, serialized from this one
//! definition (vLLM's `protocol.py` is the model). The router forwards bodies unchanged and
//! reads only what it needs for admission; `llm serve` parses requests into these types and
//! writes its answers from them.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::api::ApiError;

// ---- requests ----

/// A string or a list of strings (`stop`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    /// One string.
    One(String),
    /// A list.
    Many(Vec<String>),
}

/// A prompt: text, or token ids.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Text, tokenized by the model's tokenizer.
    Text(String),
    /// Token ids.
    Ids(Vec<u32>),
}

/// `POST /v1/completions`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompletionRequest {
    /// The model asked for; another than the one served is a 404.
    #[serde(default)]
    pub model: Option<String>,
    /// Text or token ids.
    pub prompt: Prompt,
    /// The fields both endpoints share.
    #[serde(flatten)]
    pub common: SamplingFields,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatRequest {
    /// The model asked for; another than the one served is a 404.
    #[serde(default)]
    pub model: Option<String>,
    /// The conversation, oldest first.
    pub messages: Vec<Message>,
    /// The fields both endpoints share.
    #[serde(flatten)]
    pub common: SamplingFields,
}

/// One message of a chat request.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The message's text.
    pub content: String,
}

/// Fields both endpoints share (OpenAI's names; vLLM's extensions `top_k`, `ignore_eos`,
/// `stop_token_ids`, `return_token_ids`), as vLLM's `protocol.py` lists them.
#[derive(Debug, Default, Deserialize)]
pub struct SamplingFields {
    /// Tokens to generate at most ([`crate::api::DEFAULT_MAX_TOKENS`] when absent).
    #[serde(default)]
    pub max_tokens: Option<u32>,
    /// Sampling temperature (1 when absent; 0 is greedy).
    #[serde(default)]
    pub temperature: Option<f32>,
    /// Nucleus sampling mass (1 when absent).
    #[serde(default)]
    pub top_p: Option<f32>,
    /// vLLM's: the k most likely tokens only (0 or absent: all).
    #[serde(default)]
    pub top_k: Option<usize>,
    /// The sampling seed (absent: one from the OS RNG).
    #[serde(default)]
    pub seed: Option<u64>,
    /// Strings that end the generation.
    #[serde(default)]
    pub stop: Option<OneOrMany>,
    /// vLLM's: token ids that end the generation.
    #[serde(default)]
    pub stop_token_ids: Option<Vec<u32>>,
    /// vLLM's: generate past the end-of-sequence token.
    #[serde(default)]
    pub ignore_eos: Option<bool>,
    /// Server-sent events instead of one response.
    #[serde(default)]
    pub stream: Option<bool>,
    /// vLLM's: the generated token ids in each choice.
    #[serde(default)]
    pub return_token_ids: Option<bool>,
    /// Choices per request, 1 to [`N_MAX`].
    #[serde(default)]
    pub n: Option<u32>,
    /// An end-user id; accepted, not used.
    #[serde(default)]
    pub user: Option<String>,
    // What OpenAI's SDKs and the tooling built on them (LangChain, LlamaIndex) send by default.
    // Accepted as long as they ask for nothing we do not do (`refuse_unsupported`): the neutral
    // value passes, anything else is a 400 that names the field.
    /// `{"include_usage": true}`: the last chunk of a stream carries `usage` (it always does
    /// here).
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// The chat API's newer name for `max_tokens`.
    #[serde(default)]
    pub max_completion_tokens: Option<u32>,
    /// -2 to 2: subtracted, times its count, from a generated token's logit.
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    /// -2 to 2: subtracted from the logit of a token generated at least once.
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    /// Chat: a bool; completions: the alternatives per token, 0 to
    /// [`COMPLETION_LOGPROBS_MAX`] (read by [`SamplingFields::logprobs_wanted`]).
    #[serde(default)]
    pub logprobs: Option<Value>,
    /// Chat: the alternatives per token, 0 to [`TOP_LOGPROBS_MAX`] (with `logprobs: true`).
    #[serde(default)]
    pub top_logprobs: Option<u32>,
    /// Only an empty bias is served.
    #[serde(default)]
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    /// Only `{"type": "text"}` is served.
    #[serde(default)]
    pub response_format: Option<Value>,
    /// Only false is served.
    #[serde(default)]
    pub echo: Option<bool>,
    /// Only 1 is served.
    #[serde(default)]
    pub best_of: Option<u32>,
    /// Only an empty suffix is served.
    #[serde(default)]
    pub suffix: Option<String>,
}

/// `stream_options`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    // Accepted and not read: the final event of a stream always carries `usage`.
    /// Whether the last chunk carries usage (it always does here).
    #[allow(dead_code)]
    #[serde(default)]
    pub include_usage: Option<bool>,
    /// vLLM's usage in every chunk; not served.
    #[serde(default)]
    pub continuous_usage_stats: Option<bool>,
}

/// Choices per request at most (`n`).
pub const N_MAX: u32 = 8;
/// Alternatives per token at most on `/v1/completions` (`logprobs`), OpenAI's cap.
pub const COMPLETION_LOGPROBS_MAX: u8 = 5;
/// Alternatives per token at most on `/v1/chat/completions` (`top_logprobs`), OpenAI's cap.
pub const TOP_LOGPROBS_MAX: u8 = 20;
/// The penalties' range, OpenAI's: -2 to 2.
pub const PENALTY_ABS_MAX: f32 = 2.0;

impl SamplingFields {
    /// A 400 naming the first field that asks for something this server does not do, or a
    /// value out of its range.
    pub fn refuse_unsupported(&self) -> Result<(), ApiError> {
        let unsupported = |field: &str, what: &str| {
            Err(ApiError::bad(format!("{field}: {what} is not supported by this server")))
        };
        for (field, v) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            if v.is_some_and(|p| !(-PENALTY_ABS_MAX..=PENALTY_ABS_MAX).contains(&p)) {
                return Err(ApiError::bad(format!("{field}: must be between -2 and 2")));
            }
        }
        self.choices()?;
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

    /// `n`: 1 when absent; a 400 outside 1 to [`N_MAX`].
    pub fn choices(&self) -> Result<u32, ApiError> {
        match self.n {
            None => Ok(1),
            Some(n) if (1..=N_MAX).contains(&n) => Ok(n),
            Some(n) => Err(ApiError::bad(format!("n: {n} is not in 1 to {N_MAX}"))),
        }
    }

    /// The alternatives per token the request asks log-probabilities for (`None`: none
    /// asked). Completions: `logprobs` is a count, 0 to [`COMPLETION_LOGPROBS_MAX`]; chat:
    /// `logprobs` is a bool and `top_logprobs` the count, 0 to [`TOP_LOGPROBS_MAX`]. A 400
    /// names the field otherwise.
    pub fn logprobs_wanted(&self, chat: bool) -> Result<Option<u8>, ApiError> {
        let top = self.top_logprobs.unwrap_or(0);
        if chat {
            let on = match &self.logprobs {
                None | Some(Value::Null) | Some(Value::Bool(false)) => false,
                Some(Value::Bool(true)) => true,
                Some(_) => return Err(ApiError::bad("logprobs: true or false on this endpoint")),
            };
            if top > u32::from(TOP_LOGPROBS_MAX) {
                return Err(ApiError::bad(format!(
                    "top_logprobs: {top} is not in 0 to {TOP_LOGPROBS_MAX}"
                )));
            }
            if top > 0 && !on {
                return Err(ApiError::bad("top_logprobs: needs logprobs: true"));
            }
            return Ok(on.then_some(top as u8));
        }
        if top != 0 {
            return Err(ApiError::bad("top_logprobs: a chat field; use logprobs on this endpoint"));
        }
        match &self.logprobs {
            None | Some(Value::Null) | Some(Value::Bool(false)) => Ok(None),
            Some(Value::Number(n)) => match n.as_u64() {
                Some(k) if k <= u64::from(COMPLETION_LOGPROBS_MAX) => Ok(Some(k as u8)),
                _ => Err(ApiError::bad(format!(
                    "logprobs: {n} is not in 0 to {COMPLETION_LOGPROBS_MAX}"
                ))),
            },
            Some(_) => Err(ApiError::bad(format!(
                "logprobs: an integer, 0 to {COMPLETION_LOGPROBS_MAX}, on this endpoint"
            ))),
        }
    }
}

// ---- responses ----

/// Token counts of a response (the last chunk of a stream carries it too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
}

impl Usage {
    /// `prompt` and `completion` tokens.
    pub fn new(prompt: usize, completion: usize) -> Usage {
        Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
        }
    }
}

/// A response or stream chunk: `object` is `text_completion`, `chat.completion` or
/// `chat.completion.chunk`; `C` is the kind of choice it carries.
#[derive(Debug, Clone, Serialize)]
pub struct Completion<'a, C> {
    /// `cmpl-<request id>`.
    pub id: &'a str,
    /// The object type.
    pub object: &'static str,
    /// Unix seconds at admission.
    pub created: u64,
    /// The model id `/v1/models` lists.
    pub model: &'a str,
    /// The choices (`n` of them in a whole response; a stream chunk carries one).
    pub choices: Vec<C>,
    /// Whole responses and the last chunk of a stream.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// A completions choice (whole, or one chunk of a stream).
#[derive(Debug, Clone, Serialize)]
pub struct TextChoice<'a> {
    /// Which of the `n` choices.
    pub index: u32,
    /// The text (of this chunk).
    pub text: &'a str,
    /// `stop`, `length`, `abort`, `error`; null until the end.
    pub finish_reason: Option<&'static str>,
    /// The tokens' log-probabilities (of this chunk), when asked for.
    pub logprobs: Option<CompletionLogprobs>,
    /// vLLM's `return_token_ids`: the token ids (of this chunk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<&'a [u32]>,
}

/// The assistant's message of a whole chat response.
#[derive(Debug, Clone, Serialize)]
pub struct ChatMessage<'a> {
    /// Always `assistant`.
    pub role: &'static str,
    /// The text.
    pub content: &'a str,
}

/// A whole chat response's choice.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice<'a> {
    /// Which of the `n` choices.
    pub index: u32,
    /// The message.
    pub message: ChatMessage<'a>,
    /// See [`TextChoice::finish_reason`].
    pub finish_reason: Option<&'static str>,
    /// The tokens' log-probabilities, when asked for.
    pub logprobs: Option<ChatLogprobs>,
    /// See [`TextChoice::token_ids`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<&'a [u32]>,
}

/// What a chat stream chunk adds: text, or nothing in the last chunk.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Delta<'a> {
    /// This chunk's text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<&'a str>,
}

/// A chat stream chunk's choice.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChunkChoice<'a> {
    /// Which of the `n` choices.
    pub index: u32,
    /// The text added.
    pub delta: Delta<'a>,
    /// See [`TextChoice::finish_reason`].
    pub finish_reason: Option<&'static str>,
    /// This chunk's tokens' log-probabilities, when asked for.
    pub logprobs: Option<ChatLogprobs>,
    /// See [`TextChoice::token_ids`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<&'a [u32]>,
}

/// A completions choice's `logprobs`: one entry per token in each list.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CompletionLogprobs {
    /// The tokens' text.
    pub tokens: Vec<String>,
    /// Their log-probabilities.
    pub token_logprobs: Vec<f32>,
    /// The most likely alternatives of each: token text → log-probability.
    pub top_logprobs: Vec<TopMap>,
    /// Where each token's text starts in the choice's text (characters).
    pub text_offset: Vec<usize>,
}

/// Token text → log-probability, as a JSON object (the most likely first).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TopMap(pub Vec<(String, f32)>);

impl Serialize for TopMap {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.0.iter().map(|(k, v)| (k, v)))
    }
}

/// A chat choice's `logprobs`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ChatLogprobs {
    /// One entry per token.
    pub content: Vec<ChatTokenLogprob>,
}

/// One token of [`ChatLogprobs`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatTokenLogprob {
    /// Its text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// Its bytes (UTF-8 of its text, or the raw byte of a byte token).
    pub bytes: Vec<u8>,
    /// The most likely alternatives, the most likely first.
    pub top_logprobs: Vec<TopLogprob>,
}

/// One alternative of [`ChatTokenLogprob`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TopLogprob {
    /// Its text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// Its bytes.
    pub bytes: Vec<u8>,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, Serialize)]
pub struct ModelList<'a> {
    /// Always `list`.
    pub object: &'static str,
    /// The models served (one).
    pub data: Vec<ModelCard<'a>>,
}

/// One model of [`ModelList`].
#[derive(Debug, Clone, Serialize)]
pub struct ModelCard<'a> {
    /// Its id.
    pub id: &'a str,
    /// Always `model`.
    pub object: &'static str,
    /// Always `fastlane`.
    pub owned_by: &'static str,
}

impl<'a> ModelList<'a> {
    /// The list of the one model `id`.
    pub fn one(id: &'a str) -> ModelList<'a> {
        ModelList {
            object: "list",
            data: vec![ModelCard { id, object: "model", owned_by: "fastlane" }],
        }
    }
}

/// `GET /health`.
#[derive(Debug, Clone, Serialize)]
pub struct Health {
    /// `ok`, or what is wrong in one word (`dead`, `stalled`, `upstream_unavailable`).
    pub status: &'static str,
    /// What is wrong, in words.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl Health {
    /// `200 {"status": "ok"}`.
    pub fn ok() -> Health {
        Health { status: "ok", reason: None }
    }

    /// `status` with `reason`.
    pub fn bad(status: &'static str, reason: impl Into<String>) -> Health {
        Health { status, reason: Some(reason.into()) }
    }

    /// The response: 200 when ok, else 503.
    pub fn response(self) -> axum::response::Response {
        use axum::response::IntoResponse;
        let code = if self.status == "ok" {
            axum::http::StatusCode::OK
        } else {
            axum::http::StatusCode::SERVICE_UNAVAILABLE
        };
        (code, axum::Json(self)).into_response()
    }
}

/// An error body, OpenAI's shape: `{"error": {"message", "type", "code"}}`.
#[derive(Debug, Clone, Serialize)]
pub struct ErrorBody<'a> {
    /// The error.
    pub error: ErrorDetail<'a>,
}

/// The fields of [`ErrorBody`].
#[derive(Debug, Clone, Serialize)]
pub struct ErrorDetail<'a> {
    /// What happened, for people.
    pub message: &'a str,
    /// OpenAI's error type (`invalid_request_error`, `rate_limit_error`, …).
    #[serde(rename = "type")]
    pub kind: &'a str,
    /// A code for programs.
    pub code: &'a str,
}

impl ErrorBody<'_> {
    /// The body as one SSE event (`data: {...}` and a blank line).
    pub fn sse(&self) -> String {
        format!("data: {}\n\n", json_text(self))
    }
}

/// `v` as JSON text. The types here serialize infallibly (no maps with non-string keys, no
/// fallible `Serialize` impls), so the empty-object fallback is never taken.
pub fn json_text<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_else(|_| "{}".to_string())
}

/// `v` as one SSE event: `data: {...}` and a blank line.
pub fn sse_event<T: Serialize>(v: &T) -> String {
    format!("data: {}\n\n", json_text(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_are_openais() {
        let c = Completion {
            id: "cmpl-1",
            object: "text_completion",
            created: 7,
            model: "m",
            choices: vec![TextChoice {
                index: 0,
                text: "hi",
                finish_reason: None,
                logprobs: None,
                token_ids: Some(&[5]),
            }],
            usage: None,
        };
        assert_eq!(
            json_text(&c),
            r#"{"id":"cmpl-1","object":"text_completion","created":7,"model":"m","choices":[{"index":0,"text":"hi","finish_reason":null,"logprobs":null,"token_ids":[5]}]}"#
        );
        let end = Completion {
            id: "cmpl-1",
            object: "chat.completion.chunk",
            created: 7,
            model: "m",
            choices: vec![ChatChunkChoice {
                index: 0,
                delta: Delta::default(),
                finish_reason: Some("stop"),
                logprobs: None,
                token_ids: None,
            }],
            usage: Some(Usage::new(3, 2)),
        };
        assert_eq!(
            json_text(&end),
            r#"{"id":"cmpl-1","object":"chat.completion.chunk","created":7,"model":"m","choices":[{"index":0,"delta":{},"finish_reason":"stop","logprobs":null}],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}"#
        );
        let e = ErrorBody { error: ErrorDetail { message: "x", kind: "server_error", code: "c" } };
        assert_eq!(
            e.sse(),
            "data: {\"error\":{\"message\":\"x\",\"type\":\"server_error\",\"code\":\"c\"}}\n\n"
        );
        assert_eq!(
            json_text(&ModelList::one("m")),
            r#"{"object":"list","data":[{"id":"m","object":"model","owned_by":"fastlane"}]}"#
        );
    }

    #[test]
    fn requests_parse_and_unsupported_values_are_named() {
        let r: CompletionRequest = serde_json::from_str(
            r#"{"prompt": [1, 2], "max_tokens": 4, "frequency_penalty": 0, "stream_options": {"include_usage": true}}"#,
        )
        .unwrap();
        assert!(matches!(r.prompt, Prompt::Ids(ref v) if v == &[1, 2]));
        assert!(r.common.refuse_unsupported().is_ok());
        let r: ChatRequest = serde_json::from_str(
            r#"{"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5}"#,
        )
        .unwrap();
        assert!(r.common.refuse_unsupported().is_ok());
        let r: ChatRequest = serde_json::from_str(
            r#"{"messages": [{"role": "user", "content": "x"}], "presence_penalty": 2.5}"#,
        )
        .unwrap();
        let e = r.common.refuse_unsupported().unwrap_err();
        assert!(e.message().starts_with("presence_penalty:"), "{e:?}");
        assert!(
            serde_json::from_str::<CompletionRequest>(r#"{"prompt": "x", "bogus": 1}"#).is_err()
        );
    }

    #[test]
    fn logprobs_and_n_are_read_per_endpoint_and_bounded() {
        let fields = |json: &str| serde_json::from_str::<CompletionRequest>(json).unwrap().common;
        let named = |r: Result<Option<u8>, ApiError>, field: &str| {
            let e = r.unwrap_err();
            assert!(e.message().starts_with(field), "{}", e.message());
        };
        assert_eq!(fields(r#"{"prompt": "x"}"#).logprobs_wanted(false).unwrap(), None);
        assert_eq!(
            fields(r#"{"prompt": "x", "logprobs": 0}"#).logprobs_wanted(false).unwrap(),
            Some(0)
        );
        assert_eq!(
            fields(r#"{"prompt": "x", "logprobs": 5}"#).logprobs_wanted(false).unwrap(),
            Some(5)
        );
        named(fields(r#"{"prompt": "x", "logprobs": 6}"#).logprobs_wanted(false), "logprobs:");
        named(fields(r#"{"prompt": "x", "logprobs": true}"#).logprobs_wanted(false), "logprobs:");
        named(
            fields(r#"{"prompt": "x", "top_logprobs": 2}"#).logprobs_wanted(false),
            "top_logprobs:",
        );
        let chat = |json: &str| fields(json).logprobs_wanted(true);
        assert_eq!(chat(r#"{"prompt": "x", "logprobs": true}"#).unwrap(), Some(0));
        assert_eq!(
            chat(r#"{"prompt": "x", "logprobs": true, "top_logprobs": 20}"#).unwrap(),
            Some(20)
        );
        assert_eq!(chat(r#"{"prompt": "x", "logprobs": false}"#).unwrap(), None);
        named(chat(r#"{"prompt": "x", "logprobs": true, "top_logprobs": 21}"#), "top_logprobs:");
        named(chat(r#"{"prompt": "x", "top_logprobs": 3}"#), "top_logprobs:");
        named(chat(r#"{"prompt": "x", "logprobs": 3}"#), "logprobs:");
        assert_eq!(fields(r#"{"prompt": "x", "n": 8}"#).choices().unwrap(), 8);
        for bad in [r#"{"prompt": "x", "n": 9}"#, r#"{"prompt": "x", "n": 0}"#] {
            let e = fields(bad).refuse_unsupported().unwrap_err();
            assert!(e.message().starts_with("n:"), "{}", e.message());
        }
        let e = fields(r#"{"prompt": "x", "frequency_penalty": -2.01}"#).refuse_unsupported();
        assert!(e.unwrap_err().message().starts_with("frequency_penalty:"));
        assert!(fields(r#"{"prompt": "x", "frequency_penalty": -2}"#).refuse_unsupported().is_ok());
        let top = TopMap(vec![("a".into(), -0.5), ("b".into(), -1.0)]);
        assert_eq!(json_text(&top), r#"{"a":-0.5,"b":-1.0}"#);
    }
}
