"""The tensor-parallel model on CPU: two ranks over gloo (tests/tp_procs.py) hold their shares of
tiny random models of every family and, for an extend of two prompts then a decode step through
the torch attention backend and each rank's own KV pool, produce on every rank the same full-vocab
logits as the unsharded model. Loading covers random weights (drawn whole, then sliced), HF folders
(safetensors read by slice) and GGUF files (dequantised, then sliced); a dimension the ranks cannot
split is a ValueError naming it. One pair of rank processes serves the whole module."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from families import hf_model, write_gguf
from hicache.runtime.attention.reference import TorchAttention
from hicache.runtime.batch import ForwardBatch
from hicache.runtime.model_config import ModelConfig
from hicache.runtime.models import get_model_class
from hicache.runtime.models.sharding import fused_rows, take
from hicache.runtime.parallel import SINGLE, TensorParallel
from hicache.runtime.weights import load_model
from hicache.runtime.weights.gguf import GGUFCheckpoint
from hicache.tiers.gpu.pool import DeviceKVPool
from tp_procs import run_ranks

PROMPTS = ([5, 17, 3, 99, 250, 42, 7], [11, 301, 64, 2, 480])  # ids below every tiny vocabulary
NEXT = [77, 123]  # the decode step's tokens
TOL = 1e-4


def _tiny_llama_hf():
    """A Llama with one KV head (replicated on both ranks), as llama.cpp lays it out in a GGUF."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    return model


def _tiny_gemma3_hf():
    import transformers

    cfg = transformers.Gemma3TextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=4,
                                        sliding_window_pattern=2, query_pre_attn_scalar=24,
                                        final_logit_softcapping=30.0, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.5 if "norm" in name else 0.2)
    return model


def _model(tp: TensorParallel, path: str, fmt: str):
    if fmt != "gguf":
        return load_model(path, fmt, tp=tp).model
    ckpt = GGUFCheckpoint(path)  # load_model's path without the tokenizer (these files carry none)
    model = get_model_class(ckpt.config.architecture)(ckpt.config, tp=tp)
    model.check_loaded(model.load_weights(ckpt.tensors()))
    return model


def _extend_then_decode(model) -> torch.Tensor:
    """Logits [all prompt tokens + one decode token per prompt, vocab] on this rank."""
    cfg = model.config
    pool = DeviceKVPool(64, 1, cfg.num_layers, model.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    attn = TorchAttention(cfg.head_dim, cfg.attn_scale, cfg.layer_windows)
    lens = [len(p) for p in PROMPTS]
    slots = [torch.arange(32 * i, 32 * i + n + 1) for i, n in enumerate(lens)]  # room for the decode token
    ids = torch.tensor([t for p in PROMPTS for t in p])
    pos = torch.cat([torch.arange(n) for n in lens])
    out = torch.cat([s[:n] for s, n in zip(slots, lens)])
    extend = ForwardBatch("extend", attn, pool, out, lens, [s[:n] for s, n in zip(slots, lens)])
    first = model.compute_logits(model(ids, pos, extend))
    table = torch.stack([torch.cat([s, s.new_zeros(max(lens) + 1 - len(s))]) for s in slots])
    decode = ForwardBatch("decode", attn, pool, torch.stack([s[n] for s, n in zip(slots, lens)]), [1, 1], slots,
                          slot_table=table, seq_lens=torch.tensor([n + 1 for n in lens]))
    second = model.compute_logits(model(torch.tensor(NEXT), torch.tensor(lens), decode))
    return torch.cat([first, second])


def rank_logits(tp: TensorParallel, cases: dict[str, tuple[str, str]]) -> dict[str, torch.Tensor]:
    """Per case (path, load format): this rank's logits. Runs in every rank process."""
    return {name: _extend_then_decode(_model(tp, path, fmt)) for name, (path, fmt) in cases.items()}


@pytest.fixture(scope="module")
def cases(tmp_path_factory, tiny_config_path) -> dict[str, tuple[str, str]]:
    root = tmp_path_factory.mktemp("tp")
    out = {"llama-dummy": (str(tiny_config_path), "dummy"),
           "llama-gguf-kv-replicated": (str(write_gguf(_tiny_llama_hf(), root / "llama.gguf", "llama")), "gguf"),
           "qwen3moe-gguf": (str(write_gguf(hf_model("qwen3_moe"), root / "qwen3moe.gguf", "qwen3moe")), "gguf")}
    for name, model in (("qwen2", hf_model("qwen2")), ("qwen3", hf_model("qwen3")),
                        ("qwen2_moe", hf_model("qwen2_moe")), ("gemma3", _tiny_gemma3_hf())):
        model.save_pretrained(str(root / name), safe_serialization=True)
        out[f"{name}-safetensors"] = (str(root / name), "safetensors")
    return out


@pytest.fixture(scope="module")
def two_ranks(cases, tmp_path_factory) -> list[dict[str, torch.Tensor]]:
    return run_ranks(rank_logits, 2, tmp_path_factory.mktemp("ranks"), cases)


@pytest.mark.parametrize("case", ["llama-dummy", "llama-gguf-kv-replicated", "qwen2-safetensors", "qwen3-safetensors",
                                  "qwen2_moe-safetensors", "qwen3moe-gguf", "gemma3-safetensors"])
def test_two_ranks_match_one(cases, two_ranks, case):
    want = rank_logits(SINGLE, {case: cases[case]})[case]
    for rank, got in enumerate(two_ranks):
        assert got[case].shape == want.shape, rank
        err = (got[case] - want).abs().max().item()
        assert err < TOL, f"rank {rank}: max |logit diff| {err:.3g}"


def test_ranks_hold_their_share(tiny_config_path):
    """No collectives: building a rank's share needs no process group."""
    model = load_model(tiny_config_path, "dummy", tp=TensorParallel(1, 2)).model
    whole = load_model(tiny_config_path, "dummy").model
    half = whole.config.intermediate_size // 2
    assert (model.num_heads, model.num_kv_heads) == (2, 1)
    torch.testing.assert_close(model.layers[0].mlp.down_proj, whole.layers[0].mlp.down_proj[:, half:])
    torch.testing.assert_close(model.embed_tokens, whole.embed_tokens[whole.config.vocab_size // 2:])


def test_take_reads_a_share_of_a_safetensors_slice(tmp_path):
    """A lazy safetensors slice indexed as a torch tensor: by slices (only those bytes read), by
    row ids (a fused stack: read whole, then indexed), whole."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    t = torch.randn(3, 8, 5)
    save_file({"t": t}, str(tmp_path / "t.safetensors"))
    rows = fused_rows([(4, slice(2, 4)), (4, slice(2, 4))])
    with safe_open(str(tmp_path / "t.safetensors"), framework="pt") as f:
        for idx in [(slice(None), slice(None), slice(1, 3)), (slice(None), rows), ()]:
            assert torch.equal(take(f.get_slice("t"), idx), t[idx] if idx else t), idx


@pytest.mark.parametrize(("size", "change", "field"), [(8, {}, "num_heads"), (2, {"vocab_size": 511}, "vocab_size"),
                                                  (2, {"intermediate_size": 129}, "intermediate_size")])
def test_indivisible_config_is_a_value_error(tiny_config_path, size, change, field):
    config = replace(ModelConfig.from_json_file(tiny_config_path), **change)
    with pytest.raises(ValueError, match=field):
        get_model_class(config.architecture)(config, tp=TensorParallel(0, size))
