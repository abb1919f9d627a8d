"""`@function` programs and how they run: `prog.run(**kwargs)` runs one (its state back, or its
`ProgramError`), `prog.run_batch([kwargs, ...])` runs many on a thread pool (every state back;
a failed one holds its error and the others still finish). `set_default_backend` names where
programs go when `run` is given no `backend`."""
from __future__ import annotations

import inspect
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from tqdm import tqdm

from hicache.lang.backend import Backend, as_backend
from hicache.lang.executor import Executor
from hicache.lang.state import ProgramState

logger = logging.getLogger(__name__)
_default: list[Backend | None] = [None]
SAMPLING_KEYS = ("max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
                 "frequency_penalty", "presence_penalty", "ignore_eos")
LOGPROB_KEYS = ("return_logprob", "logprob_start_len", "top_logprobs_num")


def set_default_backend(backend: Any) -> None:
    """Programs run here unless `run(backend=...)` says otherwise: a `RuntimeEndpoint` or an `Engine`."""
    _default[0] = as_backend(backend)


def default_backend() -> Backend | None:
    return _default[0]


def function(func: Callable | None = None, **_: Any) -> Function | Callable[[Callable], Function]:
    """Decorator: `@function` (or `@function()`) makes func(s, ...) a program."""
    if func is not None:
        return Function(func)
    return Function


class Function:
    def __init__(self, func: Callable, bind_arguments: dict | None = None):
        params = list(inspect.signature(func).parameters)
        if not params:
            raise TypeError(f"program {func.__name__!r} must take the state as its first argument")
        self.func, self.name = func, func.__name__
        self.arg_names = params[1:]
        self.bind_arguments = dict(bind_arguments or {})

    def bind(self, **kwargs: Any) -> Function:
        unknown = set(kwargs) - set(self.arg_names)
        if unknown:
            raise TypeError(f"program {self.name!r} has no argument(s) {sorted(unknown)}")
        return Function(self.func, {**self.bind_arguments, **kwargs})

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)

    def run(self, *args: Any, max_new_tokens: int = 128, stop: str | list[str] = (), stop_token_ids: list[int] = (),
            temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0,
            frequency_penalty: float = 0.0, presence_penalty: float = 0.0, ignore_eos: bool = False,
            return_logprob: bool | None = None, logprob_start_len: int | None = None,
            top_logprobs_num: int | None = None, stream: bool = False, backend: Any = None,
            **kwargs: Any) -> ProgramState:
        """Run the program on its arguments; the keyword options are defaults of its `gen` calls.
        Raises the `ProgramError` of a failed program; with `stream=True`, returns at once (read
        the state with `text_iter()`; `error()` tells of a failure)."""
        defaults = _defaults(locals())
        state = self._state(backend, defaults, stream)
        if stream:
            threading.Thread(target=self._execute, args=(state, args, kwargs), daemon=True).start()
            return state
        self._execute(state, args, kwargs)
        if state.executor.error_ is not None:
            raise state.executor.error_
        return state

    def run_batch(self, batch_kwargs: list, *, max_new_tokens: int = 128, stop: str | list[str] = (),
                  stop_token_ids: list[int] = (), temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
                  min_p: float = 0.0, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                  ignore_eos: bool = False, return_logprob: bool | None = None, logprob_start_len: int | None = None,
                  top_logprobs_num: int | None = None, backend: Any = None, num_threads: int | str = "auto",
                  progress_bar: bool = False) -> list[ProgramState]:
        """Run the program once per argument dict (or tuple of positional arguments), up to
        num_threads at a time ("auto": SGLang's max(96, 16 x CPUs)); states come back in order."""
        defaults = _defaults(locals())
        if not batch_kwargs:
            return []
        wanted = max(96, 16 * (os.cpu_count() or 1)) if num_threads == "auto" else max(1, int(num_threads))
        workers = min(wanted, len(batch_kwargs))
        states = [self._state(backend, defaults, False) for _ in batch_kwargs]
        bar = tqdm(total=len(states), desc=self.name, disable=not progress_bar)
        with ThreadPoolExecutor(workers, thread_name_prefix=f"lang-{self.name}") as pool:
            futures = [pool.submit(self._execute, s, *_call_args(a)) for s, a in zip(states, batch_kwargs)]
            for f in futures:
                f.add_done_callback(lambda _: bar.update())
            for f in futures:
                f.result()
        bar.close()
        failed = [s.executor.error_ for s in states if s.executor.error_ is not None]
        if failed:
            logger.warning("%d of %d programs failed; the first: %s", len(failed), len(states), failed[0])
        return states

    def _state(self, backend: Any, defaults: tuple[dict, dict], stream: bool) -> ProgramState:
        chosen = as_backend(backend) if backend is not None else default_backend()
        if chosen is None:
            raise ValueError("no backend: call set_default_backend(...) or pass backend=")
        return ProgramState(Executor(chosen, defaults[0], defaults[1], self.name, stream))

    def _execute(self, state: ProgramState, args: tuple, kwargs: dict) -> None:
        """Run the body; a failure is recorded in the state (the executor's own error first)."""
        ex = state.executor
        try:
            state.ret_value = self.func(state, *args, **{**self.bind_arguments, **kwargs})
        except Exception as e:
            if ex.error_ is None:
                ex.sync()
            if ex.error_ is None:
                ex.fail(ex.steps, "the program's own code", e)
        finally:
            ex.end()
            ex.sync()


def _defaults(options: dict) -> tuple[dict, dict]:
    """The native sampling parameters and logprob options of run's keyword options."""
    sampling = {k: options[k] for k in SAMPLING_KEYS}
    sampling["stop"] = [sampling["stop"]] if isinstance(sampling["stop"], str) else list(sampling["stop"])
    sampling["stop_token_ids"] = list(sampling["stop_token_ids"])
    return sampling, {k: options[k] for k in LOGPROB_KEYS if options[k] is not None}


def _call_args(arguments: Any) -> tuple[tuple, dict]:
    if isinstance(arguments, dict):
        return (), arguments
    if isinstance(arguments, (list, tuple)):
        return tuple(arguments), {}
    raise TypeError(f"run_batch: each item must be a dict of arguments or a tuple, got {type(arguments).__name__}")
