"""Triton linear layer for a few rows (decode steps): out = x @ w.T with x [M <= 16, K], w [N, K].

Needs triton and a CUDA device; import this module lazily (the model does, on CUDA only). At
decode batch sizes a linear layer only streams its weight, and cuBLAS reads the Llama o and down
weights well below the copy bandwidth, where this kernel measured closer to it
(benchmarks/RESULTS.md). One program owns BLOCK_N output columns for every row and walks K in BLOCK_K steps,
several loads of W deep. fp32 accumulation; 16-bit dtypes only. Reference: `torch.nn.functional.linear`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hicache.kernels.checks import on_cuda, pipeline_stages, require

MAX_ROWS = 16
BLOCK_N = 32
BLOCK_K = 256


@triton.jit
def _linear_rows(X, W, Out, M, N, K, stride_xm, stride_wn, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        x = tl.load(X + offs_m[:, None] * stride_xm + ks[None, :], mask=m_mask[:, None] & (ks < K)[None, :], other=0.0)
        w = tl.load(W + offs_n[:, None].to(tl.int64) * stride_wn + ks[None, :],
                    mask=n_mask[:, None] & (ks < K)[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    tl.store(Out + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(Out.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def prefers(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Where this kernel measured faster than cuBLAS on Hopper GPUs: up to 16 rows of bf16/fp16 against a
    contiguous weight no wider than it is deep (o, down; cuBLAS was as fast or faster on q/k/v
    and gate/up)."""
    return (x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.stride(1) == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and w.is_contiguous() and w.shape[0] <= w.shape[1])


def linear_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] (M <= 16, rows contiguous), w [N, K] contiguous, both bf16 or both fp16 -> new [M, N]."""
    device = on_cuda(x=x, w=w)
    require(x.dim() == 2 and x.stride(1) == 1, f"x must be [M, K] with contiguous rows, got {tuple(x.shape)}")
    require(x.shape[0] <= MAX_ROWS, f"x has {x.shape[0]} rows, at most {MAX_ROWS}")
    require(w.dim() == 2 and w.shape[1] == x.shape[1] and w.is_contiguous(),
            f"w must be a contiguous [N, {x.shape[1]}], got {tuple(w.shape)}")
    require(x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16),
            f"x and w must be both bf16 or both fp16, got {x.dtype} and {w.dtype}")
    (m, k), n = x.shape, w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=device)
    if m:  # 2 warps, up to 6 loads of W in flight: the best measured (benchmarks/RESULTS.md)
        stages = pipeline_stages(device, BLOCK_N * BLOCK_K * x.element_size(), (6, 4, 3, 2))
        _linear_rows[(triton.cdiv(n, BLOCK_N),)](x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
                                                 BLOCK_M=MAX_ROWS, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                                                 num_warps=2, num_stages=stages)
    return out
