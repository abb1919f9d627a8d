"""Exact verification of draft tokens: which of them the target model accepts, and the token after.

A request with draft d_1..d_k has the target's logits at k + 1 positions: position j scores the
token after d_j (position 0: after its last token). Each position's scores are processed as the
sampler processes a decode step's (runtime/sampler.py: logit bias, then penalties over the
history as if d_1..d_j had been appended, then temperature and top_k / top_p / min_p), so that
every accepted token is one that decoding would have produced:

- greedy: d_j is accepted while it equals the argmax at position j - 1; the argmax at the first
  position not accepted (or after the last draft) is taken too. The outputs are the tokens that
  decoding one at a time gives.
- sampled: a draft is a point mass q = [x], so the usual rejection rule (accept with probability
  min(1, p(x) / q(x)), else draw from the normalised max(p - q, 0)) becomes: accept x with
  probability p(x), else draw from p with x removed and renormalised; after the last accepted
  draft, one draw from p. Each token is thus distributed as p given the tokens before it. The
  uniforms and draws come from the request's own generator, but how many a step takes depends on
  its drafts, which follow measured step times and batch mates: a seeded request keeps its
  distribution, not its draws, from one run to the next.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from hicache.runtime.constraint import constrain
from hicache.runtime.penalties import apply_penalties
from hicache.runtime.pinned import tensor_to
from hicache.runtime.sampler import draw, filtered_probs

if TYPE_CHECKING:
    from hicache.runtime.request import Req


def verify(logits: torch.Tensor,  # [sum(1 + len(d)), V] float32: each request's block of positions, in order
           reqs: Sequence[Req], drafts: Sequence[list[int]]) -> list[list[int]]:
    """Per request: its accepted drafts followed by one token of the target's (at least one token)."""
    params, prompts, histories, starts = [], [], [], []
    for req, d in zip(reqs, drafts):
        starts.append(len(params))
        for j in range(len(d) + 1):
            params.append(req.params)
            prompts.append(req.input_ids)
            histories.append(req.output_ids + d[:j])
    scores = apply_penalties(constrain(logits.float(), params), params, prompts, histories)
    greedy = [i for i, req in enumerate(reqs) if req.params.is_greedy]
    sampled = [i for i, req in enumerate(reqs) if not req.params.is_greedy]
    out: list[list[int]] = [[] for _ in reqs]
    if greedy:
        rows = [starts[i] + j for i in greedy for j in range(len(drafts[i]) + 1)]
        targets = scores[tensor_to(rows, scores.device)].argmax(dim=-1).tolist()
        at = 0
        for i in greedy:
            n = len(drafts[i]) + 1
            out[i] = accept_greedy(targets[at:at + n], drafts[i])
            at += n
    for i in sampled:
        n = len(drafts[i]) + 1
        block = scores[starts[i]:starts[i] + n]
        out[i] = accept_sampled(filtered_probs(block, params[starts[i]:starts[i] + n]), drafts[i], reqs[i].generator)
    return out


def accept_greedy(targets: list[int], draft: list[int]) -> list[int]:
    """`targets`: the argmax at each of the len(draft) + 1 positions."""
    m = 0
    while m < len(draft) and draft[m] == targets[m]:
        m += 1
    return draft[:m] + [targets[m]]


def accept_sampled(probs: torch.Tensor,  # [len(draft) + 1, V] float32, each row a processed target distribution
                   draft: list[int], generator: torch.Generator | None) -> list[int]:
    """Rejection sampling of a deterministic draft (see the module docstring)."""
    dev = probs.device
    k = len(draft)
    p_draft = probs[torch.arange(k, device=dev), tensor_to(draft, dev)].tolist() if k else []
    for j, x in enumerate(draft):
        u = torch.rand(1, generator=generator, dtype=torch.float64, device=dev).item()
        if u < p_draft[j]:
            continue
        residual = probs[j].clone()
        residual[x] = 0.0
        if not residual.sum().item() > 0.0:  # p(x) is 1 but for rounding: x is accepted
            continue
        return draft[:j] + [int(draw(residual[None], [generator])[0])]
    return draft + [int(draw(probs[k:], [generator])[0])]
