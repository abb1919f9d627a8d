"""Greedy parity with HF transformers (the oracle) on the default GGUF, fp32, CPU.

The reference is `tests/golden/parity.json`: HF's greedy outputs (64 new tokens) for 16 prompts of
5 to 1,500 tokens, half of them sharing a 700-token prefix, each decoded alone with its own KV cache
(`tests/golden/regenerate.py`). Submitted together, the engine's outputs must equal them under
every configuration below. `test_live_hf_oracle` runs HF itself on one of the prompts, so that a
golden gone stale fails here rather than passing silently.

The configuration variants run a Profile: 6 of the prompts and 16 new tokens (a prefix of the golden
outputs: greedy decoding is prefix-consistent); `make test-all` also runs them on 8 prompts of up to
1,286 tokens with all 64.
"""
from __future__ import annotations

import threading
import time
from typing import NamedTuple

import pytest

from engines import assert_outputs_equal, generate_ids, greedy, make_engine
from golden import load_golden

GOLDEN = load_golden("parity")
CASES = GOLDEN["cases"]
PROMPTS = [c["prompt"] for c in CASES]
NEW_TOKENS = GOLDEN["new_tokens"]
LIVE = (1,)  # the 218-token prompt
pytestmark = pytest.mark.model


class Profile(NamedTuple):
    """Which golden prompts a variant runs, and how many tokens it decodes."""
    cases: tuple[int, ...]
    new_tokens: int

    def prompts(self) -> list[list[int]]:
        return [PROMPTS[i] for i in self.cases]

    def golden(self) -> list[dict]:
        return [CASES[i] for i in self.cases]


# lengths 5, 218, 432, 645 alone and 705, 795 sharing 700 tokens; `make test-all` adds every other
# prompt (5 to 1,286 tokens, 4 sharing the prefix) with all 64 tokens
SHORT = Profile((0, 1, 2, 3, 8, 11), 16)
FULL = Profile(tuple(range(0, 16, 2)), NEW_TOKENS)
PROFILES = [pytest.param(SHORT, id="short"), pytest.param(FULL, id="full", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def default_engine(default_model_path):
    """The default configuration with room for all 16 prompts at once (shared: it runs the
    16-prompt batch, then the cache-hit rounds over what that batch cached)."""
    with make_engine(default_model_path, max_total_tokens=40_000) as engine:
        yield engine


@pytest.mark.slow  # the default suite runs the short profile's six prompts in each configuration below
def test_sixteen_prompts_together_match_hf(default_engine):
    assert_outputs_equal(generate_ids(default_engine, PROMPTS, NEW_TOKENS), CASES, NEW_TOKENS)
    default_engine.check_integrity()


def test_live_hf_oracle(hf_reference, default_engine):
    """HF transformers, run now, still gives the golden outputs, and so does the engine, decoding
    the prompt alone (on CPU, batch-1 decode reads the linears' weights from the GGUF's blocks)."""
    from golden.regenerate import greedy as hf_greedy

    model = default_engine.scheduler.runner.model
    if model.device.type == "cpu" and model.packs:
        assert all(p.quantized is not None for p in (*model.layers[0].mlp.packs.values(), model.packs["lm_head"]))

    cases = [CASES[i] for i in LIVE]
    live = [hf_greedy(hf_reference.model, c["prompt"], NEW_TOKENS)[0] for c in cases]
    assert live == [c["output"] for c in cases], "HF disagrees with tests/golden/parity.json: run `make golden`"
    assert generate_ids(default_engine, [c["prompt"] for c in cases], NEW_TOKENS) == live


def assert_second_round_hits(engine, profile: Profile, page: int) -> None:
    """The profile's prompts again: the same outputs, each served from cache but its last token."""
    second = engine.generate(input_ids=profile.prompts(), sampling_params=greedy(profile.new_tokens))
    assert_outputs_equal([o["output_ids"] for o in second], profile.golden(), profile.new_tokens)
    for ids, o in zip(profile.prompts(), second):
        assert o["meta_info"]["cached_tokens"] == (len(ids) - 1) // page * page
    engine.check_integrity()


def assert_profile_matches(engine, profile: Profile) -> None:
    got = generate_ids(engine, profile.prompts(), profile.new_tokens)
    assert_outputs_equal(got, profile.golden(), profile.new_tokens)


@pytest.mark.parametrize("profile", PROFILES)
def test_radix_hits_match_hf(default_engine, profile):
    """After the 16-prompt batch (or a first round here when run alone), twice from cache."""
    assert_profile_matches(default_engine, profile)
    assert_second_round_hits(default_engine, profile, page=1)


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("options", [
    pytest.param({"chunked_prefill_size": 64}, id="chunked-64"),
    pytest.param({"page_size": 16}, id="page-16"),
    pytest.param({"page_size": 1, "radix_eviction_policy": "lfu"}, id="page-1-lfu", marks=pytest.mark.slow),
    pytest.param({"schedule_policy": "lpm", "max_prefill_tokens": 2048}, id="lpm", marks=pytest.mark.slow),
])
def test_batch_matches_hf_and_cache_hits_too(default_model_path, options, profile):
    with make_engine(default_model_path, max_total_tokens=40_000, **options) as engine:
        assert_profile_matches(engine, profile)
        assert_second_round_hits(engine, profile, options.get("page_size", 1))


def retraction_pool(prompts: list[list[int]], page: int, running: int = 4) -> int:
    """L1 tokens that admit the first `running` prompts with the one page each of headroom the
    scheduler keeps for their decode, and one page more: decoding past a page's worth of tokens,
    they outgrow it and the latest arrival is retracted."""
    pages = sum(-(-len(p) // page) for p in prompts[:running])
    return (pages + running + 1) * page


# decoding must outgrow the headroom: more than one page (16) of new tokens
@pytest.mark.parametrize("profile", [pytest.param(SHORT._replace(new_tokens=32), id="short"), PROFILES[1]])
def test_small_pool_retracts_and_recomputes(default_model_path, profile):
    pool = retraction_pool(profile.prompts(), page=16)
    with make_engine(default_model_path, max_total_tokens=pool, page_size=16) as engine:
        assert_profile_matches(engine, profile)
        stats = engine.get_stats()
        assert stats["retractions"] > 0, stats
        assert stats["tiers"]["device"]["evicted_tokens"] > 0
        engine.check_integrity()


@pytest.mark.parametrize("profile", PROFILES)
def test_disabled_radix_cache_matches(default_model_path, profile):
    with make_engine(default_model_path, max_total_tokens=40_000, disable_radix_cache=True) as engine:
        assert_profile_matches(engine, profile)
        again = engine.generate(input_ids=profile.prompts()[:2], sampling_params=greedy(profile.new_tokens))
        assert all(o["meta_info"]["cached_tokens"] == 0 for o in again)
        engine.check_integrity()


@pytest.mark.parametrize("profile", PROFILES)
def test_arrivals_while_others_decode(default_model_path, profile):
    prompts = profile.prompts()
    with make_engine(default_model_path, max_total_tokens=40_000, chunked_prefill_size=256) as engine:
        results: dict[int, list[int]] = {}

        def one(i):
            params = greedy(profile.new_tokens)
            results[i] = engine.generate(input_ids=prompts[i], sampling_params=params)["output_ids"]

        threads = []
        for i in range(len(prompts)):
            threads.append(threading.Thread(target=one, args=(i,)))
            threads[-1].start()
            time.sleep(0.15)  # later prompts arrive while earlier ones are decoding
        for t in threads:
            t.join()
        assert_outputs_equal([results[i] for i in range(len(prompts))], profile.golden(), profile.new_tokens)
        engine.check_integrity()


@pytest.mark.slow  # three processes load the GGUF; the tiny model's TP=2 runs in the default suite (test_tp.py)
def test_tensor_parallel_ranks_match_hf(default_model_path):
    """SmolLM2-135M has 9 query and 3 KV heads: 3 ranks split them (2 do not), over gloo. Chunked
    prefill, then the same prompts again from the radix cache."""
    with make_engine(default_model_path, tp_size=3, max_total_tokens=8192, chunked_prefill_size=128) as engine:
        for _ in range(2):
            assert_outputs_equal(generate_ids(engine, SHORT.prompts(), SHORT.new_tokens), SHORT.golden(),
                                 SHORT.new_tokens)
