"""Prefill logits through the real paged path (L1 pool, scattered slots, torch attention backend),
with and without a cached prefix, against HF transformers on the default GGUF (its logits
summarised in tests/golden/logits.json)."""
from __future__ import annotations

import pytest
import torch

from golden import load_golden, logits_vs_golden
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


def test_paged_prefill_with_cached_prefix_matches_hf(default_model):
    model, cfg = default_model.model, default_model.config
    case = next(c for c in load_golden("logits")["cases"] if c["name"] == "paged")
    ids = case["prompt"]  # 1,000 tokens of threading's source
    pool = DeviceKVPool(4096, 1, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    slots = torch.randperm(4096)[: len(ids)]  # a fragmented pool
    whole = _forward(model, pool, ids, slots, 0)
    split = 600
    _forward(model, pool, ids[:split], slots[:split], 0)
    tail = _forward(model, pool, ids, slots, split)  # extend over a cached 600-token prefix
    err_whole, argmax_whole = logits_vs_golden(whole, case)
    err_tail, argmax_tail = logits_vs_golden(tail, case, start=split)
    print(f"max |logit - HF|: whole prompt {err_whole:.3g}, extend after cached prefix {err_tail:.3g}")
    assert err_whole < 1e-3 and err_tail < 1e-3
    assert argmax_whole and argmax_tail
