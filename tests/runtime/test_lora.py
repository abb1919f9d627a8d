"""LoRA serving against HF transformers + PEFT on a tiny random Llama with random adapters of two
ranks and different target modules: greedy outputs of mixed batches (two adapters and the base
model) per request, through chunked prefill and cache hits; cache isolation between adapters in
the radix tree and in L3; adapters loaded and unloaded at run time; bad adapters refused."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engines import greedy, make_engine
from hicache.config import HiCacheConfig
from hicache.runtime.build import build_scheduler
from hicache.runtime.config import RuntimeConfig
from hicache.runtime.messages import GenerateRequest
from hicache.runtime.sampling import SamplingParams
from hicache.runtime.lora.adapter import AdapterError
from lora_models import ADAPTERS, hf_greedy, peft_adapter, tiny_hf_llama

pytest.importorskip("peft")

PAGE, NEW = 16, 8
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tiny_config_path, tmp_path_factory):
    """The base model's folder and HF model; each adapter's folder and PEFT model."""
    root = tmp_path_factory.mktemp("lora")
    base = tiny_hf_llama(tiny_config_path)
    base.save_pretrained(str(root / "base"), safe_serialization=True)
    peft = {name: peft_adapter(base, *spec, seed=10 + i, folder=root / name) for i, (name, spec) in
            enumerate(ADAPTERS.items())}
    return SimpleNamespace(root=root, base=base, peft=peft, paths=[f"{n}={root / n}" for n in ADAPTERS])


def _prompts(lengths: tuple[int, ...], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def _want(tiny, prompts, names) -> list[list[int]]:
    return [hf_greedy(tiny.base if n is None else tiny.peft[n], p, NEW) for p, n in zip(prompts, names)]


def _engine(tiny, **options):
    return make_engine(tiny.root / "base", lora_paths=tiny.paths, max_total_tokens=2048, page_size=PAGE, **options)


def _run(engine, prompts, names) -> list[dict]:
    return engine.generate(input_ids=prompts, sampling_params=greedy(NEW), lora_path=names)


def test_mixed_batch_matches_peft_with_chunks_and_cache_hits(tiny):
    prompts = _prompts((37, 50, 23, 61))
    names = [None, "attn4", "mlp8", "attn4"]
    want = _want(tiny, prompts, names)
    assert want[1] != hf_greedy(tiny.base, prompts[1], NEW) and want[2] != hf_greedy(tiny.base, prompts[2], NEW)
    with _engine(tiny, chunked_prefill_size=16) as engine:
        assert [o["output_ids"] for o in _run(engine, prompts, names)] == want
        longer = [p + w + [7, 8, 9] for p, w in zip(prompts, want)]  # the first round's pages are cached
        again = _run(engine, longer, names)
        assert [o["output_ids"] for o in again] == _want(tiny, longer, names)
        assert all(o["meta_info"]["cached_tokens"] >= PAGE * (len(p) // PAGE) for o, p in zip(again, prompts))
        engine.check_integrity()


def test_cache_never_crosses_adapters(tiny):
    prompt = _prompts((70,), seed=2)[0]
    with _engine(tiny) as engine:
        first = _run(engine, [prompt], ["attn4"])[0]
        assert first["meta_info"]["cached_tokens"] == 0
        others = _run(engine, [prompt, prompt], [None, "mlp8"])
        assert [o["meta_info"]["cached_tokens"] for o in others] == [0, 0]
        same = _run(engine, [prompt], ["attn4"])[0]
        assert same["meta_info"]["cached_tokens"] == 64
        assert [o["output_ids"] for o in [same, *others]] == _want(tiny, [prompt] * 3, ["attn4", None, "mlp8"])


def _l3_scheduler(tiny):
    rc = RuntimeConfig(model_path=str(tiny.root / "base"), lora_paths=tuple(tiny.paths), max_total_tokens=256)
    cc = HiCacheConfig(page_size=PAGE, hicache_ratio=2.0, hicache_storage_backend="memory",
                       hicache_storage_prefetch_policy="wait_complete", hicache_load_decision="always",
                       hicache_storage_backend_extra_config={"prefetch_threshold": PAGE})
    return build_scheduler(rc, cc)


def _served(sched, prompt, name) -> dict:
    """Serves `prompt` under adapter `name` alone, then waits for its L3 writes and empties L1
    and L2: its meta (and output ids)."""
    sched.add_request(GenerateRequest(f"r-{name}", prompt, SamplingParams(**greedy(NEW)), lora_path=name))
    out = {"ids": []}
    while sched.has_requests():
        for o in sched.step():
            out["ids"] += o.new_token_ids
            out["meta"] = o.meta
    while sched.cache.storage.busy():
        sched.cache.storage.wait(0.02)
        sched.cache.storage.poll()
    assert sched.flush_cache()
    return out


def test_l3_pages_are_found_under_their_own_adapter_only(tiny):
    prompt = _prompts((70,), seed=5)[0]
    sched = _l3_scheduler(tiny)
    try:
        assert _served(sched, prompt, "attn4")["meta"]["cached_tokens"] == 0
        for name in (None, "mlp8"):
            out = _served(sched, prompt, name)
            assert out["meta"]["cached_tokens"] == 0, name
            assert out["ids"] == _want(tiny, [prompt], [name])[0]
        again = _served(sched, prompt, "attn4")
        assert again["meta"]["cached_tokens_details"]["storage"] == 64
        assert again["ids"] == _want(tiny, [prompt], ["attn4"])[0]
    finally:
        sched.close()


def test_one_adapter_per_batch_still_serves_all_with_overlap(tiny):
    prompts = _prompts((20, 30, 25), seed=3)
    names = ["attn4", "mlp8", None]
    with _engine(tiny, max_loras_per_batch=1, overlap_schedule=True) as engine:
        assert [o["output_ids"] for o in _run(engine, prompts, names)] == _want(tiny, prompts, names)


def test_load_and_unload_at_run_time(tiny, tmp_path):
    prompt = _prompts((30,), seed=4)[0]
    with make_engine(tiny.root / "base", enable_lora=True, max_total_tokens=1024, page_size=PAGE) as engine:
        with pytest.raises(ValueError, match="lora_path: no adapter 'attn4'"):
            _run(engine, [prompt], ["attn4"])
        assert engine.load_lora_adapter("a", str(tiny.root / "attn4")) == {"a": str(tiny.root / "attn4")}
        assert _run(engine, [prompt], ["a"])[0]["output_ids"] == _want(tiny, [prompt], ["attn4"])[0]
        with pytest.raises(ValueError, match="already in use"):
            engine.load_lora_adapter("a", str(tiny.root / "mlp8"))
        assert engine.unload_lora_adapter("a") == {}
        with pytest.raises(ValueError, match="no adapter 'a'"):
            _run(engine, [prompt], ["a"])
        with pytest.raises(ValueError, match="no adapter 'a' is loaded"):
            engine.unload_lora_adapter("a")
        assert _run(engine, [prompt], [None])[0]["output_ids"] == _want(tiny, [prompt], [None])[0]


def test_lora_path_without_enable_lora(tiny):
    with make_engine(tiny.root / "base", max_total_tokens=512, page_size=PAGE) as engine:
        with pytest.raises(ValueError, match="lora_path: LoRA adapters are not served"):
            _run(engine, [[5, 6, 7]], ["x"])


def _broken(tiny, tmp_path, edit) -> str:
    folder = tmp_path / "broken"
    shutil.copytree(tiny.root / "attn4", folder)
    edit(folder)
    return str(folder)


def _config(folder, **changes) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _tensors(folder, change) -> None:
    from safetensors.torch import load_file, save_file

    path = folder / "adapter_model.safetensors"
    save_file(change(load_file(str(path))), str(path))


def _first_a_transposed(tensors: dict) -> dict:
    name = next(n for n in tensors if "lora_A" in n)
    return {**tensors, name: tensors[name].t().contiguous()}


@pytest.mark.parametrize("edit, message", [
    (lambda f: (f / "adapter_model.safetensors").unlink(), "no adapter_model.safetensors"),
    (lambda f: (f / "adapter_config.json").write_text("{"), "not readable JSON"),
    (lambda f: (f / "adapter_model.safetensors").write_bytes(b"\x00" * 64), "not a readable safetensors file"),
    (lambda f: _config(f, r=4, target_modules=["q_proj", "lm_head"]), r"target_modules \['lm_head'\]"),
    (lambda f: _config(f, use_dora=True), "use_dora=True is not supported"),
    (lambda f: _config(f, r=100), "rank 100 is above --max-lora-rank 64"),
    (lambda f: _config(f, r=2), r"has shape \(4, 64\), the base model needs \(2, 64\)"),
    (lambda f: _tensors(f, _first_a_transposed), "the base model needs"),
    (lambda f: _tensors(f, lambda t: {k.replace("layers.1.", "layers.7."): v for k, v in t.items()}),
     "names layer 7; the base model has 2 layers"),
    (lambda f: _tensors(f, lambda t: {k.replace("q_proj", "qq_proj"): v for k, v in t.items()}),
     "is not a LoRA weight of a supported module"),
    (lambda f: _tensors(f, lambda t: {k: v for k, v in t.items() if "lora_B" not in k}), "without its lora_B"),
])
def test_bad_adapters_are_refused_naming_the_problem(tiny, tmp_path, edit, message):
    path = _broken(tiny, tmp_path, edit)
    with make_engine(tiny.root / "base", enable_lora=True, max_total_tokens=512, page_size=PAGE) as engine:
        with pytest.raises(AdapterError, match=message):
            engine.load_lora_adapter("bad", path)
        assert engine.load_lora_adapter("good", str(tiny.root / "mlp8")) == {"good": str(tiny.root / "mlp8")}


def test_start_with_a_bad_adapter_or_name_fails(tiny, tmp_path):
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        make_engine(tiny.root / "base", lora_paths=[f"x={tmp_path}"], max_total_tokens=512, page_size=PAGE)
    with pytest.raises(ValueError, match="a name is given twice"):
        make_engine(tiny.root / "base", lora_paths=[f"x={tmp_path}", f"x={tmp_path}"], max_total_tokens=512)
    with pytest.raises(ValueError, match="not served with tp_size > 1"):
        make_engine(tiny.root / "base", enable_lora=True, tp_size=2)


def test_a_name_reloaded_with_other_weights_shares_nothing_with_its_running_requests(tiny):
    """Unloading `x` while its requests run lets them finish with their weights; `x` loaded again
    from other files serves the new weights and finds none of the old KV (its digest differs)."""
    prompt = _prompts((50,), seed=6)[0]
    rc = RuntimeConfig(model_path=str(tiny.root / "base"), enable_lora=True, max_total_tokens=1024)
    sched = build_scheduler(rc, HiCacheConfig(page_size=PAGE, hierarchical_cache=False))
    try:
        sched.load_lora_adapter("x", str(tiny.root / "attn4"))
        sched.add_request(GenerateRequest("old", prompt, SamplingParams(**greedy(NEW)), lora_path="x"))
        outs = {"old": [], "new": []}
        metas = {}
        for o in sched.step():  # its prompt is computed under attn4
            outs[o.rid] += o.new_token_ids
        assert sched.unload_lora_adapter("x") == {}
        assert sched.load_lora_adapter("x", str(tiny.root / "mlp8")) == {"x": str(tiny.root / "mlp8")}
        sched.add_request(GenerateRequest("new", prompt, SamplingParams(**greedy(NEW)), lora_path="x"))
        while sched.has_requests():
            for o in sched.step():
                outs[o.rid] += o.new_token_ids
                metas[o.rid] = o.meta
        assert outs == {"old": _want(tiny, [prompt], ["attn4"])[0], "new": _want(tiny, [prompt], ["mlp8"])[0]}
        assert metas["new"]["cached_tokens"] == 0
        sched.load_lora_adapter("y", str(tiny.root / "attn4"))  # the old files under another name
        for rid, name in (("later-x", "x"), ("later-y", "y")):
            sched.add_request(GenerateRequest(rid, prompt + [9], SamplingParams(**greedy(1)), lora_path=name))
            while sched.has_requests():
                for o in sched.step():
                    metas[o.rid] = o.meta
        assert metas["later-x"]["cached_tokens"] == metas["later-y"]["cached_tokens"] == 48
        sched.check_integrity()
    finally:
        sched.close()


def test_adapters_are_refused_on_sparse_and_gemma_models():
    from hicache.runtime.lora.registry import LoraRegistry
    from hicache.runtime.model_config import ModelConfig

    configs = REPO / "benchmarks" / "configs"
    for name in ("qwen3-30b-a3b.json", "gemma3-270m.json"):
        config = ModelConfig.from_json_file(configs / name)
        with pytest.raises(ValueError, match="dense Llama-family models only"):
            LoraRegistry(config, 64, torch.float32, torch.device("cpu"))
