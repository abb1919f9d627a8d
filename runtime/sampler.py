"""`Sampler`: picks one next token per request of a batch from the last-position logits.

Called by the model runner once per step (prefill or decode), on the scheduler thread. Stateless:
everything a request needs (its params, its generator, its token history) is passed in.

Order of operations, per row:
  1. repetition penalty (HF semantics: every token id in prompt + output; logit > 0 divided by the
     penalty, logit < 0 multiplied),
  2. frequency and presence penalties (OpenAI semantics: over output tokens only;
     logit -= frequency * count + presence * (count > 0)),
  3. greedy rows: argmax; the others: temperature, top_k, top_p, min_p filtering (HF warper
     semantics: ties at the top-k boundary are kept, top_p keeps the smallest set whose mass
     exceeds top_p, min_p drops tokens with prob < min_p * max prob), then
     `torch.multinomial(probs, 1, generator=g)` with the row's own generator, so a seeded request
     draws the same tokens whatever its position and batch mates.
The batch is vectorized where it is cheap (penalties by scatter on [B, V], one argmax for all greedy
rows, one topk / sort / softmax per filter over the rows that use it); only the draw loops over rows.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from hicache.runtime.sampling import SamplingParams


class SampleResult(NamedTuple):
    next_ids: list[int]
    # log-prob of the chosen token under the RAW model distribution: log_softmax of the unmodified
    # logits (before penalties, temperature and filtering). None where the row did not ask for it.
    logprobs: list[float | None]
    # the top-n (token id, log-prob) of that same raw log_softmax, best first; None where n == 0.
    top_logprobs: list[list[tuple[int, float]] | None]


def make_generator(seed: int | None, fallback_seed: int,
                   device: str | torch.device = "cpu") -> torch.Generator:
    """A generator for one request: seeded with `seed`, or with `fallback_seed` when the request
    gave none (the scheduler derives that from its random_seed and a request counter).

    Callers pass None instead of a generator for greedy requests. Seeds are taken modulo 2**64.
    The generator must live on the device of the logits the sampler will see.
    """
    g = torch.Generator(device=device)
    g.manual_seed((fallback_seed if seed is None else seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return g


class Sampler:
    """Batched sampler. See the module docstring for the semantics."""

    def sample(self,
               logits: torch.Tensor,  # [B, V] float32, any device
               params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None],  # per request; None for greedy
               prompt_ids: Sequence[Sequence[int]],
               output_ids: Sequence[Sequence[int]],
               top_logprobs_num: Sequence[int],
               return_logprob: Sequence[bool] | None = None) -> SampleResult:
        """Pick one token per row. `logits` is not modified.

        `logprobs[i]` is the log-prob of the chosen token under log_softmax of the unmodified
        logits; it is computed for rows where `return_logprob[i]` is true or
        `top_logprobs_num[i] > 0` (all rows when `return_logprob` is None), else None.
        """
        batch, vocab = logits.shape
        assert len(params) == len(generators) == len(prompt_ids) == len(output_ids) == batch
        raw = logits.float()
        scores = apply_penalties(raw, params, prompt_ids, output_ids)

        next_ids = torch.empty(batch, dtype=torch.long, device=raw.device)
        greedy = [i for i, p in enumerate(params) if p.is_greedy]
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        if greedy:
            rows = _index(greedy, raw.device)
            next_ids[rows] = scores[rows].argmax(dim=-1)
        if sampled:
            rows = _index(sampled, raw.device)
            probs = filtered_probs(scores[rows], [params[i] for i in sampled])
            next_ids[rows] = _draw(probs, [generators[i] for i in sampled])

        ids = next_ids.tolist()
        want = [bool(return_logprob[i]) if return_logprob is not None else True for i in range(batch)]
        logprobs, tops = _raw_logprobs(raw, ids, want, top_logprobs_num)
        return SampleResult(ids, logprobs, tops)


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _flat_ids(rows: list[int], seqs: list[Sequence[int]], vocab: int,
              device: torch.device) -> torch.Tensor:
    """Flat indices into a [len(rows), V] tensor of every (row, token) pair in `seqs`."""
    parts = [torch.as_tensor(list(s), dtype=torch.long) + j * vocab for j, s in enumerate(seqs)]
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)
    return flat.to(device)


def apply_penalties(raw: torch.Tensor, params: Sequence[SamplingParams],
                     prompt_ids: Sequence[Sequence[int]],
                     output_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """Return penalized logits (a copy when any row has penalties, else `raw` itself)."""
    batch, vocab = raw.shape
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    oai = [i for i, p in enumerate(params)
           if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and len(output_ids[i])]
    if not rep and not oai:
        return raw
    scores = raw.clone()
    dev = raw.device
    if rep:
        rows = _index(rep, dev)
        seqs = [list(prompt_ids[i]) + list(output_ids[i]) for i in rep]
        seen = torch.zeros(len(rep) * vocab, dtype=torch.bool, device=dev)
        seen[_flat_ids(rep, seqs, vocab, dev)] = True
        seen = seen.view(len(rep), vocab)
        pen = torch.tensor([params[i].repetition_penalty for i in rep], device=dev)[:, None]
        sub = scores[rows]
        penalized = torch.where(sub < 0, sub * pen, sub / pen)
        scores[rows] = torch.where(seen, penalized, sub)
    if oai:
        rows = _index(oai, dev)
        flat = _flat_ids(oai, [output_ids[i] for i in oai], vocab, dev)
        counts = torch.bincount(flat, minlength=len(oai) * vocab).view(len(oai), vocab)
        counts = counts.to(scores.dtype)
        freq = torch.tensor([params[i].frequency_penalty for i in oai], device=dev)[:, None]
        pres = torch.tensor([params[i].presence_penalty for i in oai], device=dev)[:, None]
        scores[rows] -= freq * counts + pres * (counts > 0).to(scores.dtype)
    return scores


def filtered_probs(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top_k, top_p and min_p masks; returns probs [R, V] (0 where filtered)."""
    dev = scores.device
    vocab = scores.shape[1]
    temps = torch.tensor([p.temperature for p in params], dtype=scores.dtype, device=dev)
    scores = scores / temps[:, None]

    k_rows = [j for j, p in enumerate(params) if p.top_k > 0 and p.top_k < vocab]
    if k_rows:
        rows = _index(k_rows, dev)
        ks = torch.tensor([params[j].top_k for j in k_rows], device=dev)
        sub = scores[rows]
        top = sub.topk(int(ks.max()), dim=-1).values
        kth = top.gather(1, (ks - 1)[:, None])
        scores[rows] = sub.masked_fill(sub < kth, float("-inf"))

    p_rows = [j for j, p in enumerate(params) if p.top_p < 1.0]
    if p_rows:
        rows = _index(p_rows, dev)
        ps = torch.tensor([params[j].top_p for j in p_rows], dtype=scores.dtype, device=dev)
        sub = scores[rows]
        sorted_s, order = sub.sort(dim=-1)  # ascending, as HF's TopPLogitsWarper
        cum = sorted_s.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= (1 - ps)[:, None]
        drop_sorted[:, -1] = False  # always keep the most likely token
        drop = drop_sorted.scatter(1, order, drop_sorted)
        scores[rows] = sub.masked_fill(drop, float("-inf"))

    probs = scores.softmax(dim=-1)
    m_rows = [j for j, p in enumerate(params) if p.min_p > 0.0]
    if m_rows:
        rows = _index(m_rows, dev)
        mins = torch.tensor([params[j].min_p for j in m_rows], dtype=probs.dtype, device=dev)
        sub = probs[rows]
        drop = sub < mins[:, None] * sub.amax(dim=-1, keepdim=True)
        probs[rows] = sub.masked_fill(drop, 0.0)  # multinomial renormalizes
    return probs


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One multinomial draw per row, each from its own generator (batch-composition independent)."""
    out = [torch.multinomial(probs[j], 1, generator=g) for j, g in enumerate(generators)]
    return torch.cat(out)


def _raw_logprobs(raw: torch.Tensor, ids: list[int], want: list[bool],
                  top_nums: Sequence[int]) -> tuple[list[float | None], list]:
    batch, vocab = raw.shape
    rows_l = [i for i in range(batch) if want[i] or top_nums[i] > 0]
    logprobs: list[float | None] = [None] * batch
    tops: list[list[tuple[int, float]] | None] = [None] * batch
    if not rows_l:
        return logprobs, tops
    rows = _index(rows_l, raw.device)
    sub = raw[rows]
    lse = torch.logsumexp(sub, dim=-1)
    chosen = sub.gather(1, torch.tensor([ids[i] for i in rows_l], device=raw.device)[:, None])
    for j, v in enumerate((chosen[:, 0] - lse).tolist()):
        logprobs[rows_l[j]] = v
    max_n = min(max(top_nums[i] for i in rows_l), vocab)
    if max_n > 0:
        vals, idx = sub.topk(max_n, dim=-1)
        vals = (vals - lse[:, None]).tolist()
        idx = idx.tolist()
        for j, i in enumerate(rows_l):
            n = min(top_nums[i], vocab)
            tops[i] = list(zip(idx[j][:n], vals[j][:n])) if n > 0 else None
    return logprobs, tops
