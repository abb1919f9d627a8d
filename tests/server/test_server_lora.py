"""LoRA adapters over HTTP on the default model (random adapters of its shapes, written as PEFT
saves them): loaded at start and at run time, listed by /v1/models, chosen by /generate's
`lora_path`, OpenAI's and Anthropic's `model` ("base:adapter" or the adapter's name); bad adapters
and unknown names are 4xx naming the problem, the server serving on; the cache never crosses
adapters."""
from __future__ import annotations

import json

import httpx
import pytest
import torch

from homes import private_home
from server_harness import LIGHT_FLAGS, MODEL_NAME, start_server

HIDDEN, Q, KV, LAYERS = 576, 576, 192, 30  # SmolLM2-135M
PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid. The"


def write_adapter(folder, rank: int, seed: int, modules=("q_proj", "v_proj")) -> str:
    from safetensors.torch import save_file

    shapes = {"q_proj": (HIDDEN, Q), "v_proj": (HIDDEN, KV), "k_proj": (HIDDEN, KV), "o_proj": (Q, HIDDEN)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(LAYERS):
        for m in modules:
            fan_in, fan_out = shapes[m]
            p = f"base_model.model.model.layers.{i}.self_attn.{m}"
            tensors[f"{p}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.2
            tensors[f"{p}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.2
    folder.mkdir()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(modules), "lora_dropout": 0.0,
         "bias": "none"}))
    return str(folder)


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    paths = {"a": write_adapter(root / "a", 4, 1), "b": write_adapter(root / "b", 8, 2, ("k_proj", "o_proj")),
             "big": write_adapter(root / "big", 16, 3)}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HICACHE_HOME", str(private_home(tmp_path_factory.mktemp("lora-home"))))
        handle = start_server(*LIGHT_FLAGS, "--max-total-tokens", "2048", "--context-length", "2048",
                              "--disable-hierarchical-cache", "--skip-server-warmup", "--lora-paths", f"a={paths['a']}",
                              "--max-lora-rank", "8", "--max-loras-per-batch", "2")
    try:
        yield handle, paths, root
    finally:
        handle.stop()


def _gen(url: str, lora_path=None, text: str = PROMPT) -> httpx.Response:
    body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 8}, "lora_path": lora_path}
    return httpx.post(url + "/generate", json=body, timeout=120)


def test_load_list_select_unload(lora):
    handle, paths, _ = lora
    url = handle.url
    r = httpx.post(url + "/load_lora_adapter", json={"lora_name": "b", "lora_path": paths["b"]}, timeout=120)
    assert r.status_code == 200 and r.json()["loaded_adapters"] == {"a": paths["a"], "b": paths["b"]}
    models = httpx.get(url + "/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in models] == [(MODEL_NAME, None), ("a", MODEL_NAME), ("b", MODEL_NAME)]
    base, a, b = (_gen(url, name).json() for name in (None, "a", "b"))
    assert len({tuple(x["output_ids"]) for x in (base, a, b)}) == 3  # each adapter changes the answer
    for model in (f"{MODEL_NAME}:a", "a"):
        r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 8,
                                                      "temperature": 0}, timeout=120)
        assert r.status_code == 200 and r.json()["model"] == model
        assert r.json()["choices"][0]["text"] == a["text"]
    cmpl = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json={**cmpl, "lora_path": "a"}, timeout=120)  # SGLang's field
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == a["text"]
    r = httpx.post(url + "/v1/completions", json={**cmpl, "model": f"{MODEL_NAME}:a", "lora_path": "b"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "b"}, timeout=120)
    assert r.status_code == 200 and r.json()["loaded_adapters"] == {"a": paths["a"]}
    r = _gen(url, "b")
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path" and "'b'" in r.json()["error"]["message"]
    assert _gen(url, "a").json()["output_ids"] == a["output_ids"]


def test_chat_apis_select_adapters_by_model(lora):
    handle, _, _ = lora
    messages = [{"role": "user", "content": "Name three colours."}]
    chat = {m: httpx.post(handle.url + "/v1/chat/completions", json={"model": m, "messages": messages, "max_tokens": 8,
                                                                     "temperature": 0}, timeout=120).json()
            for m in (MODEL_NAME, f"{MODEL_NAME}:a")}
    assert chat[MODEL_NAME]["choices"][0]["message"] != chat[f"{MODEL_NAME}:a"]["choices"][0]["message"]
    r = httpx.post(handle.url + "/v1/messages", json={"model": "a", "messages": messages, "max_tokens": 8,
                                                      "temperature": 0}, timeout=120)
    assert r.status_code == 200 and r.json()["model"] == "a"
    assert r.json()["content"][0]["text"] == chat[f"{MODEL_NAME}:a"]["choices"][0]["message"]["content"]
    for m in ("nope", f"{MODEL_NAME}:nope"):
        r = httpx.post(handle.url + "/v1/chat/completions", json={"model": m, "messages": messages}, timeout=60)
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_cached_prefixes_stay_with_their_adapter(lora):
    url = lora[0].url
    text = "Rivers: the Nile, the Amazon, the Danube, the Rhine, the Volga, the Mekong, the Ganges and the"
    assert _gen(url, "a", text).json()["meta_info"]["cached_tokens"] == 0
    assert _gen(url, None, text).json()["meta_info"]["cached_tokens"] == 0
    assert _gen(url, "a", text).json()["meta_info"]["cached_tokens"] > 0


@pytest.mark.parametrize("body, param, message", [
    ({"lora_name": "c", "lora_path": "/nonexistent"}, "lora_path", "no adapter_config.json"),
    ({"lora_name": "a", "lora_path": "ADAPTER_b"}, "lora_name", "already in use"),
    ({"lora_name": MODEL_NAME, "lora_path": "ADAPTER_b"}, "lora_name", "already in use"),
    ({"lora_name": "x:y", "lora_path": "ADAPTER_b"}, "lora_name", "without ':'"),
    ({"lora_name": "c", "lora_path": "ADAPTER_big"}, "lora_path", "rank 16 is above --max-lora-rank 8"),
    ({"lora_name": "c"}, "lora_path", "Field required"),
])
def test_bad_loads_are_400s_naming_the_problem(lora, body, param, message):
    handle, paths, _ = lora
    body = {k: paths[v[len("ADAPTER_"):]] if str(v).startswith("ADAPTER_") else v for k, v in body.items()}
    r = httpx.post(handle.url + "/load_lora_adapter", json=body, timeout=120)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and message in r.json()["error"]["message"]
    assert _gen(handle.url, "a").status_code == 200


def test_unknown_names_are_400s(lora):
    url = lora[0].url
    r = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "zzz"}, timeout=60)
    assert r.status_code == 400 and "no adapter 'zzz' is loaded" in r.json()["error"]["message"]
    r = _gen(url, ["a", "a"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
