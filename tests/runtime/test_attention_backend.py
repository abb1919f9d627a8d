"""The attention registry (CPU side): names are checked once, "auto" resolves by device, dtype and
head size, `make_attention` returns a concrete backend."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from hicache.runtime.attention import NAMES, SplitAttention, make_attention, resolve
from hicache.runtime.attention.cpu import CpuAttention
from hicache.runtime.attention.reference import TorchAttention
from hicache.runtime.config import RuntimeConfig

CPU, CUDA, BF16 = torch.device("cpu"), torch.device("cuda"), torch.bfloat16
# hicache.kernels.flashinfer is patched by its dotted name, imported only when a test runs: importing
# it here would import kernels.checks before tests/kernels/kernel_env.py turns Triton's interpreter on
AVAILABLE = "hicache.kernels.flashinfer.available"


def test_auto_on_cpu_is_the_compiled_kernel_where_it_builds(monkeypatch):
    from hicache.kernels import cpu

    assert resolve("torch", "auto", CUDA, BF16, 128) == ("torch", "torch")  # named: kept
    assert resolve("auto", "auto", CPU, torch.float16, 64) == ("torch", "torch")  # no fp16 kernel
    assert resolve("auto", "auto", CPU, torch.float32, 40) == ("torch", "torch")  # nor this head size
    assert resolve("auto", "torch", CPU, torch.float32, 64)[1] == "torch"
    if cpu.available():
        assert resolve("auto", "auto", CPU, BF16, 128) == ("cpu", "cpu")
        assert isinstance(make_attention("auto", "auto", CPU, torch.float32, 64), CpuAttention)
    monkeypatch.setattr(cpu, "available", lambda: False)  # no compiler
    assert resolve("auto", "auto", CPU, torch.float32, 64) == ("torch", "torch")
    assert isinstance(make_attention("auto", "auto", CPU, torch.float32, 64), TorchAttention)
    with pytest.raises(ValueError, match="'cpu' needs a C\\+\\+ compiler"):
        make_attention("cpu", "auto", CPU, torch.float32, 64)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the CUDA choices need triton")
def test_auto_on_cuda_prefills_on_flashinfer_where_it_serves_the_pool_and_decodes_on_triton(monkeypatch):
    # resolve takes the device as an argument: only flashinfer's presence needs faking
    monkeypatch.setattr(AVAILABLE, lambda: False)  # flashinfer not installed
    assert resolve("auto", "auto", CUDA, BF16, 128) == ("triton", "triton")
    monkeypatch.setattr(AVAILABLE, lambda: True)
    assert resolve("auto", "auto", CUDA, BF16, 128) == ("flashinfer", "triton")
    assert resolve("auto", "auto", CUDA, torch.float16, 64) == ("flashinfer", "triton")
    assert resolve("auto", "auto", CUDA, torch.float32, 128) == ("triton", "triton")  # no fp32 kernels
    assert resolve("auto", "auto", CUDA, BF16, 96) == ("triton", "triton")  # nor this head size
    assert resolve("auto", "flashinfer", CUDA, BF16, 128) == ("flashinfer", "flashinfer")
    assert resolve("auto", "torch", CUDA, BF16, 128) == ("flashinfer", "torch")
    assert resolve("flashinfer", "auto", CUDA, BF16, 128) == ("flashinfer", "flashinfer")
    assert resolve("triton", "flashinfer", CUDA, BF16, 128) == ("triton", "flashinfer")
    assert resolve("auto", "auto", CPU, torch.float16, 128) == ("torch", "torch")  # flashinfer present, no CUDA


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the CUDA choices need triton")
def test_windowed_models_get_flashinfer_where_it_fits(monkeypatch):
    monkeypatch.setattr(AVAILABLE, lambda: True)
    assert resolve("auto", "auto", CUDA, BF16, 256) == ("flashinfer", "triton")
    attn = make_attention("auto", "auto", CPU, torch.float32, 256, scale=0.5, windows=(512, None))
    assert attn.windows == (512, None) and attn.scale == 0.5
    assert make_attention("auto", "auto", CPU, torch.float32, 64, windows=(None, None)).windows == ()


def test_auto_on_cuda_without_triton_is_torch(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    monkeypatch.setattr(AVAILABLE, lambda: True)
    assert resolve("auto", "auto", CUDA, BF16, 128) == ("torch", "torch")


def test_prefill_and_decode_on_different_backends():
    """Named apart, prefill and decode passes go to different backends; decode graphs follow the decode one."""
    class Probe:
        graphs = True

        def __init__(self):
            self.modes = []

        def forward(self, q, k, v, layer_id, batch):
            self.modes.append(batch.mode)
            return q

        def capture_state(self, bs, max_batch, num_heads, pool, req_table):
            return ("state", bs)

        def before_replay(self, state, rows, seq_lens, lens, req_table):
            self.modes.append(state)

    prefill, decode = Probe(), Probe()
    prefill.graphs = False
    split = SplitAttention(prefill, decode)
    for mode in ("extend", "decode", "extend"):
        split.forward(None, None, None, 0, SimpleNamespace(mode=mode))
    assert prefill.modes == ["extend", "extend"] and decode.modes == ["decode"] and split.graphs
    split.before_replay(split.capture_state(4, 8, 2, None, None), None, None, [1] * 4, None)
    assert decode.modes[-1] == ("state", 4) and prefill.modes == ["extend", "extend"]
    assert not SplitAttention(decode, prefill).graphs
    assert isinstance(make_attention("torch", "torch", CPU, torch.float32, 64), TorchAttention)
    assert isinstance(make_attention("torch", "auto", CPU, torch.float32, 64), TorchAttention)


def test_engine_on_cpu_runs_the_cpu_backend(tiny_config_path):
    from hicache.kernels import cpu
    from hicache.runtime.engine import Engine

    with Engine(str(tiny_config_path), load_format="dummy", max_total_tokens=256, device="cpu",
                hierarchical_cache=False) as engine:
        attn = engine.scheduler.runner.attn
        assert isinstance(attn, CpuAttention if cpu.available() else TorchAttention)  # resolved when built
        out = engine.generate(input_ids=[5, 6, 7], sampling_params={"temperature": 0, "max_new_tokens": 2})
    assert len(out["output_ids"]) == 2


def test_bad_names_are_refused():
    assert NAMES == ("auto", "torch", "cpu", "triton", "flashinfer")
    with pytest.raises(ValueError, match="^attention_backend must be one of auto, torch, cpu, triton, flashinfer"):
        RuntimeConfig(attention_backend="flash")
    with pytest.raises(ValueError, match="^decode_attention_backend"):
        RuntimeConfig(decode_attention_backend="flash")
    with pytest.raises(ValueError, match="^attention_backend"):
        resolve("flash", "auto", CPU, torch.float32, 64)
    with pytest.raises(ValueError, match="^decode_attention_backend"):
        make_attention("torch", "flash", CPU, torch.float32, 64)
    for name in NAMES:
        RuntimeConfig(attention_backend=name, decode_attention_backend=name)  # valid where they cannot run


def test_triton_and_flashinfer_off_cuda_are_refused():
    with pytest.raises(ValueError, match="'triton' needs a CUDA device"):
        make_attention("triton", "auto", CPU, torch.float32, 64)
    with pytest.raises(ValueError, match="'flashinfer' needs a CUDA device"):
        make_attention("flashinfer", "auto", CPU, BF16, 64)
    with pytest.raises(ValueError, match="'triton' needs a CUDA device"):
        make_attention("torch", "triton", CPU, torch.float32, 64)


def test_config_checks_names_without_torch():
    code = "import sys, hicache.runtime.config, hicache.runtime.attention; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
