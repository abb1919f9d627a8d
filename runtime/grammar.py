"""Grammar-constrained decoding with XGrammar: checking, compiling, and one matcher per request.

- `check_grammar(kind, text)` parses a grammar without a tokenizer (a fraction of a millisecond to
  milliseconds; the texts that parsed are remembered, so that a batch of requests with one schema
  parses it once): the front end calls it through `SamplingParams.from_dict`, so a bad schema,
  regex or EBNF is a 400 naming the field before anything is queued.
- `GrammarCompiler` belongs to the scheduler. It advances a step's matchers together (`accept`),
  and compiles for the model's tokenizer on a small
  thread pool, so that the scheduler thread never waits for a compilation: a request stays in the
  queue until its grammar is ready, while the others keep running. Compiled grammars are cached by
  (kind, text) in an LRU (the futures themselves: requests that arrive together share one
  compilation).
- `RequestGrammar` is a request's matcher. Invariant: it has accepted exactly the request's output
  tokens (`Scheduler.process_result` advances it as it appends a token; `sync` rolls it back to the
  outputs the request keeps when it is retracted).
- `fill_bitmask` writes the allowed next tokens of a batch into an int32 bitmask on the host
  (bit j of word w: token 32 w + j), the rows on `FILL_THREADS` threads of XGrammar's: a row of a
  JSON schema over a large vocabulary costs a fraction of a millisecond, too much to fill a large
  batch's rows one after another inside a decode step. `BitmaskFiller` (the model runner's) runs it
  on a thread of its own (XGrammar's C++ releases the GIL), so that the scheduler thread goes on
  meanwhile: the runner starts the fill before the forward pass is queued (with overlap
  scheduling, a continuation's as soon as the matchers have accepted the previous step's tokens:
  `runtime/overlap.py`) and queues the sampling only when the next step needs it
  (`runtime/runner.py: PendingStep`), so that the fill overlaps the pass on the device and the
  host's results, outputs and planning. `runtime/constraint.py` applies the mask to the logits in
  the sampler, outside any CUDA graph.
- JSON schemas compile through `runtime/json_grammar.py`, which writes their length-bounded
  strings so that XGrammar precomputes their masks (a fill of such a string otherwise checks most
  of the vocabulary at run time).

Stop tokens (the model's EOS ids) are allowed only where the grammar may end; a matcher that has
accepted one is terminated, and the request finishes (`runtime/stop.py`).
"""
from __future__ import annotations

import functools
import json
import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Sequence

import torch

from hicache.runtime.json_grammar import json_schema_grammar

logger = logging.getLogger(__name__)

COMPILE_THREADS = 2
# threads that fill a batch's bitmask rows, or advance its matchers: half the cores this process
# may use, at most 16
FILL_THREADS = max(1, min(16, len(os.sched_getaffinity(0)) // 2))
ACCEPT_CHUNK = 8  # matchers a thread advances at least
CACHE_ENTRIES = 256  # compiled grammars kept (least recently used first out)
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # what OpenAI's response_format json_object asks for
# JSON may hold any whitespace between tokens, but a run of at most this many characters: small
# models otherwise fall into endless runs of newlines.
MAX_JSON_WHITESPACE = 16


@functools.lru_cache(maxsize=CACHE_ENTRIES)  # an exception is not cached: a bad text is parsed again
def check_grammar(kind: str, text: str) -> None:
    """Parses `text` as a grammar of `kind` (json_schema, regex, ebnf, structural_tag); raises
    ValueError starting with `kind` when it is not one."""
    import xgrammar as xgr

    try:
        if kind == "json_schema":
            json.loads(text)  # a clearer message than the converter's for plain JSON errors
            xgr.Grammar.from_json_schema(text)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind == "ebnf":
            xgr.Grammar.from_ebnf(text)
        else:
            xgr.Grammar.from_structural_tag(*structural_tag_args(text))
    except KeyError as e:  # a structure of the older structural tag form lacks a key
        raise ValueError(f"{kind} is not a valid {_NAMES[kind]}: a structure lacks {e}") from None
    except (ValueError, RuntimeError, TypeError) as e:  # json, xgrammar's parsers
        raise ValueError(f"{kind} is not a valid {_NAMES[kind]}: {_short(e)}") from None


_NAMES = {"json_schema": "JSON schema", "regex": "regular expression", "ebnf": "EBNF grammar",
          "structural_tag": "structural tag"}


def structural_tag_args(text: str) -> tuple:
    """XGrammar's arguments for a structural tag: the JSON text itself (`{"type": "structural_tag",
    "format": ...}`), or for SGLang's older form (`{"structures": [{"begin", "schema", "end"}],
    "triggers": [...]}`) its items and triggers."""
    import xgrammar as xgr

    tag = json.loads(text)
    if not isinstance(tag, dict) or "structures" not in tag:
        return (text,)
    items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
             for s in tag["structures"]]
    return items, list(tag.get("triggers", []))


def _short(e: Exception) -> str:
    """XGrammar's message without its source location prefix, first line only."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


class GrammarCompiler:
    """Compiles grammars for one tokenizer, off the calling thread. `start` is called on the
    scheduler thread only; the compilations run on `COMPILE_THREADS` worker threads."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]):
        self._tokenizer, self._vocab, self._stops = tokenizer, vocab_size, list(stop_token_ids)
        self._pool: ThreadPoolExecutor | None = None
        self._accept_pool: ThreadPoolExecutor | None = None  # `accept`'s
        self._compiler = None  # xgrammar.GrammarCompiler, built by the first compilation
        self._lock = threading.Lock()  # guards building _compiler
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()

    def start(self, kind: str, text: str) -> RequestGrammar:
        """A new request's matcher, ready once its grammar has compiled."""
        key = (kind, text)
        fut = self._cache.pop(key, None)
        if fut is None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="hicache-grammar")
            fut = self._pool.submit(self._compile, kind, text)
        self._cache[key] = fut
        while len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return RequestGrammar(kind, fut)

    def cached(self) -> int:
        return len(self._cache)

    def _compile(self, kind: str, text: str):
        import xgrammar as xgr

        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab,
                                                          stop_token_ids=self._stops)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        if kind == "json_schema":
            return self._compiler.compile_grammar(json_schema_grammar(text, MAX_JSON_WHITESPACE))
        if kind == "structural_tag":
            return self._compiler.compile_structural_tag(*structural_tag_args(text))
        compile_fn = {"regex": self._compiler.compile_regex, "ebnf": self._compiler.compile_grammar}[kind]
        return compile_fn(text)

    def accept(self, pairs: Sequence[tuple[RequestGrammar, int]]) -> None:
        """`RequestGrammar.accept` of each (grammar, token) pair: XGrammar's batch accept, on up to
        `FILL_THREADS` threads (its C++ releases the GIL) for a large batch."""
        import xgrammar as xgr

        live = [(g, t) for g, t in pairs if not g.rejected]
        matchers, tokens = [g.matcher for g, _ in live], [t for _, t in live]
        parts = max(1, min(FILL_THREADS, len(live) // ACCEPT_CHUNK))
        if parts == 1:
            oks = xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens) if live else []
        else:
            if self._accept_pool is None:
                self._accept_pool = ThreadPoolExecutor(FILL_THREADS, thread_name_prefix="hicache-accept")
            ends = [len(live) * k // parts for k in range(parts + 1)]
            oks = [ok for f in [self._accept_pool.submit(xgr.BatchGrammarMatcher.batch_accept_token,
                                                         matchers[a:b], tokens[a:b]) for a, b in zip(ends, ends[1:])]
                   for ok in f.result()]
        for (g, t), ok in zip(live, oks):
            g.record(t, ok)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._accept_pool is not None:
            self._accept_pool.shutdown(wait=False)


class RequestGrammar:
    """One request's grammar state. Only the scheduler thread uses it."""

    def __init__(self, kind: str, compiled: Future):
        self.kind = kind
        self._compiled = compiled
        self._matcher = None
        self.seen_ready = False  # the scheduler saw it ready (set by `look`)
        self.accepted = 0  # tokens the matcher has accepted
        self.rejected = False  # a token outside the grammar was appended (the request ends)

    @property
    def done(self) -> bool:
        return self._compiled.done()

    @property
    def error(self) -> str | None:
        """Why the grammar did not compile, once done; else None."""
        if not self._compiled.done() or self._compiled.exception() is None:
            return None
        return f"{self.kind}: the grammar did not compile: {_short(self._compiled.exception())}"

    def look(self) -> bool:
        """Whether the request may run now (compiled without error); remembered in `seen_ready`."""
        self.seen_ready = self.done and self.error is None
        return self.seen_ready

    @property
    def matcher(self):
        if self._matcher is None:
            import xgrammar as xgr

            self._matcher = xgr.GrammarMatcher(self._compiled.result())
        return self._matcher

    def accept(self, token: int) -> None:
        if not self.rejected:
            self.record(token, self.matcher.accept_token(token))

    def try_accept(self, token: int) -> bool:
        """Accepts `token` if the grammar allows it here; a refusal changes nothing."""
        ok = self.matcher.accept_token(token)
        self.accepted += ok
        return ok

    def record(self, token: int, ok: bool) -> None:
        """Notes that the matcher accepted `token` (`ok`) or refused it."""
        if ok:
            self.accepted += 1
        else:
            logger.warning("a %s grammar rejected token %d: ending the request", self.kind, token)
            self.rejected = True

    @property
    def finished(self) -> bool:
        """The grammar ended (a stop token accepted) or was broken: no token may follow."""
        return self.rejected or (self._matcher is not None and self._matcher.is_terminated())

    def sync(self, outputs: Sequence[int]) -> None:
        """Makes the matcher's accepted tokens `outputs` again: rolls back what it accepted past
        them, or replays them from the start when it had not accepted them all."""
        if self._matcher is None or self.rejected:
            return
        if self.accepted > len(outputs):
            self._matcher.rollback(self.accepted - len(outputs))
            self.accepted = len(outputs)
        elif self.accepted < len(outputs):
            self._matcher.reset()
            self.accepted = 0
            for t in outputs:
                self.accept(t)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


_fillers = threading.local()  # each filling thread's xgrammar.BatchGrammarMatcher


def fill_bitmask(grammars: Sequence[RequestGrammar | None], vocab_size: int) -> torch.Tensor | None:
    """[B, ceil(V / 32)] int32 on the host: row i the tokens request i may take next (all for a row
    without a grammar); None when no row has one."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return None
    return _fill([grammars[i].matcher for i in rows], rows, len(grammars), vocab_size)


def _fill(matchers: list, rows: list[int], batch: int, vocab_size: int, pin: bool = False) -> torch.Tensor:
    if not hasattr(_fillers, "matcher"):
        import xgrammar as xgr

        _fillers.matcher = xgr.BatchGrammarMatcher(FILL_THREADS)
    mask = torch.full((batch, bitmask_words(vocab_size)), -1, dtype=torch.int32, pin_memory=pin)
    _fillers.matcher.batch_fill_next_token_bitmask(matchers, mask, rows)
    return mask


class BitmaskFiller:
    """`fill_bitmask` on a background thread; for a CUDA `device`, into pinned memory (its copy to
    the device is not staged). The caller must not advance or roll back the matchers of a fill
    until it has its result."""

    def __init__(self, device: torch.device | None = None):
        self._pool: ThreadPoolExecutor | None = None
        self._device = device if device is not None and device.type == "cuda" else None

    def start(self, grammars: Sequence[RequestGrammar | None], vocab_size: int) -> PendingFill | None:
        """`fill_bitmask(grammars, vocab_size)` under way (a finished grammar's row allows every
        token); None when no row has a grammar still going."""
        rows = [i for i, g in enumerate(grammars) if g is not None and not g.finished]
        if not rows:
            return None
        if self._pool is None:
            index = None if self._device is None else self._device.index  # the thread's current device
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="hicache-bitmask",
                                            initializer=None if index is None else torch.cuda.set_device,
                                            initargs=() if index is None else (index,))
        future = self._pool.submit(_fill, [grammars[i].matcher for i in rows], rows, len(grammars), vocab_size,
                                   self._device is not None)
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


# ---- over a scheduler's queue (requests with a `grammar` attribute) -----------------------------


def wait_compiling(reqs: Sequence, timeout: float = 0.01) -> bool:
    """Blocks until a grammar of `reqs` still compiling is done, at most `timeout` seconds;
    False at once when none is compiling."""
    futures = [r.grammar._compiled for r in reqs if r.grammar is not None and not r.grammar.done]
    if futures:
        wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)
    return bool(futures)


def look_at(reqs: Sequence) -> list:
    """Notes which grammars of `reqs` are ready (`RequestGrammar.look`); returns the requests whose
    grammar failed to compile."""
    return [r for r in reqs if r.grammar is not None and not r.grammar.look() and r.grammar.error is not None]


def any_unseen(reqs: Sequence) -> bool:
    """A grammar of `reqs` was not ready when last looked at."""
    return any(r.grammar is not None and not r.grammar.seen_ready for r in reqs)
