"""Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE and Mixtral against HF transformers (fp32, CPU), on tiny random
models built by HF (tests/runtime/families.py): logits through the paged path with a cached
prefix, from the HF folder and from a GGUF file; the greedy outputs of an Engine on the folder,
batched with chunked prefill and a pool small enough to retract, then again from the radix cache
with pages loaded back from L2. One HF model and one Engine per family (module-scoped)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from engines import greedy, make_engine
from families import SPECS, VOCAB, Tiny, hf_greedy, hf_model, save_folder, write_gguf
from hicache.runtime.attention.reference import TorchAttention
from hicache.runtime.batch import ForwardBatch
from hicache.runtime.model_config import ModelConfig
from hicache.runtime.models import get_model_class
from hicache.runtime.models.moe import covered_names
from hicache.runtime.tokenizer import apply_chat_template, load_tokenizer
from hicache.runtime.weights import load_model
from hicache.runtime.weights.gguf import GGUFCheckpoint
from hicache.tiers.gpu.pool import DeviceKVPool

REPO = Path(__file__).resolve().parents[2]
LOGIT_TOL = 1e-4
PAGE = 4
NEW_TOKENS = 10  # more than two pages: decoding outgrows the pool's headroom


@pytest.fixture(scope="module", params=list(SPECS))
def tiny(request, tmp_path_factory, default_model_path) -> Tiny:
    model = hf_model(request.param)
    folder = save_folder(model, tmp_path_factory.mktemp(request.param), load_tokenizer(default_model_path))
    return Tiny(request.param, model, folder)


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def _paged_logits(model, pool, ids, slots, start) -> torch.Tensor:
    """Logits of ids[start:] through the paged torch path; slots[:start] hold the prefix's K/V."""
    batch = ForwardBatch("extend", TorchAttention(model.config.head_dim), pool, slots[start:], [len(ids) - start],
                         [slots])
    return model.compute_logits(model(torch.tensor(ids[start:]), torch.arange(start, len(ids)), batch))


def test_folder_logits_match_hf_with_cached_prefix(tiny):
    loaded = load_model(tiny.folder)
    model, cfg = loaded.model, loaded.config
    assert cfg.architecture == tiny.hf.config.architectures[0]
    ids = _prompts(1, (48,))[0]
    pool = DeviceKVPool(256, 1, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    slots = torch.randperm(256)[: len(ids)]
    _paged_logits(model, pool, ids[:30], slots[:30], 0)
    tail = _paged_logits(model, pool, ids, slots, 30)  # extend over a cached 30-token prefix
    ref = _hf_logits(tiny.hf, ids)[30:]
    assert (tail - ref).abs().max().item() < LOGIT_TOL
    msgs = [{"role": "user", "content": "Hi"}]
    assert loaded.tokenizer.decode(apply_chat_template(loaded.tokenizer, msgs)).endswith("<|im_start|>assistant\n")


def test_dummy_weights_from_the_config(tiny, tmp_path, prompt_logits):
    """load_format=dummy on the family's config.json: every parameter filled (biases and experts
    random, norms 1), finite logits."""
    (tmp_path / "config.json").write_text((tiny.folder / "config.json").read_text())
    loaded = load_model(tmp_path / "config.json", load_format="dummy", seed=3)
    params = dict(loaded.model.named_parameters())
    for name, p in params.items():
        assert torch.isfinite(p).all(), name
        assert bool((p == 1).all()) == ("norm" in name), name
    assert torch.isfinite(prompt_logits(loaded.model, [5, 6, 7])).all()


def test_gguf_logits_match_hf(tiny, tmp_path, prompt_logits):
    path = write_gguf(tiny.hf, tmp_path / f"{tiny.name}.gguf", SPECS[tiny.name][2])
    ckpt = GGUFCheckpoint(path)
    from_folder = ModelConfig.from_json_file(tiny.folder)
    assert ckpt.config.moe == from_folder.moe
    assert (ckpt.config.qkv_bias, ckpt.config.qk_norm, ckpt.config.architecture) == (
        from_folder.qkv_bias, from_folder.qk_norm, from_folder.architecture)
    model = get_model_class(ckpt.config.architecture)(ckpt.config)
    model.check_loaded(model.load_weights(ckpt.tensors()))
    ids = _prompts(2, (24,))[0]
    assert (prompt_logits(model, ids) - _hf_logits(tiny.hf, ids)).abs().max().item() < LOGIT_TOL


@pytest.mark.slow  # writing and reading a 49k-token vocabulary through the gguf package takes a while
def test_qwen3_gguf_with_tokenizer_and_chat_template(tmp_path, default_model_path, prompt_logits):
    """A qwen3 GGUF through load_model: the architecture, the weights and, from its metadata, the
    tokenizer and chat template (here the default model's, copied in)."""
    hf = hf_model("qwen3", seed=1)
    path = write_gguf(hf, tmp_path / "qwen3.gguf", "qwen3", tokenizer_from=default_model_path)
    loaded = load_model(path)
    assert loaded.config.architecture == "Qwen3ForCausalLM" and loaded.config.qk_norm
    ids = apply_chat_template(loaded.tokenizer, [{"role": "user", "content": "Name three colours."}])
    assert ids == apply_chat_template(load_tokenizer(default_model_path), [{"role": "user", "content": "Name three colours."}])
    assert (prompt_logits(loaded.model, ids) - _hf_logits(hf, ids)).abs().max().item() < LOGIT_TOL


def test_engine_greedy_matches_hf(tiny):
    """Round 1: four prompts at once, prefill in chunks of 16, a pool that forces a retraction.
    Round 2: the same prompts plus a new tail, their prefixes from the radix cache, most of them
    loaded back from L2 (the small pool evicted them)."""
    first = _prompts(3, (37, 22, 45, 30))
    second = [p + t for p, t in zip(first, _prompts(4, (5, 3, 6, 4)))]
    pool = (sum(-(-len(p) // PAGE) for p in first) + len(first) + 1) * PAGE
    with make_engine(tiny.folder, max_total_tokens=pool, page_size=PAGE, chunked_prefill_size=16,
                     hicache_ratio=8.0) as engine:
        for prompts in (first, second):
            outs = engine.generate(input_ids=prompts, sampling_params=greedy(NEW_TOKENS))
            assert [o["output_ids"] for o in outs] == [hf_greedy(tiny.hf, p, NEW_TOKENS) for p in prompts]
        stats = engine.get_stats()
        engine.check_integrity()
    assert stats["retractions"] > 0, stats
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in outs)
    assert stats["tiers"]["host"]["loaded_back_tokens"] > 0, stats["tiers"]["host"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_on_cuda_matches_hf(tiny):
    """The CUDA path (Triton attention, fused RMSNorm/RoPE kernels, the fused MoE, CUDA graphs), fp32."""
    prompts = _prompts(5, (37, 22, 45, 30))
    with make_engine(tiny.folder, device="cuda", dtype="float32", page_size=PAGE, attention_backend="triton",
                     max_total_tokens=4096) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=greedy(NEW_TOKENS))
        engine.check_integrity()
    assert [o["output_ids"] for o in outs] == [hf_greedy(tiny.hf, p, NEW_TOKENS) for p in prompts]


def test_qwen3_moe_config_reads_every_spelling():
    d = {**json.loads(json.dumps(SPECS["qwen3_moe"][1])), "architectures": ["Qwen3MoeForCausalLM"],
         "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 8,
         "decoder_sparse_step": 2}
    cfg = ModelConfig.from_hf_config(d)
    assert [cfg.moe.is_sparse(i) for i in range(4)] == [False, False, False, True]  # layer 1 listed dense
    renamed = {k: v for k, v in d.items() if k != "num_experts"} | {"num_local_experts": 8}  # transformers 5
    assert ModelConfig.from_hf_config(renamed) == cfg
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf_config({**d, "num_experts_per_tok": 9})


@pytest.mark.parametrize("name, total", [("qwen3-8b", 8.19e9), ("qwen3-30b-a3b", 30.53e9),
                                         ("deepseek-v2-lite", 15.71e9)])
def test_shipped_configs_build_hf_shapes(name, total):
    """benchmarks/configs/<name>.json read by HF (Qwen3Config / Qwen3MoeConfig / DeepseekV2Config) and by us: the same
    parameters, tensor by tensor (both on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = REPO / "benchmarks" / "configs" / f"{name}.json"
    d = json.loads(path.read_text())
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**d))
    cfg = ModelConfig.from_json_file(path)
    ours = get_model_class(cfg.architecture)(cfg, dtype=torch.bfloat16, device="meta")
    want = {n: tuple(p.shape) for n, p in hf.state_dict().items()}
    for n, shape in want.items():
        found = ours._target(n)
        assert found is not None and tuple(found[0].shape) == shape, n
    ours.check_loaded(set().union(*(covered_names(n, cfg.moe.num_experts if cfg.moe else 0) for n in want)))
    n_params = sum(p.numel() for p in ours.parameters())
    assert n_params == sum(p.numel() for p in hf.parameters())
    assert abs(n_params - total) / total < 0.01
