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
    /// Choices per request; only 1 is served.
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
    /// Only 0 is served.
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    /// Only 0 is served.
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    /// Chat: a bool; completions: a count. Only off (false, 0, null) is served.
    #[serde(default)]
    pub logprobs: Option<Value>,
    /// Only 0 is served.
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

impl SamplingFields {
    /// A 400 naming the first field that asks for something this server does not do.
    pub fn refuse_unsupported(&self) -> Result<(), ApiError> {
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
    /// One choice (`n` is 1).
    pub choices: [C; 1],
    /// Whole responses and the last chunk of a stream.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// A completions choice (whole, or one chunk of a stream).
#[derive(Debug, Clone, Serialize)]
pub struct TextChoice<'a> {
    /// Always 0.
    pub index: u32,
    /// The text (of this chunk).
    pub text: &'a str,
    /// `stop`, `length`, `abort`, `error`; null until the end.
    pub finish_reason: Option<&'static str>,
    /// Always null (log probabilities are not returned).
    pub logprobs: Option<()>,
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
    /// Always 0.
    pub index: u32,
    /// The message.
    pub message: ChatMessage<'a>,
    /// See [`TextChoice::finish_reason`].
    pub finish_reason: Option<&'static str>,
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
    /// Always 0.
    pub index: u32,
    /// The text added.
    pub delta: Delta<'a>,
    /// See [`TextChoice::finish_reason`].
    pub finish_reason: Option<&'static str>,
    /// See [`TextChoice::token_ids`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<&'a [u32]>,
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
            choices: [TextChoice {
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
            choices: [ChatChunkChoice {
                index: 0,
                delta: Delta::default(),
                finish_reason: Some("stop"),
                token_ids: None,
            }],
            usage: Some(Usage::new(3, 2)),
        };
        assert_eq!(
            json_text(&end),
            r#"{"id":"cmpl-1","object":"chat.completion.chunk","created":7,"model":"m","choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}"#
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
        let e = r.common.refuse_unsupported().unwrap_err();
        assert!(format!("{e:?}").contains("presence_penalty"), "{e:?}");
        assert!(
            serde_json::from_str::<CompletionRequest>(r#"{"prompt": "x", "bogus": 1}"#).is_err()
        );
    }
}
