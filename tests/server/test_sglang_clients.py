"""The bodies SGLang 0.5.17's own clients send, against a real server: `bench_serving`'s sglang
backend (`sglang/benchmark/serving.py: async_request_sglang_generate`, its warm-up included) and
the frontend language's `RuntimeEndpoint` (`sglang/lang/backend/runtime_endpoint.py`). Fields at
values that ask for nothing are served; a value that asks for a feature this server lacks is a 400
naming the field."""
from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def bench_serving_body(prompt, output_len: int, stream: bool, **extra) -> dict:
    """The /generate body bench_serving builds with its default arguments (temperature 0, top_p 1,
    EOS ignored, no LoRA, no log-probs, no routed experts), `extra` as --extra-request-body."""
    sampling_params = {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True}
    return {("text" if isinstance(prompt, str) else "input_ids"): prompt, "sampling_params": sampling_params,
            "stream": stream, "lora_path": None, "return_logprob": False, "return_routed_experts": False,
            "logprob_start_len": -1, **extra}


def runtime_endpoint_body(text: str, max_new_tokens: int) -> dict:
    """The /generate body of the frontend language's `RuntimeEndpoint.generate` for a plain
    `gen(max_tokens=...)`: `SglSamplingParams.to_srt_kwargs()` with its defaults."""
    return {"text": text, "sampling_params": {
        "skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": max_new_tokens,
        "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [], "stop_regex": [], "temperature": 0.0,
        "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
        "ignore_eos": False, "regex": None, "json_schema": None}}


def stream_events(http: httpx.Client, body: dict) -> list[dict]:
    with http.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


@pytest.mark.parametrize("prompt", ["The capital of France is", [504, 3575, 282, 4649, 314]], ids=["text", "input_ids"])
def test_bench_serving_bodies_are_served(http, prompt):
    plain = http.post("/generate", json=bench_serving_body(prompt, 6, stream=False))
    assert plain.status_code == 200, plain.text
    assert plain.json()["meta_info"]["completion_tokens"] == 6
    events = stream_events(http, bench_serving_body(prompt, 6, stream=True))
    last = events[-1]
    assert last["meta_info"]["completion_tokens"] == 6 and last["text"] == plain.json()["text"]


def test_bench_serving_logprob_options_are_served(http):
    body = bench_serving_body("Hello", 3, stream=False, return_logprob=True, top_logprobs_num=2)
    body["logprob_start_len"] = 0
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert len(meta["output_token_logprobs"]) == 3 and len(meta["output_top_logprobs"][0]) == 2


def test_runtime_endpoint_body_is_served(http):
    r = http.post("/generate", json=runtime_endpoint_body("The capital of France is", 4))
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] <= 4


@pytest.mark.parametrize("field, value, param", [
    ("return_routed_experts", True, "return_routed_experts"),
    ("lora_path", "my-adapter", "lora_path"),
    ("token_ids_logprob", [1, 2], "token_ids_logprob"),
    ("image_data", ["http://example.com/a.png"], "image_data"),
])
def test_a_value_asking_for_a_missing_feature_is_a_400_naming_it(http, field, value, param):
    r = http.post("/generate", json=bench_serving_body("Hello", 2, stream=False, **{field: value}))
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param and field in r.json()["error"]["message"]


@pytest.mark.parametrize("key, value", [("min_new_tokens", 3), ("stop_regex", ["a+"])])
def test_a_sampling_value_asking_for_a_missing_feature_is_a_400_naming_it(http, key, value):
    body = runtime_endpoint_body("Hello", 4)
    body["sampling_params"][key] = value
    r = http.post("/generate", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == f"sampling_params.{key}" and key in r.json()["error"]["message"]


def test_bench_serving_openai_bodies_are_served(http, model):
    """bench_serving's sglang-oai and sglang-oai-chat backends, streaming and not."""
    for stream in (False, True):
        r = http.post("/v1/completions", json={"model": model, "prompt": "Hello", "best_of": 1, "max_tokens": 3,
                                               "stream": stream, "temperature": 0.0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        r = http.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "Hello"}], "max_completion_tokens": 3,
            "stream": stream, "temperature": 0.0, "ignore_eos": True})
        assert r.status_code == 200, r.text
    r = http.post("/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 3, "lora_path": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"


def test_bench_serving_profile_calls_write_a_trace_of_the_steps_asked(http, tmp_path):
    """bench_serving --profile's bodies: /start_profile with its fields (steps as digits), then
    requests, then /stop_profile; the trace holds the scheduler's steps. Bad specs are 400s."""
    out = tmp_path / "prof"
    body = {"activities": ["CPU"], "num_steps": None, "profile_by_stage": False, "profile_stages": None,
            "output_dir": str(out), "profile_prefix": None, "start_step": "1"}
    assert http.post("/start_profile", json=body).status_code == 200
    again = http.post("/start_profile", json=body)
    assert again.status_code == 400 and "already running" in again.json()["error"]["message"]
    assert http.post("/generate", json=bench_serving_body("Hello there", 8, stream=False)).status_code == 200
    stop = http.post("/stop_profile", json={})
    assert stop.status_code == 200, stop.text
    (trace,) = stop.json()["traces"]
    assert trace.startswith(str(out)) and trace.endswith(".trace.json.gz")
    import gzip

    events = json.loads(gzip.open(trace).read())["traceEvents"]
    names = {str(e.get("name", "")) for e in events}
    assert "scheduler_step" in names, "the scheduler's steps are in it"
    assert any(n.startswith("aten::") for n in names), "and the model's ops"
    assert http.post("/stop_profile", json={}).status_code == 400  # none running
    for bad, field in (({"profile_by_stage": True}, "profile_by_stage"), ({"activities": ["MEM"]}, "MEM"),
                       ({"num_steps": 0}, "num_steps"), ({"output_dir": "relative/dir"}, "output_dir"),
                       ({"bogus": 1}, "bogus")):
        r = http.post("/start_profile", json=bad)
        assert r.status_code == 400 and field in json.dumps(r.json()), (bad, r.text)
