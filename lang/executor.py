"""The executor: runs one program state's expressions, in order, on a worker thread of its own,
so that a program's `s += ...` returns at once and forked branches run concurrently; reading a
variable waits for it.

Prompts are sent as token ids so that each call extends the cached prefix of the call before:
the ids of the last prompt sent (the anchor) are kept, and the next prompt is those ids plus the
tokens of the text appended since. The radix cache then matches at least the whole previous
prompt, whatever the tokenizer would have merged across the boundary (re-tokenizing the whole
text could, e.g., join the end of a prompt with the start of the generated text).
"""
from __future__ import annotations

import queue
import threading
from typing import Iterator, NamedTuple

from hicache.lang.backend import Backend
from hicache.lang.ir import Expr, Exprs, Gen, RoleBegin, RoleEnd, Select, Text, VarScopeBegin, VarScopeEnd, describe

COMMIT = {"max_new_tokens": 1, "temperature": 0.0}  # a prefill that leaves the prompt in the cache
SCORE = {"max_new_tokens": 0, "temperature": 0.0}


class ProgramError(RuntimeError):
    """A program failed: the message names the program, its step and the expression."""


class Anchor(NamedTuple):
    """The last prompt sent: it covered `text_[:text_len]` with exactly `ids`."""
    text_len: int
    ids: tuple[int, ...]


class Executor:
    def __init__(self, backend: Backend, defaults: dict, logprob_defaults: dict, name: str, stream: bool):
        self.backend, self.defaults, self.logprob_defaults = backend, defaults, logprob_defaults
        self.name, self.stream = name, stream
        self.roles = backend.role_template()
        self.text_ = ""
        self.messages_: list[dict] = []
        self.variables: dict = {}
        self.meta_info: dict = {}
        self.anchor = Anchor(0, ())
        self.role: str | None = None
        self.role_start, self.role_suffix = 0, ""
        self.error_: ProgramError | None = None
        self.finished = False
        self.steps = 0
        self.current: Expr | None = None
        self.pending: set[str] = set()  # variables submitted and not yet set
        self.scopes: dict[str, int] = {}  # open variable scopes: where each one's text begins
        self.cond = threading.Condition()
        self.queue: queue.Queue = queue.Queue()
        self.worker: threading.Thread | None = None
        self.children: list[Executor] = []

    # ---- called by the program's thread -----------------------------------------------------

    def submit(self, expr: Expr) -> None:
        self.steps += 1
        with self.cond:
            self.pending |= _names(expr)
        if self.worker is None:
            self.worker = threading.Thread(target=self._work, name=f"lang-{self.name}", daemon=True)
            self.worker.start()
        self.queue.put((self.steps, expr))

    def sync(self) -> None:
        if self.worker is not None:
            self.queue.join()

    def end(self) -> None:
        """No more expressions: the worker finishes what is queued and exits (so do the forks')."""
        for child in self.children:
            child.end()
        if self.worker is None:
            with self.cond:
                self.finished = True
                self.cond.notify_all()
        elif not self.finished:
            self.queue.put(None)

    def get_var(self, name: str):
        with self.cond:
            self.cond.wait_for(lambda: name not in self.pending)
            if name in self.variables:
                return self.variables[name]
        if self.error_ is not None:
            raise self.error_
        raise KeyError(f"program {self.name!r} has no variable {name!r}")

    def fork(self, n: int) -> list[Executor]:
        """n executors that continue from this one's state; with n > 1 the shared prefix is sent
        first, so that every branch finds it cached."""
        self.sync()
        self.steps += 1
        if self.error_ is None and n > 1 and self.text_:
            try:
                self._commit()
            except Exception as e:
                self.fail(self.steps, f"fork({n})", e)
        if self.error_ is not None:
            raise self.error_
        kids = [self._child(f"{self.name} fork {i}") for i in range(n)]
        self.children += kids
        return kids

    def stream_text(self, var: str | None) -> Iterator[str]:
        """The text (or variable var) as it grows, until the program (or var) is done."""
        pos = 0
        while True:
            with self.cond:
                self.cond.wait_for(lambda: len(self._value(var)) > pos or self._done(var))
                chunk, done = self._value(var)[pos:], self._done(var)
            pos += len(chunk)
            if chunk:
                yield chunk
            if done:
                return

    # ---- the worker -------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    with self.cond:
                        self.finished = True
                        self.cond.notify_all()
                    return
                step, expr = item
                if self.error_ is None:
                    try:
                        self._execute(expr)
                    except Exception as e:
                        self.fail(step, describe(self.current or expr), e)
            finally:
                self.queue.task_done()

    def fail(self, step: int, what: str, e: Exception) -> None:
        err = ProgramError(f"program {self.name!r} failed at step {step} ({what}): {type(e).__name__}: {e}")
        err.__cause__ = e
        with self.cond:
            self.error_ = err
            self.pending.clear()
            self.cond.notify_all()

    def _execute(self, e: Expr) -> None:
        if isinstance(e, Exprs):
            for item in e.items:
                self._execute(item)
            return
        self.current = e
        if isinstance(e, Text):
            self._append(e.value)
        elif isinstance(e, Gen):
            self._gen(e)
        elif isinstance(e, Select):
            self._select(e)
        elif isinstance(e, RoleBegin):
            self._role_begin(e.role)
        elif isinstance(e, RoleEnd):
            self._role_end(e.role)
        elif isinstance(e, VarScopeBegin):
            self.scopes[e.name] = len(self.text_)
        elif isinstance(e, VarScopeEnd):
            self._scope_end(e.name)
        else:
            raise TypeError(f"cannot execute {type(e).__name__}")

    def _gen(self, g: Gen) -> None:
        params = {**self.defaults, **g.params}
        logprobs = {**self.logprob_defaults, **g.logprobs}
        ids = self._prompt_ids()
        start = len(self.text_)
        if self.stream:
            out = None
            for out in self.backend.generate_stream(ids, params, logprobs):
                self._output(start, g.name, out["text"], out["meta_info"], final=False)
        else:
            out = self.backend.generate([ids], params, logprobs)[0]
        self._output(start, g.name, out["text"], out["meta_info"], final=True)
        self.anchor = Anchor(start, tuple(ids))

    def _select(self, sel: Select) -> None:
        ids = self._commit()
        options = self.backend.tokenize(list(sel.choices))
        # from the prefix's last token: the first entry has no logprob, the choice's tokens all do
        outs = self.backend.generate([ids + o for o in options], SCORE,
                                     {"return_logprob": True, "logprob_start_len": len(ids) - 1, "top_logprobs_num": 0})
        token_logprobs = [o["meta_info"]["input_token_logprobs"][-len(opt):] for o, opt in zip(outs, options)]
        scores = [normalized_logprob(t) for t in token_logprobs]
        best = max(range(len(scores)), key=scores.__getitem__)
        meta = {"normalized_prompt_logprobs": scores, "input_token_logprobs": token_logprobs}
        self._output(len(self.text_), sel.name, sel.choices[best], meta, final=True)
        self.anchor = Anchor(len(self.text_), tuple(ids + options[best]))

    def _commit(self) -> list[int]:
        """The ids of the whole text, sent first if the text grew since the last prompt."""
        ids = self._prompt_ids()
        if len(self.text_) > self.anchor.text_len:
            self.backend.generate([ids], COMMIT, {})
            self.anchor = Anchor(len(self.text_), tuple(ids))
        return ids

    def _prompt_ids(self) -> list[int]:
        tail = self.text_[self.anchor.text_len:]
        ids = list(self.anchor.ids) + (self.backend.tokenize([tail])[0] if tail else [])
        if not ids:
            raise ValueError("the prompt is empty: append text before gen or select")
        return ids

    def _role_begin(self, role: str) -> None:
        if self.role is not None:
            raise ValueError(f"role {role!r} begins inside role {self.role!r}: roles do not nest")
        prefix, suffix = self.roles.affixes(tuple(m["role"] for m in self.messages_), role)
        self._append(prefix)
        self.role, self.role_start, self.role_suffix = role, len(self.text_), suffix

    def _role_end(self, role: str) -> None:
        if self.role != role:
            raise ValueError(f"role {role!r} ends, but the open role is {self.role!r}")
        content = self.text_[self.role_start:]
        self._append(self.role_suffix)
        self.messages_.append({"role": role, "content": content.lstrip()})
        self.role = None

    def _scope_end(self, name: str) -> None:
        if name not in self.scopes:
            raise ValueError(f"variable scope {name!r} ends, but it was not begun")
        start = self.scopes.pop(name)
        with self.cond:
            self.variables[name] = self.text_[start:]
            self.pending.discard(name)
            self.cond.notify_all()

    # ---- state changes (under the condition, for readers on other threads) -------------------

    def _append(self, text: str) -> None:
        with self.cond:
            self.text_ += text
            self.cond.notify_all()

    def _output(self, start: int, name: str | None, text: str, meta: dict, final: bool) -> None:
        with self.cond:
            self.text_ = self.text_[:start] + text
            if name is not None:
                self.variables[name] = text
                self.meta_info[name] = meta
                if final:
                    self.pending.discard(name)
            self.cond.notify_all()

    def _value(self, var: str | None) -> str:
        return self.text_ if var is None else self.variables.get(var, "")

    def _done(self, var: str | None) -> bool:
        return self.finished or self.error_ is not None or (var in self.variables and var not in self.pending)

    def _child(self, name: str) -> Executor:
        kid = Executor(self.backend, self.defaults, self.logprob_defaults, name, self.stream)
        kid.text_, kid.messages_, kid.variables = self.text_, list(self.messages_), dict(self.variables)
        kid.anchor, kid.role, kid.scopes = self.anchor, self.role, dict(self.scopes)
        kid.role_start, kid.role_suffix = self.role_start, self.role_suffix
        return kid


def normalized_logprob(token_logprobs: list) -> float:
    """The mean log probability of the tokens (entries `[logprob, token_id, text]`)."""
    values = [e[0] for e in token_logprobs if e[0] is not None]
    if not values:
        raise ValueError("the server returned no logprobs for a choice")
    return sum(values) / len(values)


def _names(expr: Expr) -> set[str]:
    if isinstance(expr, Exprs):
        return set().union(*(_names(e) for e in expr.items)) if expr.items else set()
    if isinstance(expr, VarScopeBegin):
        return {expr.name}
    return {expr.name} if isinstance(expr, (Gen, Select)) and expr.name is not None else set()
