"""Sampler: penalties and filters against HF's logits processors, seeding, distribution, logprobs.

Every test draws fresh random inputs; nothing compares against hard-coded outputs.
"""
from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from transformers import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

from hicache.runtime.sampler import (TOP_P_CANDIDATES, SampleResult, Sampler, apply_penalties, draw,
                                     filtered_probs, make_generator)
from hicache.runtime.sampling import SamplingParams

V = 512


def _ids(rng: random.Random, n: int, vocab: int = V) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def _call(logits, params, generators=None, prompt=None, output=None, top=None, want=None) -> SampleResult:
    b = logits.shape[0]
    return Sampler().sample(
        logits, params,
        generators if generators is not None else [None] * b,
        prompt if prompt is not None else [[] for _ in range(b)],
        output if output is not None else [[] for _ in range(b)],
        top if top is not None else [0] * b,
        return_logprob=want)


def test_greedy_equals_argmax():
    b = 16
    logits = torch.randn(b, V) * 4
    params = [SamplingParams(temperature=0.0) if i % 2 else SamplingParams(top_k=1, temperature=0.7)
              for i in range(b)]
    res = _call(logits, params)
    assert res.next_ids == logits.argmax(-1).tolist()


def test_logits_not_modified():
    rng = random.Random()
    logits = torch.randn(4, V)
    before = logits.clone()
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0, temperature=0.7, top_k=20,
                             top_p=0.8, min_p=0.05)] * 4
    gens = [make_generator(None, i) for i in range(4)]
    _call(logits, params, gens, [_ids(rng, 10) for _ in range(4)], [_ids(rng, 10) for _ in range(4)])
    assert torch.equal(logits, before)


def test_repetition_penalty_matches_hf():
    rng = random.Random()
    b = 8
    logits = torch.randn(b, V) * 3
    prompts = [_ids(rng, rng.randint(0, 60)) for _ in range(b)]
    outputs = [_ids(rng, rng.randint(0, 30)) for _ in range(b)]
    params = [SamplingParams(repetition_penalty=rng.choice([1.0, rng.uniform(0.3, 3.0)])) for _ in range(b)]
    got = apply_penalties(logits, params, prompts, outputs)
    for i in range(b):
        seq = prompts[i] + outputs[i]
        ref = logits[i:i + 1].clone()
        if seq:
            proc = RepetitionPenaltyLogitsProcessor(penalty=params[i].repetition_penalty)
            ref = proc(torch.tensor([seq]), ref)
        torch.testing.assert_close(got[i], ref[0], rtol=0, atol=0)


def test_frequency_presence_penalties_over_output_only():
    rng = random.Random()
    b = 6
    logits = torch.randn(b, V)
    prompts = [_ids(rng, 40) for _ in range(b)]
    outputs = [_ids(rng, rng.randint(0, 80), vocab=50) for _ in range(b)]  # small range: repeats
    params = [SamplingParams(frequency_penalty=rng.uniform(-2, 2), presence_penalty=rng.uniform(-2, 2))
              for _ in range(b)]
    got = apply_penalties(logits, params, prompts, outputs)
    for i in range(b):
        ref = logits[i].clone()
        for tok, c in Counter(outputs[i]).items():
            ref[tok] -= params[i].frequency_penalty * c + params[i].presence_penalty
        torch.testing.assert_close(got[i], ref)


def test_penalties_combined_order():
    """Repetition penalty first (prompt + output), then frequency/presence (output)."""
    rng = random.Random()
    logits = torch.randn(1, V) * 2
    prompt, output = _ids(rng, 30), _ids(rng, 30, vocab=40)
    p = SamplingParams(repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=-0.4)
    ref = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits.clone())[0]
    for tok, c in Counter(output).items():
        ref[tok] -= 0.6 * c - 0.4
    torch.testing.assert_close(apply_penalties(logits, [p], [prompt], [output])[0], ref)


def _hf_scores(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    s = TemperatureLogitsWarper(p.temperature)(None, row[None].clone())
    if p.top_k > 0:
        s = TopKLogitsWarper(p.top_k)(None, s)
    if p.top_p < 1.0:
        s = TopPLogitsWarper(p.top_p)(None, s)
    if p.min_p > 0.0:
        s = MinPLogitsWarper(p.min_p)(None, s)
    return s[0]


def _hf_allowed(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    return torch.isfinite(_hf_scores(row, p))


@pytest.mark.parametrize("which", ["top_k", "top_p", "min_p", "all"])
def test_filters_match_hf_masks(which):
    rng = random.Random()
    b = 24
    logits = torch.randn(b, V) * rng.uniform(1, 4)
    params = []
    for _ in range(b):
        kw = {"temperature": rng.uniform(0.5, 1.5)}
        if which in ("top_k", "all") and rng.random() < 0.8:
            kw["top_k"] = rng.choice([2, rng.randint(2, 50), rng.randint(2, 2 * V)])
        if which in ("top_p", "all") and rng.random() < 0.8:
            kw["top_p"] = rng.uniform(0.05, 1.0)
        if which in ("min_p", "all") and rng.random() < 0.8:
            kw["min_p"] = rng.uniform(0.0, 0.5)
        params.append(SamplingParams(**kw))
    probs = filtered_probs(logits.clone(), params)
    for i in range(b):
        hf = _hf_scores(logits[i], params[i])
        assert torch.equal(probs[i] > 0, torch.isfinite(hf)), (i, params[i])
        torch.testing.assert_close(probs[i], hf.softmax(-1), rtol=1e-4, atol=1e-7)
    # and sampling only ever picks allowed tokens
    gens = [make_generator(None, rng.randrange(2**32)) for _ in range(b)]
    for _ in range(20):
        ids = _call(logits, params, gens).next_ids
        assert all(probs[i, t] > 0 for i, t in enumerate(ids))


@pytest.mark.parametrize("scale", [0.3, 2.0, 6.0])
def test_top_p_large_vocab_matches_hf(scale):
    """Vocab > TOP_P_CANDIDATES: peaked rows cut inside the candidates, flat rows fall back to a sort."""
    rng = random.Random()
    vocab = 4 * TOP_P_CANDIDATES
    b = 8
    logits = torch.randn(b, vocab) * scale
    params = [SamplingParams(temperature=rng.uniform(0.5, 1.2), top_p=rng.uniform(0.3, 0.999),
                             top_k=rng.choice([-1, -1, rng.randint(2, 3000)]),
                             min_p=rng.choice([0.0, 0.02]))
              for _ in range(b)]
    probs = filtered_probs(logits.clone(), params)
    for i in range(b):
        differ = (probs[i] > 0) != _hf_allowed(logits[i], params[i])
        assert not (differ & ~_near_cut(logits[i], params[i])).any(), (i, params[i], differ.nonzero())


def _near_cut(row: torch.Tensor, p: SamplingParams, tol: float = 1e-5) -> torch.Tensor:
    """Tokens that float32 rounding may put on either side of the top_p or min_p cut: their
    float64 suffix mass (HF's ascending cumulative prob) within `tol` of 1 - top_p, or their prob
    within `tol` of min_p times the best prob. Over thousands of tokens the two sides sum in
    different orders, so only these may differ."""
    s = row.double() / p.temperature
    if p.top_k > 0:
        s = s.masked_fill(s < s.topk(min(p.top_k, s.numel())).values[-1], float("-inf"))
    probs = s.softmax(-1)
    desc, order = probs.sort(descending=True)
    suffix = torch.empty_like(probs)
    suffix[order] = desc.flip(0).cumsum(0).flip(0)
    near = (suffix - (1 - p.top_p)).abs() < tol
    if p.min_p > 0:
        near |= (probs - p.min_p * probs.max()).abs() < tol
    return near


def test_draw_never_picks_zero_probability():
    rng = random.Random()
    vocab = 300
    probs = torch.rand(64, vocab) * (torch.rand(64, vocab) < 0.05)
    probs[:, rng.randrange(vocab)] += 1e-3  # at least one positive per row
    probs[:, 0] = 0.0
    probs[:, -1] = 0.0  # the edges of the CDF
    gens = [make_generator(None, rng.randrange(2**32)) for _ in range(64)]
    for _ in range(50):
        ids = draw(probs, gens)
        assert bool((probs.gather(1, ids[:, None]) > 0).all())


def _seeded_run(target_logits, target_params, seed, position, mates, mate_logits):
    """Run the target request at `position` among `mates` for len(target_logits) steps."""
    rng = random.Random()
    b = len(mates) + 1
    vocab = target_logits.shape[1]
    gen_t = make_generator(seed, fallback_seed=0)
    gen_m = [make_generator(None, rng.randrange(2**32)) if not p.is_greedy else None for p in mates]
    params = list(mates)
    params.insert(position, target_params)
    gens = list(gen_m)
    gens.insert(position, gen_t)
    out_t: list[int] = []
    outs_m = [[] for _ in mates]
    prompt_t = [3, 1, 4, 1, 5]
    for step, row in enumerate(target_logits):
        logits = mate_logits[step].clone()
        logits = torch.cat([logits[:position], row[None], logits[position:]])
        prompts = [_ids(rng, 7, vocab) for _ in mates]
        prompts.insert(position, prompt_t)
        outputs = [list(o) for o in outs_m]
        outputs.insert(position, out_t)
        ids = _call(logits, params, gens, prompts, outputs, top=[rng.randint(0, 3) for _ in range(b)]).next_ids
        out_t.append(ids[position])
        for j, t in enumerate(ids[:position] + ids[position + 1:]):
            outs_m[j].append(t)
    return out_t


def _random_params(rng: random.Random, same_k: int = 100) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, rng.uniform(0.3, 1.5)]),
        top_k=rng.choice([-1, rng.randint(2, 100), same_k]), top_p=rng.choice([1.0, rng.uniform(0.3, 1.0)]),
        min_p=rng.choice([0.0, rng.uniform(0, 0.2)]), repetition_penalty=rng.choice([1.0, 1.3]),
        frequency_penalty=rng.choice([0.0, 0.5]), presence_penalty=rng.choice([0.0, -0.5]))


@pytest.mark.parametrize("vocab,top_k,scale", [(V, 200, 2.0), (4 * TOP_P_CANDIDATES, -1, 3.0),
                                               (4 * TOP_P_CANDIDATES, -1, 0.5)])
def test_same_seed_same_tokens_whatever_the_batch(vocab, top_k, scale):
    """Mates of every kind (greedy, penalized, same or other top_k / top_p) at any position."""
    rng = random.Random()
    steps = 16
    seed = rng.randrange(2**63)
    target_params = SamplingParams(temperature=0.9, top_k=top_k, top_p=0.95, min_p=0.01, repetition_penalty=1.1,
                                   frequency_penalty=0.3, presence_penalty=0.2, seed=seed)
    target_logits = torch.randn(steps, vocab) * scale
    runs = []
    for _ in range(3):
        n_mates = rng.randint(0, 7)
        mates = [_random_params(rng, same_k=top_k if top_k > 0 else TOP_P_CANDIDATES) for _ in range(n_mates)]
        mate_logits = torch.randn(steps, n_mates, vocab) * rng.choice([0.5, 3.0])
        runs.append(_seeded_run(target_logits, target_params, seed, rng.randint(0, n_mates), mates, mate_logits))
    assert all(r == runs[0] for r in runs), runs
    assert len(set(runs[0])) > 1  # it really sampled


def test_top_k_at_candidate_width_shares_a_group_with_top_p_rows():
    vocab = 4 * TOP_P_CANDIDATES
    logits = torch.randn(4, vocab) * 3
    params = [SamplingParams(top_k=TOP_P_CANDIDATES, top_p=0.8), SamplingParams(top_p=0.8),
              SamplingParams(top_k=TOP_P_CANDIDATES, top_p=0.3, min_p=0.1), SamplingParams(top_p=0.5, min_p=0.2)]
    probs = filtered_probs(logits.clone(), params)
    for i in range(4):
        assert torch.equal(probs[i] > 0, _hf_allowed(logits[i], params[i])), (i, params[i])


def test_different_seeds_differ():
    logits = torch.randn(1, V) * 0.5  # flat-ish: two independent draws rarely agree
    p = [SamplingParams(temperature=1.0)]
    probs = torch.softmax(logits[0], -1)
    collide = float((probs ** 2).sum())  # chance two independent draws agree
    g1, g2 = make_generator(1234, 0), make_generator(None, 98765)
    n = 400
    a = [_call(logits, p, [g1]).next_ids[0] for _ in range(n)]
    b = [_call(logits, p, [g2]).next_ids[0] for _ in range(n)]
    agree = sum(x == y for x, y in zip(a, b)) / n
    assert agree < collide + 5 * math.sqrt(collide / n) + 0.01
    # and the same seed replays exactly
    g3 = make_generator(1234, 555)
    assert [_call(logits, p, [g3]).next_ids[0] for _ in range(n)] == a


def _chi2_critical(df: int, z: float = 4.0) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at normal z (4.0 ~ p = 3e-5)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _assert_chi2_fits(counts: torch.Tensor, expected: torch.Tensor) -> None:
    """Pearson chi-square of observed counts against expected probabilities (cells under 5 pooled)."""
    n = float(counts.sum())
    exp = expected * n
    keep = exp >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    ex = torch.cat([exp[keep], exp[~keep].sum()[None]])
    obs, ex = obs[ex > 0], ex[ex > 0]
    assert len(ex) >= 2, "degenerate distribution"
    stat = float(((obs - ex) ** 2 / ex).sum())
    assert stat < _chi2_critical(len(ex) - 1), (stat, len(ex) - 1)


@pytest.mark.parametrize("temperature,vocab,scale", [(1.0, 24, 1.5), (0.6, 24, 1.5), (1.0, 1000, 1.0)])
def test_empirical_distribution_matches_softmax(temperature, vocab, scale):
    logits = torch.randn(1, vocab) * scale
    b, calls = 2000, 10  # one generator drawn by every row in turn
    g = make_generator(20241121, 0)
    params = [SamplingParams(temperature=temperature)] * b
    counts = torch.zeros(vocab)
    for _ in range(calls):
        ids = _call(logits.expand(b, vocab), params, [g] * b).next_ids
        counts += torch.bincount(torch.tensor(ids), minlength=vocab)
    _assert_chi2_fits(counts, torch.softmax(logits[0] / temperature, -1))


def test_filtered_distribution_is_renormalized():
    vocab = 40
    logits = torch.randn(1, vocab)
    p = SamplingParams(temperature=0.8, top_k=10, top_p=0.9)
    allowed = _hf_allowed(logits[0], p)
    expected = torch.softmax((logits[0] / 0.8).masked_fill(~allowed, float("-inf")), -1)
    b = 8000
    g = make_generator(7, 0)
    ids = _call(logits.expand(b, vocab), [p] * b, [g] * b).next_ids
    counts = torch.bincount(torch.tensor(ids), minlength=vocab).float()
    assert counts[~allowed].sum() == 0
    _assert_chi2_fits(counts[allowed], expected[allowed])


def test_logprobs_are_raw_log_softmax():
    rng = random.Random()
    b = 12
    logits = torch.randn(b, V) * 3
    params = [_random_params(rng) for _ in range(b)]
    gens = [None if p.is_greedy else make_generator(None, rng.randrange(2**32)) for p in params]
    top = [rng.choice([0, 1, 5, 20]) for _ in range(b)]
    prompts = [_ids(rng, 20) for _ in range(b)]
    outputs = [_ids(rng, 10) for _ in range(b)]
    res = _call(logits, params, gens, prompts, outputs, top)
    ref = torch.log_softmax(logits, -1)
    for i in range(b):
        assert res.logprobs[i] == pytest.approx(float(ref[i, res.next_ids[i]]), abs=1e-5)
        if top[i] == 0:
            assert res.top_logprobs[i] is None
            continue
        vals, idx = ref[i].topk(top[i])
        got_ids = [t for t, _ in res.top_logprobs[i]]
        got_vals = [v for _, v in res.top_logprobs[i]]
        assert got_ids == idx.tolist()
        assert got_vals == pytest.approx(vals.tolist(), abs=1e-5)
        assert got_vals == sorted(got_vals, reverse=True)


def test_return_logprob_flags():
    logits = torch.randn(4, V)
    params = [SamplingParams(temperature=0.0)] * 4
    res = _call(logits, params, top=[0, 3, 0, 0], want=[True, False, False, True])
    assert res.logprobs[0] is not None and res.logprobs[3] is not None
    assert res.logprobs[1] is not None  # top-k asked: the chosen token's logprob comes along
    assert res.logprobs[2] is None
    assert res.top_logprobs[1] is not None and len(res.top_logprobs[1]) == 3
    assert res.top_logprobs[0] is None and res.top_logprobs[2] is None


def test_top_logprobs_num_larger_than_vocab_is_clamped():
    logits = torch.randn(2, 8)
    res = _call(logits, [SamplingParams(temperature=0.0)] * 2, top=[100, 3])
    assert len(res.top_logprobs[0]) == 8 and len(res.top_logprobs[1]) == 3


def test_unseeded_row_without_generator_uses_global_rng():
    logits = torch.randn(3, V)
    res = _call(logits, [SamplingParams(temperature=1.0)] * 3, generators=[None] * 3)
    assert all(0 <= t < V for t in res.next_ids)


def test_make_generator_seeds():
    a = torch.rand(5, generator=make_generator(42, 0))
    assert torch.equal(a, torch.rand(5, generator=make_generator(None, 42)))
    assert not torch.equal(a, torch.rand(5, generator=make_generator(43, 42)))
    torch.rand(1, generator=make_generator(-1, 0))  # negative and huge seeds are accepted
    torch.rand(1, generator=make_generator(2**70, 0))
