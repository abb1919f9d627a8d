"""Role framing from the model's own chat template.

A role's text is what the template adds for one more message: render the conversation so far
with placeholder contents, render it again with a message of the role whose content is a
placeholder too, and the difference, split at that placeholder, is the role's prefix and suffix.
So `user("hi")` after a system message becomes exactly the text the template gives that message
there, and a program's prompt equals the chat API's prompt for the same messages (for templates
that only append, as chat templates do; one that rewrites earlier turns is refused).

The framing depends on the roles before a message, not on their contents, so it is computed once
per sequence of roles and backend.
"""
from __future__ import annotations

import threading
from typing import Callable, NamedTuple

SLOT = "\x1fhicache-lang-{}\x1f"  # placeholder content: a control character no template strips


class Affixes(NamedTuple):
    prefix: str
    suffix: str


class RoleTemplate:
    """`affixes(roles_before, role)` for one backend's chat template, computed on first use."""

    def __init__(self, render: Callable[[list[dict]], str]):
        self._render = render
        self._cache: dict[tuple[tuple[str, ...], str], Affixes] = {}
        self._lock = threading.Lock()

    def affixes(self, before: tuple[str, ...], role: str) -> Affixes:
        key = (before, role)
        with self._lock:
            hit = self._cache.get(key)
        if hit is None:
            hit = self._compute(before, role)
            with self._lock:
                self._cache[key] = hit
        return hit

    def _compute(self, before: tuple[str, ...], role: str) -> Affixes:
        history = [{"role": r, "content": SLOT.format(i)} for i, r in enumerate(before)]
        base = self._render(history) if history else ""
        slot = SLOT.format(len(before))
        full = self._render(history + [{"role": role, "content": slot}])
        if not full.startswith(base) or full.count(slot) != 1:
            raise ValueError(f"the chat template does not just append a {role!r} message after roles {list(before)}: "
                             "programs with roles need a template that does")
        prefix, suffix = full[len(base):].split(slot)
        return Affixes(prefix, suffix)
