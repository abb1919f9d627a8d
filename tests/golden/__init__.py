"""Golden reference outputs of HF transformers on packaged GGUFs (see `regenerate.py`)."""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

HERE = Path(__file__).resolve().parent


@lru_cache(maxsize=None)
def load_golden(name: str, model: str = "smollm2-135m") -> dict:
    """The parsed `tests/golden/<name>.json`; refuses one made on other weights than the packaged
    `model` (a name of `hicache.runtime.default_model.PACKAGED_MODELS`)."""
    from hicache.runtime.default_model import PACKAGED_MODELS

    want = PACKAGED_MODELS[model]
    data = json.loads((HERE / f"{name}.json").read_text())
    if data["model"] != {"file": want.file_name, "sha256": want.sha256}:
        raise AssertionError(f"tests/golden/{name}.json was made on {data['model']}, not "
                             f"{want.file_name}: run `make golden`")
    return data


def first_difference(got: list[int], want: list[int]) -> int | None:
    """Index of the first token where got and want differ (a length difference counts), None if equal."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def logits_vs_golden(ours, case: dict, start: int = 0) -> tuple[float, bool]:
    """Our logits [T, vocab] for positions start.. of a `logits.json` case against HF's summary:
    (largest |ours - HF| over HF's top ids at every position and over the logsumexp, whether our
    argmax is HF's top id at every position)."""
    import torch

    end = start + ours.shape[0]
    ids = torch.tensor(case["top_ids"][start:end])
    want = torch.tensor(case["top_logits"][start:end])
    lse = torch.tensor(case["logsumexp"][start:end])
    assert ids.shape[0] == ours.shape[0], f"the golden has {ids.shape[0]} positions from {start}, ours {ours.shape[0]}"
    ours = ours.float()
    err = max((ours.gather(1, ids) - want).abs().max().item(), (ours.logsumexp(-1) - lse).abs().max().item())
    return err, bool(torch.equal(ours.argmax(-1), ids[:, 0]))
