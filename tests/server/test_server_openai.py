"""The OpenAI-compatible API of a real server, driven by the `openai` package."""
from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
LONG_SYSTEM = ("You are a meticulous assistant for a travel company. " * 4 + "Rules: " +
               " ".join(f"Rule {i}: always answer politely, cite the city name, and keep it brief." for i in range(25)))


def test_models_lists_the_served_model(client, model):
    assert model == "SmolLM2-135M-Instruct.Q4_1"
    assert client.models.list().data[0].owned_by == "hicache"


def test_chat_greedy_answers(client, model):
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 10 and 0 < r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_max_completion_tokens_caps_output(client, model):
    r = client.chat.completions.create(model=model, messages=QUESTION, max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_completions(client, model):
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].text and r.usage.completion_tokens == 5
    echo = client.completions.create(model=model, prompt="Hello", max_tokens=2, temperature=0, echo=True)
    assert echo.choices[0].text.startswith("Hello")


def test_completions_batch_of_prompts_and_token_ids(client, model):
    r = client.completions.create(model=model, prompt=["One, two,", "Red, green,"], max_tokens=3, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 6
    ids = client.completions.create(model=model, prompt=[[504, 3458, 314], [504, 3458]], max_tokens=2, temperature=0)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5


def test_chat_stream_with_usage(client, model):
    stream = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    full = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=10, temperature=0)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == full.usage.completion_tokens
    details = usage.prompt_tokens_details
    assert details.cached_tokens >= 0 and set(details.model_extra["cached_tokens_details"]) == {"device", "host", "storage"}


def test_n2_returns_two_choices(client, model):
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=6, temperature=1.0, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert 2 <= r.usage.completion_tokens <= 12  # summed over the choices, the prompt counted once
    single = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=1)
    assert r.usage.prompt_tokens == single.usage.prompt_tokens
    stream = client.completions.create(model=model, prompt="Once upon a time", max_tokens=4, n=2, stream=True)
    seen = {c.choices[0].index for c in stream if c.choices}
    assert seen == {0, 1}


def test_stop_string_is_not_returned(client, model):
    base = client.completions.create(model=model, prompt="List: apples, pears, plums,", max_tokens=16, temperature=0)
    text = base.choices[0].text
    words = [w for w in text.split() if len(w) >= 3]
    assert words, f"greedy output too short to pick a stop string: {text!r}"
    stop = words[len(words) // 2]
    expected = text[: text.find(stop)]
    r = client.completions.create(model=model, prompt="List: apples, pears, plums,", max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="List: apples, pears, plums,", max_tokens=16, temperature=0, stop=stop, stream=True) if c.choices)
    assert streamed == expected


def test_seed_reproducible(client, model):
    def sample(seed):
        r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=1.0, seed=seed)
        return r.choices[0].message.content

    assert sample(1234) == sample(1234)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_cached_tokens_on_shared_system_prompt(client, model):
    def ask(q):
        return client.chat.completions.create(model=model, max_tokens=2, temperature=0, messages=[
            {"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": q}])

    first = ask("Where is the Louvre?")
    second = ask("Where is the Colosseum?")
    assert first.usage.prompt_tokens > 300
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 300, cached
    assert second.usage.prompt_tokens_details.model_extra["cached_tokens_details"]["device"] == cached


def test_logprobs_cover_the_content_not_the_stop_token(client, model):
    """A stop token that ended the answer is not part of it: no logprobs entry for it (as OpenAI)."""
    kw = dict(model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=40, temperature=0,
              logprobs=True)
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "stop"
    tokens = [e.token for e in r.choices[0].logprobs.content]
    assert "".join(tokens) == r.choices[0].message.content and "<|im_end|>" not in tokens
    assert len(tokens) == r.usage.completion_tokens - 1  # the stop token is counted, as generated
    streamed = [e.token for c in client.chat.completions.create(**kw, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == tokens
    c = client.completions.create(model=model, prompt="<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n",
                                  max_tokens=40, temperature=0, logprobs=1)
    assert c.choices[0].finish_reason == "stop" and "".join(c.choices[0].logprobs.tokens) == c.choices[0].text


def test_logprobs(client, model):
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=3, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.token == entry.top_logprobs[0].token  # greedy picks the top token
    c = client.completions.create(model=model, prompt="Hello", max_tokens=2, temperature=0, logprobs=1)
    assert len(c.choices[0].logprobs.tokens) == 2 and len(c.choices[0].logprobs.top_logprobs[0]) == 1


def test_openai_errors_raise_typed_exceptions(client, model):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=QUESTION, max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=QUESTION, max_tokens=1, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=QUESTION, max_tokens=100_000)
    assert e.value.body["code"] == "context_length_exceeded"


def test_continuous_usage_and_informational_fields(client, model):
    stream = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=3, temperature=0, stream=True, user="u1", metadata={"k": "v"},
        service_tier="auto", store=False, extra_body={"prompt_cache_key": "a", "safety_identifier": "s"},
        stream_options={"include_usage": True, "continuous_usage_stats": True})
    counts = [c.usage.completion_tokens for c in stream if c.choices and c.choices[0].delta.content]
    assert counts and counts == sorted(counts) and counts[-1] <= 3


def test_alias_is_accepted_and_the_first_name_reported(client, model):
    from server_harness import ALIAS

    assert [m.id for m in client.models.list().data] == [model, ALIAS]
    assert client.completions.create(model=ALIAS, prompt="Hi", max_tokens=1).model == model
