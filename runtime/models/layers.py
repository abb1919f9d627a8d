"""The layers' building blocks shared by the model families: linear (with the few-row Triton kernel
on CUDA, and on CPU oneDNN on prepacked weights or, for few rows, the weights' GGUF blocks),
RMSNorm, RoPE (default, linear, llama3, GGUF freq factors), and the packing of weights for the
compiled CPU kernels (`hicache.kernels.cpu`).

Each block picks its path at run time: the Triton kernels on CUDA where triton is installed, the
compiled CPU kernels once a model's `use_cpu_kernels` turned them on, else torch ops.
"""
from __future__ import annotations

import functools
import importlib.util
import math
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hicache.runtime.model_config import ModelConfig, yarn_mscale


@functools.cache
def cuda_kernels():
    """The layer's Triton kernels (RMSNorm, add + RMSNorm, RoPE, SiLU-mul, few-row linear) where
    triton is installed, else None."""
    if importlib.util.find_spec("triton") is None:
        return None
    from hicache.kernels import fused, linear

    return types.SimpleNamespace(rmsnorm=fused.rmsnorm, add_rmsnorm=fused.add_rmsnorm, rope=fused.rope,
                                 silu_mul=fused.silu_mul, linear_rows=linear.linear_rows, prefers_rows=linear.prefers)


@functools.cache
def cpu_kernels():
    """The compiled CPU kernels (`hicache.kernels.cpu`) where they build, else None."""
    from hicache.kernels import cpu

    return cpu if cpu.available() else None


def linear(x: torch.Tensor, w: torch.Tensor, packed: Any = None) -> torch.Tensor:
    """x @ w.T. With `packed` (w prepacked on CPU, `LlamaForCausalLM.use_cpu_kernels`) through
    oneDNN, or for few rows the weight's exact GGUF blocks where it has them; on CUDA,
    decode-sized batches go through the Triton few-row kernel where it is the faster one
    (`hicache.kernels.linear.prefers`); everything else through F.linear."""
    if packed is not None:
        return cpu_kernels().linear(x, packed)
    kernels = cuda_kernels() if x.is_cuda else None
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
        if x.is_cuda and x.dim() == 2 and cuda_kernels() is not None:  # one launch instead of ~7
            return cuda_kernels().rmsnorm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add before this norm: (x + delta, norm(x + delta)), one launch on CUDA
        (one call with the CPU kernels)."""
        if self.cpu is not None and x.dim() == 2:
            return self.cpu.add_rmsnorm(x, delta, self.weight, self.eps)
        if x.is_cuda and x.dim() == 2 and cuda_kernels() is not None:
            return cuda_kernels().add_rmsnorm(x, delta, self.weight, self.eps)
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
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, dim, config.rope_theta, scaling)
    raise ValueError(f"unsupported rope type {kind!r}")


def rope_attention_factor(config: ModelConfig) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor (given, or mscale(factor,
    mscale) / mscale(factor, mscale_all_dim)), 1 for other RoPE types."""
    s = config.rope_scaling
    if s is None or s["rope_type"] != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor, mscale, all_dim = float(s["factor"]), s.get("mscale"), s.get("mscale_all_dim")
    if mscale and all_dim:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(all_dim))
    return yarn_mscale(factor)


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, base: float, s: dict) -> torch.Tensor:
    """As HF's YaRN: interpolated (divided by factor) below the correction range, extrapolated
    (unchanged) above it, a linear ramp between."""
    factor, old_len = float(s["factor"]), float(s["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(float(s.get("beta_fast") or 32)), correction_dim(float(s.get("beta_slow") or 1))
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    extrapolation = 1 - ramp
    return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation


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
        self.attention_factor = rope_attention_factor(config)
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
            self.cos_sin = (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * self.attention_factor).to(dev)

    def cover(self, positions: torch.Tensor) -> None:
        """The cache on the positions' device, grown on CPU to hold them."""
        if self.cos_sin is None or self.cos_sin.device != positions.device:
            self.ensure(self.max_positions, positions.device)
        if positions.device.type == "cpu" and positions.numel() and int(positions.max()) >= self.cos_sin.shape[0]:
            self.ensure(2 * int(positions.max()) + 1, positions.device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                qk_norm: tuple[RMSNorm, RMSNorm] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64; q [T, Hq, D], k [T, Hk, D] -> rotated (new tensors, input dtype).
        qk_norm: per-head RMSNorms applied to q and k first (one launch with the rotation on CUDA)."""
        self.cover(positions)
        if positions.is_cuda and cuda_kernels() is not None:  # one launch for q and k
            norms = () if qk_norm is None else (qk_norm[0].weight, qk_norm[1].weight, qk_norm[0].eps)
            return cuda_kernels().rope(positions, q, k, self.cos_sin, *norms)
        if qk_norm is not None:
            q, k = rms_norm(q, qk_norm[0].weight, qk_norm[0].eps), rms_norm(k, qk_norm[1].weight, qk_norm[1].eps)
        if self.cpu is not None:
            return self.cpu.rope(positions, q, k, self.cos_sin)
        cos, sin = self.cos_sin.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def repack(module: nn.Module, names: tuple[str, ...], kernels: Any, keep: bool = False,
           quantized: bool = False) -> None:
    """Restores `module`'s packed weights, then, with `kernels`, packs `names` into
    `module.packs` (each parameter's data emptied unless `keep`); with `quantized`, each also in
    the GGUF blocks that hold its values exactly, where there are such (`kernels.pack_linear`)."""
    for name, packed in module.packs.items():
        if getattr(module, name).numel() == 0:
            getattr(module, name).data = packed.dense.to_dense()
    module.packs = {}
    for name in names if kernels is not None else ():
        weight = getattr(module, name)
        packed = kernels.pack_linear(weight, quantized)
        if packed is not None:
            module.packs[name] = packed
            if not keep:
                weight.data = weight.data.new_empty(0)
