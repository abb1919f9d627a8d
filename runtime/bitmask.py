"""The grammars' next-token bitmasks, filled on the host.

`fill_bitmask` writes the allowed next tokens of a batch into an int32 bitmask on the host
(bit j of word w: token 32 w + j), the rows on `FILL_THREADS` threads of XGrammar's: a row of a
JSON schema over a large vocabulary costs a fraction of a millisecond, too much to fill a large
batch's rows one after another inside a decode step. `BitmaskFiller` (the model runner's) runs it
on a thread of its own (XGrammar's C++ releases the GIL), so that the scheduler thread goes on
meanwhile: the runner starts the fill before the forward pass is queued (with overlap
scheduling, a continuation's as soon as the matchers have accepted the previous step's tokens:
`runtime/scheduler/overlap.py`) and queues the sampling only when the next step needs it
(`runtime/runner.py: PendingStep`), so that the fill overlaps the pass on the device and the
host's results, outputs and planning. `runtime/constraint.py` applies the mask to the logits in
the sampler, outside any CUDA graph.

Before it fills, `BitmaskFiller`'s job feeds the matchers the tokens recorded since their last
fill (`runtime/grammar.py: RequestGrammar.take`), in one batch accept per position, so that the
scheduler thread does not advance them itself; a large batch is fed and filled in chunks of rows
on `FILL_THREADS` threads, each chunk's fill right after its own feed.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from hicache.runtime.grammar import refused

if TYPE_CHECKING:
    from hicache.runtime.grammar import RequestGrammar

# threads that fill a batch's bitmask rows: half the cores this process may use, at most 16
FILL_THREADS = max(1, min(16, len(os.sched_getaffinity(0)) // 2))


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


CHUNK_ROWS = 16  # rows of a large batch that one thread feeds and fills
_fillers = threading.local()  # each filling thread's xgrammar.BatchGrammarMatcher
_chunk_pool: ThreadPoolExecutor | None = None  # the threads of a large batch's chunks


def fill_bitmask(grammars: Sequence[RequestGrammar | None], vocab_size: int) -> torch.Tensor | None:
    """[B, ceil(V / 32)] int32 on the host: row i the tokens request i may take next (all for a row
    without a grammar); None when no row has one."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return None
    mask = _all_allowed(len(grammars), vocab_size)
    _fill_into(mask, [grammars[i].matcher for i in rows], rows, FILL_THREADS)
    return mask


def allowed_ids(bitmask: torch.Tensor, ids: Sequence[int]) -> list[bool]:
    """Whether row i of a host `bitmask` allows token ids[i], for each row (numpy: a few
    microseconds for a batch, a quarter of torch's)."""
    t = np.asarray(ids, dtype=np.int64)
    words = bitmask.numpy()[np.arange(len(t)), t >> 5]
    return ((words >> (t & 31)) & 1).astype(bool).tolist()


def _feed(matchers: list, tokens: list[list[int]]) -> None:
    """Each matcher accepts its tokens, in order: XGrammar's batch accept per position (one C++
    call for the rows, without the GIL)."""
    import xgrammar as xgr

    for k in range(max(map(len, tokens), default=0)):
        rows = [i for i, ts in enumerate(tokens) if len(ts) > k]
        oks = xgr.BatchGrammarMatcher.batch_accept_token([matchers[i] for i in rows], [tokens[i][k] for i in rows])
        if not all(oks):  # each was sampled under its bitmask
            refused()


def _feed_and_fill(matchers: list, tokens: list[list[int]], rows: list[int], batch: int, vocab_size: int,
                   pin: bool) -> torch.Tensor:
    """The filler's job: feed, then fill. A large batch goes in chunks of `CHUNK_ROWS` rows on
    `FILL_THREADS` threads, each feeding its rows and filling them (a row's fill needs only its
    own feed), so that feeding is spread over the threads too."""
    mask = _all_allowed(batch, vocab_size, pin)
    if len(rows) < 2 * CHUNK_ROWS or FILL_THREADS == 1:
        _feed(matchers, tokens)
        _fill_into(mask, matchers, rows, FILL_THREADS)
        return mask
    global _chunk_pool
    if _chunk_pool is None:
        _chunk_pool = ThreadPoolExecutor(FILL_THREADS, thread_name_prefix="hicache-bitmask-rows")

    def chunk(a: int) -> None:
        part = slice(a, a + CHUNK_ROWS)
        _feed(matchers[part], tokens[part])
        _fill_into(mask, matchers[part], rows[part], 1)

    for done in [_chunk_pool.submit(chunk, a) for a in range(0, len(rows), CHUNK_ROWS)]:
        done.result()
    return mask


def _batch_matcher(threads: int):
    """This thread's xgrammar.BatchGrammarMatcher on `threads` threads."""
    if not hasattr(_fillers, "matcher"):
        import xgrammar as xgr

        _fillers.matcher = xgr.BatchGrammarMatcher(threads)
    return _fillers.matcher


def _all_allowed(batch: int, vocab_size: int, pin: bool = False) -> torch.Tensor:
    return torch.full((batch, bitmask_words(vocab_size)), -1, dtype=torch.int32, pin_memory=pin)


def _fill_into(mask: torch.Tensor, matchers: list, rows: list[int], threads: int) -> None:
    """Row rows[k] of `mask`: what matchers[k] allows next."""
    _batch_matcher(threads).batch_fill_next_token_bitmask(matchers, mask, rows)


class BitmaskFiller:
    """`fill_bitmask` on a background thread; for a CUDA `device`, into pinned memory (its copy to
    the device is not staged). The caller must not advance or roll back the matchers of a fill
    until it has its result."""

    def __init__(self, device: torch.device | None = None):
        self._pool: ThreadPoolExecutor | None = None
        self._device = device if device is not None and device.type == "cuda" else None

    def start(self, grammars: Sequence[RequestGrammar | None], vocab_size: int) -> PendingFill | None:
        """`fill_bitmask(grammars, vocab_size)` under way (a finished grammar's row allows every
        token), after the matchers are fed their pending tokens; None when no row has a grammar
        still going."""
        rows = [i for i, g in enumerate(grammars) if g is not None and not g.finished]
        if not rows:
            return None
        if self._pool is None:
            index = None if self._device is None else self._device.index  # the thread's current device
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="hicache-bitmask",
                                            initializer=None if index is None else torch.cuda.set_device,
                                            initargs=() if index is None else (index,))
        matchers, tokens = zip(*(grammars[i].take() for i in rows))
        future = self._pool.submit(_feed_and_fill, list(matchers), list(tokens), rows, len(grammars), vocab_size,
                                   self._device is not None)
        for i in rows:
            grammars[i].lend(future)
        return PendingFill(future, rows, len(grammars))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class PendingFill:
    """A batch's bitmask being filled (`BitmaskFiller.start`): `result()` waits for it."""

    def __init__(self, future: Future, rows: list[int], batch: int, select: list[int] | None = None):
        self._future, self._select = future, select
        self.rows, self.batch = rows, batch  # the rows with a grammar, of `batch`

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> torch.Tensor:
        mask = self._future.result()
        return mask if self._select is None else mask[self._select]

    def take(self, keep: list[int]) -> PendingFill | None:
        """The fill of the rows `keep` only, in that order; None when none of them has a grammar."""
        if keep == list(range(self.batch)):
            return self
        has = set(self.rows)
        rows = [j for j, i in enumerate(keep) if i in has]
        select = keep if self._select is None else [self._select[i] for i in keep]
        return PendingFill(self._future, rows, len(keep), select) if rows else None
