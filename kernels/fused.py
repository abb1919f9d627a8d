"""Fused Triton kernels of the Llama layer: RMSNorm (alone or after the residual add), rotary
embedding (optionally after a per-head RMSNorm of q and k), SiLU-and-multiply.

Needs triton and a CUDA device; import this module lazily (the model does, on CUDA only). They
replace chains of small torch ops (RMSNorm: ~7 kernels, RoPE of q and k: ~18, SiLU-mul: 2), which
dominate a decode step's kernel count. Numerics follow the torch code in
`hicache.runtime.models.llama` (itself HF's): RMSNorm normalises in fp32, rounds to the input
dtype, then scales by the weight; RoPE (rotate-half) computes in fp32 from an fp32
[positions, D] cos|sin table and rounds once; SiLU rounds to the dtype before the product.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hicache.kernels.checks import on_cuda, require


@triton.jit
def _rmsnorm(X, W, Out, stride_x, stride_o, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, 0) / n
    normed = (x * tl.rsqrt(var + eps)).to(Out.dtype.element_ty)
    w = tl.load(W + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(Out.dtype.element_ty)
    tl.store(Out + row * stride_o + cols, out, mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] (rows contiguous), weight [H] of x's dtype -> new [T, H]."""
    on_cuda(x=x, weight=weight)
    require(x.dim() == 2 and x.stride(1) == 1, f"x must be [T, H] with contiguous rows, got {tuple(x.shape)}")
    require(weight.shape == (x.shape[1],) and weight.dtype == x.dtype and weight.is_contiguous(),
            f"weight must be [{x.shape[1]}] {x.dtype}, got {tuple(weight.shape)} {weight.dtype}")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.shape[0]:
        block = triton.next_power_of_2(x.shape[1])
        _rmsnorm[(x.shape[0],)](x, weight, out, x.stride(0), out.stride(0), x.shape[1], eps, BLOCK=block,
                                num_warps=min(16, max(1, block // 256)))
    return out


@triton.jit
def _add_rmsnorm(X, Delta, W, Sum, Out, stride_x, stride_d, stride_s, stride_o, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(Delta + row * stride_d + cols, mask=mask, other=0.0).to(tl.float32)
    total = (x + d).to(Sum.dtype.element_ty)
    tl.store(Sum + row * stride_s + cols, total, mask=mask)
    t = total.to(tl.float32)
    normed = (t * tl.rsqrt(tl.sum(t * t, 0) / n + eps)).to(Out.dtype.element_ty)
    w = tl.load(W + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(Out.dtype.element_ty)
    tl.store(Out + row * stride_o + cols, out, mask=mask)


def add_rmsnorm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next RMSNorm in one launch: returns (x + delta rounded to x's
    dtype, rmsnorm of that), both new [T, H]. x, delta [T, H] with contiguous rows."""
    on_cuda(x=x, delta=delta, weight=weight)
    require(x.dim() == 2 and x.stride(1) == 1, f"x must be [T, H] with contiguous rows, got {tuple(x.shape)}")
    require(delta.shape == x.shape and delta.dtype == x.dtype and delta.stride(1) == 1,
            f"delta must be like x {tuple(x.shape)} {x.dtype}, got {tuple(delta.shape)} {delta.dtype}")
    require(weight.shape == (x.shape[1],) and weight.dtype == x.dtype and weight.is_contiguous(),
            f"weight must be [{x.shape[1]}] {x.dtype}, got {tuple(weight.shape)} {weight.dtype}")
    total = torch.empty_like(x, memory_format=torch.contiguous_format)
    out = torch.empty_like(total)
    if x.shape[0]:
        block = triton.next_power_of_2(x.shape[1])
        _add_rmsnorm[(x.shape[0],)](x, delta, weight, total, out, x.stride(0), delta.stride(0), total.stride(0),
                                    out.stride(0), x.shape[1], eps, BLOCK=block,
                                    num_warps=min(16, max(1, block // 256)))
    return total, out


@triton.jit
def _rotate_heads(X, Out, W, eps, cos, sin, t, stride_xt, stride_xh, stride_ot, stride_oh, num_heads,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, NORM: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, HALF)
    mask = (heads < num_heads)[:, None]
    base = X + t * stride_xt + heads[:, None] * stride_xh + cols[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:  # each head's RMSNorm first, rounded as the torch code rounds
        r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(W + cols).to(tl.float32)[None, :]
        w2 = tl.load(W + HALF + cols).to(tl.float32)[None, :]
        x1 = (w1 * (x1 * r).to(Out.dtype.element_ty).to(tl.float32)).to(Out.dtype.element_ty).to(tl.float32)
        x2 = (w2 * (x2 * r).to(Out.dtype.element_ty).to(tl.float32)).to(Out.dtype.element_ty).to(tl.float32)
    first = x1 * cos[None, :] - x2 * sin[None, :]
    second = x2 * cos[None, :] + x1 * sin[None, :]
    out = Out + t * stride_ot + heads[:, None] * stride_oh + cols[None, :]
    tl.store(out, first.to(Out.dtype.element_ty), mask=mask)
    tl.store(out + HALF, second.to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _rope(Q, K, QOut, KOut, CosSin, Pos, QW, KW, eps, stride_qt, stride_qh, stride_kt, stride_kh,
          stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs, num_q_heads, num_k_heads,
          HALF: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + t).to(tl.int64)
    cols = tl.arange(0, HALF)
    cos = tl.load(CosSin + pos * stride_cs + cols)
    sin = tl.load(CosSin + pos * stride_cs + HALF + cols)
    _rotate_heads(Q, QOut, QW, eps, cos, sin, t, stride_qt, stride_qh, stride_qot, stride_qoh, num_q_heads, HALF,
                  BLOCK_QH, NORM)
    _rotate_heads(K, KOut, KW, eps, cos, sin, t, stride_kt, stride_kh, stride_kot, stride_koh, num_k_heads, HALF,
                  BLOCK_KH, NORM)


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor,
         q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
         eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int; q [T, Hq, D], k [T, Hk, D] (each head contiguous; rows may be strided);
    cos_sin [P, D] fp32 (cos in [:, :D/2], sin in [:, D/2:]), P > every position (not checked:
    that would sync). Returns rotated contiguous copies in q's / k's dtype. With q_weight and
    k_weight ([D], q's dtype), each head is RMS-normalised (Qwen3's q/k norm) before rotating."""
    on_cuda(positions=positions, q=q, k=k, cos_sin=cos_sin)
    require(q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] == positions.numel()
            and q.shape[2] == k.shape[2],
            f"q {tuple(q.shape)}, k {tuple(k.shape)} and positions {tuple(positions.shape)} do not fit")
    d = q.shape[2]
    require(d >= 4 and d & (d - 1) == 0, f"head_dim must be a power of two, got {d}")
    require(q.stride(2) == 1 and k.stride(2) == 1, "q and k heads must be contiguous")
    require(cos_sin.dtype == torch.float32 and cos_sin.dim() == 2 and cos_sin.shape[1] == d and cos_sin.stride(1) == 1,
            f"cos_sin must be [P, {d}] float32, got {tuple(cos_sin.shape)} {cos_sin.dtype}")
    require(positions.dim() == 1 and positions.dtype in (torch.int32, torch.int64) and positions.is_contiguous(),
            "positions must be a contiguous 1-D int tensor")
    norm = q_weight is not None
    if norm:
        for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
            require(w is not None and w.shape == (d,) and w.dtype == q.dtype and w.is_contiguous(),
                    f"{name} must be [{d}] {q.dtype}")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if q.shape[0]:
        _rope[(q.shape[0],)](q, k, q_out, k_out, cos_sin, positions, q_weight if norm else q, k_weight if norm else k,
                             eps, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                             q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin.stride(0),
                             q.shape[1], k.shape[1], HALF=d // 2, BLOCK_QH=triton.next_power_of_2(q.shape[1]),
                             BLOCK_KH=triton.next_power_of_2(k.shape[1]), NORM=norm, num_warps=4)
    return q_out, k_out


@triton.jit
def _silu_mul(X, Out, stride_x, stride_o, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (act * up).to(Out.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = gate | up (rows contiguous) -> silu(gate) * up, new [T, I]."""
    on_cuda(x=x)
    require(x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(1) == 1,
            f"x must be [T, 2I] with contiguous rows, got {tuple(x.shape)}")
    n = x.shape[1] // 2
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    if x.shape[0]:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul[(x.shape[0], triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n, BLOCK=block, num_warps=4)
    return out
