"""Grammar-constrained decoding with XGrammar: checking, compiling, and one matcher per request.

- `check_grammar(kind, text)` parses a grammar without a tokenizer (a fraction of a millisecond to
  milliseconds; the texts up to 64 Ki characters that parsed are remembered, so that a batch of
  requests with one schema parses it once): the front end calls it through `SamplingParams.from_dict`, so a bad schema,
  regex or EBNF is a 400 naming the field before anything is queued; so is a schema keyword the
  grammar would not enforce (`runtime/schema_keywords.py`).
- `GrammarCompiler` belongs to the scheduler. It records a step's tokens for their matchers
  (`accept`), and compiles for the model's tokenizer on a small thread pool, so that the scheduler
  thread never waits for a compilation: a request stays in the queue until its grammar is ready,
  while the others keep running. Compiled grammars are cached by (kind, text) in an LRU (the
  futures themselves: requests that arrive together share one compilation) bounded in entries and
  in bytes. `check_grammar` bounds what one compilation may cost by the grammar's size.
- `RequestGrammar` is a request's matcher. Invariant: it has accepted exactly the request's output
  tokens (`Scheduler.process_result` advances it as it appends a token; `sync` rolls it back to the
  outputs the request keeps when it is retracted), some of them perhaps still pending: a token
  sampled under the grammar's bitmask is known to be accepted (the mask holds exactly the tokens
  the matcher accepts; whether a stop token ended the grammar follows), so the scheduler thread
  only records it, and the matcher is fed the step's tokens in one batch on the filler's thread,
  before it fills the next bitmask (`runtime/bitmask.py: BitmaskFiller.start`). Whoever else
  reads the matcher (`RequestGrammar.matcher`: jump-forward, retraction) first waits for that and
  feeds it what is still pending.
- Bitmasks are filled in `runtime/bitmask.py`, on a thread of the model runner's.
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
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Sequence

from hicache.runtime.json_grammar import json_schema_grammar
from hicache.runtime.schema_keywords import unenforced

logger = logging.getLogger(__name__)

COMPILE_THREADS = 2
CACHE_ENTRIES = 256  # compiled grammars kept (least recently used first out)
CACHE_BYTES = 1 << 28  # and at most this much memory of compiled grammars (XGrammar's measure)
MAX_GRAMMAR_TEXT = 1 << 20  # characters of a grammar's text
MAX_GRAMMAR_CHARS = 1 << 18  # characters of a grammar's EBNF form
CACHED_TEXT = 1 << 16  # the longest grammar text whose check is remembered
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # what OpenAI's response_format json_object asks for
# JSON may hold any whitespace between tokens, but a run of at most this many characters: small
# models otherwise fall into endless runs of newlines.
MAX_JSON_WHITESPACE = 16


def check_grammar(kind: str, text: str) -> None:
    """Parses `text` as a grammar of `kind` (json_schema, regex, ebnf, structural_tag); raises
    ValueError starting with `kind` when it is not one, or when it is too large to compile: its
    text longer than `MAX_GRAMMAR_TEXT` characters (refused before parsing) or its grammar's EBNF
    form longer than `MAX_GRAMMAR_CHARS` (the time and memory of a compilation grow with it).
    Texts up to `CACHED_TEXT` characters that passed are remembered."""
    (_check_remembered if len(text) <= CACHED_TEXT else _check)(kind, text)


def _check(kind: str, text: str) -> None:
    if len(text) > MAX_GRAMMAR_TEXT:
        raise ValueError(f"{kind} is too long: {len(text)} characters, at most {MAX_GRAMMAR_TEXT} are accepted")
    why = _unenforced_keyword(text) if kind == "json_schema" else None
    if why is not None:
        raise ValueError(f"{kind} is a schema the output could break: {why}; remove it or reword the schema")
    size = len(str(_parse(kind, text)))
    if size > MAX_GRAMMAR_CHARS:
        raise ValueError(f"{kind} is too large to compile: its grammar holds {size} characters in EBNF form, "
                         f"at most {MAX_GRAMMAR_CHARS} are accepted; use fewer properties, enum values or alternatives")


def _parse(kind: str, text: str):
    """`text` parsed as an `xgrammar.Grammar` of `kind`; ValueError starting with `kind` when it is
    not one."""
    import xgrammar as xgr

    try:
        if kind == "json_schema":
            json.loads(text)  # a clearer message than the converter's for plain JSON errors
            return xgr.Grammar.from_json_schema(text, max_whitespace_cnt=MAX_JSON_WHITESPACE)  # as compiled
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "ebnf":
            return xgr.Grammar.from_ebnf(text)
        return xgr.Grammar.from_structural_tag(*structural_tag_args(text))
    except KeyError as e:  # a structure of the older structural tag form lacks a key
        raise ValueError(f"{kind} is not a valid {_NAMES[kind]}: a structure lacks {e}") from None
    except (ValueError, RuntimeError, TypeError) as e:  # json, xgrammar's parsers
        raise ValueError(f"{kind} is not a valid {_NAMES[kind]}: {_short(e)}") from None


_check_remembered = functools.lru_cache(maxsize=CACHE_ENTRIES)(_check)  # an exception is not cached


def _unenforced_keyword(text: str) -> str | None:
    """`schema_keywords.unenforced` of the schema text; None for text that is not JSON (the parse
    that follows says why)."""
    try:
        return unenforced(json.loads(text))
    except ValueError:
        return None


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


def refused() -> None:
    """A matcher refused a token recorded as accepted: its bitmask allowed it."""
    logger.error("a grammar matcher refused a token its bitmask allowed")


class GrammarCompiler:
    """Compiles grammars for one tokenizer, off the calling thread. `start` is called on the
    scheduler thread only; the compilations run on `COMPILE_THREADS` worker threads."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]):
        self._tokenizer, self._vocab, self._stops = tokenizer, vocab_size, list(stop_token_ids)
        self._stop_set = frozenset(self._stops)
        self._pool: ThreadPoolExecutor | None = None
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
        self._trim()
        return RequestGrammar(kind, fut, self._stop_set)

    def _trim(self) -> None:
        """Drops the least recently used grammars past `CACHE_ENTRIES`, or while they hold more
        than `CACHE_BYTES` (the newest always stays; its requests hold it anyway)."""
        while len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)
        held = sum(_bytes(key, fut) for key, fut in self._cache.items())
        while held > CACHE_BYTES and len(self._cache) > 1:
            held -= _bytes(*self._cache.popitem(last=False))

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

    def accept(self, steps: Sequence[tuple[RequestGrammar, int, bool | None]]) -> None:
        """Each (grammar, token, allowed) of a step: a token its bitmask `allowed` (or refused) is
        recorded, to be fed to the matcher later (`RequestGrammar.take`); one sampled without a
        mask (`allowed` None) is fed at once."""
        for g, token, allowed in steps:
            if allowed is None:
                g.accept(token)
            elif not g.rejected:
                g.record(token, allowed, pending=True)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _bytes(key: tuple[str, str], fut: Future) -> int:
    """The memory a cached grammar holds: its text, and once compiled what XGrammar reports."""
    if not fut.done() or fut.exception() is not None:
        return len(key[1])
    return len(key[1]) + fut.result().memory_size_bytes


class RequestGrammar:
    """One request's grammar state. Only the scheduler thread uses it; its matcher is also fed and
    read on the filler's thread, by the job `_inflight` (`BitmaskFiller.start`)."""

    def __init__(self, kind: str, compiled: Future, stops: frozenset[int] = frozenset()):
        self.kind = kind
        self._compiled = compiled
        self._stops = stops  # the tokens that end the grammar
        self._matcher = None
        self._pending: list[int] = []  # tokens accepted (recorded) that the matcher was not fed yet
        self._inflight: Future | None = None  # the filler's last job on the matcher
        self.seen_ready = False  # the scheduler saw it ready (set by `look`)
        self.accepted = 0  # tokens the matcher has accepted, pending ones included
        self.terminated = False  # a stop token was accepted: the grammar ended
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

    @property
    def tokenizer_info(self):
        """The compiled grammar's `xgrammar.TokenizerInfo` (once compiled)."""
        return self._compiled.result().tokenizer_info

    def look(self) -> bool:
        """Whether the request may run now (compiled without error); remembered in `seen_ready`."""
        self.seen_ready = self.done and self.error is None
        return self.seen_ready

    @property
    def matcher(self):
        """The matcher, having accepted every token recorded (after the filler's job on it)."""
        if self._inflight is not None:
            self._inflight.result()
            self._inflight = None
        matcher, pending = self.take()
        for token in pending:
            if not matcher.accept_token(token):
                refused()
        return matcher

    def take(self) -> tuple[Any, list[int]]:
        """The matcher and the tokens it must be fed (no longer pending), for whoever feeds it
        them next (`lend`)."""
        if self._matcher is None:
            import xgrammar as xgr

            self._matcher = xgr.GrammarMatcher(self._compiled.result())
        pending, self._pending = self._pending, []
        return self._matcher, pending

    def lend(self, job: Future) -> None:
        """The matcher (and what `take` returned) is `job`'s until it has run."""
        self._inflight = job

    def accept(self, token: int) -> None:
        if not self.rejected:
            self.record(token, self.matcher.accept_token(token))

    def try_accept(self, token: int) -> bool:
        """Accepts `token` if the grammar allows it here; a refusal changes nothing."""
        ok = self.matcher.accept_token(token)
        if ok:
            self.accepted += 1
            self.terminated = token in self._stops
        return ok

    def record(self, token: int, ok: bool, pending: bool = False) -> None:
        """Notes that the matcher accepted `token` (`ok`; with `pending`, it will once fed it) or
        refused it."""
        if ok:
            self.accepted += 1
            self.terminated = token in self._stops
            if pending:
                self._pending.append(token)
        else:
            logger.warning("a %s grammar rejected token %d: ending the request", self.kind, token)
            self.rejected = True

    @property
    def finished(self) -> bool:
        """The grammar ended (a stop token accepted) or was broken: no token may follow."""
        return self.rejected or self.terminated

    def sync(self, outputs: Sequence[int]) -> None:
        """Makes the matcher's accepted tokens `outputs` again: rolls back what it accepted past
        them, or replays them from the start when it had not accepted them all."""
        if self._matcher is None or self.rejected:
            return
        matcher = self.matcher
        if self.accepted > len(outputs):
            matcher.rollback(self.accepted - len(outputs))
            self.accepted = len(outputs)
            self.terminated = matcher.is_terminated()
        elif self.accepted < len(outputs):
            matcher.reset()
            self.accepted, self.terminated = 0, False
            for t in outputs:
                self.accept(t)


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
