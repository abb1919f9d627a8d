"""Prompt log-probs through a real server: OpenAI completions with echo + logprobs (the `openai`
client, as lm-evaluation-harness scores choices), and SGLang's meta_info fields on /generate. Their
values against HF are tested on the Engine (tests/runtime/test_prompt_logprobs.py); here the two
routes must agree with each other."""
from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.model

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def native(http):
    """/generate's prompt log-probs of PROMPT from its first token, with top 2 and token texts."""
    r = http.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 0},
                                     "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
                                     "return_text_in_logprobs": True})
    assert r.status_code == 200
    return r.json()["meta_info"]


def test_generate_meta_info_is_sglangs(native):
    tokens, tops = native["input_token_logprobs"], native["input_top_logprobs"]
    assert len(tokens) == len(tops) == native["prompt_tokens"]
    assert tokens[0][0] is None and tops[0] is None
    assert "".join(t[2] for t in tokens) == PROMPT
    for (lp, _, _), top in zip(tokens[1:], tops[1:]):
        assert lp <= top[0][0] + 1e-5 <= 1e-5 and len(top) == 2 and top[0][0] >= top[1][0]
    assert native["output_token_logprobs"] == [] and native["output_top_logprobs"] == []


def test_completions_echo_logprobs_max_tokens_zero(client, native):
    model = client.models.list().data[0].id
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    choice, lp = r.choices[0], r.choices[0].logprobs
    assert choice.text == PROMPT and r.usage.completion_tokens == 0
    assert "".join(lp.tokens) == PROMPT and lp.text_offset[0] == 0
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [t[0] for t in native["input_token_logprobs"][1:]]
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], want)) < 1e-5
    assert all(len(top) >= 1 for top in lp.top_logprobs[1:])


def test_completions_echo_logprobs_with_new_tokens_streamed_and_not(client, native):
    model = client.models.list().data[0].id
    kw = dict(model=model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=1)
    whole = client.completions.create(**kw).choices[0]
    n = len(native["input_token_logprobs"])
    assert len(whole.logprobs.tokens) == n + 3 and whole.text.startswith(PROMPT)
    assert whole.logprobs.token_logprobs[0] is None and all(v <= 0 for v in whole.logprobs.token_logprobs[1:])
    streamed = [lp for c in client.completions.create(stream=True, **kw) if (lp := c.choices[0].logprobs)]
    assert sum((s.tokens for s in streamed), []) == whole.logprobs.tokens
    assert sum((s.token_logprobs for s in streamed), [])[1:] == pytest.approx(whole.logprobs.token_logprobs[1:],
                                                                               abs=1e-5)


def test_logprob_start_len_beyond_the_prompt_is_a_400(http):
    r = http.post("/generate", json={"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprob_start_len"
    ok = http.post("/generate", json={"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 3,
                                      "sampling_params": {"max_new_tokens": 1}})
    assert ok.status_code == 200 and ok.json()["meta_info"]["input_token_logprobs"] == []
