"""DeepSeek-V2 (multi-head latent attention, DeepSeek MoE) against HF transformers (fp32, CPU), on
tiny random models built by HF from a DeepseekV2Config: q through a LoRA projection or directly
(V2-Lite), group-limited routing with a routed scaling factor and a shared expert after one dense
layer, YaRN RoPE. The L1 pool holds one latent per token and layer; the Engine's greedy outputs
equal HF's through chunked prefill, a retraction, radix hits and L2 load-backs, and after an L3
round trip (a restart on the same LMDB)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engines import greedy, make_engine, run_together
from families import hf_greedy, save_folder
from hicache.config import HiCacheConfig
from hicache.runtime.attention import make_latent_attention
from hicache.runtime.attention.latent import LatentAttention
from hicache.runtime.batch import ForwardBatch
from hicache.runtime.build import build_scheduler
from hicache.runtime.config import RuntimeConfig
from hicache.runtime.model_config import ModelConfig
from hicache.runtime.parallel import SINGLE, TensorParallel
from hicache.runtime.models import get_model_class
from hicache.runtime.tokenizer import load_tokenizer
from hicache.runtime.weights import load_model
from hicache.runtime.weights.gguf import GGUFCheckpoint
from hicache.tiers.gpu.pool import DeviceKVPool
from test_hicache_l3 import settle
from tp_procs import run_ranks

VOCAB = 49152  # the default model's tokenizer
PAGE = 4
NEW_TOKENS = 10
LOGIT_TOL = 1e-4
_BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB,
             max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, intermediate_size=96,
             moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
             topk_group=2, topk_method="group_limited_greedy", routed_scaling_factor=2.0, first_k_dense_replace=1,
             q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
         "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
VARIANTS = {"v2": {}, "v2_lite": {"q_lora_rank": None}, "yarn": {"rope_parameters": _YARN}, "v3": {"v3": True},
            "v3_lite": {"v3": True, "q_lora_rank": None, "norm_topk_prob": False}}
LATENT = 32 + 8  # kv_lora_rank + qk_rope_head_dim


def hf_deepseek(seed: int = 0, v3: bool = False, **options) -> torch.nn.Module:
    """HF's DeepSeek-V2, or with `v3` DeepSeek-V3 (its noaux_tc routing, renormalised top-k and a
    random correction bias), random weights."""
    import transformers

    if v3:
        base = {k: v for k, v in _BASE.items() if k != "topk_method"} | {"norm_topk_prob": True}
        config = transformers.DeepseekV3Config(**{**base, **options})
    else:
        config = transformers.DeepseekV2Config(**{**_BASE, **options})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    return load_tokenizer(default_model_path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer) -> tuple[torch.nn.Module, Path]:
    model = hf_deepseek()
    return model, save_folder(model, tmp_path_factory.mktemp("deepseek_v2"), tokenizer)


@pytest.fixture(scope="module")
def tiny_v3(tmp_path_factory, tokenizer) -> tuple[torch.nn.Module, Path]:
    model = hf_deepseek(v3=True)
    return model, save_folder(model, tmp_path_factory.mktemp("deepseek_v3"), tokenizer)


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_folder_logits_match_hf_with_cached_prefix(variant, tmp_path, tokenizer):
    """Through the latent pool: a 30-token prefix, then the rest extending over its cached latents
    (past YaRN's original context for the yarn variant)."""
    hf = hf_deepseek(**VARIANTS[variant])
    loaded = load_model(save_folder(hf, tmp_path, tokenizer))
    model, cfg = loaded.model, loaded.config
    assert cfg.architecture == type(hf).__name__ and cfg.moe.dense_layers == (0,)
    ids = _prompts(1, (72,))[0]
    pool = DeviceKVPool(256, 1, cfg.num_layers, cfg.cache_heads, cfg.cache_head_dim, torch.float32, "cpu")
    attn = LatentAttention(cfg.mla.kv_lora_rank, cfg.attn_scale)
    slots = torch.randperm(256)[: len(ids)]

    def logits(start: int, end: int) -> torch.Tensor:
        batch = ForwardBatch("extend", attn, pool, slots[start:end], [end - start], [slots[:end]])
        return model.compute_logits(model(torch.tensor(ids[start:end]), torch.arange(start, end), batch))

    logits(0, 30)
    tail = logits(30, len(ids))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, 30:]
    assert (tail - ref).abs().max().item() < LOGIT_TOL


_GGUF_LAYER = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
               "self_attn.q_proj.weight": "attn_q", "self_attn.q_a_proj.weight": "attn_q_a",
               "self_attn.q_a_layernorm.weight": "attn_q_a_norm", "self_attn.q_b_proj.weight": "attn_q_b",
               "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa", "self_attn.kv_a_layernorm.weight":
               "attn_kv_a_norm", "self_attn.o_proj.weight": "attn_output", "mlp.gate.weight": "ffn_gate_inp",
               "mlp.experts.down_proj": "ffn_down_exps", "mlp.gate_proj.weight": "ffn_gate",
               "mlp.up_proj.weight": "ffn_up", "mlp.down_proj.weight": "ffn_down",
               "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp",
               "mlp.shared_experts.up_proj.weight": "ffn_up_shexp",
               "mlp.shared_experts.down_proj.weight": "ffn_down_shexp", "mlp.gate.e_score_correction_bias":
               "exp_probs_b.bias"}


def _gguf_layer_tensors(rest: str, t: torch.Tensor, c):
    """llama.cpp's deepseek2 tensors of one HF layer tensor: kv_b split into k_b (transposed) and v_b."""
    if rest == "self_attn.kv_b_proj.weight":
        kv_b = t.view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
        k_b, v_b = kv_b.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)
        yield "attn_k_b.weight", k_b.transpose(1, 2)
        yield "attn_v_b.weight", v_b
    elif rest == "mlp.experts.gate_up_proj":
        gate, up = t.chunk(2, dim=1)
        yield "ffn_gate_exps.weight", gate
        yield "ffn_up_exps.weight", up
    else:
        name = _GGUF_LAYER[rest]
        yield name if name.endswith(".bias") else name + ".weight", t


def write_deepseek2_gguf(model: torch.nn.Module, path: Path) -> Path:
    """model as an fp32 `deepseek2` GGUF laid out as llama.cpp's converter writes it (MLA as MQA
    over the latent: head_count_kv 1, key_length the latent's, key_length_mla a head's; V3's
    sigmoid gating and correction bias)."""
    import gguf
    import numpy as np

    c, arch = model.config, "deepseek2"
    v3 = c.model_type == "deepseek_v3"
    w = gguf.GGUFWriter(str(path), arch)
    ints = {"block_count": c.num_hidden_layers, "context_length": c.max_position_embeddings,
            "embedding_length": c.hidden_size, "feed_forward_length": c.intermediate_size,
            "attention.head_count": c.num_attention_heads, "attention.head_count_kv": 1,
            "attention.kv_lora_rank": c.kv_lora_rank, "attention.key_length": c.kv_lora_rank + c.qk_rope_head_dim,
            "attention.value_length": c.kv_lora_rank, "attention.key_length_mla": c.qk_nope_head_dim + c.qk_rope_head_dim,
            "attention.value_length_mla": c.v_head_dim, "rope.dimension_count": c.qk_rope_head_dim,
            "vocab_size": c.vocab_size, "leading_dense_block_count": c.first_k_dense_replace,
            "expert_feed_forward_length": c.moe_intermediate_size, "expert_count": c.n_routed_experts,
            "expert_used_count": c.num_experts_per_tok, "expert_shared_count": c.n_shared_experts,
            "expert_gating_func": 2 if v3 else 1, "expert_group_count": c.n_group, "expert_group_used_count": c.topk_group}
    if c.q_lora_rank:
        ints["attention.q_lora_rank"] = c.q_lora_rank
    for key, value in ints.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", float(c.rope_parameters["rope_theta"]))
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    w.add_float32(f"{arch}.expert_weights_scale", c.routed_scaling_factor)
    w.add_bool(f"{arch}.expert_weights_norm", bool(v3 and c.norm_topk_prob))
    for name, t in model.state_dict().items():
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            pairs = [(f"blk.{i}.{g}", gt) for g, gt in _gguf_layer_tensors(rest, t, c)]
        else:
            pairs = [({"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                       "lm_head.weight": "output.weight"}[name], t)]
        for gname, gt in pairs:
            w.add_tensor(gname, np.ascontiguousarray(gt.detach().float().numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("variant", ["v2", "v2_lite", "v3"])
def test_gguf_logits_match_hf(variant, tmp_path):
    hf = hf_deepseek(**VARIANTS[variant])
    ckpt = GGUFCheckpoint(write_deepseek2_gguf(hf, tmp_path / "tiny.gguf"))
    assert ckpt.config.architecture == type(hf).__name__
    from_hf = ModelConfig.from_hf_config(hf.config.to_dict())
    assert (ckpt.config.mla, ckpt.config.moe) == (from_hf.mla, from_hf.moe)
    model = get_model_class(ckpt.config.architecture)(ckpt.config)
    model.check_loaded(model.load_weights(ckpt.tensors()))
    ids = _prompts(2, (24,))[0]
    ours = _latent_logits(model, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < LOGIT_TOL


def _latent_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits of a prompt through a fresh latent pool."""
    cfg, n = model.config, len(ids)
    pool = DeviceKVPool(64, 1, cfg.num_layers, cfg.cache_heads, cfg.cache_head_dim, torch.float32, "cpu")
    batch = ForwardBatch("extend", LatentAttention(cfg.mla.kv_lora_rank, cfg.attn_scale), pool, torch.arange(n), [n],
                         [torch.arange(n)])
    return model.compute_logits(model(torch.tensor(ids), torch.arange(n), batch))


def test_dummy_weights_from_the_config(tiny_v3, tmp_path):
    """load_format=dummy on a V3 config.json: every parameter filled (the correction bias random,
    norms 1), finite logits."""
    (tmp_path / "config.json").write_text((tiny_v3[1] / "config.json").read_text())
    loaded = load_model(tmp_path / "config.json", load_format="dummy", seed=3)
    for name, p in loaded.model.named_parameters():
        assert torch.isfinite(p).all(), name
        assert bool((p == 1).all()) == ("norm" in name), name
    assert torch.isfinite(_latent_logits(loaded.model, [5, 6, 7])).all()


def test_latent_pool_bytes_per_token(tiny):
    """One latent (kv_lora_rank + qk_rope_head_dim values) per token per layer in L1 and L2, not
    per-head K and V."""
    _, folder = tiny
    with make_engine(folder, max_total_tokens=256, page_size=PAGE) as engine:
        stats = engine.get_stats()
        assert engine.scheduler.bytes_per_token == 2 * LATENT * 4
    assert stats["tiers"]["host"]["bytes_per_token"] == 2 * LATENT * 4
    per_head = 2 * 4 * (16 + 8 + 16) * 4  # layers x heads x (K + V widths) x fp32
    assert per_head / (2 * LATENT * 4) == 4.0


@pytest.mark.parametrize("family", ["tiny", "tiny_v3"])
def test_engine_greedy_matches_hf(family, request):
    """Round 1: four prompts at once, prefill in chunks of 16, a pool that forces a retraction.
    Round 2: the same prompts plus a new tail, their prefixes from the radix cache, most of them
    loaded back from L2 (the small pool evicted them). DeepSeek-V2 and V3."""
    hf, folder = request.getfixturevalue(family)
    first = _prompts(3, (37, 22, 45, 30))
    second = [p + t for p, t in zip(first, _prompts(4, (5, 3, 6, 4)))]
    pool = (sum(-(-len(p) // PAGE) for p in first) + len(first) + 1) * PAGE
    with make_engine(folder, max_total_tokens=pool, page_size=PAGE, chunked_prefill_size=16,
                     hicache_ratio=8.0) as engine:
        for prompts in (first, second):
            outs = engine.generate(input_ids=prompts, sampling_params=greedy(NEW_TOKENS))
            assert [o["output_ids"] for o in outs] == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
        stats = engine.get_stats()
        engine.check_integrity()
    assert stats["retractions"] > 0, stats
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in outs)
    assert stats["tiers"]["host"]["loaded_back_tokens"] > 0, stats["tiers"]["host"]


def _l3_scheduler(folder: Path, lmdb: Path):
    rc = RuntimeConfig(model_path=str(folder), max_total_tokens=256, max_running_requests=4)
    cc = HiCacheConfig(page_size=PAGE, hicache_ratio=2.0, hicache_storage_backend="lmdb",
                       hicache_load_decision="always", hicache_storage_io="threads",
                       hicache_storage_backend_extra_config={"path": str(lmdb), "prefetch_threshold": 8})
    return build_scheduler(rc, cc)


def test_l3_round_trip_of_latent_pages(tiny, tmp_path):
    """Latent pages backed up to LMDB, then a fresh scheduler on the same LMDB serves the prompt's
    pages from storage, with HF's greedy output."""
    hf, folder = tiny
    prompt = _prompts(5, (40,))[0]
    want = hf_greedy(hf, prompt, NEW_TOKENS)
    first = _l3_scheduler(folder, tmp_path)
    assert _run_together(first, "a", [prompt])[0][0] == want
    settle(first)
    assert first.stats()["tiers"]["storage"]["backed_up_tokens"] >= 40 // PAGE * PAGE
    first.close()
    second = _l3_scheduler(folder, tmp_path)
    out, meta = _run_together(second, "b", [prompt])[0]
    second.close()
    assert out == want
    assert meta["cached_tokens_details"]["storage"] >= 36, meta


def rank_logits(tp: TensorParallel, folder: str) -> torch.Tensor:
    """This rank's full-vocabulary logits of an extend of two prompts, then a decode step of
    each, through its own latent pool. Runs in every rank process (tests/tp_procs.py)."""
    model = load_model(folder, tp=tp).model
    cfg = model.config
    pool = DeviceKVPool(64, 1, cfg.num_layers, model.num_kv_heads, cfg.cache_head_dim, torch.float32, "cpu")
    attn = LatentAttention(cfg.mla.kv_lora_rank, cfg.attn_scale)
    prompts = _prompts(7, (9, 6))
    lens = [len(p) for p in prompts]
    slots = [torch.arange(32 * i, 32 * i + n + 1) for i, n in enumerate(lens)]
    extend = ForwardBatch("extend", attn, pool, torch.cat([s[:n] for s, n in zip(slots, lens)]), lens,
                          [s[:n] for s, n in zip(slots, lens)])
    ids, pos = torch.tensor([t for p in prompts for t in p]), torch.cat([torch.arange(n) for n in lens])
    first = model.compute_logits(model(ids, pos, extend))
    table = torch.stack([torch.cat([s, s.new_zeros(max(lens) + 1 - len(s))]) for s in slots])
    decode = ForwardBatch("decode", attn, pool, torch.stack([s[n] for s, n in zip(slots, lens)]), [1, 1], slots,
                          slot_table=table, seq_lens=torch.tensor([n + 1 for n in lens]))
    return torch.cat([first, model.compute_logits(model(torch.tensor([77, 123]), torch.tensor(lens), decode))])


def test_two_ranks_match_one(tiny, tmp_path):
    """Heads split over two gloo ranks (q_b, kv_b rows, o_proj columns), the latent whole on each,
    experts' and the dense MLP's intermediate dimension split: every rank's logits are the
    unsharded model's."""
    _, folder = tiny
    want = rank_logits(SINGLE, str(folder))
    for rank, got in enumerate(run_ranks(rank_logits, 2, tmp_path, str(folder))):
        assert (got - want).abs().max().item() < LOGIT_TOL, rank


def test_tp2_overlapped_scheduler_matches_hf(tiny):
    """Two gloo ranks under the overlapped scheduler, each with its latent pools: HF's greedy
    outputs through chunked prefill, a retraction, then radix hits loaded back from L2."""
    hf, folder = tiny
    first = _prompts(8, (37, 22, 45, 30))
    second = [p + t for p, t in zip(first, _prompts(9, (5, 3, 6, 4)))]
    rc = RuntimeConfig(model_path=str(folder), max_total_tokens=(sum(-(-len(p) // PAGE) for p in first) + 5) * PAGE,
                       max_running_requests=4, chunked_prefill_size=16, overlap_schedule=True, tp_size=2,
                       schedule_conservativeness=0)
    sched = build_scheduler(rc, HiCacheConfig(page_size=PAGE, hicache_ratio=8.0, hicache_storage_backend="none",
                                              hicache_load_decision="always"))
    try:
        for tag, prompts in (("a", first), ("b", second)):
            outs = _run_together(sched, tag, prompts)
            assert [o for o, _ in outs] == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
        stats = sched.stats()
    finally:
        sched.close()
    assert stats["retractions"] > 0 and stats["tiers"]["host"]["loaded_back_tokens"] > 0, stats
    assert all(m["cached_tokens"] > 0 for _, m in outs)


def _run_together(sched, tag: str, prompts: list[list[int]], **sampling) -> list[tuple[list[int], dict]]:
    return run_together(sched, tag, prompts, VOCAB, NEW_TOKENS, **sampling)


def test_deepseek_config_refusals():
    d = {**_BASE, "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2"}
    cfg = ModelConfig.from_hf_config(d)
    assert (cfg.cache_heads, cfg.cache_head_dim, cfg.head_dim) == (1, LATENT // 2, 8)
    assert cfg.moe.shared_intermediate_size == 32 and cfg.moe.routed_scaling_factor == 2.0
    with pytest.raises(ValueError, match="norm_topk_prob"):
        ModelConfig.from_hf_config({**d, "norm_topk_prob": True})
    with pytest.raises(ValueError, match="topk_method"):
        ModelConfig.from_hf_config({**d, "topk_method": "noaux_tc"})
    v3 = {**d, "architectures": ["DeepseekV3ForCausalLM"], "topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    assert ModelConfig.from_hf_config(v3).moe.routing == "noaux_tc"
    with pytest.raises(ValueError, match="quantization_config 'fp8'"):
        ModelConfig.from_hf_config({**v3, "quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(ValueError, match="rope_interleave"):
        ModelConfig.from_hf_config({**v3, "rope_interleave": False})
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf_config({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
                                    "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 8,
                                    "rope_scaling": _YARN})
    with pytest.raises(ValueError, match="MLA"):
        make_latent_attention("triton", "auto", 32, 0.2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_on_cuda_matches_hf(tiny):
    """The torch latent backend on CUDA, fp32, with the L2 load-back of a second round."""
    hf, folder = tiny
    first = _prompts(5, (37, 22, 45, 30))
    second = [p + t for p, t in zip(first, _prompts(6, (5, 3, 6, 4)))]
    with make_engine(folder, device="cuda", dtype="float32", page_size=PAGE, max_total_tokens=256,
                     hicache_ratio=8.0) as engine:
        for prompts in (first, second):
            outs = engine.generate(input_ids=prompts, sampling_params=greedy(NEW_TOKENS))
            assert [o["output_ids"] for o in outs] == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
        engine.check_integrity()
    with pytest.raises(ValueError, match="MLA"):
        make_engine(folder, device="cuda", attention_backend="triton")
