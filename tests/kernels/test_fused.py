"""Fused Triton RMSNorm, RoPE and SiLU-mul vs the model's torch code on the same tensors (on CUDA,
or on the CPU under Triton's interpreter: kernel_env)."""
from __future__ import annotations

import kernel_env as env  # first: it may turn on Triton's interpreter
import pytest
import torch

from hicache.runtime.models.layers import _rotate, rms_norm

pytestmark = env.kernels
if env.CUDA or env.INTERPRETED:
    from hicache.kernels.fused import add_rmsnorm, rmsnorm, rope, silu_mul

DEV = env.DEV
TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-5}
HALF = env.half(torch.bfloat16)


def rel_err(out, want):
    return float((out.float() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize("dtype", [HALF, torch.float32])
@pytest.mark.parametrize("tokens,hidden", env.sizes([(1, 4096), (77, 576), (1000, 4096)], [(1, 4096), (77, 576)]))
def test_rmsnorm(dtype, tokens, hidden):
    gen = torch.Generator(DEV).manual_seed(torch.seed() % 2**31)
    x = (3 * torch.randn(tokens, hidden, generator=gen, device=DEV)).to(dtype)
    w = torch.randn(hidden, generator=gen, device=DEV).to(dtype)
    out = rmsnorm(x, w, 1e-5)
    want = rms_norm(x, w, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, want) < TOL[dtype]
    strided = torch.cat([x, x], dim=1)[:, :hidden]  # rows with a stride
    assert torch.equal(rmsnorm(strided, w, 1e-5), out)


@pytest.mark.parametrize("dtype", [HALF, torch.float32])
@pytest.mark.parametrize("tokens,hidden", [(1, 4096), (77, 576)])
def test_add_rmsnorm(dtype, tokens, hidden):
    gen = torch.Generator(DEV).manual_seed(torch.seed() % 2**31)
    x, delta = ((3 * torch.randn(tokens, hidden, generator=gen, device=DEV)).to(dtype) for _ in range(2))
    w = torch.randn(hidden, generator=gen, device=DEV).to(dtype)
    total, out = add_rmsnorm(x, delta, w, 1e-5)
    assert torch.equal(total, x + delta)  # the residual stream is rounded as torch rounds it
    assert rel_err(out, rms_norm(x + delta, w, 1e-5)) < TOL[dtype]
    assert torch.equal(out, rmsnorm(x + delta, w, 1e-5))
    with pytest.raises(ValueError, match="delta"):
        add_rmsnorm(x, delta[:, :-1], w, 1e-5)


@pytest.mark.parametrize("dtype", [HALF, torch.float32])
@pytest.mark.parametrize("hq,hk,d", env.sizes([(32, 8, 128), (9, 3, 64)], [(8, 2, 128), (9, 3, 64)]))
def test_rope_on_strided_qk(dtype, hq, hk, d):
    gen = torch.Generator(DEV).manual_seed(torch.seed() % 2**31)
    t, positions_max = env.sizes(300, 40), 40_000
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen, device=DEV).to(dtype)  # as the fused projection
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=DEV).float() / d))
    freqs = torch.outer(torch.arange(positions_max, device=DEV).float(), inv)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    pos = torch.randint(0, positions_max, (t,), generator=gen, device=DEV)
    q_out, k_out = rope(pos, q, k, cos_sin)
    cos, sin = cos_sin.index_select(0, pos).unsqueeze(1).chunk(2, dim=-1)
    assert rel_err(q_out, _rotate(q, cos, sin)) < TOL[dtype]
    assert rel_err(k_out, _rotate(k, cos, sin)) < TOL[dtype]
    assert q_out.is_contiguous() and q_out.dtype == dtype
    qw, kw = (torch.randn(d, generator=gen, device=DEV).to(dtype) for _ in range(2))  # Qwen3's q/k norm first
    q_out, k_out = rope(pos, q, k, cos_sin, qw, kw, 1e-6)
    assert rel_err(q_out, _rotate(rms_norm(q, qw, 1e-6), cos, sin)) < TOL[dtype]
    assert rel_err(k_out, _rotate(rms_norm(k, kw, 1e-6), cos, sin)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [HALF, torch.float32])
@pytest.mark.parametrize("tokens,inter", env.sizes([(1, 14336), (129, 1536)], [(1, 14336), (9, 1536)]))
def test_silu_mul(dtype, tokens, inter):
    gen = torch.Generator(DEV).manual_seed(torch.seed() % 2**31)
    x = (2 * torch.randn(tokens, 2 * inter, generator=gen, device=DEV)).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    assert rel_err(silu_mul(x), torch.nn.functional.silu(gate) * up) < TOL[dtype]


def test_launchers_reject_bad_arguments():
    x = torch.zeros(2, 64, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="weight"):
        rmsnorm(x, torch.zeros(64, device=DEV), 1e-5)
    if env.CUDA:  # (the interpreter takes CPU tensors)
        with pytest.raises(ValueError, match="CUDA"):
            rmsnorm(x.cpu(), torch.zeros(64, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="2I"):
        silu_mul(torch.zeros(2, 7, device=DEV))
    q = torch.zeros(2, 4, 64, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cos_sin"):
        rope(torch.zeros(2, dtype=torch.int64, device=DEV), q, q, torch.zeros(10, 64, device=DEV, dtype=torch.bfloat16))
