"""Engine API on the default model: bad input, sampling features, abort, streaming."""
from __future__ import annotations

import asyncio

import pytest

from engines import make_engine

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def engine(default_model_path):
    with make_engine(default_model_path, max_total_tokens=8192, context_length=2048) as e:
        yield e


@pytest.mark.parametrize("kwargs,field", [
    ({"prompt": ""}, "prompt"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": list(range(2100))}, "input_ids"),  # over the 2,048-token context
    ({"input_ids": [1, 2, 10**6]}, "input_ids"),  # outside the vocabulary
    ({"input_ids": [1, -3]}, "input_ids"),
    ({"prompt": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"prompt": "hi", "sampling_params": {"temperature": -0.5}}, "temperature"),
    ({"prompt": "hi", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"prompt": "hi", "sampling_params": {"top_p": 1.5}}, "top_p"),
    ({"prompt": "hi", "sampling_params": {"bogus": 1}}, "bogus"),
    ({"prompt": "hi", "sampling_params": {"stop_token_ids": [49152]}}, "stop_token_ids"),
    ({"prompt": "hi", "sampling_params": {"n": 0}}, "n"),
])
def test_bad_input_names_the_field_and_engine_keeps_serving(engine, kwargs, field):
    with pytest.raises(ValueError, match=field):
        engine.generate(**kwargs)
    out = engine.generate("The sky is", {"temperature": 0, "max_new_tokens": 4})
    assert out["meta_info"]["completion_tokens"] == 4


def test_seed_reproducible_and_n_samples(engine):
    params = {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 16, "seed": 1234, "ignore_eos": True}
    a = engine.generate("Once upon a time", params)
    b = engine.generate(["Once upon a time", "Another prompt"], [params, params])[0]
    assert a["output_ids"] == b["output_ids"]  # same seed, same tokens, whatever the batch
    many = engine.generate("Once upon a time", {**params, "n": 3})
    assert len(many) == 3 and many[0]["output_ids"] == a["output_ids"]
    assert len({tuple(m["output_ids"]) for m in many}) > 1


def test_stop_string_is_not_returned(engine):
    greedy = engine.generate("Count: 1, 2, 3, 4,", {"temperature": 0, "max_new_tokens": 24})
    text = greedy["text"]
    stop = text.strip()[3:6] if len(text.strip()) > 6 else text.strip()[-2:]
    cut = engine.generate("Count: 1, 2, 3, 4,", {"temperature": 0, "max_new_tokens": 24, "stop": stop})
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in cut["text"] and text.startswith(cut["text"])


def test_stop_token_ids_and_max_new_tokens_zero(engine):
    greedy = engine.generate("Paris is the capital of", {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
    stop_id = greedy["output_ids"][2]
    out = engine.generate("Paris is the capital of",
                          {"temperature": 0, "max_new_tokens": 8, "stop_token_ids": [stop_id]})
    assert out["output_ids"] == greedy["output_ids"][:3]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    empty = engine.generate("Paris", {"max_new_tokens": 0})
    assert empty["output_ids"] == [] and empty["meta_info"]["finish_reason"]["type"] == "length"


def test_logprobs_with_top_alternatives(engine):
    out = engine.generate("The capital of France is", {"temperature": 0, "max_new_tokens": 3},
                          return_logprob=True, top_logprobs_num=3)
    lps, tops = out["meta_info"]["output_token_logprobs"], out["meta_info"]["output_top_logprobs"]
    assert len(lps) == len(tops) == 3 and out["meta_info"]["input_token_logprobs"] == []
    for token, (lp, tid, text), top in zip(out["output_ids"], lps, tops):  # SGLang's [logprob, id, text]
        assert tid == token and text is None
        assert top[0][1] == token and abs(top[0][0] - lp) < 1e-5  # greedy picks the top token
        assert lp <= 0 and top[0][0] >= top[1][0] >= top[2][0]


def test_async_stream_and_abort_frees_everything(engine):
    async def run():
        chunks = []
        params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
        async for chunk in engine.async_generate("Tell me a story.", params):
            chunks.append(chunk)
        return chunks

    chunks = asyncio.run(run())
    assert [len(c["output_ids"]) for c in chunks] == list(range(1, 13))

    async def abandon():
        async for chunk in engine.async_generate("Tell me a long story.", {"max_new_tokens": 500, "ignore_eos": True}):
            if len(chunk["output_ids"]) >= 3:
                break  # closing the stream aborts the request

    asyncio.run(abandon())
    stats = engine.get_stats()
    for _ in range(50):
        if stats["running"] == 0:
            break
        stats = engine.get_stats()
    assert stats["running"] == 0 and stats["pages_held"] == 0 and stats["requests_aborted"] >= 1
    engine.check_integrity()


def test_chat_names_paris(engine):
    out = engine.chat([{"role": "user", "content": "What is the capital of France?"}],
                      {"temperature": 0, "max_new_tokens": 32})
    assert "Paris" in out["text"]


def test_l1_sized_from_available_memory_and_the_context_served_fits_it(monkeypatch, caplog):
    from types import SimpleNamespace

    import torch

    from hicache.runtime import build
    from hicache.runtime.config import RuntimeConfig
    from hicache.tiers.gpu.pool import DeviceKVPool

    cfg = SimpleNamespace(num_layers=30, kv_layers=30, head_dim=64, cache_head_dim=64)
    per_token = DeviceKVPool.token_bytes(30, 3, 64, torch.float32)
    monkeypatch.setattr(build, "available_ram", lambda: 4 << 30)  # MemAvailable, page cache included
    tokens = build.kv_pool_tokens(RuntimeConfig(), cfg, torch.float32, torch.device("cpu"), 64, 3)
    assert tokens == int(min((4 << 30) * 0.85 * 0.25, build.CPU_KV_CAP_BYTES) // per_token) // 64 * 64
    assert tokens * per_token <= 512 << 20  # modest: resident from the start
    reserved = build.kv_pool_tokens(RuntimeConfig(), cfg, torch.float32, torch.device("cpu"), 64, 3,
                                    reserved=640 * per_token)  # a recurrent-state pool's bytes
    assert reserved == tokens - 640
    monkeypatch.setattr(build, "available_ram", lambda: 1 << 30)  # other processes hold the memory
    with caplog.at_level("WARNING", logger=build.logger.name):
        small = build.kv_pool_tokens(RuntimeConfig(), cfg, torch.float32, torch.device("cpu"), 64, 3)
    assert small == int((1 << 30) * 0.85 * 0.25 // per_token) // 64 * 64 and "sized down" in caplog.text
    assert build.served_context(8192, 1856) == 1856 and build.served_context(2048, 8192) == 2048
