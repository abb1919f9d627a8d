"""Torch reference attention over a paged KV pool: the CPU path and the oracle for GPU kernels.

Every function checks its inputs strictly and names the offending argument. Shapes:
q [T, Hq, D]; k_buffer / v_buffer [num_slots, Hkv, D]; Hq a multiple of Hkv (grouped-query).
A sliding `window` W (None: full attention) follows HF's convention: the query at position i
sees the keys at positions j with i - W < j <= i, W keys at most, itself included.
"""
from __future__ import annotations

import itertools
from typing import Sequence

import torch
import torch.nn.functional as F


def store_kv(k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Write new tokens' K and V (each [T, Hkv, D]) into slots `loc` ([T] int64)."""
    if loc.dtype != torch.int64 or loc.dim() != 1 or loc.numel() != k.shape[0]:
        raise ValueError(f"loc must be [T] int64 with T={k.shape[0]}, got {tuple(loc.shape)} {loc.dtype}")
    if k.shape != v.shape or k.shape[1:] != k_buffer.shape[1:]:
        raise ValueError(f"k/v shape {tuple(k.shape)}/{tuple(v.shape)} does not fit the pool {tuple(k_buffer.shape)}")
    k_buffer.index_copy_(0, loc, k.to(k_buffer.dtype))
    v_buffer.index_copy_(0, loc, v.to(v_buffer.dtype))


def _check_heads(q: torch.Tensor, k_buffer: torch.Tensor) -> None:
    if q.dim() != 3 or k_buffer.dim() != 3 or q.shape[2] != k_buffer.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k_buffer {tuple(k_buffer.shape)} must be [*, H, D] with equal D")
    if q.shape[1] % k_buffer.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of KV heads {k_buffer.shape[1]}")


def extend_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     token_slots: Sequence[torch.Tensor], extend_lens: Sequence[int],
                     scale: float, window: int | None = None) -> torch.Tensor:
    """Prefill of new tokens that attend to a cached prefix plus themselves, causally.

    token_slots[i]: [prefix_i + extend_i] int64, the slots of request i's whole sequence so far
    (its new tokens' K/V already stored). q holds the requests' new tokens concatenated in order.
    Returns [T, Hq, D] in q's dtype. Requests of one new token (decoding requests beside longer
    chunks) attend in one batched `decode_attention`, the others one by one.
    """
    _check_heads(q, k_buffer)
    if sum(extend_lens) != q.shape[0] or len(token_slots) != len(extend_lens):
        raise ValueError(f"extend_lens sum {sum(extend_lens)} != q tokens {q.shape[0]} or count mismatch")
    out = torch.empty_like(q)
    starts = list(itertools.accumulate(extend_lens, initial=0))
    singles = [i for i, n in enumerate(extend_lens) if n == 1] if extend_lens.count(1) > 1 else []
    if singles:
        table = torch.nn.utils.rnn.pad_sequence([token_slots[i] for i in singles], batch_first=True)
        lens = torch.tensor([token_slots[i].numel() for i in singles], device=q.device)
        at = torch.tensor([starts[i] for i in singles], device=q.device)
        out[at] = decode_attention(q[at], k_buffer, v_buffer, table, lens, scale, window)
    for slots, n, start in zip(token_slots, extend_lens, starts):
        total = slots.numel()
        if n > total:
            raise ValueError(f"extend length {n} exceeds sequence length {total}")
        if n == 1 and singles:
            continue
        qi = q[start:start + n].transpose(0, 1)  # [Hq, n, D]
        ki = k_buffer.index_select(0, slots).transpose(0, 1).to(q.dtype)  # [Hkv, total, D]
        vi = v_buffer.index_select(0, slots).transpose(0, 1).to(q.dtype)
        rows = torch.arange(total - n, total, device=q.device)[:, None]
        cols = torch.arange(total, device=q.device)[None, :]
        mask = cols <= rows  # [n, total]
        if window is not None:
            mask &= cols > rows - window
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:start + n] = o.transpose(0, 1)
    return out


def decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     slot_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     window: int | None = None) -> torch.Tensor:
    """One query token per request over its paged KV.

    q [B, Hq, D]; slot_table [B, L] int64 (row b's first seq_lens[b] entries are request b's
    slots, the rest are ignored); seq_lens [B] int64 >= 1. Returns [B, Hq, D].
    """
    _check_heads(q, k_buffer)
    if slot_table.dim() != 2 or slot_table.shape[0] != q.shape[0] or seq_lens.shape != (q.shape[0],):
        raise ValueError(f"slot_table {tuple(slot_table.shape)} / seq_lens {tuple(seq_lens.shape)} "
                         f"do not match batch {q.shape[0]}")
    batch, max_len = q.shape[0], int(seq_lens.max())
    cols = torch.arange(max_len, device=q.device)[None, :]
    valid = cols < seq_lens[:, None]  # [B, L]
    visible = valid if window is None else valid & (cols >= seq_lens[:, None] - window)
    # index_select on one flat index is several times faster than 2-D advanced indexing on CPU
    flat = slot_table[:, :max_len].masked_fill(~valid, 0).reshape(-1)
    shape = (batch, max_len) + k_buffer.shape[1:]
    k = k_buffer.index_select(0, flat).view(shape).transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
    v = v_buffer.index_select(0, flat).view(shape).transpose(1, 2).to(q.dtype)
    o = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=visible[:, None, None, :],
                                       scale=scale, enable_gqa=True)
    return o[:, :, 0, :]
