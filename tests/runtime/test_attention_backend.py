"""Attention backend selection (CPU side): auto resolves by device, bad names are refused."""
from __future__ import annotations

import pytest
import torch

from hicache.runtime.attention import (AutoAttention, TorchAttention, make_attention_backend,
                                       resolve_attention_backend)
from hicache.runtime.config import RuntimeConfig


def test_auto_is_torch_on_cpu():
    assert resolve_attention_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_attention_backend("torch", torch.device("cuda")) == "torch"


def test_auto_backend_picks_torch_for_cpu_tensors(tiny_config_path):
    from hicache.runtime.engine import Engine

    with Engine(str(tiny_config_path), load_format="dummy", max_total_tokens=256, device="cpu",
                disable_hierarchical_cache=True) as engine:
        out = engine.generate(input_ids=[5, 6, 7], sampling_params={"temperature": 0, "max_new_tokens": 2})
        attn = engine.scheduler.runner.attn
    assert len(out["output_ids"]) == 2
    assert isinstance(attn, AutoAttention) and isinstance(attn.impl, TorchAttention)


def test_bad_names_are_refused():
    with pytest.raises(ValueError, match="attention_backend"):
        RuntimeConfig(attention_backend="flash")
    with pytest.raises(ValueError, match="attention_backend"):
        make_attention_backend("flash", 64)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_triton_without_cuda_is_refused():
    with pytest.raises(ValueError, match="CUDA"):
        make_attention_backend("triton", 64)
