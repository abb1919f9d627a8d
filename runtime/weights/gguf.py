"""GGUF weights (llama.cpp's format): metadata -> ModelConfig, tensors -> HF-named fp32 tensors.

`GGUFFile` parses the header itself: `gguf.GGUFReader` builds a numpy view for every element of
the tokenizer's string arrays, which takes seconds on a vocabulary of ~100k strings; we only need
the scalars and tensor offsets, which parse in a small fraction of that. Tensors are memory-mapped and dequantised with
`gguf.quants.dequantize`; constants come from the `gguf` package. For `llama` and `mistral`
files llama.cpp's converter permutes the rows of q and k weights for its interleaved RoPE;
`_unpermute` undoes it exactly as transformers' GGUF loader does
(`LlamaTensorProcessor._reverse_permute_weights`), so our rotate-half RoPE matches HF. Qwen files
keep HF's row order. A `llama` file with experts is Mixtral. Experts come as one stacked tensor
per layer and projection (`ffn_gate_exps`, ...), which the model loads whole, or in older
Mixtral files as one tensor per expert (`ffn_gate.3.weight`). A `deepseek2` file (DeepSeek-V2)
holds MLA's kv_b projection as llama.cpp's converter splits it, `attn_k_b` (each head's key rows,
transposed) and `attn_v_b`, which `_fuse_kv_b` joins back into HF's `kv_b_proj` (older files hold
`attn_kv_b` whole); its RoPE is interleaved in llama.cpp as in HF, so no rows are permuted.
"""
from __future__ import annotations

import os
import re
import struct
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import numpy as np
import torch

from hicache.runtime.model_config import ModelConfig

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                  "gemma3": "Gemma3ForCausalLM", "deepseek2": "DeepseekV2ForCausalLM"}
SUPPORTED_GGUF_ARCHS = tuple(_ARCHITECTURES)
_PERMUTED_ARCHS = ("llama", "mistral")  # q/k rows interleaved by llama.cpp's converter (see `_unpermute`)
# Gemma's converter stores norm weights plus one (llama.cpp's RMSNorm scales by the weight alone)
_NORM_OFFSETS = {"gemma3": 1.0}

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
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
_ARCH_LAYER_NAMES = {"gemma3": {
    **_LAYER_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}}
_ARCH_LAYER_NAMES["deepseek2"] = {
    **{k: v for k, v in _LAYER_NAMES.items() if "shexp" not in k},
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_k_b.weight": "self_attn.k_b_proj.weight",  # fused with attn_v_b by `_fuse_kv_b`
    "attn_v_b.weight": "self_attn.v_b_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",  # DeepSeek-V3's
}
_KV_B_PARTS = ("self_attn.k_b_proj.weight", "self_attn.v_b_proj.weight")
_GATING_FUNCS = {1: "softmax", 2: "sigmoid"}  # llama.cpp's expert_gating_func
_BLK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^ffn_(gate|up|down)\.(\d+)\.weight$")
_PREFETCH = 8  # tensors dequantised ahead of the consumer


class GGUFCheckpoint:
    """An opened .gguf file: `config`, `num_tensors`, and `tensors()` yielding (hf_name, tensor)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.reader = GGUFFile(self.path)
        self.config = gguf_config(self.reader, name=self.path.stem)
        self.arch = _field(self.reader, "general.architecture")
        self.permuted = self.arch in _PERMUTED_ARCHS

    @property
    def num_tensors(self) -> int:
        return sum(1 for t in self.reader.tensors if hf_name(t.name, self.arch) is not None)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Dequantised in a few threads (numpy releases the GIL), at most `_PREFETCH` ahead so
        that memory stays bounded for large files; yielded in file order."""
        return _fuse_kv_b(self._dequantised())

    def _dequantised(self) -> Iterator[tuple[str, torch.Tensor]]:
        todo = [(hf, t) for t in self.reader.tensors if (hf := hf_name(t.name, self.arch)) is not None]
        workers = max(1, min(4, os.cpu_count() or 1))
        with ThreadPoolExecutor(workers) as pool:
            pending: deque = deque()
            for item in todo:
                pending.append(pool.submit(self._tensor, *item))
                if len(pending) > _PREFETCH:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()

    def _tensor(self, name: str, t: GGUFTensorInfo) -> tuple[str, torch.Tensor]:
        from gguf import dequantize

        arr = dequantize(t.data, t.tensor_type)
        if not arr.flags.writeable or not arr.flags.c_contiguous:
            arr = np.array(arr)  # a read-only view into the memory map
        w = torch.from_numpy(arr)
        if self.permuted and name.endswith("q_proj.weight"):
            w = _unpermute(w, self.config.num_heads)
        elif self.permuted and name.endswith("k_proj.weight"):
            w = _unpermute(w, self.config.num_kv_heads)
        elif self.arch in _NORM_OFFSETS and name.endswith("norm.weight"):
            w = w - _NORM_OFFSETS[self.arch]
        elif name.endswith("shared_expert_gate.weight"):
            w = w.reshape(1, -1)  # stored as a vector
        return name, w


def _fuse_kv_b(items: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream with each layer's k_b ([H, kv_lora_rank, nope], as llama.cpp transposes it) and
    v_b ([H, v_head_dim, kv_lora_rank]) yielded as one HF kv_b_proj [H * (nope + v), kv_lora_rank]
    once both have come; other tensors unchanged."""
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in items:
        part = next((p for p in _KV_B_PARTS if name.endswith(p)), None)
        if part is None:
            yield name, t
            continue
        layer = name[:-len(part)]
        parts = held.setdefault(layer, {})
        parts[part] = t
        if len(parts) == 2:
            del held[layer]
            k, v = parts[_KV_B_PARTS[0]].transpose(1, 2), parts[_KV_B_PARTS[1]]
            yield f"{layer}self_attn.kv_b_proj.weight", torch.cat([k, v], dim=1).reshape(-1, k.shape[-1])


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """HF parameter name of a GGUF tensor, or None for tensors we do not load (rope_freqs, ...)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
    m = _BLK_RE.match(gguf_name)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
    e = _EXPERT_RE.match(m.group(2)) if m else None
    if e:  # older Mixtral files: one tensor per expert
        return f"model.layers.{m.group(1)}.mlp.experts.{e.group(2)}.{e.group(1)}_proj.weight"
    return None


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp convert_hf_to_gguf `permute`: rows [h, 2, d/2] were stored [h, d/2, 2]."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape).contiguous()


def gguf_config(reader: GGUFFile, name: str) -> ModelConfig:
    """ModelConfig from GGUF metadata (keys as transformers' GGUF_CONFIG_MAPPING reads them)."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported "
                         f"(hicache runs {', '.join(SUPPORTED_GGUF_ARCHS)})")

    def get(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    heads = get("attention.head_count")
    if isinstance(heads, list) or isinstance(get("attention.head_count_kv"), list):
        raise ValueError("GGUF with per-layer head counts is not supported")
    tensor_names = {t.name for t in reader.tensors}
    vocab = get("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
    eos = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    d = {
        "architectures": [_ARCHITECTURES[arch] if not (arch == "llama" and get("expert_count")) else
                          "MixtralForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": get("embedding_length"),
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length") or get("rope.dimension_count"),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": get("rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(reader, arch),
        "max_position_embeddings": get("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(e for e in eos if e is not None)),
        **(_deepseek2_keys(get) if arch == "deepseek2" else _moe_keys(arch, get, tensor_names)),
    }
    if arch == "gemma3":  # head size is key_length; the layer pattern and local RoPE base are HF's defaults
        d.update(head_dim=get("attention.key_length"), sliding_window=get("attention.sliding_window"),
                 rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-6))
    return ModelConfig.from_hf_config(d, name=name)


def _deepseek2_keys(get) -> dict:
    """DeepSeek's MLA and MoE keys, from llama.cpp's (its MQA view: key_length is the latent's,
    key_length_mla a head's; older files have no *_mla keys and per-head key/value lengths). A
    file with sigmoid expert gating is DeepSeek-V3 (noaux_tc routing)."""
    rope = get("rope.dimension_count")
    mla = get("attention.key_length_mla") is not None
    groups = get("expert_group_count", 1)
    scoring = _GATING_FUNCS.get(get("expert_gating_func", 1), "unknown")
    v3 = scoring == "sigmoid"
    keys = {"q_lora_rank": get("attention.q_lora_rank") or None, "kv_lora_rank": get("attention.kv_lora_rank"),
            "qk_rope_head_dim": rope,
            "qk_nope_head_dim": get("attention.key_length_mla" if mla else "attention.key_length") - rope,
            "v_head_dim": get("attention.value_length_mla" if mla else "attention.value_length"),
            "num_key_value_heads": get("attention.head_count"),
            "n_routed_experts": get("expert_count"), "num_experts_per_tok": get("expert_used_count"),
            "moe_intermediate_size": get("expert_feed_forward_length"),
            "n_shared_experts": get("expert_shared_count", 0),
            "first_k_dense_replace": get("leading_dense_block_count", 0),
            "routed_scaling_factor": get("expert_weights_scale", 1.0),
            "norm_topk_prob": bool(get("expert_weights_norm", False)), "scoring_func": scoring,
            "topk_method": "noaux_tc" if v3 else "group_limited_greedy" if groups > 1 else "greedy",
            "n_group": groups, "topk_group": get("expert_group_used_count", 1)}
    return keys | ({"architectures": ["DeepseekV3ForCausalLM"]} if v3 else {})


def _moe_keys(arch: str, get, tensor_names: set[str]) -> dict:
    """The HF config keys of a mixture of experts (none for a dense file): layers without a router
    are dense. llama.cpp renormalises Qwen3-MoE's top-k weights and not Qwen2-MoE's."""
    if not get("expert_count"):
        return {}
    keys = {"num_experts": get("expert_count"), "num_local_experts": get("expert_count"),
            "num_experts_per_tok": get("expert_used_count"),
            "mlp_only_layers": [i for i in range(get("block_count"))
                                if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]}
    if arch == "llama":  # Mixtral: feed_forward_length is the expert's
        return keys
    return {**keys, "moe_intermediate_size": get("expert_feed_forward_length"),
            "shared_expert_intermediate_size": get("expert_shared_feed_forward_length", 0),
            "norm_topk_prob": bool(get("expert_weights_norm", arch == "qwen3moe"))}


def _rope_scaling(reader: GGUFFile, arch: str) -> dict | None:
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # Llama 3.1's llama3 scaling, as per-dim divisors
            from gguf import dequantize

            factors = dequantize(t.data, t.tensor_type).ravel()
            return {"rope_type": "freq_factors", "factors": [float(x) for x in factors]}
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
    if kind == "yarn":  # llama.cpp stores 0.1 * mscale_all_dim; DeepSeek's mscale equals it
        mscale = float(_field(reader, f"{arch}.rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        return {"rope_type": "yarn", "factor": float(_field(reader, f"{arch}.rope.scaling.factor")),
                "original_max_position_embeddings": int(_field(reader, f"{arch}.rope.scaling.original_context_length")),
                "mscale": mscale, "mscale_all_dim": mscale}
    raise ValueError(f"GGUF rope scaling {kind!r} is not supported")


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


# ---- a minimal GGUF (v2, v3, little-endian) header reader -------------------------------------

class GGUFTensorInfo(NamedTuple):
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order (slowest first): reversed ggml ne
    data: np.ndarray  # uint8 [..., bytes per row], a read-only view of the memory map


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
               12: "<f8"}
_STRING, _ARRAY = 8, 9


class GGUFFile:
    """`fields`: metadata key -> Python value (str, int, float, bool, list); `tensors`: list of
    GGUFTensorInfo in file order. Raises ValueError for a file that is not GGUF v2/v3."""

    def __init__(self, path: str | Path):
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUF_DEFAULT_ALIGNMENT

        self.path = Path(path)
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self._mm)
        if bytes(self._buf[:4]) != b"GGUF":
            raise ValueError(f"{self.path} is not a GGUF file (bad magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", self._buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 or 3; big-endian files neither)")
        self._off = 24
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._u32())
        infos = [self._tensor_info() for _ in range(n_tensors)]
        align = int(self.fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        start = -(-self._off // align) * align
        self.tensors = []
        for name, ne, ttype, offset in infos:
            qtype = GGMLQuantizationType(ttype)
            block, type_size = GGML_QUANT_SIZES[qtype]
            row_bytes = ne[0] // block * type_size
            rows = int(np.prod(ne[1:], dtype=np.int64)) if len(ne) > 1 else 1
            data = self._mm[start + offset: start + offset + rows * row_bytes]
            shape = tuple(reversed(ne))
            self.tensors.append(GGUFTensorInfo(name, qtype, shape, data.reshape(*shape[:-1], row_bytes)))

    def _u32(self) -> int:
        (v,) = struct.unpack_from("<I", self._buf, self._off)
        self._off += 4
        return v

    def _u64(self) -> int:
        (v,) = struct.unpack_from("<Q", self._buf, self._off)
        self._off += 8
        return v

    def _string(self) -> str:
        n = self._u64()
        s = bytes(self._buf[self._off:self._off + n]).decode("utf-8", errors="replace")
        self._off += n
        return s

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._u32(), self._u64()
            if etype in _NP_SCALARS:  # numbers: one frombuffer, no per-element work
                arr = np.frombuffer(self._buf, dtype=_NP_SCALARS[etype], count=count, offset=self._off)
                self._off += arr.nbytes
                return arr.tolist()
            return [self._value(etype) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype}")
        (v,) = struct.unpack_from(_SCALARS[vtype], self._buf, self._off)
        self._off += struct.calcsize(_SCALARS[vtype])
        return v

    def _tensor_info(self) -> tuple[str, list[int], int, int]:
        name = self._string()
        n_dims = self._u32()
        ne = list(struct.unpack_from(f"<{n_dims}Q", self._buf, self._off))
        self._off += 8 * n_dims
        ttype, offset = self._u32(), self._u64()
        return name, ne, ttype, offset
