"""`Sampler`: picks one next token per request of a batch from the last-position logits.

Called by the model runner once per step (prefill or decode), on the scheduler thread. Stateless:
everything a request needs (its params, its generator, its token history) is passed in.

Order of operations, per row:
  0. logit_bias and the grammar's bitmask (runtime/constraint.py: disallowed tokens get -inf),
  1. repetition penalty (HF semantics: every token id in prompt + output; logit > 0 divided by the
     penalty, logit < 0 multiplied),
  2. frequency and presence penalties (OpenAI semantics: over output tokens only;
     logit -= frequency * count + presence * (count > 0)),
  3. greedy rows: argmax; the others: temperature, then top_k, top_p, min_p with HF's warper
     semantics (top_p drops tokens whose ascending cumulative prob is <= 1 - top_p, always keeping
     the best; min_p drops probs < min_p * max prob; top_k keeps exactly k, ties at the boundary
     broken by torch.topk where HF would keep them all), then one categorical draw per row from the
     row's own generator, so a seeded request draws the same tokens whatever its position and batch
     mates (rows are grouped so that no row's arithmetic depends on another row's shape).

The draw is inverse-CDF sampling from one `torch.rand(1, generator=g)` per row (see `draw`): the same
distribution as `torch.multinomial(probs, 1, generator=g)`, which runs exponential_ over the whole
vocabulary one row at a time: measured on CPU, that loop is two orders of magnitude slower than
`draw` and would dominate a CPU decode step.

Vectorized where it is cheap: penalties touch only the history positions of a [B, V] copy, greedy
rows take one argmax, and filtered rows work on candidates: one topk per distinct top_k (or
`TOP_P_CANDIDATES` for top_p alone, falling back to a full sort when the cut lies beyond them), after
which temperature, top_p, min_p and the draw cost O(candidates).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from hicache.runtime.constraint import constrain
from hicache.runtime.penalties import apply_penalties
from hicache.runtime.pinned import HostCopy, tensor_to
from hicache.runtime.sampling import SamplingParams

# Rows with top_p but no top_k first try the cut inside their best this-many tokens.
TOP_P_CANDIDATES = 1024


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

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None], prompt_ids: Sequence[Sequence[int]],
               output_ids: Sequence[Sequence[int]], top_logprobs_num: Sequence[int],
               return_logprob: Sequence[bool] | None = None, bitmask: torch.Tensor | None = None) -> SampleResult:
        """`launch(...).result()`: the host waits for the tokens."""
        return self.launch(logits, params, generators, prompt_ids, output_ids, top_logprobs_num,
                           return_logprob, bitmask).result()

    def launch(self,
               logits: torch.Tensor,  # [B, V] float32, any device
               params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None],  # per request; None for greedy
               prompt_ids: Sequence[Sequence[int]],
               output_ids: Sequence[Sequence[int]],
               top_logprobs_num: Sequence[int],
               return_logprob: Sequence[bool] | None = None,
               bitmask: torch.Tensor | None = None) -> PendingSample:  # [B, ceil(V/32)] int32 allowed tokens
        """Pick one token per row. `logits` is not modified. The tokens stay on the device
        (`PendingSample.next_ids`) and are copied to the host without waiting: `result()` waits.
        Greedy rows queue no host sync; top_p without top_k and presence penalties sync inside.

        `logprobs[i]` is the log-prob of the chosen token under log_softmax of the unmodified
        logits (not of the penalized / tempered / filtered distribution it was drawn from); it is
        computed for rows where `return_logprob[i]` is true or `top_logprobs_num[i] > 0` (every row
        when `return_logprob` is None), else None. A sampled row whose generator is None draws from
        torch's global RNG.
        """
        batch = logits.shape[0]
        assert len(params) == len(generators) == len(prompt_ids) == len(output_ids) == batch
        raw = logits.float()
        scores = apply_penalties(constrain(raw, params, bitmask), params, prompt_ids, output_ids)

        next_ids = torch.empty(batch, dtype=torch.long, device=raw.device)
        greedy = [i for i, p in enumerate(params) if p.is_greedy]
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        if greedy:
            _put(next_ids, greedy, _take(scores, greedy).argmax(dim=-1))
        if sampled:
            _put(next_ids, sampled, _sample_rows(_take(scores, sampled), [params[i] for i in sampled],
                                                 [generators[i] for i in sampled]))

        want = [True] * batch if return_logprob is None else [bool(w) for w in return_logprob]
        return PendingSample(next_ids, *_raw_logprobs(raw, next_ids, want, top_logprobs_num))


class PendingSample:
    """A batch's sampled tokens: on the device at once (`next_ids`, what the next decode step can
    read before the host has them), on the host after `result()`."""

    def __init__(self, next_ids: torch.Tensor, rows: list[int], top_nums: list[int],
                 chosen: torch.Tensor | None, top_vals: torch.Tensor | None, top_idx: torch.Tensor | None):
        self.next_ids = next_ids  # [B] int64, device
        self._rows, self._top_nums = rows, top_nums  # the rows with log-probs, and their top-n
        self._copy = HostCopy([next_ids, chosen, top_vals, top_idx])
        self._result: SampleResult | None = None

    def result(self) -> SampleResult:
        """Waits for the copies (once); the lists of `SampleResult`."""
        if self._result is None:
            self._result = self._lists(*self._copy.wait())
        return self._result

    def _lists(self, ids, chosen, vals, idx) -> SampleResult:
        batch = ids.shape[0]
        logprobs: list[float | None] = [None] * batch
        tops: list[list[tuple[int, float]] | None] = [None] * batch
        if self._rows:
            for i, v in zip(self._rows, chosen.tolist()):
                logprobs[i] = v
        if vals is not None:
            vals, idx = vals.tolist(), idx.tolist()
            for j, i in enumerate(self._rows):
                n = min(self._top_nums[i], len(vals[j]))
                tops[i] = list(zip(idx[j][:n], vals[j][:n])) if n > 0 else None
        return SampleResult(ids.tolist(), logprobs, tops)


# ---- row selection: skip the gather when a group is the whole batch -------------------------------


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return tensor_to(rows, device)


def _whole(t: torch.Tensor, rows: list[int]) -> bool:
    return len(rows) == t.shape[0]  # rows are ascending and distinct


def _take(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return t if _whole(t, rows) else t[_index(rows, t.device)]


def _put(t: torch.Tensor, rows: list[int], value: torch.Tensor) -> None:
    if _whole(t, rows):
        t.copy_(value)
    else:
        t[_index(rows, t.device)] = value


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return tensor_to(values, like.device, like.dtype)[:, None]


# ---- filters --------------------------------------------------------------------------------------
#
# Rows are split into groups of one shape each, so that a row's arithmetic never depends on its
# batch mates (bit-exact reproducibility under a seed):
#   - full rows (no top_k, no top_p): softmax over the vocabulary, min_p, draw over V;
#   - candidate rows, grouped by width W: the W best tokens by one topk (W = top_k, or
#     TOP_P_CANDIDATES for top_p without top_k); temperature, top_p and min_p act on [r, W] only,
#     and the draw picks a candidate. A top_p row whose cut lies beyond its candidates is redone
#     with W = V (a full sort).


class _Group(NamedTuple):
    rows: list[int]  # positions in the sampled rows
    token_ids: torch.Tensor | None  # [r, W] int64 vocabulary id of each candidate; None: W = V
    probs: torch.Tensor  # [r, W] float32 unnormalized, exactly 0 where filtered


def filtered_probs(scores: torch.Tensor,  # [R, V] float32 penalized logits of the sampled rows
                   params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then the top_k, top_p and min_p filters as probs [R, V] (0 where filtered).

    The same groups `Sampler` draws from, scattered back to the vocabulary: for tests and debugging.
    """
    out = torch.zeros_like(scores)
    for g in _filter_groups(scores, params):
        probs = g.probs / g.probs.sum(dim=-1, keepdim=True)
        rows = _index(g.rows, scores.device)
        out[rows] = probs if g.token_ids is None else torch.zeros_like(out[rows]).scatter_(
            1, g.token_ids, probs)
    return out


def _sample_rows(scores: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """[R] int64 drawn ids for the sampled rows."""
    out = torch.empty(scores.shape[0], dtype=torch.long, device=scores.device)
    for g in _filter_groups(scores, params):
        pos = draw(g.probs, [generators[j] for j in g.rows])
        ids = pos if g.token_ids is None else g.token_ids.gather(1, pos[:, None])[:, 0]
        _put(out, g.rows, ids)
    return out


def _width(p: SamplingParams, vocab: int) -> int:
    if 1 <= p.top_k < vocab:
        return p.top_k
    return min(TOP_P_CANDIDATES, vocab) if p.top_p < 1.0 else vocab


def _filter_groups(scores: torch.Tensor, params: Sequence[SamplingParams]) -> list[_Group]:
    vocab = scores.shape[1]
    widths: dict[int, list[int]] = {}
    for j, p in enumerate(params):
        widths.setdefault(_width(p, vocab), []).append(j)
    groups = []
    at_vocab = widths.pop(vocab, [])
    full = [j for j in at_vocab if params[j].top_p == 1.0]
    redo = [j for j in at_vocab if params[j].top_p < 1.0]  # small vocab: sort at once
    if full:
        groups.append(_full_group(scores, params, full))
    for width, rows in sorted(widths.items()):
        group, beyond = _candidate_group(scores, params, rows, width)
        groups.append(group)
        redo += beyond
    if redo:
        groups.append(_candidate_group(scores, params, sorted(redo), vocab)[0])
    return [g for g in groups if g.rows]


def _full_group(scores: torch.Tensor, params: Sequence[SamplingParams], rows: list[int]) -> _Group:
    sub = _take(scores, rows)
    probs = (sub / _column([params[j].temperature for j in rows], sub)).softmax(dim=-1)
    return _Group(rows, None, _min_p(probs, probs.amax(dim=-1, keepdim=True), params, rows))


def _min_p(probs: torch.Tensor, top: torch.Tensor, params: Sequence[SamplingParams],
           rows: list[int]) -> torch.Tensor:
    """HF's MinPLogitsWarper: drop probs < min_p * (best prob); `top` is that best prob [r, 1]."""
    if all(params[j].min_p == 0.0 for j in rows):
        return probs
    return probs.masked_fill(probs < _column([params[j].min_p for j in rows], probs) * top, 0.0)


def _candidate_group(scores: torch.Tensor, params: Sequence[SamplingParams], rows: list[int],
                     width: int) -> tuple[_Group, list[int]]:
    """Top-`width` candidates of `rows`, filtered; also the rows whose top_p cut lies beyond them.

    top_k keeps exactly k tokens (ties at the boundary broken by torch.topk). top_p follows HF's
    TopPLogitsWarper: drop tokens whose ascending cumulative prob is <= 1 - top_p, i.e. whose
    suffix sum in descending order is; the best token always stays.
    """
    sub = _take(scores, rows)
    vocab = sub.shape[1]
    if width < vocab:
        vals, ids = sub.topk(width, dim=-1)
    else:
        vals, ids = sub.sort(dim=-1, descending=True)
    temps = _column([params[j].temperature for j in rows], sub)
    vals = vals / temps
    # truncated: the candidates are the row's whole support (top_k, or all V), so normalize over them
    truncated = [1 <= params[j].top_k < vocab or width == vocab for j in rows]
    lse = torch.logsumexp(vals, dim=-1, keepdim=True)
    if not all(truncated):
        whole = tensor_to(truncated, sub.device, torch.bool)[:, None]
        lse = torch.where(whole, lse, torch.logsumexp(sub / temps, dim=-1, keepdim=True))
    probs = (vals - lse).exp()
    keep, beyond = _top_p_keep(probs, [params[j].top_p for j in rows], truncated)
    probs = _min_p(probs * keep, probs[:, :1], params, rows)
    rows_kept = [j for i, j in enumerate(rows) if i not in beyond]
    if beyond:
        kept = _index([i for i in range(len(rows)) if i not in beyond], sub.device)
        ids, probs = ids[kept], probs[kept]
    return _Group(rows_kept, ids, probs), [rows[i] for i in beyond]


def _top_p_keep(probs: torch.Tensor, ps: list[float],
                truncated: list[bool]) -> tuple[torch.Tensor, set[int]]:
    """Keep mask [r, W] of descending candidate probs, and the rows whose cut is not inside."""
    if all(p >= 1.0 for p in ps):
        return torch.ones_like(probs, dtype=torch.bool), set()
    whole = tensor_to(truncated, probs.device, torch.bool)[:, None]
    outside = torch.where(whole, 0.0, (1.0 - probs.sum(dim=-1, keepdim=True)).clamp(min=0.0))
    suffix = probs.flip(-1).cumsum(dim=-1).flip(-1) + outside
    keep = suffix > (1.0 - _column(ps, suffix))
    keep[:, 0] = True
    beyond = (keep[:, -1] & ~whole[:, 0]).nonzero()[:, 0].tolist()
    return keep, {i for i in beyond if ps[i] < 1.0}


# ---- the draw -------------------------------------------------------------------------------------

_DRAW_BLOCK = 256


def draw(probs: torch.Tensor,  # [R, V] nonnegative float32, rows need not sum to 1
         generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One categorical draw per row by inverse CDF, from one uniform of the row's own generator.

    Two levels so that only one pass touches the whole vocabulary: pick a block of `_DRAW_BLOCK`
    tokens by the cumulative block masses, then a token inside it by a float64 cumsum of that block
    only (the uniform's position inside the block is rescaled, so the in-block choice is exact).
    Returns [R] int64 on probs' device. A token with probability 0 is never drawn.
    """
    rows, vocab = probs.shape
    dev = probs.device
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=dev) for g in generators])
    pad = (-vocab) % _DRAW_BLOCK
    blocks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).reshape(rows, -1, _DRAW_BLOCK)
    mass = blocks.sum(dim=-1).double()  # [R, NB]
    bcdf = mass.cumsum(dim=-1)
    block, target = _search(bcdf, u[:, None])
    lo = torch.where(block > 0, bcdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    frac = ((target - lo) / mass.gather(1, block)).clamp(0.0, 1.0)
    inner = blocks[torch.arange(rows, device=dev), block[:, 0]].double().cumsum(dim=-1)  # [R, BLOCK]
    pos, _ = _search(inner, frac)
    return (block * _DRAW_BLOCK + pos)[:, 0]


def _search(cdf: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First index whose cdf exceeds u * total (u in [0, 1]), so an empty step is never chosen."""
    total = cdf[:, -1:]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True), target


# ---- log-probs ------------------------------------------------------------------------------------


def _raw_logprobs(raw: torch.Tensor, next_ids: torch.Tensor, want: list[bool], top_nums: Sequence[int]):
    """(rows with log-probs, top-n per row, chosen log-prob [r], top-n values [r, n] and ids [r, n]),
    on the device; the tensors are None where no row asks."""
    batch, vocab = raw.shape
    rows = [i for i in range(batch) if want[i] or top_nums[i] > 0]
    nums = [int(n) for n in top_nums]
    if not rows:
        return rows, nums, None, None, None
    sub = _take(raw, rows)
    lse = torch.logsumexp(sub, dim=-1, keepdim=True)
    chosen = (sub.gather(1, _take(next_ids, rows)[:, None]) - lse)[:, 0]
    max_n = min(max(nums[i] for i in rows), vocab)
    if max_n <= 0:
        return rows, nums, chosen, None, None
    vals, idx = sub.topk(max_n, dim=-1)
    return rows, nums, chosen, vals - lse, idx
