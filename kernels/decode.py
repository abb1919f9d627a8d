"""Triton decode attention: one query token per request over its paged KV (flash-decoding).

Needs triton and a CUDA device; import this module lazily (the runtime does, on CUDA only).
Stage 1 splits each request's visible keys (the whole sequence, or under a sliding window W its
last W keys: HF's convention) into `num_splits` ranges; one program handles one
(request, KV head, range) and all the query heads of that KV head's group at once (grouped-query
heads share each K/V load). Stage 2 merges the ranges' partial outputs by their log-sum-exp.
Reference: `hicache.kernels.attention.decode_attention` (with slot_table = req_to_token[req_rows]).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hicache.kernels.checks import (dot_precision, heads, index_vector, kv_buffers, num_sms, on_cuda, pipeline_stages,
                                    require)

BLOCK_N = 64
MAX_SPLITS = 64
LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 30  # the window of full attention: wider than any sequence


@triton.jit(do_not_specialize=["num_splits"])  # one build for every split count
def _decode_split(Q, K, V, Table, Rows, SeqLens, PartOut, PartLse, window, scale_log2,
                  stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tr,
                  stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, num_splits,
                  GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                  DOT_PREC: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    row = tl.load(Rows + b).to(tl.int64)
    lo = tl.maximum(seq_len - window, 0)
    split_len = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < GROUP
    q_heads = kvh * GROUP + offs_h
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b.to(tl.int64) * stride_qb + q_heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None], other=0.0)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        slots = tl.load(Table + row * stride_tr + offs_n, mask=n_mask, other=0).to(tl.int64)
        k = tl.load(K + slots[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
                    mask=n_mask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2  # [BLOCK_H, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(V + slots[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
                    mask=n_mask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m = m_new

    has = l > 0
    out = acc / tl.where(has, l, 1.0)[:, None]
    lse = tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("-inf"))
    base_h = b.to(tl.int64) * stride_pb + q_heads * stride_ph + split * stride_ps
    tl.store(PartOut + base_h[:, None] + offs_d[None, :], out, mask=h_mask[:, None])
    tl.store(PartLse + b.to(tl.int64) * stride_lb + q_heads * stride_lh + split, lse, mask=h_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge(PartOut, PartLse, Out, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                  stride_ob, stride_oh, num_splits, SPLITS_P2: tl.constexpr, D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P2)
    s_mask = offs_s < num_splits
    offs_d = tl.arange(0, D)
    lse = tl.load(PartLse + b * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    w = w / tl.sum(w, 0)
    part = tl.load(PartOut + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                   mask=s_mask[:, None], other=0.0)
    out = tl.sum(part * w[:, None], 0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty))


def default_num_splits(batch: int, num_kv_heads: int, max_len: int, num_sms: int) -> int:
    """Enough (request, head, range) programs to fill the GPU about twice, at least a block each."""
    by_len = triton.cdiv(max_len, BLOCK_N)
    by_occupancy = triton.cdiv(2 * num_sms, batch * num_kv_heads)
    return max(1, min(by_len, by_occupancy, MAX_SPLITS))


def decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     req_to_token: torch.Tensor, req_rows: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, num_splits: int | None = None, out: torch.Tensor | None = None,
                     window: int | None = None) -> torch.Tensor:
    """q [B, Hq, D]; k/v_buffer [slots, Hkv, D] (q's dtype); req_to_token [R, C] int32/int64 (row
    r lists request r's slots in order); req_rows [B], seq_lens [B] (>= 1, <= C). Returns [B, Hq, D]
    (into `out` if given). `num_splits` fixed (CUDA graphs) or None: picked from seq_lens (syncs).
    window: a sliding window W >= 1 (the last W keys), or None."""
    device = on_cuda(q=q, k_buffer=k_buffer, v_buffer=v_buffer, req_to_token=req_to_token,
                     req_rows=req_rows, seq_lens=seq_lens)
    kv_buffers(k_buffer, v_buffer)
    group = heads(q, k_buffer)
    batch, num_heads, d = q.shape
    index_vector("req_rows", req_rows, batch)
    index_vector("seq_lens", seq_lens, batch)
    require(req_to_token.dim() == 2 and req_to_token.stride(1) == 1
            and req_to_token.dtype in (torch.int32, torch.int64),
            f"req_to_token must be [R, C] int32/int64 with contiguous rows, "
            f"got {tuple(req_to_token.shape)} {req_to_token.dtype}")
    if num_splits is None:
        max_len = int(seq_lens.max()) if batch else 1
        num_splits = default_num_splits(batch, k_buffer.shape[1], max_len, num_sms(device))
    require(1 <= num_splits <= MAX_SPLITS, f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    require(window is None or window >= 1, f"window must be None or >= 1, got {window}")
    if out is None:
        out = torch.empty_like(q)
    require(out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, "out must be like q")
    if batch == 0:
        return out
    part_out = torch.empty((batch, num_heads, num_splits, d), dtype=torch.float32, device=device)
    part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=device)
    block_h = max(16, triton.next_power_of_2(group))
    block_n = 32 if q.dtype == torch.float32 and d > 64 else BLOCK_N
    # 2 warps, 3 stages: the best of a parameter sweep
    stages = pipeline_stages(device, 2 * block_n * d * q.element_size(), (3, 2))
    _decode_split[(batch, k_buffer.shape[1], num_splits)](
        q, k_buffer, v_buffer, req_to_token, req_rows, seq_lens, part_out, part_lse,
        NO_WINDOW if window is None else window, scale * LOG2E,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0), part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), num_splits,
        GROUP=group, BLOCK_H=block_h, D=d, BLOCK_N=block_n, DOT_PREC=dot_precision(q.dtype),
        num_warps=2, num_stages=stages)
    _decode_merge[(batch, num_heads)](
        part_out, part_lse, out, part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1), num_splits,
        SPLITS_P2=triton.next_power_of_2(num_splits), D=d, num_warps=4)
    return out
