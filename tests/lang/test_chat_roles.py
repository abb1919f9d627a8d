"""Role framing from chat templates (no model: templates rendered with jinja2 as transformers
renders them, from a string)."""
from __future__ import annotations

import jinja2
import pytest

from hicache.lang.chat import RoleTemplate

CHATML_DEFAULT_SYSTEM = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nDefault.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
LLAMA3 = ("{{ '<|begin_of_text|>' }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] }}<|eot_id|>{% endfor %}")
REWRITES = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% if loop.last %} [last]{% endif %}\n{% endfor %}"


def renderer(source: str):
    template = jinja2.Environment().from_string(source)
    return lambda messages: template.render(messages=messages)


@pytest.mark.parametrize("source", [CHATML_DEFAULT_SYSTEM, LLAMA3])
def test_affixes_rebuild_the_rendered_conversation(source):
    render = renderer(source)
    roles = RoleTemplate(render)
    messages = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]
    for start in (0, 1):  # without and with a leading system message
        convo = ([{"role": "system", "content": "Be brief."}] if start else []) + messages
        text = ""
        for i, m in enumerate(convo):
            prefix, suffix = roles.affixes(tuple(x["role"] for x in convo[:i]), m["role"])
            text += prefix + m["content"] + suffix
        assert text == render(convo)


def test_the_default_system_message_comes_with_the_first_turn_only():
    roles = RoleTemplate(renderer(CHATML_DEFAULT_SYSTEM))
    assert roles.affixes((), "user").prefix == "<|im_start|>system\nDefault.<|im_end|>\n<|im_start|>user\n"
    assert roles.affixes(("user",), "user").prefix == "<|im_start|>user\n"
    assert roles.affixes((), "system").prefix == "<|im_start|>system\n"


def test_a_template_that_rewrites_earlier_turns_is_refused():
    with pytest.raises(ValueError, match="does not just append"):
        RoleTemplate(renderer(REWRITES)).affixes(("user",), "assistant")
