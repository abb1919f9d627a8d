"""`ProgramState` (the `s` of a program) and `ProgramStateGroup` (what `s.fork(n)` returns), with
SGLang's methods: `s += expr`, `s["name"]`, `s.text()`, `s.messages()`, `s.text_iter()`,
`s.get_meta_info(name)`, `s.fork(n)`, `forks.join()`, `with s.user(): ...` role scopes and
`with s.var_scope(name): ...` variable scopes."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

from hicache.lang.executor import Executor, ProgramError
from hicache.lang.ir import Expr, RoleBegin, RoleEnd, VarScopeBegin, VarScopeEnd, as_expr


class ProgramState:
    def __init__(self, executor: Executor):
        self.executor = executor
        self.ret_value: Any = None

    def __iadd__(self, other: Any) -> ProgramState:
        self.executor.submit(as_expr(other))
        return self

    def __getitem__(self, name: str) -> Any:
        return self.executor.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.executor.variables[name] = value

    def __contains__(self, name: str) -> bool:
        return name in self.executor.variables

    def get_var(self, name: str) -> Any:
        return self.executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self[name] = value

    def get_meta_info(self, name: str) -> dict | None:
        """The `meta_info` of the call that set variable name (prompt and cached tokens,
        logprobs when asked for); for a `select`, its per-choice scores; for a variable the
        branches of a fork set, after `join()`, the list of theirs."""
        self.executor.get_var(name)
        return self.executor.meta_info.get(name)

    def text(self) -> str:
        self.sync()
        return self.executor.text_

    def messages(self) -> list[dict]:
        """The roles' messages so far, as chat API messages ({"role", "content"})."""
        self.sync()
        return list(self.executor.messages_)

    def sync(self) -> None:
        self.executor.sync()

    def error(self) -> ProgramError | None:
        self.sync()
        return self.executor.error_

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The text (or one variable) piece by piece as it is generated (`run(stream=True)`);
        without streaming, all of it at once when done."""
        return self.executor.stream_text(var_name)

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """Variable `name` is the text appended inside the `with` block, generations included."""
        self.executor.submit(VarScopeBegin(name))
        yield
        self.executor.submit(VarScopeEnd(name))

    def fork(self, size: int = 1) -> ProgramStateGroup:
        return ProgramStateGroup([ProgramState(e) for e in self.executor.fork(int(size))], self)

    @contextmanager
    def copy(self) -> Iterator[ProgramState]:
        group = self.fork(1)
        try:
            yield group[0]
        finally:
            group.join()

    def system(self, expr: Any = None):
        return self._role("system", expr)

    def user(self, expr: Any = None):
        return self._role("user", expr)

    def assistant(self, expr: Any = None):
        return self._role("assistant", expr)

    def _role(self, role: str, expr: Any):
        """With expr: append the role's message now. Without: a `with` scope for the message."""
        if expr is not None:
            self.executor.submit(RoleBegin(role) + as_expr(expr) + RoleEnd(role))
            return None
        return self._role_scope(role)

    @contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        self.executor.submit(RoleBegin(role))
        yield
        self.executor.submit(RoleEnd(role))

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup:
    """The branches of a fork. `forks += expr` appends to every branch (a callable gets the
    branch index, a list gives one item a branch); `join()` waits for them and gathers each new
    variable, and its meta_info, into a list in the parent."""

    def __init__(self, states: list[ProgramState], parent: ProgramState):
        self.states, self.parent = states, parent

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        for i, state in enumerate(self.states):
            state += _branch_item(other, i)
        return self

    def join(self) -> None:
        parent = self.parent.executor
        known = set(parent.variables)
        for state in self.states:
            state.sync()
            if state.executor.error_ is not None:
                raise state.executor.error_
            for name, value in state.executor.variables.items():
                if name not in known:
                    parent.variables.setdefault(name, []).append(value)
                    parent.meta_info.setdefault(name, []).append(state.executor.meta_info.get(name))
        for state in self.states:
            state.executor.end()


def _branch_item(other: Any, i: int) -> Any:
    if isinstance(other, Expr) or isinstance(other, str):
        return other
    if isinstance(other, Callable):
        return other(i)
    if isinstance(other, (list, tuple)):
        return other[i]
    raise TypeError(f"cannot append {type(other).__name__} to forked states")
