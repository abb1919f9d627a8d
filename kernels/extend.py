"""Triton extend attention: new tokens attend to a cached prefix plus themselves (causal), paged.

Needs triton and a CUDA device; import this module lazily (the runtime does, on CUDA only).
One program handles BLOCK_M new tokens of one request for one query head. All keys (the prefix
and the new tokens, whose K/V are already stored) are read through the request-to-token table;
blocks that every row sees whole skip the mask, the rest apply it. With a sliding window W (HF's
convention: the query at position i sees keys i - W < j <= i) the blocks wholly before every
row's window are skipped, and those that cut some row's window are masked.
Reference: `hicache.kernels.attention.extend_attention`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hicache.kernels.checks import dot_precision, heads, index_vector, kv_buffers, on_cuda, require

LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 30  # the window of full attention: wider than any sequence


@triton.jit
def _attend(acc, m, l, q, K, V, Table, row, kvh, n0, q_pos, kv_end, window, scale_log2,
            stride_ks, stride_kh, stride_vs, stride_vh, stride_tr,
            D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_PREC: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    if MASKED:
        n_mask = offs_n < kv_end
        slots = tl.load(Table + row * stride_tr + offs_n, mask=n_mask, other=0).to(tl.int64)
        k = tl.load(K + slots[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        v = tl.load(V + slots[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=n_mask[:, None], other=0.0)
    else:
        slots = tl.load(Table + row * stride_tr + offs_n).to(tl.int64)
        k = tl.load(K + slots[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :])
        v = tl.load(V + slots[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :])
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2  # [BLOCK_M, BLOCK_N]
    if MASKED:
        ok = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] > q_pos[:, None] - window) & n_mask[None, :]
        s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet (window)
    alpha = tl.exp2(m - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l


@triton.jit(do_not_specialize=["NUM_M_BLOCKS"])  # one build for every prompt length
def _extend(Q, K, V, Out, Table, Rows, PrefixLens, ExtendLens, QStarts, window, scale_log2,
            stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tr, stride_ot, stride_oh,
            NUM_M_BLOCKS, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            DOT_PREC: tl.constexpr):
    mb = NUM_M_BLOCKS - 1 - tl.program_id(0)  # the longest (last) blocks start first
    h = tl.program_id(1)
    r = tl.program_id(2)
    ext = tl.load(ExtendLens + r).to(tl.int32)
    prefix = tl.load(PrefixLens + r).to(tl.int32)
    q0 = tl.load(QStarts + r).to(tl.int64)
    row = tl.load(Rows + r).to(tl.int64)
    kvh = h // GROUP
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < ext
    offs_d = tl.arange(0, D)
    q = tl.load(Q + (q0 + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=m_mask[:, None],
                other=0.0)
    q_pos = prefix + offs_m  # absolute position of each new token: it sees keys 0..q_pos

    live = mb * BLOCK_M < ext
    kv_end = tl.where(live, prefix + tl.minimum((mb + 1) * BLOCK_M, ext), 0)
    full_end = tl.where(live, (prefix + mb * BLOCK_M + 1) // BLOCK_N * BLOCK_N, 0)  # keys every row sees
    # the window: keys before lo are out of every row's window; from win_full on, in every row's
    first_pos = prefix + mb * BLOCK_M
    lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
    win_full = tl.cdiv(tl.maximum(kv_end - window, 0), BLOCK_N) * BLOCK_N
    open_lo = tl.maximum(lo, tl.minimum(win_full, full_end))
    open_hi = tl.maximum(open_lo, full_end)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for n0 in range(lo, open_lo, BLOCK_N):
        acc, m, l = _attend(acc, m, l, q, K, V, Table, row, kvh, n0, q_pos, kv_end, window, scale_log2,
                            stride_ks, stride_kh, stride_vs, stride_vh, stride_tr, D, BLOCK_N, True, DOT_PREC)
    for n0 in range(open_lo, open_hi, BLOCK_N):
        acc, m, l = _attend(acc, m, l, q, K, V, Table, row, kvh, n0, q_pos, kv_end, window, scale_log2,
                            stride_ks, stride_kh, stride_vs, stride_vh, stride_tr, D, BLOCK_N, False, DOT_PREC)
    for n0 in range(open_hi, kv_end, BLOCK_N):
        acc, m, l = _attend(acc, m, l, q, K, V, Table, row, kvh, n0, q_pos, kv_end, window, scale_log2,
                            stride_ks, stride_kh, stride_vs, stride_vh, stride_tr, D, BLOCK_N, True, DOT_PREC)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(Out + (q0 + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=m_mask[:, None])


def launch_config(dtype: torch.dtype, head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a dtype and head size."""
    if head_dim > 128:  # (Gemma 3: 256) smaller tiles, so that the pipelined K/V tiles fit in shared memory
        return (32, 32, 4, 2) if dtype == torch.float32 else (64, 32, 4, 2)
    if dtype == torch.float32:
        return 64, 32, 4, 2
    return 128, 64, 4, 3  # the best of a parameter sweep at head_dim 128 (benchmarks/RESULTS.md)


def extend_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     req_to_token: torch.Tensor, req_rows: torch.Tensor, prefix_lens: torch.Tensor,
                     extend_lens: torch.Tensor, q_starts: torch.Tensor, max_extend: int, scale: float,
                     out: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """q [T, Hq, D]: the requests' new tokens concatenated, request i's at q_starts[i]..+extend_lens[i];
    k/v_buffer [slots, Hkv, D] holding the prefix and the new tokens' K/V; req_to_token [R, C]
    (row req_rows[i] lists request i's slots, prefix first); prefix_lens, extend_lens, q_starts [N]
    on the device; max_extend >= max(extend_lens) (host int, sizes the grid); window: a sliding
    window W >= 1, or None. Returns [T, Hq, D]."""
    on_cuda(q=q, k_buffer=k_buffer, v_buffer=v_buffer, req_to_token=req_to_token, req_rows=req_rows,
            prefix_lens=prefix_lens, extend_lens=extend_lens, q_starts=q_starts)
    kv_buffers(k_buffer, v_buffer)
    group = heads(q, k_buffer)
    n = req_rows.numel()
    for name, t in (("req_rows", req_rows), ("prefix_lens", prefix_lens), ("extend_lens", extend_lens),
                    ("q_starts", q_starts)):
        index_vector(name, t, n)
    require(req_to_token.dim() == 2 and req_to_token.stride(1) == 1
            and req_to_token.dtype in (torch.int32, torch.int64),
            f"req_to_token must be [R, C] int32/int64 with contiguous rows, "
            f"got {tuple(req_to_token.shape)} {req_to_token.dtype}")
    require(max_extend >= 0, f"max_extend must be >= 0, got {max_extend}")
    require(window is None or window >= 1, f"window must be None or >= 1, got {window}")
    if out is None:
        out = torch.empty_like(q)
    require(out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, "out must be like q")
    if n == 0 or max_extend == 0:
        return out
    d = q.shape[2]
    block_m, block_n, warps, stages = launch_config(q.dtype, d)
    num_m = triton.cdiv(max_extend, block_m)
    _extend[(num_m, q.shape[1], n)](
        q, k_buffer, v_buffer, out, req_to_token, req_rows, prefix_lens, extend_lens, q_starts,
        NO_WINDOW if window is None else window, scale * LOG2E,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0), out.stride(0), out.stride(1), num_m,
        GROUP=group, D=d, BLOCK_M=block_m, BLOCK_N=block_n, DOT_PREC=dot_precision(q.dtype),
        num_warps=warps, num_stages=stages)
    return out
