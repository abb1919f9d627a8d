"""The tool-call parsers on hand-written model outputs, whole and streamed in random chunkings: the
streamed events rebuild the same content and calls, and no markup of a call leaks into content."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.server.tool_parser import ToolDelta, ToolParser, parse_text
from hicache.server.tools import format_call

W = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
# (format, model output, expected content, expected [(name, arguments)])
OUTPUTS = [
    ("hermes", f"I'll check.\n<tool_call>\n{W}\n</tool_call>", "I'll check.",
     [("get_weather", {"city": "Paris", "unit": "c"})]),
    ("hermes", f"<tool_call>\n{W}\n</tool_call>\n<tool_call>\n"
               '{"name": "search", "arguments": {"q": "a}b{\\"c", "n": [1, {"x": []}]}}\n</tool_call>', None,
     [("get_weather", {"city": "Paris", "unit": "c"}), ("search", {"q": 'a}b{"c', "n": [1, {"x": []}]})]),
    ("hermes", "Paris is the capital. 1 < 2, and <tool is no tag <tool_cal", "Paris is the capital. 1 < 2, and "
               "<tool is no tag <tool_cal", []),
    ("hermes", 'Voilà <tool_call>{"name": "search", "arguments": {"q": "café ☕"}}</tool_call> fini',
     "Voilàfini", [("search", {"q": "café ☕"})]),
    ("hermes", '<tool_call>{"arguments": {"q": 1}, "name": "f"}</tool_call>', None, [("f", {"q": 1})]),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"q\\": 1}"}</tool_call>', None, [("f", {"q": 1})]),
    ("hermes", f"<tool_call>\n{W}", None, [("get_weather", {"city": "Paris", "unit": "c"})]),
    ("hermes", '<tool_call>{"foo": 1}</tool_call> ok', '<tool_call>{"foo": 1}</tool_call> ok', []),
    ("hermes", "<tool_call>no json here", "<tool_call>no json here", []),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
    ("llama3", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', None,
     [("f", {"a": 1}), ("g", {})]),
    ("llama3", ' {"name": "f", "arguments": {"s": "}{;"}}', None, [("f", {"s": "}{;"})]),
    ("llama3", "The answer is {4}.", "The answer is {4}.", []),
    ("llama3", '{"answer": 4}', '{"answer": 4}', []),
    # a call cut (by the token limit) before its name was read is neither content nor a call
    ("hermes", 'I will check.\n<tool_call>\n{"', "I will check.", []),
    ("hermes", f'<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{{"na', None,
     [("get_weather", {"city": "Paris", "unit": "c"})]),
    ("hermes", '<tool_call>\n{"arguments": {"q": 1', None, []),
    ("llama3", '{"name": "f", "parameters": {}}; {"na', None, [("f", {})]),
    ("llama3", ' {"nam', None, []),
    ("llama3", '{"answer": 4', '{"answer": 4', []),
]


def _stream(fmt: str, text: str, cuts: list[int], parallel: bool = True) -> tuple[str | None, list, ToolParser]:
    """Feed `text` cut at `cuts`; the content and the calls rebuilt from the deltas."""
    parser = ToolParser(fmt, parallel)
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(text))), len(text)]
    events = [e for a, b in zip(bounds, bounds[1:]) for e in parser.feed(text[a:b])] + parser.finish()
    content = "".join(e for e in events if isinstance(e, str))
    calls: dict[int, list] = {}
    for d in (e for e in events if isinstance(e, ToolDelta)):
        if d.index not in calls:
            assert d.id is not None and d.id.startswith("call_") and d.name and d.arguments == ""
            calls[d.index] = [d.id, d.name, ""]
        else:
            assert d.id is None and d.name is None and d.arguments
            calls[d.index][2] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content or None, [tuple(calls[i]) for i in sorted(calls)], parser


@pytest.mark.parametrize("fmt,text,content,calls", OUTPUTS)
def test_whole_outputs(fmt, text, content, calls):
    parsed = parse_text(text, fmt)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    assert all(c.id.startswith("call_") for c in parsed.calls) and len({c.id for c in parsed.calls}) == len(calls)


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(OUTPUTS), cuts=st.lists(st.integers(0, 200), max_size=30))
def test_streamed_in_any_chunking_reads_the_same(case, cuts):
    fmt, text, content, calls = case
    streamed, rebuilt, parser = _stream(fmt, text, cuts)
    assert streamed == content
    assert [(name, json.loads(args)) for _, name, args in rebuilt] == calls
    assert [(c.id, c.name, c.arguments) for c in parser.tool_calls()] == rebuilt
    if calls:
        assert "<tool_call>" not in (streamed or "") and "</tool_call>" not in (streamed or "")


@settings(max_examples=20, deadline=None)
@given(cuts=st.lists(st.integers(0, 200), max_size=30))
def test_without_parallel_calls_only_the_first_is_kept(cuts):
    text = OUTPUTS[1][1]
    content, rebuilt, parser = _stream("hermes", text, cuts, parallel=False)
    assert content is None and [name for _, name, _ in rebuilt] == ["get_weather"]
    assert [c.name for c in parser.tool_calls()] == ["get_weather"]
    assert [c.name for c in parse_text(text, "hermes", parallel=False).calls] == ["get_weather"]


def test_arguments_stream_as_they_are_written():
    parser = ToolParser("hermes")
    events = [e for piece in ("<tool_call>", '{"name": "f", "arguments": {"a": ', '"long', ' text"}}')
              for e in parser.feed(piece)]
    assert events[0] == ToolDelta(0, events[0].id, "f", "")
    assert [e.arguments for e in events[1:]] == ['{"a": ', '"long', ' text"}']


def test_unknown_format():
    with pytest.raises(ValueError, match="format"):
        ToolParser("mistral")


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                           max_leaves=8)
CALLS = st.lists(st.tuples(st.from_regex(r"[A-Za-z_][A-Za-z0-9_\-]{0,10}", fullmatch=True),
                           st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=4)), min_size=1, max_size=3)
TEXTS = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12).filter(
    lambda t: "<tool_call>" not in t and "</tool_call>" not in t)


@settings(max_examples=50, deadline=None)
@given(calls=CALLS, texts=st.lists(TEXTS, min_size=4, max_size=4), cuts=st.lists(st.integers(0, 400), max_size=40))
def test_random_calls_among_random_text_hermes(calls, texts, cuts):
    """Any calls written in the Hermes format among any text read back, whole and in any chunking."""
    segments = [texts[i % 4] for i in range(len(calls) + 1)]
    out = segments[0]
    for (name, args), text in zip(calls, segments[1:]):
        out += format_call(name, json.dumps(args), "hermes") + text
    kept = [s.lstrip() if i else s for i, s in enumerate(segments)]
    content = "".join(s.rstrip() if i < len(calls) else s for i, s in enumerate(kept)) or None
    streamed, rebuilt, _ = _stream("hermes", out, cuts)
    assert streamed == content == parse_text(out, "hermes").content
    assert [(name, json.loads(args)) for _, name, args in rebuilt] == calls


@settings(max_examples=40, deadline=None)
@given(calls=CALLS, tag=st.booleans(), cuts=st.lists(st.integers(0, 400), max_size=40))
def test_random_calls_llama3(calls, tag, cuts):
    out = ("<|python_tag|>" if tag else "") + "; ".join(format_call(n, json.dumps(a), "llama3") for n, a in calls)
    streamed, rebuilt, _ = _stream("llama3", out, cuts)
    assert streamed is None and parse_text(out, "llama3").content is None
    assert [(name, json.loads(args)) for _, name, args in rebuilt] == calls
