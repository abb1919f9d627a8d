"""Attention backend selection (CPU side): auto resolves by device, bad names are refused."""
from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from hicache.kernels import flashinfer
from hicache.runtime.attention import (AutoAttention, SplitAttention, TorchAttention, make_attention_backend,
                                       resolve_attention_backends)
from hicache.runtime.config import RuntimeConfig


def test_auto_is_torch_on_cpu():
    cpu = torch.device("cpu")
    assert resolve_attention_backends("auto", "auto", cpu, torch.bfloat16, 128) == ("torch", "torch")
    assert resolve_attention_backends("torch", "auto", torch.device("cuda"), torch.bfloat16, 128) == ("torch", "torch")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the CUDA choices need triton")
def test_auto_on_cuda_prefills_on_flashinfer_where_it_serves_the_pool_and_decodes_on_triton(monkeypatch):
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    monkeypatch.setattr(flashinfer, "available", lambda: False)  # flashinfer not installed
    assert resolve_attention_backends("auto", "auto", cuda, bf16, 128) == ("triton", "triton")
    monkeypatch.setattr(flashinfer, "available", lambda: True)
    assert resolve_attention_backends("auto", "auto", cuda, bf16, 128) == ("flashinfer", "triton")
    assert resolve_attention_backends("auto", "auto", cuda, torch.float16, 64) == ("flashinfer", "triton")
    assert resolve_attention_backends("auto", "auto", cuda, torch.float32, 128) == ("triton", "triton")  # no fp32 kernels
    assert resolve_attention_backends("auto", "auto", cuda, bf16, 96) == ("triton", "triton")  # nor this head size
    assert resolve_attention_backends("auto", "flashinfer", cuda, bf16, 128) == ("flashinfer", "flashinfer")
    assert resolve_attention_backends("flashinfer", "auto", cuda, bf16, 128) == ("flashinfer", "flashinfer")
    assert resolve_attention_backends("triton", "flashinfer", cuda, bf16, 128) == ("triton", "flashinfer")


def test_prefill_and_decode_on_different_backends():
    """Named apart, prefill and decode passes go to different backends; decode graphs follow the decode one."""
    class Probe:
        graphs = True

        def __init__(self):
            self.modes = []

        def forward(self, q, k, v, layer_id, batch):
            self.modes.append(batch.mode)
            return q

    prefill, decode = Probe(), Probe()
    prefill.graphs = False
    split = SplitAttention(prefill, decode)
    for mode in ("extend", "decode", "extend"):
        split.forward(None, None, None, 0, SimpleNamespace(mode=mode))
    assert prefill.modes == ["extend", "extend"] and decode.modes == ["decode"] and split.graphs
    assert isinstance(make_attention_backend("torch", 64, "torch"), TorchAttention)


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
    with pytest.raises(ValueError, match="decode_attention_backend"):
        RuntimeConfig(decode_attention_backend="flash")
    with pytest.raises(ValueError, match="attention_backend"):
        make_attention_backend("flash", 64)
    with pytest.raises(ValueError, match="decode_attention_backend"):
        make_attention_backend("torch", 64, "flash")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_triton_and_flashinfer_without_cuda_are_refused():
    with pytest.raises(ValueError, match="CUDA"):
        make_attention_backend("triton", 64)
    with pytest.raises(ValueError, match="'flashinfer' needs a CUDA device"):
        make_attention_backend("flashinfer", 64)
    RuntimeConfig(attention_backend="flashinfer")  # a valid name: refused only where it cannot run
