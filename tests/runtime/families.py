"""Tiny random models of the non-Llama families, built by HF transformers (2 layers, hidden 64),
saved as HF folders (safetensors, config.json, the default model's tokenizer) or written as GGUF
files the way llama.cpp's converter lays them out. HF's model is the oracle."""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

VOCAB = 49152  # the default model's tokenizer
_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
               max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
# HF config class, its options, the GGUF architecture
SPECS = {
    "qwen2": ("Qwen2Config", dict(intermediate_size=128, tie_word_embeddings=True), "qwen2"),
    "qwen3": ("Qwen3Config", dict(intermediate_size=128, head_dim=32), "qwen3"),
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                         num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1]), "qwen3moe"),
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                         num_experts_per_tok=2, shared_expert_intermediate_size=48), "qwen2moe"),
    "mixtral": ("MixtralConfig", dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2), "llama"),
}


class Tiny(NamedTuple):
    name: str
    hf: torch.nn.Module  # HF's model, fp32, eval
    folder: Path  # the same weights as an HF folder


def hf_model(name: str, seed: int = 0) -> torch.nn.Module:
    """HF's model for SPECS[name] with random weights large enough that greedy choices and expert
    routing are clear of near-ties (norms around 1)."""
    import transformers

    cls, options, _ = SPECS[name]
    config = getattr(transformers, cls)(**_COMMON, **options)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.normal_(1.0 if "norm" in pname else 0.0, 0.1)
    return model


def save_folder(model: torch.nn.Module, folder: Path, tokenizer) -> Path:
    model.save_pretrained(str(folder), safe_serialization=True)
    tokenizer.save_pretrained(str(folder))
    return folder


def hf_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             min_new_tokens=new_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def write_gguf(model: torch.nn.Module, path: Path, arch: str, tokenizer_from: Path | None = None) -> Path:
    """model's weights and config as an fp32 GGUF file, with the tokenizer metadata (vocabulary,
    merges, special ids, chat template) of the GGUF `tokenizer_from` if given."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    if tokenizer_from is not None:
        _copy_tokenizer(w, tokenizer_from)
    for key, value in (("block_count", c.num_hidden_layers), ("context_length", c.max_position_embeddings),
                       ("embedding_length", c.hidden_size), ("feed_forward_length", c.intermediate_size),
                       ("attention.head_count", c.num_attention_heads),
                       ("attention.head_count_kv", c.num_key_value_heads),
                       ("attention.key_length", getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads),
                       ("vocab_size", c.vocab_size)):
        w.add_uint32(f"{arch}.{key}", value)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)  # Gemma 3 nests its global layers'
    w.add_float32(f"{arch}.rope.freq_base", float(rope["rope_theta"]))
    if arch == "gemma3":
        w.add_uint32(f"{arch}.attention.sliding_window", c.sliding_window)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)
    if experts:
        w.add_uint32(f"{arch}.expert_count", experts)
        w.add_uint32(f"{arch}.expert_used_count", c.num_experts_per_tok)
        if getattr(c, "moe_intermediate_size", None):
            w.add_uint32(f"{arch}.expert_feed_forward_length", c.moe_intermediate_size)
        if getattr(c, "shared_expert_intermediate_size", None):
            w.add_uint32(f"{arch}.expert_shared_feed_forward_length", c.shared_expert_intermediate_size)
    for name, tensor in _gguf_tensors(model, arch):
        w.add_tensor(name, np.ascontiguousarray(tensor.detach().float().numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _copy_tokenizer(w, source: Path) -> None:
    from hicache.runtime.weights.gguf import GGUFFile

    for key, value in GGUFFile(source).fields.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        else:
            w.add_uint32(key, value)


_GGUF_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
               "mlp.experts.down_proj": "ffn_down_exps.weight", "mlp.shared_expert_gate.weight":
               "ffn_gate_inp_shexp.weight"}
_PROJ = {"gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}
_GEMMA3_NORMS = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight":
                 "post_attention_norm.weight", "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                 "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}


def _gguf_tensors(model: torch.nn.Module, arch: str):
    """llama.cpp's names; Gemma's norm weights stored plus one, as its converter does."""
    c = model.config
    for name, t in model.state_dict().items():
        t = t + 1.0 if arch == "gemma3" and name.endswith("norm.weight") else t
        if name == "lm_head.weight":
            if not c.tie_word_embeddings:
                yield "output.weight", t
            continue
        if not name.startswith("model.layers."):
            yield {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[name], t
            continue
        i, rest = name[len("model.layers."):].split(".", 1)
        for gname, gt in _layer_tensor(rest, t, c, arch):
            yield f"blk.{i}.{gname}", gt


def _layer_tensor(rest: str, t: torch.Tensor, c, arch: str):
    if arch == "gemma3" and rest in _GEMMA3_NORMS:
        yield _GEMMA3_NORMS[rest], t
    elif rest in _GGUF_NAMES and not (rest == "mlp.experts.down_proj" and arch == "llama"):
        yield _GGUF_NAMES[rest], t.reshape(-1) if rest.endswith("shared_expert_gate.weight") else t
    elif rest.startswith("self_attn.") and rest[10] in "qkv" and rest[11:17] == "_proj.":
        p, suffix = rest[10], rest[17:]
        heads = c.num_attention_heads if p == "q" else c.num_key_value_heads
        yield f"attn_{p}.{suffix}", _permute(t, heads) if arch == "llama" and p != "v" else t
    elif rest.startswith("self_attn.") and rest.endswith("_norm.weight"):
        yield f"attn_{rest[10]}_norm.weight", t
    elif rest.startswith("mlp.experts.") and arch == "llama":  # Mixtral as older files hold it: per expert
        stacks = dict(zip(("gate", "up"), t.chunk(2, dim=1))) if rest.endswith("gate_up_proj") else {"down": t}
        for proj, stack in stacks.items():
            yield from ((f"ffn_{proj}.{e}.weight", m) for e, m in enumerate(stack))
    elif rest == "mlp.experts.gate_up_proj":
        gate, up = t.chunk(2, dim=1)
        yield "ffn_gate_exps.weight", gate
        yield "ffn_up_exps.weight", up
    else:  # mlp.{gate,up,down}_proj.weight, mlp.shared_expert.*
        proj = rest.split(".")[-2].removesuffix("_proj")
        yield _PROJ[proj] + ("_shexp" if ".shared_expert." in rest else "") + ".weight", t


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter's q/k row order (interleaved RoPE pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
