"""The torch reference attention over a paged pool vs a naive per-head softmax, fresh random inputs."""
from __future__ import annotations

import math

import pytest
import torch

from hicache.kernels.attention import decode_attention, extend_attention, store_kv


def naive(q, keys, values, first_pos):
    """q [n, Hq, D] at positions first_pos.., keys/values [L, Hkv, D]: causal GQA softmax."""
    group = q.shape[1] // keys.shape[1]
    out = torch.empty_like(q)
    for t in range(q.shape[0]):
        for h in range(q.shape[1]):
            k = keys[: first_pos + t + 1, h // group].double()
            w = torch.softmax(k @ q[t, h].double() / math.sqrt(q.shape[2]), dim=0)
            out[t, h] = (w @ values[: first_pos + t + 1, h // group].double()).to(q.dtype)
    return out


def random_pool(num_slots, hkv, d, gen):
    return torch.randn(num_slots, hkv, d, generator=gen), torch.randn(num_slots, hkv, d, generator=gen)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (8, 1)])
def test_extend_matches_naive_with_prefix(hq, hkv):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    d, num_slots = 16, 256
    k_buf, v_buf = random_pool(num_slots, hkv, d, gen)
    perm = torch.randperm(num_slots, generator=gen)
    prefixes, extends = [0, 7, 30, 19, 0], [5, 1, 12, 1, 1]  # the one-token chunks attend together
    slots, qs, used = [], [], 0
    for p, e in zip(prefixes, extends):
        slots.append(perm[used:used + p + e])
        used += p + e
        qs.append(torch.randn(e, hq, d, generator=gen))
    new_k = torch.randn(sum(extends), hkv, d, generator=gen)
    new_v = torch.randn(sum(extends), hkv, d, generator=gen)
    loc = torch.cat([s[p:] for s, p in zip(slots, prefixes)])
    store_kv(k_buf, v_buf, loc, new_k, new_v)
    out = extend_attention(torch.cat(qs), k_buf, v_buf, slots, extends, d ** -0.5)
    start = 0
    for s, p, e, q in zip(slots, prefixes, extends, qs):
        ref = naive(q, k_buf[s], v_buf[s], p)
        torch.testing.assert_close(out[start:start + e], ref, rtol=1e-4, atol=1e-5)
        start += e


def test_decode_matches_naive_ragged():
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    hq, hkv, d, num_slots = 6, 2, 32, 2048
    k_buf, v_buf = random_pool(num_slots, hkv, d, gen)
    lens = [1, 17, 200, 3, 90, 64, 5, 33, 120, 7, 2, 150]
    perm = torch.randperm(num_slots, generator=gen)
    table = torch.zeros(len(lens), 256, dtype=torch.int64)
    used = 0
    for i, n in enumerate(lens):
        table[i, :n] = perm[used:used + n]
        used += n
    q = torch.randn(len(lens), hq, d, generator=gen)
    out = decode_attention(q, k_buf, v_buf, table, torch.tensor(lens), d ** -0.5)
    for i, n in enumerate(lens):
        ref = naive(q[i:i + 1], k_buf[table[i, :n]], v_buf[table[i, :n]], n - 1)
        torch.testing.assert_close(out[i:i + 1], ref, rtol=1e-4, atol=1e-5)


def test_launchers_reject_bad_shapes():
    k_buf, v_buf = torch.zeros(8, 2, 4), torch.zeros(8, 2, 4)
    with pytest.raises(ValueError, match="not a multiple"):
        extend_attention(torch.zeros(1, 3, 4), k_buf, v_buf, [torch.tensor([0])], [1], 1.0)
    with pytest.raises(ValueError, match="loc"):
        store_kv(k_buf, v_buf, torch.tensor([0, 1], dtype=torch.int32), torch.zeros(2, 2, 4), torch.zeros(2, 2, 4))
    with pytest.raises(ValueError, match="extend_lens"):
        extend_attention(torch.zeros(2, 2, 4), k_buf, v_buf, [torch.tensor([0])], [1], 1.0)
