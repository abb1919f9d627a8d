"""Log-probs of prompt tokens (SGLang's return_logprob + logprob_start_len) on the default model,
against HF transformers' log_softmax of the same prompt (fp32, CPU): chunked prefill, a prefix
served from the cache, a prefix recomputed for its log-probs, top-n, max_new_tokens 0."""
from __future__ import annotations

import random

import pytest
import torch

from engines import make_engine

pytestmark = pytest.mark.model

CHUNK, PAGE = 8, 4  # a 40-token prompt spans five prefill chunks
TOL = 3e-3  # fp32: our oneDNN linears and compiled attention sum in other orders than HF's torch ops, which
# over 30 layers moves a log-prob by up to about 2e-3 on some random prompts; a wrong position or chunk
# boundary moves it by far more


@pytest.fixture(scope="module")
def engine(default_model_path):
    with make_engine(default_model_path, max_total_tokens=2048, context_length=512, chunked_prefill_size=CHUNK,
                     page_size=PAGE) as e:
        yield e


@pytest.fixture(scope="module")
def prompt_and_hf(hf_reference):
    """A fresh random prompt of 48 tokens and HF's log_softmax over it [48, V]."""
    ids = [random.randrange(100, 49000) for _ in range(48)]
    with torch.inference_mode():
        logits = hf_reference.model(torch.tensor([ids])).logits[0].float()
    return ids, torch.log_softmax(logits, dim=-1)


def _check(meta: dict, ids: list[int], start: int, ref: torch.Tensor, top: int = 0) -> None:
    """meta_info's input_token_logprobs (and input_top_logprobs) for ids[start:] against HF."""
    got = meta["input_token_logprobs"]
    assert [e[1] for e in got] == ids[start:] and got[0][0] is None
    want = [float(ref[p - 1, ids[p]]) for p in range(start + 1, len(ids))]
    assert max(abs(g[0] - w) for g, w in zip(got[1:], want)) < TOL
    if top:
        tops = meta["input_top_logprobs"]
        assert len(tops) == len(got) and tops[0] is None
        for p, entry in zip(range(start, len(ids) - 1), tops[1:]):
            vals, best = ref[p].topk(top)
            assert [e[1] for e in entry] == best.tolist()
            assert max(abs(e[0] - float(v)) for e, v in zip(entry, vals)) < TOL


def test_prompt_logprobs_match_hf_chunked_cached_and_recomputed(engine, prompt_and_hf):
    ids, ref = prompt_and_hf
    head = ids[:40]
    first = engine.generate(input_ids=head, sampling_params={"max_new_tokens": 1, "temperature": 0},
                            return_logprob=True, logprob_start_len=0, top_logprobs_num=3)
    _check(first["meta_info"], head, 0, ref, top=3)  # five chunks of 8
    assert first["meta_info"]["output_token_logprobs"][0][1] == first["output_ids"][0]
    # the 40 tokens are cached now: from position 30 on, only what is not cached is recomputed
    cached = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                             logprob_start_len=30)
    assert cached["meta_info"]["cached_tokens"] == 28  # the prefix match stops at the page before 30
    _check(cached["meta_info"], ids, 30, ref)
    whole = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                            logprob_start_len=0)
    assert whole["meta_info"]["cached_tokens"] == 0  # every position is scored: nothing is reused
    assert whole["output_ids"] == [] and whole["meta_info"]["output_token_logprobs"] == []
    _check(whole["meta_info"], ids, 0, ref)


def test_batch_sharing_a_prefix_as_select_sends_it(engine, prompt_and_hf):
    ids, ref = prompt_and_hf
    outs = engine.generate(input_ids=[ids[:20], ids[:33], ids], sampling_params={"max_new_tokens": 0},
                           return_logprob=True, logprob_start_len=18, return_text_in_logprobs=True)
    for out, n in zip(outs, (20, 33, 48)):
        _check(out["meta_info"], ids[:n], 18, ref)
        assert all(isinstance(e[2], str) for e in out["meta_info"]["input_token_logprobs"])


def test_no_prompt_logprobs_unless_asked_and_bad_start(engine):
    ids = list(range(300, 310))
    for start in (-1, len(ids)):
        out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1}, return_logprob=True,
                              logprob_start_len=start, top_logprobs_num=2)
        meta = out["meta_info"]
        assert meta["input_token_logprobs"] == [] and meta["input_top_logprobs"] == []
        assert len(meta["output_token_logprobs"]) == 1 and len(meta["output_top_logprobs"][0]) == 2
    for start in (len(ids) + 1, -2):
        with pytest.raises(ValueError, match="logprob_start_len"):
            engine.generate(input_ids=ids, return_logprob=True, logprob_start_len=start)
