"""Repetition, frequency and presence penalties of a batch's logits (the sampler's step 1 and 2;
see `runtime/sampler.py`), touching only the positions of each row's token history."""
from __future__ import annotations

from typing import Sequence

import torch

from hicache.runtime.pinned import tensor_to, to_device
from hicache.runtime.sampling import SamplingParams


def _flat_ids(rows: list[int], seqs: list[Sequence[int]], vocab: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat indices into a [B, V] tensor of every (row, token) pair, the position in `rows` of each)."""
    parts = [torch.as_tensor(s, dtype=torch.long) + r * vocab for r, s in zip(rows, seqs)]
    which = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([len(s) for s in seqs]))
    return to_device(torch.cat(parts), device), to_device(which, device)


def apply_penalties(raw: torch.Tensor,  # [B, V] float32
                    params: Sequence[SamplingParams],
                    prompt_ids: Sequence[Sequence[int]],
                    output_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """Penalized logits [B, V]: a copy when any row has penalties, else `raw` itself.

    Work is O(B * V) for the copy plus O(history tokens): only the listed positions are touched.
    """
    rep = [i for i, p in enumerate(params)
           if p.repetition_penalty != 1.0 and (len(prompt_ids[i]) or len(output_ids[i]))]
    oai = [i for i, p in enumerate(params)
           if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and len(output_ids[i])]
    if not rep and not oai:
        return raw
    scores = raw.clone()
    flat_scores = scores.view(-1)
    vocab = scores.shape[1]
    if rep:  # HF: gather, penalize, scatter back (duplicates write the same value)
        idx, which = _flat_ids(rep, [list(prompt_ids[i]) + list(output_ids[i]) for i in rep], vocab,
                               scores.device)
        pen = tensor_to([params[i].repetition_penalty for i in rep], scores.device, scores.dtype)[which]
        vals = flat_scores[idx]
        flat_scores[idx] = torch.where(vals < 0, vals * pen, vals / pen)
    if oai:  # OpenAI: every occurrence costs `frequency`, the first one also `presence`
        idx, which = _flat_ids(oai, [output_ids[i] for i in oai], vocab, scores.device)
        freq = tensor_to([params[i].frequency_penalty for i in oai], scores.device, scores.dtype)
        pres = tensor_to([params[i].presence_penalty for i in oai], scores.device, scores.dtype)
        flat_scores.index_add_(0, idx, -freq[which])
        uniq, first = _unique_with_source(idx, which)
        flat_scores.index_add_(0, uniq, -pres[first])
    return scores


def _unique_with_source(idx: torch.Tensor, which: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct flat indices and, for each, the row group it came from (a flat index names its row)."""
    uniq, inverse = torch.unique(idx, return_inverse=True)
    src = torch.empty_like(uniq).scatter_(0, inverse, which)
    return uniq, src
