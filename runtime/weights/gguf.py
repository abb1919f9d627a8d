"""GGUF weights (llama.cpp's format): metadata -> ModelConfig, tensors -> HF-named fp32 tensors.

Dequantised with `gguf.quants.dequantize`. llama.cpp's converter permutes the rows of q and k
weights for its interleaved RoPE; `_unpermute` undoes it exactly as transformers' GGUF loader
does (`LlamaTensorProcessor._reverse_permute_weights`), so our rotate-half RoPE matches HF.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from hicache.runtime.model_config import ModelConfig

SUPPORTED_GGUF_ARCHS = ("llama", "mistral")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


class GGUFCheckpoint:
    """An opened .gguf file: `config`, `num_tensors`, and `tensors()` yielding (hf_name, tensor)."""

    def __init__(self, path: str | Path):
        from gguf import GGUFReader

        self.path = Path(path)
        self.reader = GGUFReader(str(self.path))
        self.config = gguf_config(self.reader, name=self.path.stem)

    @property
    def num_tensors(self) -> int:
        return sum(1 for t in self.reader.tensors if hf_name(t.name) is not None)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from gguf import dequantize

        c = self.config
        for t in self.reader.tensors:
            name = hf_name(t.name)
            if name is None:
                continue
            arr = dequantize(t.data, t.tensor_type)
            if not arr.flags.writeable or not arr.flags.c_contiguous:
                arr = np.array(arr)  # a read-only view into the memory map
            w = torch.from_numpy(arr)
            if name.endswith("q_proj.weight"):
                w = _unpermute(w, c.num_heads)
            elif name.endswith("k_proj.weight"):
                w = _unpermute(w, c.num_kv_heads)
            yield name, w


def hf_name(gguf_name: str) -> str | None:
    """HF parameter name of a GGUF tensor, or None for tensors we do not load (rope_freqs, ...)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLK_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp convert_hf_to_gguf `permute`: rows [h, 2, d/2] were stored [h, d/2, 2]."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape).contiguous()


def gguf_config(reader: Any, name: str) -> ModelConfig:
    """ModelConfig from GGUF metadata (keys as transformers' GGUF_CONFIG_MAPPING reads them)."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (hicache runs {', '.join(SUPPORTED_GGUF_ARCHS)})")

    def get(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    heads = get("attention.head_count")
    if isinstance(heads, list) or isinstance(get("attention.head_count_kv"), list):
        raise ValueError("GGUF with per-layer head counts is not supported")
    tensor_names = {t.name for t in reader.tensors}
    vocab = get("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
    eos = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    d = {
        "architectures": ["MistralForCausalLM" if arch == "mistral" else "LlamaForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": get("embedding_length"),
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("rope.dimension_count"),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": get("rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(reader, arch),
        "max_position_embeddings": get("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(e for e in eos if e is not None)),
    }
    return ModelConfig.from_hf_config(d, name=name)


def _rope_scaling(reader: Any, arch: str) -> dict | None:
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # Llama 3.1's llama3 scaling, as per-dim divisors
            return {"rope_type": "freq_factors", "factors": [float(x) for x in np.asarray(t.data, dtype=np.float32).ravel()]}
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
    raise ValueError(f"GGUF rope scaling {kind!r} is not supported")


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    if isinstance(v, np.generic):
        v = v.item()
    return v
