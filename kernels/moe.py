"""Fused mixture-of-experts MLP in Triton: a grouped GEMM over tokens sorted by expert.

Computes what `hicache.kernels.experts.moe_reference` computes (same arguments and result). The
T*K (token, k) pairs are sorted by expert into blocks of `block_m` rows, each expert's run padded
to whole blocks (`align`). One launch of `_moe_gemm` multiplies each block by its expert's gate
and up rows and applies SiLU-mul; a second multiplies by the expert's down matrix and the
routing weight; a sum over k finishes. Nothing waits for the host: grids are sized for the worst
case and blocks past the padded end exit at once, so the path is CUDA-graph safe.

Needs triton and a CUDA device (or the interpreter); import this module lazily.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from hicache.kernels.checks import dot_precision, on_cuda, require


class Tiles(NamedTuple):
    """Launch shape of the grouped GEMM (both launches)."""
    block_m: int  # rows of a block: each expert's run is padded to a multiple
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def default_tiles(num_pairs: int, num_experts: int) -> Tiles:
    """Small blocks when experts get few rows each (decode), larger ones for prefill."""
    if num_pairs <= 4 * num_experts:
        return Tiles(16, 64, 64)
    return Tiles(64, 64, 64)


class Alignment(NamedTuple):
    sorted_pairs: torch.Tensor  # [P] int32: pair ids (t * K + k) grouped by expert; T * K marks padding
    block_expert: torch.Tensor  # [P // block_m] int32: the expert of each block of rows
    num_padded: torch.Tensor  # [1] int32: rows in use; blocks from there on exit


@triton.jit
def _count(Ids, Counts, Rank, n, BLOCK: tl.constexpr):
    """Rank[i] = how many pairs before this one (in atomic order) chose the same expert."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    expert = tl.load(Ids + i, mask=mask, other=0)
    tl.store(Rank + i, tl.atomic_add(Counts + expert, 1, mask=mask), mask=mask)


@triton.jit
def _offsets(Counts, Starts, BlockExpert, NumPadded, num_experts, num_blocks, block_m,
             BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr):
    """One program: each expert's first row (runs padded to whole blocks), each block's expert."""
    e = tl.arange(0, BLOCK_E)
    counts = tl.load(Counts + e, mask=e < num_experts, other=0)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = tl.cumsum(padded, 0)
    tl.store(Starts + e, ends - padded, mask=e < num_experts)
    tl.store(NumPadded, tl.sum(padded, 0))
    for b0 in range(0, num_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        row = b * block_m
        expert = tl.sum((ends[None, :] <= row[:, None]) & (e[None, :] < num_experts), 1)
        tl.store(BlockExpert + b, tl.minimum(expert, num_experts - 1), mask=b < num_blocks)


@triton.jit
def _place(Ids, Rank, Starts, Sorted, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    expert = tl.load(Ids + i, mask=mask, other=0)
    slot = tl.load(Starts + expert, mask=mask, other=0) + tl.load(Rank + i, mask=mask, other=0)
    tl.store(Sorted + slot, i, mask=mask)


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Pairs grouped by expert (in no particular order within an expert), each expert's run padded
    to a multiple of block_m: three small launches, no host sync."""
    flat = topk_ids.reshape(-1).to(torch.int32)
    n, dev = flat.numel(), flat.device
    size = -(-(n + min(num_experts, n) * (block_m - 1)) // block_m) * block_m
    sorted_pairs = torch.full((size,), n, dtype=torch.int32, device=dev)
    block_expert = torch.empty(size // block_m, dtype=torch.int32, device=dev)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=dev)  # the last: the padded total
    starts, rank = torch.empty(num_experts, dtype=torch.int32, device=dev), torch.empty_like(flat)
    if n:
        block = 1024
        _count[(triton.cdiv(n, block),)](flat, counts, rank, n, BLOCK=block)
        _offsets[(1,)](counts, starts, block_expert, counts[num_experts:], num_experts, size // block_m, block_m,
                       BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_B=64)
        _place[(triton.cdiv(n, block),)](flat, rank, starts, sorted_pairs, n, BLOCK=block)
    return Alignment(sorted_pairs, block_expert, counts[num_experts:])


@triton.jit
def _moe_gemm(A, B, C, Weights, Pairs, BlockExpert, NumPadded, num_pairs, n, k, a_div,
              stride_a, stride_be, stride_bn, stride_c,
              GATED: tl.constexpr, WEIGHTED: tl.constexpr, PRECISION: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[pair, :n] = act(A[pair // a_div] @ B[e, :n].T) (times the pair's weight when WEIGHTED);
    GATED: B[e] holds 2n rows (gate, then up) and act is silu(gate) * up."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(NumPadded):
        return
    pairs = tl.load(Pairs + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = (pairs // a_div).to(tl.int64)
    expert = tl.load(BlockExpert + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = A + rows[:, None] * stride_a + ks[None, :]
    b_ptrs = B + expert * stride_be + cols[None, :].to(tl.int64) * stride_bn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kmask = k0 + ks < k
        a = tl.load(a_ptrs, mask=valid[:, None] & kmask[None, :], other=0.0)
        bmask = kmask[:, None] & (cols[None, :] < n)
        acc = tl.dot(a, tl.load(b_ptrs, mask=bmask, other=0.0), acc, input_precision=PRECISION)
        if GATED:
            up = tl.load(b_ptrs + n * stride_bn, mask=bmask, other=0.0)
            acc_up = tl.dot(a, up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if GATED:  # rounded to the dtype before the product, as the torch path rounds
        gate = (acc / (1.0 + tl.exp(-acc))).to(C.dtype.element_ty).to(tl.float32)
        acc = gate * acc_up.to(C.dtype.element_ty).to(tl.float32)
    if WEIGHTED:
        acc = acc * tl.load(Weights + pairs, mask=valid, other=0.0)[:, None]
    c_ptrs = C + pairs[:, None].to(tl.int64) * stride_c + cols[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < n))


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, tiles: Tiles | None = None) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, K], topk_ids [T, K] -> [T, H] in
    x's dtype. tiles: the launch shape, by default `default_tiles`."""
    on_cuda(x=x, w13=w13, w2=w2, topk_ids=topk_ids)
    t, h = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    require(w13.dim() == 3 and w13.shape[2] == h and tuple(w2.shape) == (num_experts, h, inter),
            f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)}")
    require(x.dtype == w13.dtype == w2.dtype, f"dtypes differ: x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}")
    require(x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1, "x, w13 and w2 need a contiguous last dim")
    require(topk_weights.shape == topk_ids.shape and topk_ids.shape[0] == t,
            f"topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} must be [{t}, K]")
    k = topk_ids.shape[1]
    n = t * k
    tiles = tiles or default_tiles(n, num_experts)
    al = align(topk_ids, num_experts, tiles.block_m)
    weights = topk_weights.reshape(-1).float().contiguous()
    act = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    _launch(x, w13, act, weights, al, k, inter, h, True, tiles)
    out = torch.empty(n, h, dtype=x.dtype, device=x.device)
    _launch(act, w2, out, weights, al, 1, h, inter, False, tiles)
    return out.view(t, k, h).sum(dim=1)


def _launch(a, b, c, weights, al: Alignment, a_div: int, n: int, k: int, gated: bool, tiles: Tiles) -> None:
    blocks = al.sorted_pairs.numel() // tiles.block_m
    if blocks == 0:
        return
    _moe_gemm[(blocks, triton.cdiv(n, tiles.block_n))](
        a, b, c, weights, al.sorted_pairs, al.block_expert, al.num_padded, c.shape[0], n, k, a_div,
        a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        GATED=gated, WEIGHTED=not gated, PRECISION=dot_precision(a.dtype),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages)
