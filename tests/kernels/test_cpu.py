"""The CPU kernels (kernels/cpu.py) against the torch reference attention and the model's torch
layer ops, on fresh random inputs; and the clean fallback where no compiler exists."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from paged_inputs import extend_case, fresh_gen, rel_err

from hicache.kernels import attention as ref
from hicache.kernels import cpu
from hicache.runtime.models.layers import _rotate, rms_norm

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler: the CPU kernels are not built")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype,window,decode", [(torch.float32, None, False), (torch.bfloat16, None, False),
                                                 (torch.float32, 40, False), (torch.float32, None, True),
                                                 (torch.bfloat16, 40, True)])
def test_paged_attention_matches_reference(dtype, window, decode):
    """Extend over cached prefixes and decode (one new token) in one ragged batch, or a batch
    of decodes only (a task then covers all KV heads of a request); the kernel stores the new
    tokens' K/V itself, then reads the pool in place."""
    gen = fresh_gen()
    prefixes, extends = [0, 37, 300, 5, 130], [70, 1, 20, 1, 1]
    if decode:
        prefixes, extends = [37, 300, 5, 130, 64, 1, 250, 90], [1] * 8
    c = extend_case(prefixes, extends, 16, 9, 3, 64, dtype, gen)
    c = type(c)(*(t.cpu() if isinstance(t, torch.Tensor) else [s.cpu() for s in t] for t in c))
    loc = torch.cat([s[p:] for s, p in zip(c.slots, prefixes)])
    k_new, v_new = c.k_buf[loc].clone(), c.v_buf[loc].clone()
    want = ref.extend_attention(c.q.float(), c.k_buf.float(), c.v_buf.float(), c.slots, extends, 0.125, window)
    c.k_buf[loc], c.v_buf[loc] = 0, 0
    qkv = torch.cat([k_new, v_new], dim=1)  # strided views, as the model's split of its qkv projection
    out = cpu.paged_attention(c.q, qkv[:, :3], qkv[:, 3:], c.k_buf, c.v_buf, loc, c.table, c.rows, c.prefix_lens,
                              c.extend_lens, c.starts, 0.125, window)
    assert torch.equal(c.k_buf[loc], k_new) and torch.equal(c.v_buf[loc], v_new)
    for s, e in zip(c.starts.tolist(), extends):
        assert rel_err(out[s:s + e], want[s:s + e]) < TOL[dtype], (s, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_over_shared_keys_reads_them_once_per_group(dtype):
    """Two groups of decode requests sharing their first slots (one group past a page boundary),
    and requests sharing nothing: `shared_keys` finds the groups, and attention that reads each
    group's keys once equals the reference."""
    gen = fresh_gen()
    hq, hkv, d = 9, 3, 64
    perm = torch.randperm(4096, generator=gen)
    system_a, system_b = perm[:150], perm[150:350]
    own = iter(perm[350:].split(40))
    prompts = [system_a, system_a, system_b, system_a, perm[4000:4060], system_b, system_a[:70]]
    slots = [torch.cat([p, next(own)[:n]]) for p, n in zip(prompts, (5, 33, 1, 17, 9, 40, 2))]
    k_buf, v_buf = (torch.randn(4096, hkv, d, generator=gen).to(dtype) for _ in range(2))
    table = torch.zeros(len(slots), 400, dtype=torch.int64)
    for i, s in enumerate(slots):
        table[i, :len(s)] = s
    rows, lens = torch.arange(len(slots)), torch.tensor([len(s) for s in slots])
    prefix = lens - 1
    groups = cpu.shared_keys(table, rows, prefix)
    members = [groups.members[a:b].tolist() for a, b in zip(groups.offsets[:-1], groups.offsets[1:])]
    assert sorted(members) == [[0, 1, 3, 6], [2, 5]] and groups.lens.tolist() == [70, 70, 200, 70, 0, 200, 70]
    assert cpu.shared_keys(table, rows, prefix, min_keys=250) is None
    q = torch.randn(len(slots), hq, d, generator=gen).to(dtype)
    loc = torch.stack([s[-1] for s in slots])
    k_new, v_new = k_buf[loc].clone(), v_buf[loc].clone()
    want = ref.decode_attention(q.float(), k_buf.float(), v_buf.float(), table, lens, 0.125)
    ones = torch.ones(len(slots), dtype=torch.int64)
    out = cpu.paged_attention(q, k_new, v_new, k_buf, v_buf, loc, table, rows, prefix, ones, rows, 0.125,
                              shared=groups)
    assert rel_err(out, want) < TOL[dtype]
    for i in range(len(slots)):
        assert rel_err(out[i], want[i]) < TOL[dtype], i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_ops_match_torch(dtype):
    gen = fresh_gen()
    x, delta = (torch.randn(5, 96, generator=gen).to(dtype) for _ in range(2))
    w = torch.rand(96, generator=gen).to(dtype) + 0.5
    torch.testing.assert_close(cpu.rmsnorm(x, w, 1e-5), rms_norm(x, w, 1e-5))
    total, normed = cpu.add_rmsnorm(x, delta, w, 1e-5)
    torch.testing.assert_close(total, x + delta)
    torch.testing.assert_close(normed, rms_norm(x + delta, w, 1e-5))
    qkv = torch.randn(5, 7 * 32, generator=gen).to(dtype)
    q, k = qkv[:, :128].view(5, 4, 32), qkv[:, 128:192].view(5, 2, 32)  # strided rows
    positions = torch.randint(0, 50, (5,), generator=gen)
    cos_sin = torch.cat([torch.rand(50, 16, generator=gen), torch.rand(50, 16, generator=gen)], dim=1)
    cos, sin = cos_sin.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
    q_out, k_out = cpu.rope(positions, q, k, cos_sin)
    torch.testing.assert_close(q_out, _rotate(q, cos, sin))
    torch.testing.assert_close(k_out, _rotate(k, cos, sin))
    gate_up = torch.randn(5, 64, generator=gen).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu.silu_mul(gate_up), F.silu(gate) * up)
    weight = torch.randn(48, 96, generator=gen).to(dtype)
    packed = cpu.pack_linear(weight)
    if packed is not None:
        torch.testing.assert_close(cpu.linear(x, packed), F.linear(x, weight))


def gguf_exact(shape: tuple[int, int], kind: str, gen: torch.Generator) -> torch.Tensor:
    """Fresh random float32 weights through GGUF's reference quantiser and back: the values a
    GGUF tensor of `kind` dequantises to."""
    from gguf import GGMLQuantizationType, dequantize, quantize

    qtype = GGMLQuantizationType[kind.upper()]
    w = (torch.randn(shape, generator=gen) * torch.rand(shape[0], 1, generator=gen)).numpy()
    return torch.from_numpy(dequantize(quantize(w, qtype), qtype).copy())


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_quantized_linear_matches_dequantized_matmul(kind):
    """The blocks hold the weights bit for bit (an identity input reads them back exactly), and
    products with few rows (odd counts, tails of the row tiles) match float32 matmul up to the
    order of the sums; `linear` takes them up to QUANT_MAX_ROWS rows, oneDNN beyond."""
    gen = fresh_gen()
    w = gguf_exact((37, 96), kind, gen)
    q = cpu.quantize_exact(w)
    assert q is not None and q.kind == kind and q.shape == (37, 96)
    assert torch.equal(cpu.linear_quantized(torch.eye(96), q).T, w)
    packed = cpu.pack_linear(w, quantized=True)
    for rows in (1, 2, 3, 4, 5, 7, cpu.QUANT_MAX_ROWS, cpu.QUANT_MAX_ROWS + 3):
        x = torch.randn(rows, 96, generator=gen)
        want = (x.double() @ w.double().T).float()
        torch.testing.assert_close(cpu.linear_quantized(x, q), want, rtol=1e-5, atol=1e-5)
        if packed is not None:
            torch.testing.assert_close(cpu.linear(x, packed), want, rtol=1e-5, atol=1e-5)


def test_quantize_exact_refuses_weights_no_block_holds():
    gen = fresh_gen()
    w = gguf_exact((8, 64), "q4_1", gen)
    assert cpu.quantize_exact(w.to(torch.bfloat16)) is None
    assert cpu.quantize_exact(w[:, :48].contiguous()) is None  # not whole blocks
    w[3, 5] = w[3, 5].item() + 1e-3  # one value off its block's grid: Q8_0 cannot hold this block either
    assert cpu.quantize_exact(w) is None
    assert cpu.quantize_exact(torch.randn(8, 64, generator=gen)) is None
    with pytest.raises(ValueError, match="x must be"):
        cpu.linear_quantized(torch.zeros(1, 32), cpu.quantize_exact(gguf_exact((4, 64), "q8_0", gen)))


def test_launchers_reject_bad_inputs():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="weight"):
        cpu.rmsnorm(x, torch.zeros(4), 1e-5)
    with pytest.raises(ValueError, match="x must be float32 or bfloat16"):
        cpu.silu_mul(torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="not a multiple"):
        cpu.paged_attention(torch.zeros(1, 3, 16), torch.zeros(1, 2, 16), torch.zeros(1, 2, 16), torch.zeros(4, 2, 16),
                            torch.zeros(4, 2, 16), torch.zeros(1, dtype=torch.int64), torch.zeros(1, 4, dtype=torch.int64),
                            *(torch.zeros(1, dtype=torch.int64) for _ in range(4)), 1.0)


def test_no_compiler_falls_back_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(cpu.shutil, "which", lambda name: None)
    cpu.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu.__name__):
            assert cpu.library() is None and cpu.library() is None and not cpu.available()
        assert len([r for r in caplog.records if "no C++ compiler" in r.message]) == 1
    finally:
        cpu.library.cache_clear()
