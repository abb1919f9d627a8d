"""Tool calls read out of a model's text, incrementally: the Hermes / Qwen format
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of blocks among text) and
the Llama 3.x JSON format (the whole answer is `{"name": ..., "parameters": {...}}`, optionally
after `<|python_tag|>`, several calls separated by `;`).

`ToolParser.feed(text)` returns the events that text completes: `str` content and `ToolDelta`s
(a call's index, id and name first, then fragments of its arguments, the raw JSON as the model
writes it). Text that may still turn out to open a call is held back, so that no markup reaches
the content. `finish()` releases what is left. `parse_text` runs the same machine over a whole
text, so that a streamed answer and a non-streamed one read the same. Whitespace between text and
a call is dropped. A block whose JSON is not a call stays content; a call cut short (by the token
limit) keeps the arguments read so far, and one cut before its name is dropped.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import NamedTuple, Union

from hicache.server.tools import ToolCall

HERMES_OPEN, HERMES_CLOSE, PYTHON_TAG = "<tool_call>", "</tool_call>", "<|python_tag|>"
_CALL_KEYS = ('{"name":', '{"arguments":', '{"parameters":')  # how a call's JSON begins, blanks removed
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*', re.S)


class ToolDelta(NamedTuple):
    index: int
    id: str | None  # with the name, in a call's first delta only
    name: str | None
    arguments: str


Event = Union[str, ToolDelta]


class ParsedText(NamedTuple):
    content: str | None  # None when empty
    calls: list[ToolCall]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class _JsonEnd:
    """Finds where a JSON value that starts at `start` ends, scanning only new text."""

    def __init__(self, start: int) -> None:
        self.pos, self.depth, self.in_str, self.esc = start, 0, False, False

    def scan(self, text: str) -> int | None:
        """The end index of the value (exclusive) once it is complete, else None."""
        while self.pos < len(text):
            ch = text[self.pos]
            self.pos += 1
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
                    if self.depth == 0:
                        return self.pos
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return self.pos
        return None


class _Call:
    """One call being read; `text` starts at its JSON object."""

    def __init__(self, index: int) -> None:
        self.index, self.text = index, ""
        self.id: str | None = None  # set once the name has been sent
        self.name = ""
        self.args: _JsonEnd | None = None  # scans the arguments value, once the head is read
        self.args_start = -1
        self.args_end: int | None = None
        self.sent = ""  # the arguments sent so far
        self.outer = _JsonEnd(0)
        self.end: int | None = None  # the object's end, once complete

    def feed(self, more: str) -> list[ToolDelta]:
        self.text += more
        if self.end is None:
            self.end = self.outer.scan(self.text)
        if self.args is None and not self._head():
            return self._whole() if self.end is not None else []
        if self.args_end is None:
            self.args_end = self.args.scan(self.text)
        if self.text[self.args_start] == '"':  # arguments as a JSON string: decoded whole
            if self.args_end is None or self.id is not None:
                return []
            return self._send(_string_arguments(self.text[self.args_start:self.args_end]))
        stop = len(self.text) if self.args_end is None else self.args_end
        return self._send(self.text[self.args_start + len(self.sent):stop])

    def _head(self) -> bool:
        m = _HEAD.match(self.text)
        if m is None or m.end() >= len(self.text) or self.text[m.end()] not in '{"':
            return False
        self.name, self.args_start = json.loads(m.group(1)), m.end()
        self.args = _JsonEnd(m.end())
        return True

    def _whole(self) -> list[ToolDelta]:
        """A complete object whose keys come in another order: a call if it has a name and arguments."""
        try:
            obj = json.loads(self.text[:self.end])
        except ValueError:
            return []
        args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
        if not isinstance(obj.get("name") if args is not None else None, str) or not isinstance(args, (dict, str)):
            return []
        self.name = obj["name"]
        return self._send(args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))

    def _send(self, fragment: str) -> list[ToolDelta]:
        """The name first (once), then this fragment of the arguments."""
        out = []
        if self.id is None:
            self.id = new_call_id()
            out.append(ToolDelta(self.index, self.id, self.name, ""))
        if fragment:
            self.sent += fragment
            out.append(ToolDelta(self.index, None, None, fragment))
        return out


def _string_arguments(raw: str) -> str:
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    return value if isinstance(value, str) else raw


class ToolParser:
    """The incremental reader of one answer; `fmt` is 'hermes' or 'llama3'. With `parallel`
    false only the first call is kept (later ones are dropped, neither content nor call)."""

    def __init__(self, fmt: str, parallel: bool = True) -> None:
        if fmt not in ("hermes", "llama3"):
            raise ValueError(f"unknown tool-call format {fmt!r}")
        self.fmt, self.parallel = fmt, parallel
        self.mode = "start"  # start, text, call, closing (hermes), between (llama3), plain (llama3)
        self.pending = ""  # text not yet released
        self.call: _Call | None = None
        self.block = ""  # the current call's raw text with its markup: content if it is no call
        self.calls: list[_Call] = []  # calls whose name was sent

    def feed(self, text: str) -> list[Event]:
        self.pending += text
        events: list[Event] = []
        while self.pending:
            step = getattr(self, "_" + self.mode)()
            if step is None:
                break
            events.extend(step)
        return _merge(events)

    def finish(self) -> list[Event]:
        """What is left as content; a call cut short before its name (by the token limit) is
        dropped, neither content nor a call."""
        events: list[Event] = []
        if self.mode == "call" and self.call.id is None and not self._cut_call():
            events.append(self.block + self.pending)
        elif self.mode in ("text", "start", "plain") or (self.mode == "between" and self.pending.strip()):
            events.append(self.pending)
        self.pending, self.mode = "", "plain"
        return _merge(events)

    def tool_calls(self) -> list[ToolCall]:
        kept = self.calls if self.parallel else self.calls[:1]
        return [ToolCall(c.id, c.name, c.sent) for c in kept]

    def _cut_call(self) -> bool:
        """Whether the unfinished block began a call: after Hermes' tag, any JSON object; in
        Llama 3's bare JSON, an object that begins as a call does."""
        if self.fmt == "hermes":
            return True
        head = re.sub(r"\s+", "", self.call.text + self.pending)
        return any(k.startswith(head) or head.startswith(k) for k in _CALL_KEYS)

    # ---- outside calls -----------------------------------------------------------------------

    def _start(self) -> list[Event] | None:
        if self.fmt == "hermes":
            self.mode = "text"
            return []
        body = self.pending.lstrip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip()
        elif PYTHON_TAG.startswith(body):
            return None  # still possibly the tag
        if not body:
            return None
        if body[0] != "{":
            self.mode = "plain"
            return []
        return self._open(self.pending[:len(self.pending) - len(body)], body)

    def _text(self) -> list[Event] | None:
        at = self.pending.find(HERMES_OPEN)
        if at < 0:
            keep = _held_back(self.pending, HERMES_OPEN)
            out, self.pending = self.pending[:keep], self.pending[keep:]
            return [out] if out else None
        out = self.pending[:at].rstrip()
        return [out] + self._open(self.pending[at:at + len(HERMES_OPEN)], self.pending[at + len(HERMES_OPEN):])

    def _plain(self) -> list[Event]:
        out, self.pending = self.pending, ""
        return [out]

    def _open(self, markup: str, body: str) -> list[Event]:
        self.call, self.block, self.pending, self.mode = _Call(len(self.calls)), markup, body, "call"
        return []

    # ---- inside a call ---------------------------------------------------------------------

    def _call(self) -> list[Event] | None:
        call, more = self.call, self.pending
        if not call.text.strip() and more.strip() and more.lstrip()[0] != "{":  # no JSON object: not a call
            return self._not_a_call(call.text + more)
        self.pending = ""
        deltas = call.feed(more)
        self.block += more
        if call.id is not None and call not in self.calls:
            self.calls.append(call)
        if call.end is None:
            return self._visible(deltas) or None
        rest = call.text[call.end:]
        self.block = self.block[:len(self.block) - len(rest)]
        call.text = call.text[:call.end]
        if call.id is None:
            return self._not_a_call("", rest)
        self.pending, self.mode = rest, "closing" if self.fmt == "hermes" else "between"
        return self._visible(deltas)

    def _not_a_call(self, text: str, rest: str = "") -> list[Event]:
        """The block read so far is content; text mode goes on after it."""
        out = self.block if not text else self.block[:len(self.block) - len(self.call.text)] + text
        self.call, self.pending, self.mode = None, rest, "text" if self.fmt == "hermes" else "plain"
        return [out]

    def _closing(self) -> list[Event] | None:
        """Hermes: after a call's object, its closing tag (and the whitespace that follows)."""
        stripped = self.pending.lstrip()
        if stripped.startswith(HERMES_CLOSE):
            stripped = stripped[len(HERMES_CLOSE):].lstrip()
        elif HERMES_CLOSE.startswith(stripped):
            return None
        if not stripped:
            return None
        self.pending, self.mode = stripped, "text"
        return []

    def _between(self) -> list[Event] | None:
        """Llama 3: after a call's object, '; {' opens the next call; other text is content."""
        stripped = self.pending.lstrip()
        if not stripped or stripped == ";":
            return None
        if stripped[0] != ";":
            self.pending, self.mode = stripped, "plain"
            return []
        body = stripped[1:].lstrip()
        if not body:
            return None
        if body[0] != "{":
            self.pending, self.mode = body, "plain"
            return []
        return self._open("", body)

    def _visible(self, deltas: list[ToolDelta]) -> list[Event]:
        return list(deltas) if self.parallel or not deltas or deltas[0].index == 0 else []


def _held_back(text: str, tag: str) -> int:
    """Where the longest tail of `text` that could begin `tag` starts; trailing whitespace is
    held back too (it is dropped if a call follows)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return len(text[:-k].rstrip())
    return len(text.rstrip())


def _merge(events: list[Event]) -> list[Event]:
    """Adjacent content joined, empty content dropped."""
    out: list[Event] = []
    for e in events:
        if isinstance(e, str):
            if not e:
                continue
            if out and isinstance(out[-1], str):
                out[-1] += e
                continue
        out.append(e)
    return out


def parse_text(text: str, fmt: str, parallel: bool = True) -> ParsedText:
    """A whole answer: its content (text outside the calls) and its calls."""
    parser = ToolParser(fmt, parallel)
    events = parser.feed(text) + parser.finish()
    content = "".join(e for e in events if isinstance(e, str))
    return ParsedText(content or None, parser.tool_calls())
