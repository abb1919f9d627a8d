"""Engines on the default model for tests, and greedy comparisons with the HF goldens.

An Engine's default L3 is LMDB under `$HICACHE_HOME`: every page a test computes would be written
to disk. Tests that do not test LMDB itself run L3 on the in-memory backend instead (private to
each engine), so the storage path (backups, prefetch queries) still runs, at memory speed.
"""
from __future__ import annotations

from pathlib import Path

from golden import first_difference
from hicache import Engine
from hicache.runtime.messages import GenerateRequest
from hicache.runtime.sampling import SamplingParams

MEMORY_L3 = {"hicache_storage_backend": "memory"}


def make_engine(model_path: str | Path, **options) -> Engine:
    """An Engine on model_path with L3 in memory unless options name another backend."""
    return Engine(str(model_path), **{**MEMORY_L3, **options})


def greedy(new_tokens: int) -> dict:
    return {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}


def run_together(sched, tag: str, prompts: list[list[int]], vocab: int, new_tokens: int,
                 **sampling) -> list[tuple[list[int], dict]]:
    """Greedy outputs and meta of `prompts` submitted together to a Scheduler, its cache's
    integrity checked after every step."""
    params = SamplingParams.from_dict({**greedy(new_tokens), **sampling}, vocab_size=vocab)
    for i, p in enumerate(prompts):
        sched.add_request(GenerateRequest(f"{tag}{i}", p, params))
    out: dict[str, list] = {}
    for _ in range(5000):
        if not sched.has_requests():
            return [(out[f"{tag}{i}"][0], out[f"{tag}{i}"][1]) for i in range(len(prompts))]
        for o in sched.step():
            rec = out.setdefault(o.rid, [[], None])
            rec[0] += o.new_token_ids
            rec[1] = o.meta
        sched.check_integrity()
    raise AssertionError("the requests did not finish")


def generate_ids(engine: Engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy output ids of all prompts, submitted together."""
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=greedy(new_tokens))]


def assert_outputs_equal(got: list[list[int]], cases: list[dict], new_tokens: int, label: str = "prompt") -> None:
    """Each output equals the first new_tokens of its golden case's HF output (greedy decoding is
    prefix-consistent); a failure names the first differing token and HF's top-1 minus top-2
    logit there (a tiny margin is a near tie)."""
    for i, (g, case) in enumerate(zip(got, cases, strict=True)):
        want = case["output"][:new_tokens]
        assert len(want) == new_tokens, f"the golden holds only {len(want)} tokens"
        at = first_difference(g, want)
        if at is not None:
            margin = case["margins"][at] if at < len(case["margins"]) else None
            raise AssertionError(f"{label} {i} ({len(case['prompt'])} tokens): first difference at output token {at}"
                                 f" (ours {g[at:at + 3]}, HF {want[at:at + 3]}, HF's top-2 margin there {margin})")
