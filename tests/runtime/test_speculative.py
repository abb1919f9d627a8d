"""Speculative decoding (NGRAM, runtime/spec/): greedy outputs equal decoding without drafts, on
the tiny random model (driving the Scheduler, integrity checked after every step) and on the
default model; rejection sampling keeps the target distribution; bad options name their field."""
from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hicache.config import HiCacheConfig
from hicache.runtime.build import build_scheduler
from hicache.runtime.config import RuntimeConfig
from hicache.runtime.sampler import filtered_probs
from hicache.runtime.sampling import SamplingParams
from hicache.runtime.spec.drafter import Drafter
from hicache.runtime.spec.verify import accept_sampled, verify
from engines import make_engine
from test_overlap import GREEDY, request, run


REAL_TIMED = Drafter.timed  # (the fixture below replaces it)


@pytest.fixture(autouse=True)
def memory_bound_step_costs(monkeypatch):
    """Step costs of a memory-bound device (a token more costs a hundredth of a step), recorded
    instead of this machine's timings: whether and how long a request drafts must not depend on
    how loaded the machine running the tests is. The cost model itself is tested on its own."""
    def timed(self, plan, seconds):
        if plan.mode in ("decode", "verify"):
            self.costs.tick()
            self.costs.record(sum(plan.extend_lens), 0.01 * (1 + sum(plan.extend_lens) / 100))
    monkeypatch.setattr(Drafter, "timed", timed)


def scheduler(config_path, spec: bool, page_size: int = 4, draft=None, **options):
    """NGRAM with `spec`; STANDALONE with `draft` (the draft model's config: dummy weights too)."""
    options = {"max_total_tokens": 1024, "chunked_prefill_size": 48, "device": "cpu", **options}
    algorithm = "STANDALONE" if draft is not None else "NGRAM" if spec else None
    rc = RuntimeConfig(model_path=str(config_path), load_format="dummy", max_running_requests=8,
                       max_prefill_tokens=96, dtype="float32", speculative_algorithm=algorithm,
                       speculative_draft_model_path=None if draft is None else str(draft), **options)
    return build_scheduler(rc, HiCacheConfig(page_size=page_size, hicache_storage_backend="none"))


def repeating(seed: int, n: int, params: dict) -> dict:
    """Arrivals of `n` requests whose prompts repeat a random phrase (so that the tiny random
    model's greedy outputs loop too, and drafts get accepted), two by two."""
    rnd = random.Random(seed)
    phrase = [rnd.randrange(3, 500) for _ in range(9)]
    script: dict = {}
    for i in range(n):
        script.setdefault(2 * (i // 2), []).append(
            request(f"r{i}", (phrase * 5)[i:30 + 3 * i], {**params, "max_new_tokens": 29 + 5 * i}))
    return script


@pytest.mark.parametrize("page_size, penalties", [(1, {}), (4, {}), (4, {"frequency_penalty": 0.2,
                                                                         "repetition_penalty": 1.05})])
def test_greedy_outputs_equal_decoding_and_drafts_are_accepted(tiny_config_path, page_size, penalties):
    """With penalties too: each position's history holds the drafts before it."""
    params = {**GREEDY, **penalties}
    base = scheduler(tiny_config_path, False, page_size)
    plain = run(base, repeating(0, 6, params))
    sched = scheduler(tiny_config_path, True, page_size)
    spec = run(sched, repeating(0, 6, params))  # integrity after every step; no page held at the end
    assert sched.cache.tree.total_tokens() == base.cache.tree.total_tokens()  # no rejected draft reached it
    for rid in plain:
        assert spec[rid]["ids"] == plain[rid]["ids"], rid
        assert spec[rid]["reason"] == plain[rid]["reason"], rid
    counts = sched.stats()["speculative"]
    assert counts["accepted_tokens"] > (0 if penalties else 0.3 * counts["draft_tokens"]) and counts["draft_tokens"]
    per = counts["accepted_per_draft"]
    assert sum(per.values()) == counts["drafts"] and sum(int(m) * n for m, n in per.items()) == counts["accepted_tokens"]
    metas = [o["meta"] for o in spec.values()]
    assert sum(m.get("spec_verify_ct", 0) for m in metas) == counts["drafts"]
    assert all(m["spec_accept_length"] >= 1 for m in metas if "spec_verify_ct" in m)
    assert sched.stats()["forward_steps"] < sum(len(o["ids"]) for o in plain.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_greedy_outputs_equal_decoding_on_cuda(tiny_config_path, backend):
    """The verify step on CUDA (Triton's extend kernel with the draft positions, or torch's), the
    plain decode steps through CUDA graphs: the same tokens as decoding without drafts."""
    options = {"device": "cuda", "attention_backend": backend}
    plain = run(scheduler(tiny_config_path, False, **options), repeating(1, 6, GREEDY))
    sched = scheduler(tiny_config_path, True, **options)
    spec = run(sched, repeating(1, 6, GREEDY))
    assert {rid: o["ids"] for rid, o in spec.items()} == {rid: o["ids"] for rid, o in plain.items()}
    assert sched.stats()["speculative"]["accepted_tokens"] > 0


def test_greedy_equal_under_retraction_chunked_prefill_and_l2_load_back(tiny_config_path):
    """A small L1: prompts longer than a prefill chunk, requests retracted while they draft, and a
    second wave of the same prompts loaded back from L2."""
    def script():
        rnd = random.Random(5)
        phrase = [rnd.randrange(3, 500) for _ in range(11)]
        wave = [(phrase * 9)[i:70 + 4 * i] for i in range(6)]
        return {0: [request(f"a{i}", ids, {**GREEDY, "max_new_tokens": 40}) for i, ids in enumerate(wave)],
                400: [request(f"b{i}", ids, {**GREEDY, "max_new_tokens": 40}) for i, ids in enumerate(wave)]}

    small = {"max_total_tokens": 320, "schedule_conservativeness": 0}  # admit past the outputs' room: retract
    plain = run(scheduler(tiny_config_path, False, **small), script())
    sched = scheduler(tiny_config_path, True, **small)
    spec = run(sched, script())
    for rid in plain:
        assert spec[rid]["ids"] == plain[rid]["ids"], rid
    stats = sched.stats()
    assert stats["retractions"] > 0 and stats["tiers"]["host"]["hit_tokens"] > 0
    assert stats["speculative"]["accepted_tokens"] > 0


def test_stop_tokens_and_a_draft_past_them_end_where_decoding_ends(tiny_config_path):
    first = run(scheduler(tiny_config_path, False), repeating(1, 4, GREEDY))
    # stop at a token each output holds after its first few: drafts carry past it
    stops = {rid: o["ids"][7] for rid, o in first.items()}
    assert len(stops) == 4

    def script():
        return {step: [request(m.rid, m.input_ids, {**GREEDY, "max_new_tokens": m.sampling_params.max_new_tokens,
                                                     "stop_token_ids": [stops[m.rid]]}) for m in msgs]
                for step, msgs in repeating(1, 4, GREEDY).items()}

    plain = run(scheduler(tiny_config_path, False), script())
    spec = run(scheduler(tiny_config_path, True), script())
    for rid in plain:
        assert spec[rid]["ids"] == plain[rid]["ids"] and spec[rid]["reason"] == plain[rid]["reason"], rid
        assert plain[rid]["reason"]["type"] == "stop"


def test_sampled_requests_finish_and_logprob_requests_decode(tiny_config_path):
    params = {"temperature": 0.1, "top_k": 20, "top_p": 0.95, "seed": 7,
              "ignore_eos": True}
    script = {**repeating(2, 4, params),
              1: [request("lp", list(range(5, 30)) * 2, {**GREEDY, "max_new_tokens": 12}, return_logprob=True)]}
    sched = scheduler(tiny_config_path, True)
    out = run(sched, script)  # integrity after every step
    for rid, o in out.items():
        assert o["reason"]["type"] == "length" and len(o["ids"]) == o["meta"]["completion_tokens"], rid
    assert [len(out[f"r{i}"]["ids"]) for i in range(4)] == [29 + 5 * i for i in range(4)]
    assert len(out["lp"]["logprobs"]) == len(out["lp"]["ids"]) == 12  # one log-prob a token: it never drafted
    assert "spec_verify_ct" not in out["lp"]["meta"]
    assert sched.stats()["speculative"]["accepted_tokens"] > 0, sched.stats()["speculative"]


def test_no_drafts_past_the_batch_limit(tiny_config_path):
    sched = scheduler(tiny_config_path, True, speculative_max_batch_size=1)
    run(sched, {0: [m for msgs in repeating(3, 4, GREEDY).values() for m in msgs]})
    small = scheduler(tiny_config_path, True)
    run(small, {0: [m for msgs in repeating(3, 4, GREEDY).values() for m in msgs]})
    assert sched.stats()["speculative"]["drafts"] < small.stats()["speculative"]["drafts"]


def test_drafts_are_cut_to_what_the_measured_step_costs_pay_for(tiny_config_path):
    from hicache.runtime.spec.drafter import REFRESH, StepCosts

    drafter = scheduler(tiny_config_path, True).drafter
    proposals = [4, 4]  # draft tokens proposed
    assert drafter.fit([0.5, 0.5], proposals) == [0, 0]  # a plain step of two is measured first
    drafter.costs.record(2, 0.010)
    assert drafter.fit([0.5, 0.5], proposals) == proposals  # larger steps: estimated as that one, tried
    costs = StepCosts()
    costs.record(2, 0.010)
    costs.record(10, 0.050)
    assert costs.estimate(6) == pytest.approx(0.030) and costs.estimate(20) == 0.050 and costs.estimate(1) == 0.010
    for n in range(2, 11):  # memory-bound steps: a token more costs little
        drafter.costs.record(n, 0.010 + 0.0001 * n)
    assert drafter.fit([0.9, 0.9], proposals) == proposals
    assert drafter.fit([0.9, 0.02], proposals) == [4, 0]  # one whose drafts fail drafts none
    for n in range(2, 11):  # compute-bound steps: each token costs as much as the step before
        drafter.costs.record(n, 0.005 * n)
        drafter.costs.record(n, 0.005 * n)
        drafter.costs.record(n, 0.005 * n)
    assert drafter.fit([0.6, 0.6], proposals) == [0, 0]
    for _ in range(REFRESH):
        drafter.costs.tick()
        drafter.costs.record(10, 0.001)
    assert drafter.costs.stale(2) and drafter.fit([0.99, 0.99], proposals) == [0, 0]  # measured again first


def test_a_batch_size_whose_verify_steps_gave_less_than_plain_ones_stops_drafting(tiny_config_path):
    """The expected gain says draft (memory-bound costs, good rates), but verify steps of two
    requests were measured to give fewer tokens a second than a plain step of two: no drafts
    at that size until that measure is REFRESH steps old; other sizes draft. A single bad verify
    step (one whose drafts were all rejected) is not enough."""
    from hicache.runtime.spec.drafter import REFRESH, YIELD_EVIDENCE

    drafter = scheduler(tiny_config_path, True).drafter
    proposals = [4, 4]  # draft tokens proposed
    for n in range(1, 11):
        drafter.costs.record(n, 0.010 + 0.0001 * n)
    assert drafter.fit([0.9, 0.9], proposals) == proposals
    drafter.yields.record(2, 0.06, 2)
    assert drafter.fit([0.9, 0.9], proposals) == proposals  # one step: no evidence yet
    drafter.yields.clear()
    for _ in range(YIELD_EVIDENCE):  # seconds and tokens emitted; a plain step of two: 0.0051 a token
        drafter.yields.record(2, 0.0204, 4)
    assert drafter.fit([0.9, 0.9], proposals) == proposals  # (no worse)
    drafter.yields.record(2, 0.06, 2)
    assert drafter.fit([0.9, 0.9], proposals) == [0, 0]
    assert drafter.fit([0.9, 0.9, 0.9], proposals + [1]) == proposals + [1]
    for _ in range(REFRESH):
        drafter.yields.tick()
    assert drafter.fit([0.9, 0.9], proposals) == proposals  # tried again


def test_timed_steps_measure_step_costs_and_verify_yields(tiny_config_path):
    """A step's seconds go to the costs of its token count; a verify step's, over the tokens it
    emitted (one a request plus the drafts accepted), to its batch size's yield too."""
    from hicache.runtime.batch import BatchPlan
    from hicache.runtime.spec.drafter import YIELD_EVIDENCE, SpecState

    drafter = scheduler(tiny_config_path, True).drafter
    REAL_TIMED(drafter, BatchPlan("decode", [None, None], [5, 7], [1, 1], [True, True]), 0.02)
    assert drafter.costs.measured(2) == 0.02 and drafter.yields.seconds_per_token(2) is None
    a, b = SimpleNamespace(spec=SpecState(1, 3)), SimpleNamespace(spec=SpecState(1, 3))
    verify = BatchPlan("verify", [a, b], [5, 7], [4, 3], [True, True], drafts=[[1, 2, 3], [4, 5]])
    for n in range(YIELD_EVIDENCE):
        assert drafter.yields.seconds_per_token(2) is None  # too few verify steps measured yet
        drafter.record(a, 3, 2)
        drafter.record(b, 2, 0)
        REAL_TIMED(drafter, verify, 0.03)
        if n == 0:
            assert drafter.costs.measured(7) == 0.03
            assert drafter.prior == pytest.approx((0.99 * 2 + 1) / (0.99 * 2 + 0.99 + 1 + 2))  # 2 accepted, 2 rejections
    assert drafter.yields.seconds_per_token(2) == pytest.approx(0.03 / 4)  # 4 tokens a step: 1 + 1 + 2 accepted


def test_a_new_request_starts_from_the_server_share_of_accepted_drafts():
    from hicache.runtime.spec.drafter import SpecState

    fresh = SpecState(1, 3)
    assert fresh.rate() == 0.5 and fresh.rate(0.1) == pytest.approx(0.1)
    fresh.record(4, 4)
    assert fresh.rate(0.1) > 0.5


def test_a_request_record_of_rejections_fades():
    from hicache.runtime.spec.drafter import SpecState

    state = SpecState(1, 3)
    assert state.rate() == 0.5
    for _ in range(5):
        state.record(4, 0)
    low = state.rate()
    assert low < 0.2
    for _ in range(40):
        state.fade()
    assert low < state.rate() < 0.5  # tried again, some time later
    state.record(4, 4)
    assert state.rate() > 0.5


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_rejection_sampling_keeps_the_target_distribution():
    """First token of a draft [x, y]: distributed as p0 whether x is accepted or not; second
    token, given x was accepted: as p1. Chi-square against the exact distributions (df <= 7,
    0.1% critical values ~ 24)."""
    gen = torch.Generator().manual_seed(1234)
    logits = torch.randn(3, 8, generator=gen) * 1.5
    p = logits.softmax(dim=-1)
    draft = [int(p[0].argsort()[3]), int(p[1].argmax())]  # a middling first draft: often rejected
    n = 40_000
    first, second = torch.zeros(8), torch.zeros(8)
    for _ in range(n):
        out = accept_sampled(p, draft, gen)
        first[out[0]] += 1
        if out[0] == draft[0]:
            second[out[1]] += 1
    assert chi_square(first, p[0]) < 24
    assert chi_square(second, p[1]) < 24


def test_verify_processes_each_position_as_the_sampler_does():
    """Temperature, top_k and a repetition penalty that depends on the drafts before a position:
    the first token follows the sampler's processed distribution at position 0, the second (given
    the first draft accepted) the one at position 1 with the draft in the history."""
    vocab, draft = 8, [3, 5]
    gen = torch.Generator().manual_seed(99)
    logits = torch.randn(3, vocab, generator=gen)
    logits[0, 3] = logits[0].max() + 0.5  # the first draft is likely
    params = SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.5)

    class R:
        input_ids, output_ids, generator = [1, 2], [4], gen

    R.params = params
    want = [filtered_probs(_penalized(logits[j:j + 1], params, [4, *draft[:j]]), [params])[0] for j in range(2)]
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    for _ in range(20_000):
        out = verify(logits, [R], [draft])[0]
        first[out[0]] += 1
        if out[0] == draft[0]:
            second[out[1]] += 1
    assert chi_square(first, want[0]) < 24
    assert chi_square(second, want[1]) < 24
    greedy = SamplingParams(temperature=0.0)
    R.params = greedy
    targets = logits.argmax(dim=-1).tolist()
    got = verify(logits, [R], [[targets[0], 99 % vocab]])[0]
    assert got[:1] == [targets[0]] and len(got) in (2, 3)


def _penalized(row: torch.Tensor, params: SamplingParams, history: list[int]) -> torch.Tensor:
    out = row.clone()
    for t in {1, 2, *history}:
        out[0, t] = out[0, t] / params.repetition_penalty if out[0, t] > 0 else out[0, t] * params.repetition_penalty
    return out


@pytest.mark.parametrize("options, field", [
    ({"speculative_algorithm": "EAGLE"}, "speculative_algorithm"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 0}, "speculative_num_draft_tokens"),
    ({"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 5}, "speculative_ngram_min_match"),
    ({"speculative_algorithm": "NGRAM", "speculative_max_batch_size": 0}, "speculative_max_batch_size"),
    ({"speculative_algorithm": "NGRAM", "overlap_schedule": True}, "speculative_algorithm"),
    ({"speculative_algorithm": "NGRAM", "tp_size": 2}, "speculative_algorithm"),
    ({"speculative_algorithm": "STANDALONE"}, "speculative_draft_model_path"),
    ({"speculative_algorithm": "NGRAM", "speculative_draft_model_path": "x"}, "speculative_draft_model_path"),
    ({"speculative_draft_model_path": "x"}, "speculative_draft_model_path"),
])
def test_bad_options_name_their_field(options, field):
    with pytest.raises(ValueError, match=field):
        RuntimeConfig(**options)


def tiny_draft(tmp_path, tiny_config_path, **changes) -> Path:
    """A config of another tiny random model: the target's with `changes`."""
    cfg = {**json.loads(tiny_config_path.read_text()), "_name_or_path": "tiny-draft", **changes}
    path = tmp_path / "draft.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.fixture(params=["the target", "another model"])
def draft_config(request, tmp_path, tiny_config_path):
    """The draft model of STANDALONE tests: the target itself (same dummy weights: its drafts are
    the target's tokens) or a smaller random model with the same vocabulary."""
    if request.param == "the target":
        return tiny_config_path
    return tiny_draft(tmp_path, tiny_config_path, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)


@pytest.mark.parametrize("page_size", [1, 4])
def test_standalone_greedy_outputs_equal_decoding_across_chunked_prefill(tiny_config_path, draft_config, page_size):
    """Prompts longer than a prefill chunk; the draft catches up on each request's tokens, its
    rejected drafts' KV freed (integrity of both caches after every step), and its prefixes
    cached in its own tree once requests finish."""
    small = {"chunked_prefill_size": 16}
    base = scheduler(tiny_config_path, False, page_size, **small)
    plain = run(base, repeating(0, 6, GREEDY))
    sched = scheduler(tiny_config_path, True, page_size, draft=draft_config, **small)
    spec = run(sched, repeating(0, 6, GREEDY))  # integrity of both caches after every step
    assert sched.cache.tree.total_tokens() == base.cache.tree.total_tokens()  # no rejected draft reached it
    for rid in plain:
        assert spec[rid]["ids"] == plain[rid]["ids"] and spec[rid]["reason"] == plain[rid]["reason"], rid
    counts = sched.stats()["speculative"]
    assert counts["drafts"] > 0
    if draft_config == tiny_config_path:  # the same weights: the draft decodes the target's tokens
        assert counts["accepted_tokens"] > 0.9 * counts["draft_tokens"]
    # the draft's tree holds what it computed of the finished requests, no more than the target's
    assert 0 < sched.drafter.model.cache.tree.total_tokens() <= base.cache.tree.total_tokens()


def test_standalone_greedy_equal_under_retraction_stop_tokens_and_sampling(tiny_config_path, draft_config):
    """A small L1 (requests retracted while they draft: their shadows released), stop tokens that
    drafts carry past, and sampled requests that finish at their length."""
    first = run(scheduler(tiny_config_path, False), repeating(1, 4, GREEDY))
    stops = {rid: o["ids"][7] for rid, o in first.items()}

    def script():
        return {step: [request(m.rid, m.input_ids, {**GREEDY, "max_new_tokens": m.sampling_params.max_new_tokens,
                                                     "stop_token_ids": [stops[m.rid]]}) for m in msgs]
                for step, msgs in repeating(1, 4, GREEDY).items()}

    plain = run(scheduler(tiny_config_path, False), script())
    spec = run(scheduler(tiny_config_path, True, draft=draft_config), script())
    for rid in plain:
        assert spec[rid]["ids"] == plain[rid]["ids"] and spec[rid]["reason"] == plain[rid]["reason"], rid
    small = {"max_total_tokens": 160, "schedule_conservativeness": 0}
    plain = run(scheduler(tiny_config_path, False, **small), repeating(2, 6, GREEDY))
    sched = scheduler(tiny_config_path, True, draft=draft_config, **small)
    spec = run(sched, repeating(2, 6, GREEDY))
    for rid in plain:
        assert spec[rid]["ids"] == plain[rid]["ids"], rid
    assert sched.stats()["retractions"] > 0 and sched.stats()["speculative"]["drafts"] > 0
    params = {"temperature": 0.8, "top_k": 20, "seed": 3, "ignore_eos": True}
    out = run(scheduler(tiny_config_path, True, draft=draft_config), repeating(3, 4, params))
    assert [len(out[f"r{i}"]["ids"]) for i in range(4)] == [29 + 5 * i for i in range(4)]


def test_standalone_refuses_a_draft_model_of_another_vocabulary(tmp_path, tiny_config_path):
    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        scheduler(tiny_config_path, True, draft=tiny_draft(tmp_path, tiny_config_path, vocab_size=256))


MERGE = """def merge_sorted(a, b):
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out
"""


def test_default_model_greedy_equal_with_and_without_drafts(default_model_path):
    prompt = ("<|im_start|>user\nRewrite this Python function, renaming merge_sorted to merge_lists, and keep "
              f"everything else the same:\n\n{MERGE}<|im_end|>\n<|im_start|>assistant\n")
    params = {"temperature": 0, "max_new_tokens": 96}
    outs = {}
    for spec in (None, "NGRAM"):
        engine = make_engine(default_model_path, speculative_algorithm=spec, hicache_storage_backend="none",
                             max_total_tokens=4096)
        try:
            outs[spec] = engine.generate(prompt, sampling_params=params)
            stats = engine.get_stats()
            engine.check_integrity()
        finally:
            engine.shutdown()
    assert outs["NGRAM"]["output_ids"] == outs[None]["output_ids"]
    assert stats["speculative"]["accepted_tokens"] > 40


def test_a_regenerated_answer_drafts_from_the_cache(default_model_path):
    """The second time a prompt is answered, the first answer is in the radix tree: drafts from
    the tree's index are accepted much longer than drafts from the request's own tokens alone."""
    prompt = "<|im_start|>user\nWrite a short poem about the sea at night.<|im_end|>\n<|im_start|>assistant\n"
    params = {"temperature": 0, "max_new_tokens": 64}
    lengths, texts = {}, {}
    for capacity in (0, 1_000_000):
        engine = make_engine(default_model_path, speculative_algorithm="NGRAM", speculative_ngram_capacity=capacity,
                             hicache_storage_backend="none", max_total_tokens=4096)
        try:
            first = engine.generate(prompt, sampling_params=params)
            again = engine.generate(prompt, sampling_params=params)
            engine.check_integrity()
        finally:
            engine.shutdown()
        assert again["output_ids"] == first["output_ids"]
        lengths[capacity], texts[capacity] = again["meta_info"].get("spec_accept_length", 1.0), again["output_ids"]
    assert texts[0] == texts[1_000_000]
    assert lengths[1_000_000] >= 1.5 * lengths[0], lengths


def test_default_model_standalone_greedy_equal_with_stop_strings_and_chunked_prefill(default_model_path):
    """The default model drafting for itself (its drafts hold), prompts in chunks, and a stop
    string inside the answer: the text ends where decoding without drafts ends it."""
    prompt = ("<|im_start|>user\nRewrite this Python function, renaming merge_sorted to merge_lists, and keep "
              f"everything else the same:\n\n{MERGE}<|im_end|>\n<|im_start|>assistant\n")
    outs, stats = {}, None
    for spec in (None, "STANDALONE"):
        engine = make_engine(default_model_path, speculative_algorithm=spec, hicache_storage_backend="none",
                             max_total_tokens=4096, chunked_prefill_size=32,
                             speculative_draft_model_path=default_model_path if spec else None)
        try:
            free = engine.generate(prompt, sampling_params={"temperature": 0, "max_new_tokens": 64})
            stop = free["text"][len(free["text"]) // 2:][:6]
            stopped = engine.generate(prompt, sampling_params={"temperature": 0, "max_new_tokens": 64, "stop": stop})
            outs[spec] = (free, stopped, stop)
            stats = engine.get_stats()
            engine.check_integrity()
        finally:
            engine.shutdown()
    (free, stopped, stop), (sfree, sstopped, sstop) = outs[None], outs["STANDALONE"]
    assert sfree["output_ids"] == free["output_ids"] and sstop == stop
    assert sstopped["text"] == stopped["text"] and len(stopped["text"]) < len(free["text"])
    assert sstopped["meta_info"]["finish_reason"] == stopped["meta_info"]["finish_reason"]
    assert stats["speculative"]["accepted_tokens"] > 0.8 * stats["speculative"]["draft_tokens"] > 0
    assert sfree["meta_info"]["spec_accept_length"] > 2
