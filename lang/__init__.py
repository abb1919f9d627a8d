"""hicache's frontend language: SGLang's, so that SGLang programs run with
`import hicache.lang as sgl`. A program is a Python function over a state `s`; `s += text`,
`s += gen("name")`, `s += select("name", choices)`, roles (`system`, `user`, `assistant`) framed
by the model's chat template, `s.fork(n)`. Its calls go to a backend: `RuntimeEndpoint(url)` (a
running `hicache serve`) or an in-process `Engine`."""
from __future__ import annotations

from typing import Any

from hicache.lang.backend import Backend, EngineBackend, RuntimeEndpoint, as_backend
from hicache.lang.executor import ProgramError
from hicache.lang.ir import (
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    select,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from hicache.lang.program import Function, default_backend, function, set_default_backend
from hicache.lang.state import ProgramState, ProgramStateGroup


def Engine(*args: Any, **kwargs: Any):
    """An in-process `hicache.Engine` (usable as a backend: `set_default_backend(Engine())`)."""
    from hicache.runtime.engine import Engine as RuntimeEngine

    return RuntimeEngine(*args, **kwargs)


def gen_int(name: str | None = None, **kwargs: Any):
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any):
    return gen(name, dtype=str, **kwargs)


def flush_cache(backend: Any = None) -> Any:
    return _chosen(backend).flush_cache()


def get_server_info(backend: Any = None) -> dict:
    return _chosen(backend).get_server_info()


def _chosen(backend: Any) -> Backend:
    chosen = as_backend(backend) if backend is not None else default_backend()
    if chosen is None:
        raise ValueError("no backend: call set_default_backend(...) or pass one")
    return chosen


__all__ = [
    "Backend", "Engine", "EngineBackend", "Function", "ProgramError", "ProgramState", "ProgramStateGroup",
    "RuntimeEndpoint", "assistant", "assistant_begin", "assistant_end", "flush_cache", "function", "gen", "gen_int",
    "gen_string", "get_server_info", "select", "set_default_backend", "system", "system_begin", "system_end", "user",
    "user_begin", "user_end",
]
