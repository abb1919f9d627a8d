"""Gemma 3 270M (Q4_K_M GGUF, `--model-path gemma3-270m`) against HF transformers on the same
GGUF, fp32 on CPU: greedy outputs equal the golden `tests/golden/gemma3.json` (HF's, made by
tests/golden/regenerate.py). Only in `make test-all` (the file is fetched on first use): two short
prompts and one past the 512-token sliding window; all 8 prompts (up to 2,000 tokens) with all 32
tokens, then again from the radix cache; HF live on one prompt. The default suite covers the
gemma3 GGUF loader on a tiny model (test_gemma3.py)."""
from __future__ import annotations

import pytest

from engines import assert_outputs_equal, generate_ids, make_engine
from golden import load_golden

GOLDEN = load_golden("gemma3", model="gemma3-270m")
CASES = GOLDEN["cases"]
pytestmark = [pytest.mark.model, pytest.mark.slow]


@pytest.fixture(scope="module")
def engine():
    with make_engine("gemma3-270m", max_total_tokens=16_384, context_length=4096) as e:
        yield e


def test_short_and_past_the_window_match_hf(engine):
    cases = [CASES[0], CASES[1], CASES[3]]  # 6, 300 and 700 tokens
    assert len(cases[2]["prompt"]) > 512  # the model's sliding window
    assert_outputs_equal(generate_ids(engine, [c["prompt"] for c in cases], 4), cases, 4)


def test_eight_prompts_up_to_2k_tokens_match_hf_twice(engine):
    prompts, new = [c["prompt"] for c in CASES], GOLDEN["new_tokens"]
    assert_outputs_equal(generate_ids(engine, prompts, new), CASES, new)
    assert_outputs_equal(generate_ids(engine, prompts, new), CASES, new, label="cached prompt")


def test_live_hf_oracle_agrees_with_the_golden():
    from golden.regenerate import greedy, load_hf

    model, _ = load_hf("gemma3-270m")
    case = CASES[3]
    assert greedy(model, case["prompt"], 8)[0] == case["output"][:8]
