"""The latent attention backend of multi-head latent attention (DeepSeek-V2's MLA): the torch
reference, on any device.

The L1 pool of an MLA model has one "head" per token whose K holds the first half of the token's
latent (kv_lora_rank + qk_rope_head_dim values: normed latent, then the rotated RoPE key) and V
the second half (`ModelConfig.cache_head_dim`), so that L1, L2, L3 and the copies between them
carry the latent as they carry K and V, at its size. Attention is absorbed (as FlashMLA's): the
query comes already multiplied into the latent space (`models/deepseek.py`), every head scores
the same latents, and the output is the weighted latents' first kv_lora_rank values.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hicache.kernels.attention import store_kv

if TYPE_CHECKING:
    from hicache.runtime.batch import ForwardBatch


class LatentAttention:
    """Stores the new tokens' latents at `batch.out_cache_loc` and attends over each request's
    slots (`batch.token_slots` for extend, `slot_table` / `seq_lens` for decode)."""

    graphs = False  # it syncs with the host

    def __init__(self, kv_lora_rank: int, scale: float):
        self.kv_lora_rank, self.scale = kv_lora_rank, scale

    def forward(self, q: torch.Tensor, latent: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        """q [T, H, W] (absorbed), latent [T, W] for the batch's T new tokens, W = kv_lora_rank +
        qk_rope_head_dim, in the pool's dtype on its device. Returns [T, H, kv_lora_rank]."""
        k_buf, v_buf = batch.pool.k_buffer(layer_id), batch.pool.v_buffer(layer_id)
        half = k_buf.shape[2]
        if latent.shape[1] != 2 * half:
            raise ValueError(f"a latent of {latent.shape[1]} values does not fit the pool's halves of {half}")
        store_kv(k_buf, v_buf, batch.out_cache_loc, latent[:, None, :half], latent[:, None, half:])
        batch.wait_layer(layer_id)  # this layer's load-back from L2, if one is in flight
        out, row = [], 0
        for slots, n in self._requests(batch):
            out.append(self._attend(q[row:row + n], torch.cat([k_buf[slots, 0], v_buf[slots, 0]], dim=-1)))
            row += n
        return torch.cat(out)

    @staticmethod
    def _requests(batch: ForwardBatch) -> list[tuple[torch.Tensor, int]]:
        """Per request: (the slots of its whole sequence so far, its new tokens)."""
        if batch.mode == "decode":
            return [(batch.slot_table[i, :n], 1) for i, n in enumerate(batch.seq_lens.tolist())]
        return list(zip(batch.token_slots, batch.extend_lens))

    def _attend(self, q: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """q [n, H, W] of the last n of latents [L, W] -> [n, H, kv_lora_rank], causal."""
        n, total = q.shape[0], latents.shape[0]
        scores = torch.einsum("nhw,lw->hnl", q.float(), latents.float()) * self.scale
        keys, queries = torch.arange(total, device=q.device), torch.arange(total - n, total, device=q.device)
        future = keys[None, :] > queries[:, None]
        probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        return torch.einsum("hnl,lc->nhc", probs, latents[:, :self.kv_lora_rank].float()).to(q.dtype)
