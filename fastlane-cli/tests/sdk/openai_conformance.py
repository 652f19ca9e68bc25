"""The official `openai` Python SDK against `fastlane llm serve` (or `fastlane router` in front
of it): every call a client makes, asserted on. Run by fastlane-cli/tests/llm_openai_sdk.rs.

Usage: python openai_conformance.py BASE_URL KEY TIGHT_KEY [PAIR_KEY]
  BASE_URL   the server's URL (the SDK's base_url is BASE_URL/v1)
  KEY        a tenant key with room for every request here
  TIGHT_KEY  a tenant key with a bucket of one request (rpm 1): a 429 within three requests
  PAIR_KEY   (llm serve only) a tenant key with a bucket of one request and two slots: a
             request with n=2 is two requests to its bucket, so a 429

Exits 0 when every check passed; otherwise prints the failed check and exits 1.
"""

import sys

import openai
from openai import OpenAI


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def main():
    base, key, tight_key = sys.argv[1], sys.argv[2], sys.argv[3]
    pair_key = sys.argv[4] if len(sys.argv) > 4 else None
    url = base.rstrip("/") + "/v1"
    client = OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)

    # ---- models.list ----
    models = client.models.list()
    ids = [m.id for m in models.data]
    check(len(ids) == 1, f"one model listed: {ids}")
    model = ids[0]
    print(f"model {model}")

    # Every generation below runs to max_tokens (ignore_eos) so counts are exact.
    fixed = {"ignore_eos": True, "return_token_ids": True}

    # ---- completions, not streamed ----
    r = client.completions.create(model=model, prompt="hello", max_tokens=12, temperature=0,
                                  extra_body=fixed)
    check(r.object == "text_completion", f"object: {r.object}")
    check(len(r.choices) == 1 and r.choices[0].index == 0, f"one choice: {r.choices}")
    check(r.choices[0].finish_reason == "length", f"finish_reason: {r.choices[0]}")
    check(r.usage.completion_tokens == 12, f"usage: {r.usage}")
    check(r.usage.total_tokens == r.usage.prompt_tokens + 12, f"usage: {r.usage}")
    check(r.choices[0].logprobs is None, "no logprobs unless asked")
    greedy_text = r.choices[0].text

    # ---- completions, streamed, with usage ----
    chunks = list(client.completions.create(
        model=model, prompt="hello", max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=fixed))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    check(text == greedy_text, f"streamed text {text!r} == whole {greedy_text!r}")
    check(chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12,
          f"the last chunk carries usage: {chunks[-1]}")
    check(chunks[-1].choices[0].finish_reason == "length", f"last chunk: {chunks[-1]}")

    # ---- stop: a printable character of the greedy text ends the same generation there ----
    r = client.completions.create(model=model, prompt="hello", max_tokens=48, temperature=0,
                                  extra_body={"ignore_eos": True})
    long_text = r.choices[0].text
    stop = next((ch for ch in long_text[1:] if ch.isascii() and ch.isalnum()), None)
    check(stop is not None, f"a letter or digit to stop at in {long_text!r}")
    r = client.completions.create(model=model, prompt="hello", max_tokens=48, temperature=0,
                                  stop=[stop], extra_body={"ignore_eos": True})
    want = long_text[:long_text.index(stop)]
    check(r.choices[0].text == want, f"stop {stop!r}: {r.choices[0].text!r} == {want!r}")
    check(r.choices[0].finish_reason == "stop", f"finish_reason: {r.choices[0]}")

    # ---- seed: the same seed reproduces, another differs ----
    def sampled(seed, **kw):
        r = client.completions.create(model=model, prompt="once upon", max_tokens=16,
                                      temperature=1.0, seed=seed, extra_body=fixed, **kw)
        return r
    a, b, c = sampled(42), sampled(42), sampled(43)
    check(a.choices[0].token_ids == b.choices[0].token_ids, "seed 42 reproduces")
    check(a.choices[0].token_ids != c.choices[0].token_ids, "seed 43 differs from 42")

    # ---- n=2: choice i samples from seed + i ----
    two = sampled(42, n=2)
    check([ch.index for ch in two.choices] == [0, 1], f"indices: {two.choices}")
    check(two.choices[0].token_ids == a.choices[0].token_ids, "choice 0 is seed 42")
    check(two.choices[1].token_ids == c.choices[0].token_ids, "choice 1 is seed 43")
    check(two.usage.completion_tokens == 32, f"usage sums the choices: {two.usage}")
    check(two.usage.prompt_tokens == a.usage.prompt_tokens, "the prompt counted once")
    chunks = list(client.completions.create(
        model=model, prompt="once upon", max_tokens=16, temperature=1.0, seed=42, n=2,
        stream=True, stream_options={"include_usage": True}, extra_body=fixed))
    per = {0: "", 1: ""}
    ends = {}
    for ch in chunks:
        for choice in ch.choices:
            per[choice.index] += choice.text
            if choice.finish_reason:
                ends[choice.index] = choice.finish_reason
    check(per[0] == two.choices[0].text and per[1] == two.choices[1].text,
          f"streamed n=2 {per} == whole {[x.text for x in two.choices]}")
    check(ends == {0: "length", 1: "length"}, f"each choice ends: {ends}")
    check(chunks[-1].usage.completion_tokens == 32, f"streamed usage: {chunks[-1].usage}")

    # ---- logprobs (completions) ----
    r = client.completions.create(model=model, prompt="hello", max_tokens=8, temperature=0,
                                  logprobs=3, extra_body=fixed)
    lp = r.choices[0].logprobs
    check(lp is not None, "logprobs returned")
    n = r.usage.completion_tokens
    check(len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) ==
          len(lp.text_offset) == n, f"one entry per token: {lp}")
    check(lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset),
          f"text_offset: {lp.text_offset}")
    for t, l, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        check(l <= 0.0, f"a log-probability: {l}")
        check(1 <= len(top) <= 3, f"at most 3 alternatives: {top}")
        # Greedy: the chosen token is the most likely one.
        check(l >= max(top.values()) - 1e-5, f"greedy {t!r} {l} is the best of {top}")
    chunks = list(client.completions.create(
        model=model, prompt="hello", max_tokens=8, temperature=0, logprobs=3, stream=True,
        extra_body=fixed))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs
                for x in c.choices[0].logprobs.token_logprobs]
    check(len(streamed) == n, f"streamed logprobs per token: {streamed}")
    check(all(abs(x - y) < 1e-6 for x, y in zip(streamed, lp.token_logprobs)),
          "streamed logprobs are the whole response's")

    # ---- penalties: greedy repeats less with them ----
    def tokens(**kw):
        r = client.completions.create(model=model, prompt="the cat", max_tokens=48,
                                      temperature=0, extra_body=fixed, **kw)
        return r.choices[0].token_ids
    plain = tokens()
    pen = tokens(presence_penalty=2.0, frequency_penalty=2.0)
    check(len(set(pen)) > len(set(plain)),
          f"penalties: {len(set(pen))} distinct tokens > {len(set(plain))}")
    check(pen == tokens(presence_penalty=2.0, frequency_penalty=2.0), "penalties are deterministic")

    # ---- chat ----
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=10, temperature=0,
                                       extra_body=fixed)
    check(r.object == "chat.completion", f"object: {r.object}")
    check(r.choices[0].message.role == "assistant", f"role: {r.choices[0].message}")
    check(r.usage.completion_tokens == 10, f"usage: {r.usage}")
    chat_text = r.choices[0].message.content
    chunks = list(client.chat.completions.create(
        model=model, messages=msgs, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=fixed))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    check(text == chat_text, f"streamed chat {text!r} == {chat_text!r}")
    check(chunks[-1].usage.completion_tokens == 10, f"streamed chat usage: {chunks[-1]}")
    # stop
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=48, temperature=0,
                                       extra_body={"ignore_eos": True})
    long_chat = r.choices[0].message.content
    stop = next((ch for ch in long_chat[1:] if ch.isascii() and ch.isalnum()), None)
    check(stop is not None, f"a letter or digit to stop at in {long_chat!r}")
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=48, temperature=0,
                                       stop=stop, extra_body={"ignore_eos": True})
    check(r.choices[0].message.content == long_chat[:long_chat.index(stop)],
          f"chat stop {stop!r}: {r.choices[0].message.content!r}")
    check(r.choices[0].finish_reason == "stop", f"chat finish_reason: {r.choices[0]}")
    # seed and n
    def chat_sampled(seed, **kw):
        return client.chat.completions.create(model=model, messages=msgs, max_tokens=12,
                                              temperature=1.0, seed=seed, extra_body=fixed,
                                              **kw)
    a, b = chat_sampled(7), chat_sampled(7)
    check(a.choices[0].message.content == b.choices[0].message.content, "chat seed reproduces")
    two = chat_sampled(7, n=2)
    check([c.index for c in two.choices] == [0, 1], f"chat indices: {two.choices}")
    check(two.choices[0].message.content == a.choices[0].message.content, "chat choice 0: seed 7")
    check(two.choices[1].message.content == chat_sampled(8).choices[0].message.content,
          "chat choice 1: seed 8")
    check(two.usage.completion_tokens == 24, f"chat n=2 usage: {two.usage}")
    chunks = list(client.chat.completions.create(
        model=model, messages=msgs, max_tokens=12, temperature=1.0, seed=7, n=2, stream=True,
        extra_body=fixed))
    per = {0: "", 1: ""}
    for ch in chunks:
        for choice in ch.choices:
            per[choice.index] += choice.delta.content or ""
    check([per[0], per[1]] == [x.message.content for x in two.choices],
          f"streamed chat n=2: {per}")
    # logprobs
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=2, extra_body=fixed)
    content = r.choices[0].logprobs.content
    check(len(content) == 6, f"one logprob per token: {content}")
    for e in content:
        check(len(e.top_logprobs) == 2, f"top_logprobs=2: {e}")
        check(abs(e.top_logprobs[0].logprob - e.logprob) < 1e-6, f"greedy picks the top: {e}")
        check(e.top_logprobs[1].logprob <= e.logprob <= 0.0, f"ordered: {e}")
        check(isinstance(e.bytes, list) and all(0 <= x < 256 for x in e.bytes), f"bytes: {e}")
    chunks = list(client.chat.completions.create(
        model=model, messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
        stream=True, extra_body=fixed))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    check([e.token for e in streamed] == [e.token for e in content], "streamed chat logprobs")
    # penalties
    def chat_tokens(**kw):
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=48,
                                           temperature=0, extra_body=fixed, **kw)
        return r.choices[0].token_ids
    check(len(set(chat_tokens(presence_penalty=2.0, frequency_penalty=2.0)))
          > len(set(chat_tokens())), "chat penalties repeat less")

    # ---- errors ----
    bad = OpenAI(base_url=url, api_key="not-a-key", max_retries=0, timeout=60)
    try:
        bad.completions.create(model=model, prompt="x", max_tokens=1)
        check(False, "a wrong key is refused")
    except openai.AuthenticationError as e:
        check(e.status_code == 401, f"401: {e}")
    try:
        client.chat.completions.create(model="no-such-model", messages=msgs, max_tokens=1)
        check(False, "an unknown model is refused")
    except openai.NotFoundError as e:
        check(e.status_code == 404 and "no-such-model" in str(e), f"404: {e}")
    for field, kw in [("frequency_penalty", {"frequency_penalty": 2.5}),
                      ("presence_penalty", {"presence_penalty": -3}),
                      ("n", {"n": 9}),
                      ("logprobs", {"logprobs": 6})]:
        try:
            client.completions.create(model=model, prompt="x", max_tokens=1, **kw)
            check(False, f"{field} out of range is refused")
        except openai.BadRequestError as e:
            check(e.status_code == 400 and field in str(e), f"400 names {field}: {e}")
    try:
        client.chat.completions.create(model=model, messages=msgs, max_tokens=1, logprobs=True,
                                       top_logprobs=21)
        check(False, "top_logprobs 21 is refused")
    except openai.BadRequestError as e:
        check("top_logprobs" in str(e), f"400 names top_logprobs: {e}")
    tight = OpenAI(base_url=url, api_key=tight_key, max_retries=0, timeout=60)
    limited = None
    for _ in range(3):
        try:
            tight.completions.create(model=model, prompt="x", max_tokens=1)
        except openai.RateLimitError as e:
            limited = e
            break
    check(limited is not None, "the tight tenant is rate limited within three requests")
    check(limited.status_code == 429, f"429: {limited}")
    retry = limited.response.headers.get("retry-after")
    check(retry is not None and int(retry) >= 1, f"Retry-After: {retry}")

    if pair_key is not None:
        pair = OpenAI(base_url=url, api_key=pair_key, max_retries=0, timeout=60)
        try:
            pair.completions.create(model=model, prompt="x", max_tokens=1, n=2)
            check(False, "n=2 on a bucket of one is refused")
        except openai.RateLimitError as e:
            check(e.response.headers.get("retry-after") is not None, f"Retry-After: {e}")

    print(f"ok: openai {openai.__version__} against {base}")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        sys.exit(1)
