"""Log-probs of prompt tokens, computed in the extend pass that computes the prompt.

Position p's logits score prompt token p + 1: for request i of an extend plan, the positions
`Req.input_logprob_positions(start, n)` give log_softmax(logits_p)[all_ids[p + 1]] and, with
top_logprobs_num > 0, the best n (token, log-prob) of that log_softmax, under the raw model
distribution (as the sampler's log-probs of generated tokens). A long prompt spans several chunks:
each chunk gives the positions it computes, the scheduler appends them in order.

The model keeps only the rows it samples otherwise; these positions are read from the pass's
hidden states, `SLICE_ROWS` at a time, so that the full-vocabulary logits of a long prompt are
never held at once: each slice keeps its chosen and top-n values only.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from hicache.runtime.pinned import HostCopy, tensor_to

if TYPE_CHECKING:
    from hicache.runtime.batch import BatchPlan

SLICE_ROWS = 256  # positions whose [rows, vocab] logits exist at once


class PromptRows(NamedTuple):
    """What one extend pass scores: flat over the plan's requests, in plan order."""

    rows: list[int]  # rows of the pass's hidden states [T, hidden]
    targets: list[int]  # the prompt token each row scores
    counts: list[int]  # per request of the plan: how many of the rows are its
    top_nums: list[int]  # per request of the plan: its top_logprobs_num


def select_rows(plan: BatchPlan) -> PromptRows | None:
    """The positions of `plan` whose prompt log-probs are still missing; None when there are none."""
    rows, targets, counts, offset = [], [], [], 0
    for req, start, n in zip(plan.reqs, plan.starts, plan.extend_lens):
        a, b = req.input_logprob_positions(start, n)
        rows.extend(range(offset + a - start, offset + b - start))
        targets.extend(req.input_ids[a + 1:b + 1])
        counts.append(b - a)
        offset += n
    if not rows:
        return None
    return PromptRows(rows, targets, counts, [r.top_logprobs_num for r in plan.reqs])


def launch(model: torch.nn.Module, hidden: torch.Tensor, sel: PromptRows | None) -> PendingPromptLogprobs | None:
    """Queues the prompt log-probs of the rows `sel` (`select_rows` of a plan) from its pass's
    `hidden` [T, hidden] (device); their copy to the host starts at once. None when sel is None."""
    if sel is None:
        return None
    rows, targets = tensor_to(sel.rows, hidden.device), tensor_to(sel.targets, hidden.device)
    top = max(sel.top_nums)
    chosen, vals, ids = [], [], []
    for lo in range(0, len(sel.rows), SLICE_ROWS):
        logits = model.compute_logits(hidden[rows[lo:lo + SLICE_ROWS]])  # [r, V] float32
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        chosen.append((logits.gather(1, targets[lo:lo + SLICE_ROWS, None]) - lse)[:, 0])
        if top > 0:
            v, i = logits.topk(min(top, logits.shape[1]), dim=-1)
            vals.append(v - lse)
            ids.append(i)
    tops = [torch.cat(vals), torch.cat(ids)] if top > 0 else [None, None]
    return PendingPromptLogprobs(sel, HostCopy([torch.cat(chosen), *tops]))


class PendingPromptLogprobs:
    """A launched pass's prompt log-probs on their way to the host."""

    def __init__(self, sel: PromptRows, copy: HostCopy):
        self.sel, self.copy = sel, copy

    def result(self) -> list[list | None]:
        """Per request of the plan: [[logprob, [[token_id, logprob], ...top-n] or None], ...] for
        its scored positions in order, or None where it has none."""
        chosen, vals, ids = self.copy.wait()
        chosen = chosen.tolist()
        vals, ids = (vals.tolist(), ids.tolist()) if vals is not None else (None, None)
        out: list[list | None] = []
        at = 0
        for count, n in zip(self.sel.counts, self.sel.top_nums):
            out.append([[chosen[j], _top(ids, vals, j, n)] for j in range(at, at + count)] if count else None)
            at += count
        return out


def _top(ids: list | None, vals: list | None, j: int, n: int) -> list | None:
    if n <= 0 or ids is None:
        return None
    return [[t, v] for t, v in zip(ids[j][:n], vals[j][:n])]
