//! Unit tests of the request conversion and its limits.

use super::*;

fn completion(json: &str) -> CompletionRequest {
    serde_json::from_str(json).unwrap()
}

fn chat(json: &str) -> ChatRequest {
    serde_json::from_str(json).unwrap()
}

#[test]
fn a_completion_and_the_same_chat_make_the_same_engine_request() {
    let fields = r#""max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 40,
        "seed": 3, "stop": ["x", "y"], "stop_token_ids": [5], "ignore_eos": true,
        "n": 1, "user": "u""#;
    let prompt = r#""<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n""#;
    let messages = r#"[{"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"}]"#;
    let (a, b) = (
        completion(&format!(r#"{{"prompt": {prompt}, {fields}}}"#)),
        chat(&format!(r#"{{"messages": {messages}, {fields}}}"#)),
    );
    let tok = Tokenizer::Bytes;
    let ra =
        engine_request(&a.common, Kind::Completion, completion_prompt(&tok, a.prompt).unwrap(), 2)
            .unwrap();
    let rb =
        engine_request(&b.common, Kind::Chat, chat_prompt(&tok, &b.messages).unwrap(), 2).unwrap();
    assert_eq!(format!("{ra:?}"), format!("{rb:?}"));
    assert_eq!(
        ra.prompt,
        tok.encode("<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n").unwrap()
    );
    assert_eq!((ra.max_tokens, ra.tenant, ra.ignore_eos, ra.digest_logits), (7, 2, true, false));
    let want = SamplingParams {
        temperature: 0.5,
        top_p: 0.9,
        top_k: 40,
        seed: 3,
        ..SamplingParams::default()
    };
    assert_eq!(ra.sampling, want);
    assert_eq!((ra.stop, ra.stop_token_ids), (vec!["x".to_string(), "y".into()], vec![5]));
    // The chat API's newer name for max_tokens, and one stop string.
    let c = chat(
        r#"{"messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 9, "stop": "z", "seed": 1}"#,
    );
    let r = engine_request(&c.common, Kind::Chat, vec![1], 0).unwrap();
    assert_eq!((r.max_tokens, r.stop), (9, vec!["z".to_string()]));
}

#[test]
fn engine_request_defaults_and_refusals() {
    let c = completion(r#"{"prompt": [1, 2, 3], "seed": 4}"#);
    let r = engine_request(
        &c.common,
        Kind::Completion,
        completion_prompt(&Tokenizer::Bytes, c.prompt).unwrap(),
        0,
    )
    .unwrap();
    assert_eq!((r.prompt, r.max_tokens), (vec![1, 2, 3], DEFAULT_MAX_TOKENS));
    let want = SamplingParams { temperature: 1.0, seed: 4, ..SamplingParams::default() };
    assert_eq!(r.sampling, want);
    assert!(r.stop.is_empty() && r.stop_token_ids.is_empty() && !r.ignore_eos);
    let n9 = completion(r#"{"prompt": "hi", "n": 9}"#);
    assert!(engine_request(&n9.common, Kind::Completion, vec![1], 0).is_err());
    let pen = completion(r#"{"prompt": "hi", "frequency_penalty": 2.5}"#);
    assert!(engine_request(&pen.common, Kind::Completion, vec![1], 0).is_err());
    // The penalties and logprobs reach the sampler; n choices get seeds seed + i.
    let c = completion(
        r#"{"prompt": "hi", "presence_penalty": 0.5, "frequency_penalty": -1, "logprobs": 3,
        "n": 3, "seed": 10}"#,
    );
    let rs = engine_requests(&c.common, Kind::Completion, vec![1], 0).unwrap();
    let seeds: Vec<u64> = rs.iter().map(|r| r.sampling.seed).collect();
    assert_eq!(seeds, [10, 11, 12]);
    let s = rs[2].sampling;
    assert_eq!((s.presence_penalty, s.frequency_penalty, s.logprobs), (0.5, -1.0, Some(3)));
    let c = chat(r#"{"messages": [{"role": "user", "content": "x"}], "n": 2}"#);
    let rs = engine_requests(&c.common, Kind::Chat, vec![1], 0).unwrap();
    assert_ne!(rs[0].sampling.seed, rs[1].sampling.seed, "independent seeds without one");
    let lp = chat(r#"{"messages": [], "logprobs": true, "top_logprobs": 4}"#);
    assert_eq!(
        engine_request(&lp.common, Kind::Chat, vec![1], 0).unwrap().sampling.logprobs,
        Some(4)
    );
    assert!(engine_request(&lp.common, Kind::Completion, vec![1], 0).is_err());
    let tok = Tokenizer::Bytes;
    assert!(chat_prompt(&tok, &[]).is_err());
    let tool = chat(r#"{"messages": [{"role": "tool", "content": "x"}]}"#);
    assert!(chat_prompt(&tok, &tool.messages).is_err());
}

#[test]
fn what_costs_engine_time_per_token_is_bounded() {
    let refused = |json: &str, field: &str| {
        let e = engine_request(&completion(json).common, Kind::Completion, vec![1], 0).unwrap_err();
        assert_eq!(e.status(), StatusCode::BAD_REQUEST, "{json}");
        assert!(e.message().starts_with(field), "{json}: {}", e.message());
    };
    let ok = |json: &str| {
        engine_request(&completion(json).common, Kind::Completion, vec![1], 0).unwrap()
    };
    let four = r#"{"prompt": "x", "stop": ["a", "b", "c", "d"]}"#;
    assert_eq!(ok(four).stop.len(), STOP_STRINGS_MAX);
    refused(r#"{"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}"#, "stop:");
    let long = "x".repeat(STOP_STRING_BYTES_MAX);
    assert_eq!(
        ok(&format!(r#"{{"prompt": "x", "stop": "{long}"}}"#)).stop,
        std::slice::from_ref(&long)
    );
    refused(&format!(r#"{{"prompt": "x", "stop": "{long}y"}}"#), "stop:");
    refused(r#"{"prompt": "x", "stop": [""]}"#, "stop:");
    let ids = |n: usize| vec!["7"; n].join(",");
    let json = |n| format!(r#"{{"prompt": "x", "stop_token_ids": [{}]}}"#, ids(n));
    assert_eq!(ok(&json(STOP_TOKEN_IDS_MAX)).stop_token_ids.len(), STOP_TOKEN_IDS_MAX);
    refused(&json(STOP_TOKEN_IDS_MAX + 1), "stop_token_ids:");
}
