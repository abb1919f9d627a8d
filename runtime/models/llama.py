"""Llama-family decoder: Llama 2/3/3.1, Mistral (sliding window in the attention backend), SmolLM2, Qwen2/2.5, Qwen3,
and the mixtures of experts Qwen2-MoE, Qwen3-MoE and Mixtral.

Our own implementation: RMSNorm, RoPE (default, linear, llama3, GGUF freq factors), GQA attention
through a pluggable backend, SwiGLU MLP or a sparse MLP (`models/moe.py`), optional tied
embeddings. The families differ by config options only (`ModelConfig.qkv_bias`, `qk_norm`,
`moe`): a Llama layer runs exactly the Llama code. Weights are fused on load (q/k/v into
`qkv_proj`, gate/up into `gate_up_proj`); `load_weights` takes HF-named tensors.

Contract with the attention backend (runtime/attention/): each layer calls
`batch.attn.forward(q, k, v, layer_id, batch)` with q [T, num_heads, head_dim] and k, v
[T, num_kv_heads, head_dim] in the model dtype, on the model device, RoPE already applied to q and
k; q and k are contiguous, v may be a strided view (last dim contiguous). The backend stores k/v in
the KV pool, attends with scale head_dim**-0.5 and returns [T, num_heads, head_dim].
"""
from __future__ import annotations

import functools
import importlib.util
import math
import re
import types
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from hicache.runtime.model_config import ModelConfig
from hicache.runtime.models.moe import SparseMoeBlock, covered_names, hf_name


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


@functools.cache
def _cuda_kernels():
    """The layer's Triton kernels (RMSNorm, add + RMSNorm, RoPE, SiLU-mul, few-row linear) where
    triton is installed, else None."""
    if importlib.util.find_spec("triton") is None:
        return None
    from hicache.kernels import fused, linear

    return types.SimpleNamespace(rmsnorm=fused.rmsnorm, add_rmsnorm=fused.add_rmsnorm, rope=fused.rope,
                                 silu_mul=fused.silu_mul, linear_rows=linear.linear_rows, prefers_rows=linear.prefers)


@functools.cache
def _cpu_kernels():
    """The compiled CPU kernels (`hicache.kernels.cpu`) where they build, else None."""
    from hicache.kernels import cpu

    return cpu if cpu.available() else None


def linear(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T. With `packed` (w prepacked for oneDNN on CPU, `LlamaForCausalLM.use_cpu_kernels`)
    through oneDNN; on CUDA, decode-sized batches go through the Triton few-row kernel where it
    is the faster one (`hicache.kernels.linear.prefers`); everything else through F.linear."""
    if packed is not None:
        return _cpu_kernels().linear(x, packed)
    kernels = _cuda_kernels() if x.is_cuda else None
    if kernels is not None and kernels.prefers_rows(x, w):
        return kernels.linear_rows(x, w)
    return F.linear(x, w)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch path. As HF: normalise in fp32, cast back, then scale in the model dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    cpu: Any = None  # the CPU kernels, once `LlamaForCausalLM.use_cpu_kernels` turned them on

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu is not None and x.dim() == 2:
            return self.cpu.rmsnorm(x, self.weight, self.eps)
        if x.is_cuda and x.dim() == 2 and _cuda_kernels() is not None:  # one launch instead of ~7
            return _cuda_kernels().rmsnorm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add before this norm: (x + delta, norm(x + delta)), one launch on CUDA
        (one call with the CPU kernels)."""
        if self.cpu is not None and x.dim() == 2:
            return self.cpu.add_rmsnorm(x, delta, self.weight, self.eps)
        if x.is_cuda and x.dim() == 2 and _cuda_kernels() is not None:
            return _cuda_kernels().add_rmsnorm(x, delta, self.weight, self.eps)
        total = x + delta
        return total, rms_norm(total, self.weight, self.eps)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, with the config's scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope type {kind!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE with a lazily built fp32 cos/sin cache.

    The cache covers `max(max_position_embeddings, ensure(n))` positions and is built on first use
    on the device of the positions. On CPU a larger position grows it; on CUDA call `ensure(n)`
    before capturing graphs or running past max_position_embeddings (no device sync in forward).
    """

    cpu: Any = None  # the CPU kernels, once `LlamaForCausalLM.use_cpu_kernels` turned them on

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.inv_freq = rope_inv_freq(config)  # [D/2] fp32, CPU
        self.max_positions = config.max_position_embeddings
        self.cos_sin: torch.Tensor | None = None  # [P, D] fp32: cos in [:, :D/2], sin in [:, D/2:]

    def ensure(self, num_positions: int, device: torch.device | str | None = None) -> None:
        self.max_positions = max(self.max_positions, num_positions)
        if device is not None:
            dev = torch.device(device)
        else:
            dev = self.cos_sin.device if self.cos_sin is not None else torch.device("cpu")
        if self.cos_sin is None or self.cos_sin.shape[0] < self.max_positions or self.cos_sin.device != dev:
            t = torch.arange(self.max_positions, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq)
            self.cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dev)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                qk_norm: tuple[RMSNorm, RMSNorm] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64; q [T, Hq, D], k [T, Hk, D] -> rotated (new tensors, input dtype).
        qk_norm: per-head RMSNorms applied to q and k first (one launch with the rotation on CUDA)."""
        if self.cos_sin is None or self.cos_sin.device != positions.device:
            self.ensure(self.max_positions, positions.device)
        if positions.device.type == "cpu" and positions.numel() and int(positions.max()) >= self.cos_sin.shape[0]:
            self.ensure(2 * int(positions.max()) + 1, positions.device)
        if positions.is_cuda and _cuda_kernels() is not None:  # one launch for q and k
            norms = () if qk_norm is None else (qk_norm[0].weight, qk_norm[1].weight, qk_norm[0].eps)
            return _cuda_kernels().rope(positions, q, k, self.cos_sin, *norms)
        if qk_norm is not None:
            q, k = rms_norm(q, qk_norm[0].weight, qk_norm[0].eps), rms_norm(k, qk_norm[1].weight, qk_norm[1].eps)
        if self.cpu is not None:
            return self.cpu.rope(positions, q, k, self.cos_sin)
        cos, sin = self.cos_sin.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class LlamaAttention(nn.Module):
    LINEARS = ("qkv_proj", "o_proj")  # the weights `use_cpu_kernels` prepacks into `packs`

    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = _param(self.q_size + 2 * self.kv_size, config.hidden_size, dtype=dtype, device=device)
        self.o_proj = _param(config.hidden_size, self.q_size, dtype=dtype, device=device)
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size, dtype=dtype, device=device) if config.qkv_bias else None
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device) if config.qk_norm else None
        self.packs: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, batch: Any) -> torch.Tensor:
        T = x.shape[0]
        qkv = linear(x, self.qkv_proj, self.packs.get("qkv_proj"))
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.view(T, self.num_heads, self.head_dim), k.view(T, self.num_kv_heads, self.head_dim)
        q, k = rope(positions, q, k, None if self.q_norm is None else (self.q_norm, self.k_norm))
        out = batch.attn.forward(q, k, v.view(T, self.num_kv_heads, self.head_dim), self.layer_id, batch)
        return linear(out.reshape(T, self.q_size), self.o_proj, self.packs.get("o_proj"))


class LlamaMLP(nn.Module):
    LINEARS = ("gate_up_proj", "down_proj")
    cpu: Any = None

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 intermediate_size: int | None = None):
        super().__init__()
        self.intermediate_size = inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = _param(2 * inter, config.hidden_size, dtype=dtype, device=device)
        self.down_proj = _param(config.hidden_size, inter, dtype=dtype, device=device)
        self.packs: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_proj, self.packs.get("gate_up_proj"))
        down = self.packs.get("down_proj")
        if self.cpu is not None and gate_up.dim() == 2:
            return linear(self.cpu.silu_mul(gate_up), self.down_proj, down)
        if gate_up.is_cuda and gate_up.dim() == 2 and _cuda_kernels() is not None:
            return linear(_cuda_kernels().silu_mul(gate_up), self.down_proj)
        gate, up = gate_up.chunk(2, dim=-1)
        return linear(F.silu(gate) * up, self.down_proj, down)

    def weight_names(self) -> list[str]:
        return ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]

    def target(self, rest: str) -> torch.Tensor | None:
        """The parameter (or the slice of one) that the tensor `mlp.<rest>` fills."""
        i = self.intermediate_size
        return {"gate_proj.weight": self.gate_up_proj[:i], "up_proj.weight": self.gate_up_proj[i:],
                "down_proj.weight": self.down_proj}.get(rest)


def make_mlp(config: ModelConfig, layer_id: int, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """A dense SwiGLU MLP, or the sparse MLP on the layers the MoE config names."""
    moe = config.moe
    if moe is None or not moe.is_sparse(layer_id):
        return LlamaMLP(config, dtype, device)
    shared = LlamaMLP(config, dtype, device, moe.shared_intermediate_size) if moe.shared_intermediate_size else None
    return SparseMoeBlock(config, dtype, device, shared)


def _repack(module: nn.Module, names: tuple[str, ...], kernels: Any, keep: bool = False) -> None:
    """Restores `module`'s packed weights, then, with `kernels`, packs `names` into
    `module.packs` (each parameter's data emptied unless `keep`)."""
    for name, packed in module.packs.items():
        if getattr(module, name).numel() == 0:
            getattr(module, name).data = packed.to_dense()
    module.packs = {}
    for name in names if kernels is not None else ():
        weight = getattr(module, name)
        packed = kernels.pack_linear(weight)
        if packed is not None:
            module.packs[name] = packed
            if not keep:
                weight.data = weight.data.new_empty(0)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(config, layer_id, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp = make_mlp(config, layer_id, dtype, device)

    def forward(self, x: torch.Tensor, normed: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream entering the layer; normed: input_layernorm(x). Returns (stream
        after attention, MLP output): the caller adds the two with the next norm (one launch)."""
        x, normed = self.post_attention_layernorm.add_forward(x, self.self_attn(normed, positions, rope, batch))
        return x, self.mlp(normed)


class LlamaForCausalLM(nn.Module):
    """The whole model. Parameters are created uninitialised (torch.empty) in `dtype` on `device`;
    fill them with `load_weights` or a random init (weights/dummy.py). Norm weights start at 1."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__()
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.embed_tokens = _param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, dtype, device) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head = self.embed_tokens if config.tie_word_embeddings else _param(
            config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.rotary_emb = RotaryEmbedding(config)
        self.packs: dict[str, torch.Tensor] = {}

    def use_cpu_kernels(self, on: bool = True) -> bool:
        """Runs the layers' RMSNorm, RoPE and SiLU-mul on the compiled CPU kernels
        (`hicache.kernels.cpu`) and the linears through oneDNN on weights prepacked now, or, with
        `on` False, back on torch ops. Only a CPU model of float32 or bfloat16 turns them on, and
        only where the kernels build; returns whether they are on. A packed weight replaces its
        parameter's data (left empty, restored when turned off), but for a tied lm_head, which the
        embedding still reads. Call it once the weights are final: `load_weights` turns it off."""
        kernels = _cpu_kernels() if on and self.device.type == "cpu" and self.dtype in (
            torch.float32, torch.bfloat16) else None
        for module in self.modules():
            if isinstance(module, (RMSNorm, RotaryEmbedding, LlamaMLP)):
                module.cpu = kernels
            if hasattr(module, "LINEARS"):
                _repack(module, module.LINEARS, kernels)
        _repack(self, ("lm_head",), kernels, keep=self.config.tie_word_embeddings)
        return kernels is not None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: Any) -> torch.Tensor:
        """input_ids, positions: [T] int64 (all requests' new tokens concatenated), on the model
        device. `batch.attn` is the attention backend. Returns [T, hidden] after the final norm."""
        x = F.embedding(input_ids, self.embed_tokens)
        normed = self.layers[0].input_layernorm(x)
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, next_norm in zip(self.layers, norms):
            x, delta = layer(x, normed, positions, self.rotary_emb, batch)
            x, normed = next_norm.add_forward(x, delta)
        return normed

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32."""
        return linear(hidden, self.lm_head, self.packs.get("lm_head")).float()

    # ---- weights -------------------------------------------------------------------------
    _LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors (`model.layers.3.self_attn.q_proj.weight`, ...) into the fused
        parameters, converting dtype and device. Returns the HF names it consumed; unknown names
        (rotary inv_freq buffers, ...) are skipped. Call `check_loaded` afterwards."""
        self.use_cpu_kernels(False)
        loaded = set()
        experts = self.config.moe.num_experts if self.config.moe is not None else 0
        for name, tensor in weights:
            name = hf_name(name)
            dst = self._target(name)
            if dst is None:
                continue
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not fit {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.update(covered_names(name, experts))
        return loaded

    def expected_weight_names(self) -> set[str]:
        """HF names a complete checkpoint provides for this config."""
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not self.config.tie_word_embeddings:
            names.add("lm_head.weight")
        attn = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"]
        attn += ["q_proj.bias", "k_proj.bias", "v_proj.bias"] if self.config.qkv_bias else []
        attn += ["q_norm.weight", "k_norm.weight"] if self.config.qk_norm else []
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            names |= {p + s for s in ("input_layernorm.weight", "post_attention_layernorm.weight")}
            names |= {p + "self_attn." + s for s in attn} | {p + "mlp." + s for s in layer.mlp.weight_names()}
        return names

    def check_loaded(self, loaded: set[str]) -> None:
        missing = self.expected_weight_names() - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:5]}")

    def _target(self, name: str) -> torch.Tensor | None:
        """The parameter, or the rows of a fused one, that an HF tensor name fills."""
        c = self.config
        if name == "model.embed_tokens.weight":
            return self.embed_tokens
        if name == "lm_head.weight":
            return None if c.tie_word_embeddings else self.lm_head
        if name == "model.norm.weight":
            return self.norm.weight
        m = self._LAYER_RE.match(name)
        if m is None or int(m.group(1)) >= c.num_layers:
            return None
        layer, rest = self.layers[int(m.group(1))], m.group(2)
        if rest.startswith("mlp."):
            return layer.mlp.target(rest[len("mlp."):])
        attn = layer.self_attn
        table = {
            "input_layernorm.weight": layer.input_layernorm.weight,
            "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
            "self_attn.o_proj.weight": attn.o_proj,
        }
        for suffix, fused in (("weight", attn.qkv_proj), ("bias", attn.qkv_bias)):
            if fused is not None:
                table |= {f"self_attn.{p}_proj.{suffix}": part
                          for p, part in zip("qkv", fused.split([c.q_size, c.kv_size, c.kv_size]))}
        if attn.q_norm is not None:
            table |= {"self_attn.q_norm.weight": attn.q_norm.weight, "self_attn.k_norm.weight": attn.k_norm.weight}
        return table.get(rest)
