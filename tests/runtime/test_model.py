"""Our Llama model against HF transformers: SmolLM2 from the default GGUF (HF's logits summarised
in tests/golden/logits.json), a tiny random model, and RoPE scaling variants."""
from __future__ import annotations

import json

import pytest
import torch

from golden import load_golden, logits_vs_golden
from hicache.kernels import cpu as cpu_kernels
from hicache.runtime.model_config import ModelConfig
from hicache.runtime.models import LlamaForCausalLM, get_model_class
from hicache.runtime.models.layers import RotaryEmbedding, rope_inv_freq

LOGIT_TOL = 1e-3

PARAGRAPH = (
    "The hierarchical cache keeps every prefix the engine has computed in a radix tree whose pages "
    "live in GPU memory, pinned host memory or a storage tier, and moves pages between tiers "
    "asynchronously so that the scheduler almost never recomputes what some tier still holds. "
)
WHOLE_PROMPTS = ("short", "chat", "code", "long")  # up to 1,500 tokens


@pytest.mark.model
def test_matches_hf_on_default_gguf(default_model, prompt_logits):
    """Whole-prompt logits within LOGIT_TOL of HF's (at its top 3 tokens and in the logsumexp over
    the vocabulary) and the same argmax at every position."""
    cases = {c["name"]: c for c in load_golden("logits")["cases"]}
    worst = 0.0
    for name in WHOLE_PROMPTS:
        ours = prompt_logits(default_model.model, cases[name]["prompt"])
        err, same_argmax = logits_vs_golden(ours, cases[name])
        worst = max(worst, err)
        print(f"{name}: {ours.shape[0]} tokens, max |logit diff| = {err:.3g}")
        assert same_argmax, name
        assert err < LOGIT_TOL, name
    print(f"worst max |logit diff| over all prompts: {worst:.3g}")


@pytest.mark.model
def test_incremental_decode_matches_whole_prompt(default_model, prompt_logits, simple_batch):
    model = default_model.model
    ids = default_model.tokenizer(PARAGRAPH)["input_ids"][:40]
    whole = prompt_logits(model, ids)
    batch = simple_batch(model)
    parts = [prompt_logits(model, ids[:30], batch)]  # prefix, then a chunk, then token by token
    parts.append(prompt_logits(model, ids[30:35], batch, start=30))
    parts += [prompt_logits(model, ids[i:i + 1], batch, start=i) for i in range(35, 40)]
    inc = torch.cat(parts)
    assert (inc - whole).abs().max().item() < 1e-4
    assert torch.equal(inc.argmax(-1), whole.argmax(-1))


@pytest.mark.model
def test_bf16_close_to_fp32(default_model, prompt_logits):
    from hicache.runtime.weights import load_model

    bf16 = load_model(default_model.path, dtype=torch.bfloat16).model
    ids = default_model.tokenizer("The capital of France is")["input_ids"]
    lo32, lo16 = prompt_logits(default_model.model, ids), prompt_logits(bf16, ids)
    assert lo16.dtype == torch.float32 and torch.isfinite(lo16).all()
    assert lo16[-1].argmax() == lo32[-1].argmax()
    assert bf16.embed_tokens.dtype == torch.bfloat16


def _tiny_pair(path, seed=0):
    """HF LlamaForCausalLM and ours with the same random weights (tiny config: untied, llama3 RoPE)."""
    from transformers import LlamaConfig, LlamaForCausalLM as HFLlama

    d = json.loads(path.read_text())
    torch.manual_seed(seed)
    hf = HFLlama(LlamaConfig(**d)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.05)  # HF inits norms to 1: randomise them too
    ours = LlamaForCausalLM(ModelConfig.from_hf_config(d), dtype=torch.float32, device="cpu")
    loaded = ours.load_weights(hf.state_dict().items())
    ours.check_loaded(loaded)
    return hf, ours


def test_tiny_model_matches_hf(tiny_config_path, prompt_logits):
    hf, ours = _tiny_pair(tiny_config_path)
    ids = torch.randint(0, 512, (600,), generator=torch.Generator().manual_seed(1)).tolist()
    mine = prompt_logits(ours, ids)  # 600 > original_max_position_embeddings (256): scaling matters
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (mine - ref).abs().max().item() < 1e-4
    assert torch.equal(mine.argmax(-1), ref.argmax(-1))


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler: the CPU kernels are not built")
def test_cpu_kernels_match_hf_and_turn_off_cleanly(tiny_config_path, prompt_logits):
    """The compiled CPU layer ops and prepacked linears (the server's CPU default) against HF; off
    again, the weights are the loaded ones, bit for bit."""
    hf, ours = _tiny_pair(tiny_config_path)
    before = {n: p.clone() for n, p in ours.named_parameters()}
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    assert ours.use_cpu_kernels()
    assert ours.layers[0].self_attn.packs and ours.layers[0].self_attn.qkv_proj.numel() == 0
    mine = prompt_logits(ours, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (mine - ref).abs().max().item() < 1e-4
    assert not ours.use_cpu_kernels(False)
    assert all(torch.equal(p, before[n]) for n, p in ours.named_parameters())


def _hf_rope(config_dict, positions, q, k):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    rot = LlamaRotaryEmbedding(LlamaConfig(**config_dict))
    qh, kh = q.transpose(0, 1)[None], k.transpose(0, 1)[None]  # [1, H, T, D]
    cos, sin = rot(qh, positions[None])
    qr, kr = apply_rotary_pos_emb(qh, kh, cos, sin)
    return rot.inv_freq, qr[0].transpose(0, 1), kr[0].transpose(0, 1)


@pytest.mark.parametrize("rope_scaling", ["llama3", "linear", None])
def test_rope_matches_hf(llama31_config_path, rope_scaling):
    d = json.loads(llama31_config_path.read_text())
    if rope_scaling == "linear":
        d["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
    elif rope_scaling is None:
        d["rope_scaling"] = None
    cfg = ModelConfig.from_hf_config(d)
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, cfg.max_position_embeddings, (64,), generator=g)
    q = torch.randn(64, cfg.num_heads, cfg.head_dim, generator=g)
    k = torch.randn(64, cfg.num_kv_heads, cfg.head_dim, generator=g)
    hf_inv, hf_q, hf_k = _hf_rope(d, positions, q, k)
    assert torch.allclose(rope_inv_freq(cfg), hf_inv, rtol=1e-6, atol=0)
    our_q, our_k = RotaryEmbedding(cfg)(positions, q, k)
    # fp32 sin/cos of angles up to 1.3e5 rad: both sides round the same product, allow a few ulps
    assert (our_q - hf_q).abs().max().item() < 1e-4
    assert (our_k - hf_k).abs().max().item() < 1e-4


def test_llama3_scaling_changes_low_frequencies(llama31_config_path):
    d = json.loads(llama31_config_path.read_text())
    scaled = rope_inv_freq(ModelConfig.from_hf_config(d))
    plain = rope_inv_freq(ModelConfig.from_hf_config({**d, "rope_scaling": None}))
    assert torch.equal(scaled[:8], plain[:8])  # high frequencies untouched
    assert torch.allclose(scaled[-4:], plain[-4:] / 8.0)  # lowest divided by the factor


def test_freq_factors_rope_equals_llama3(llama31_config_path):
    """A GGUF's rope_freqs divisors reproduce llama3 scaling exactly."""
    d = json.loads(llama31_config_path.read_text())
    llama3 = rope_inv_freq(ModelConfig.from_hf_config(d))
    plain = rope_inv_freq(ModelConfig.from_hf_config({**d, "rope_scaling": None}))
    factors = (plain / llama3).tolist()
    freq_factors = {"rope_type": "freq_factors", "factors": factors}
    via = rope_inv_freq(ModelConfig.from_hf_config({**d, "rope_scaling": freq_factors}))
    assert torch.allclose(via, llama3, rtol=1e-6)


def test_rope_cache_grows_past_max_positions(tiny_config_path):
    cfg = ModelConfig.from_json_file(tiny_config_path)
    rope = RotaryEmbedding(cfg)
    q = torch.randn(2, cfg.num_heads, cfg.head_dim)
    k = torch.randn(2, cfg.num_kv_heads, cfg.head_dim)
    far = torch.tensor([5, cfg.max_position_embeddings + 10])
    qr, kr = rope(far, q, k)
    assert rope.cos_sin.shape[0] > cfg.max_position_embeddings + 10
    q0, _ = rope(torch.tensor([5]), q[:1], k[:1])
    assert torch.equal(q0, qr[:1])


def test_model_config_from_llama31(llama31_config_path):
    d = json.loads(llama31_config_path.read_text())
    cfg = ModelConfig.from_hf_config(d, name="llama-3.1-8b")
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (32, 32, 8, 128)
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_theta == 500000.0
    assert cfg.eos_token_ids == (128001,) and not cfg.tie_word_embeddings
    # transformers 5 spelling: rope_parameters holding rope_theta and the scaling
    v5 = {k: v for k, v in d.items() if k not in ("rope_scaling", "rope_theta")}
    v5["rope_parameters"] = {**d["rope_scaling"], "rope_theta": 500000.0}
    assert ModelConfig.from_hf_config(v5, name="llama-3.1-8b") == cfg
    assert ModelConfig.from_hf_config(cfg.to_hf_config(), name="llama-3.1-8b") == cfg


def test_fingerprint_stable_and_distinct(llama31_config_path):
    d = json.loads(llama31_config_path.read_text())
    a = ModelConfig.from_hf_config(d, name="x")
    assert a.fingerprint == ModelConfig.from_hf_config(d, name="x").fingerprint
    assert len(a.fingerprint) == 16 and hash(a) == hash(ModelConfig.from_hf_config(d, name="x"))
    assert a.fingerprint != ModelConfig.from_hf_config(d, name="y").fingerprint
    assert a.fingerprint != ModelConfig.from_hf_config({**d, "num_key_value_heads": 4}, name="x").fingerprint
    assert a.fingerprint != ModelConfig(**{**a.__dict__, "qk_norm": True}).fingerprint  # a family option
    # token ids do not change KV: same fingerprint
    assert a.fingerprint == ModelConfig.from_hf_config({**d, "eos_token_id": [1, 2]}, name="x").fingerprint


@pytest.mark.parametrize("change, match", [
    ({"architectures": ["FalconForCausalLM"]}, "unsupported architecture.*Qwen3MoeForCausalLM"),
    ({"attention_bias": True}, "bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type"),
    ({"attn_logit_softcapping": 50.0}, "softcapping"),
])
def test_model_config_rejects_unsupported(llama31_config_path, change, match):
    d = json.loads(llama31_config_path.read_text())
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_config({**d, **change})
    if "architectures" in change:
        with pytest.raises(ValueError):
            get_model_class("FalconForCausalLM")
