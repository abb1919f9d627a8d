"""Torch reference of the mixture-of-experts MLP over routed tokens: the CPU path and the oracle
for the fused Triton kernel (`hicache.kernels.moe`).

For x [T, H], w13 [E, 2I, H] (each expert's gate rows, then its up rows), w2 [E, H, I],
topk_weights [T, K] and topk_ids [T, K] (int64, in 0..E-1):

    out[t] = sum_k topk_weights[t, k] * w2[e] @ (silu(gate_e @ x[t]) * (up_e @ x[t])),  e = topk_ids[t, k]

returned as [T, H] in x's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """Expert by expert over the tokens routed to it: gathered, computed, scattered back."""
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    weights = topk_weights.reshape(-1).to(x.dtype)
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        tokens = pairs // k
        gate, up = F.linear(x[tokens], w13[e]).chunk(2, dim=-1)
        out.index_add_(0, tokens, F.linear(F.silu(gate) * up, w2[e]) * weights[pairs, None])
    return out
