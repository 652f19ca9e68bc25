//! Fuzzes what `llm serve` and the router do with a request body before the engine sees it:
//! any bytes parse as a completions or chat request (then pass or fail the check of the
//! fields the server does not do and of the ranges of `n`, the penalties and logprobs) or are refused with an error; never a panic.
#![no_main]

use fastlane_openai::protocol::{ChatRequest, CompletionRequest};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(r) = serde_json::from_slice::<CompletionRequest>(data) {
        let _ = r.common.refuse_unsupported();
        let _ = r.common.logprobs_wanted(false);
    }
    if let Ok(r) = serde_json::from_slice::<ChatRequest>(data) {
        let _ = r.common.refuse_unsupported();
        let _ = r.common.logprobs_wanted(true);
    }
    // The router reads only a few fields of a JSON value.
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) {
        let _ = fastlane_openai::router::estimate_tokens(&v);
    }
});
