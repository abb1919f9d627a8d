"""Triton KV store: write the new tokens' K and V into their pool slots, one launch for both.

Needs triton and a CUDA device; import this module lazily. Reference:
`hicache.kernels.attention.store_kv`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hicache.kernels.checks import index_vector, kv_buffers, on_cuda, require

BLOCK = 1024


@triton.jit
def _store(K, V, KBuf, VBuf, Loc, stride_kt, stride_vt, stride_buf, ROW: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < ROW
    slot = tl.load(Loc + t).to(tl.int64)
    k = tl.load(K + t * stride_kt + offs, mask=mask)
    v = tl.load(V + t * stride_vt + offs, mask=mask)
    tl.store(KBuf + slot * stride_buf + offs, k.to(KBuf.dtype.element_ty), mask=mask)
    tl.store(VBuf + slot * stride_buf + offs, v.to(VBuf.dtype.element_ty), mask=mask)


def store_kv(k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """k, v [T, Hkv, D] (each token's heads contiguous; rows may be strided, as a view of a fused
    qkv projection) into slots `loc` [T] of k/v_buffer [slots, Hkv, D] (cast to the pool dtype)."""
    on_cuda(k_buffer=k_buffer, v_buffer=v_buffer, loc=loc, k=k, v=v)
    kv_buffers(k_buffer, v_buffer)
    index_vector("loc", loc, k.shape[0])
    require(k.shape == v.shape and k.dim() == 3 and k.shape[1:] == k_buffer.shape[1:],
            f"k/v shape {tuple(k.shape)}/{tuple(v.shape)} does not fit the pool {tuple(k_buffer.shape)}")
    d = k.shape[2]
    for name, t in (("k", k), ("v", v)):
        require(t.stride(2) == 1 and t.stride(1) == d, f"{name}'s heads must be contiguous within a token")
    if k.shape[0] == 0:
        return
    row = k.shape[1] * d
    _store[(k.shape[0], triton.cdiv(row, BLOCK))](
        k, v, k_buffer, v_buffer, loc, k.stride(0), v.stride(0), k_buffer.stride(0),
        ROW=row, BLOCK=min(BLOCK, triton.next_power_of_2(row)), num_warps=4)
