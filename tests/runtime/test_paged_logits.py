"""Prefill logits through the real paged path (L1 pool, scattered slots, torch attention backend),
with and without a cached prefix, against HF transformers on the default GGUF."""
from __future__ import annotations

import inspect
import threading

import pytest
import torch

from hicache.runtime.attention.reference import TorchAttention
from hicache.runtime.batch import ForwardBatch
from hicache.tiers.gpu.pool import DeviceKVPool

pytestmark = pytest.mark.model


def _forward(model, pool, ids, slots, start):
    """Logits of tokens ids[start:], whose K/V go to slots[start:]; slots[:start] hold the prefix."""
    batch = ForwardBatch("extend", TorchAttention(model.config.head_dim), pool, slots[start:],
                         [len(ids) - start], [slots])
    x = torch.tensor(ids[start:])
    pos = torch.arange(start, len(ids))
    return model.compute_logits(model(x, pos, batch))


def test_paged_prefill_with_cached_prefix_matches_hf(default_model, hf_reference):
    model, cfg = default_model.model, default_model.config
    ids = hf_reference.tokenizer(inspect.getsource(threading)[:8000])["input_ids"][:1000]
    with torch.no_grad():
        ref = hf_reference.model(torch.tensor([ids])).logits[0].float()
    pool = DeviceKVPool(4096, 1, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    slots = torch.randperm(4096)[: len(ids)]  # a fragmented pool
    whole = _forward(model, pool, ids, slots, 0)
    split = 600
    _forward(model, pool, ids[:split], slots[:split], 0)
    tail = _forward(model, pool, ids, slots, split)  # extend over a cached 600-token prefix
    err_whole = (whole - ref).abs().max().item()
    err_tail = (tail - ref[split:]).abs().max().item()
    print(f"max |logit - HF|: whole prompt {err_whole:.3g}, extend after cached prefix {err_tail:.3g}")
    assert err_whole < 1e-3 and err_tail < 1e-3
    assert torch.equal(whole.argmax(-1), ref.argmax(-1))
