"""Every program under examples/ runs on the default model (few tokens each), on the in-process
Engine (tests/lang/test_programs.py runs programs over HTTP too)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lang_support import needs_grammar, needs_logprobs

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
import agent  # noqa: E402
import json_extraction  # noqa: E402
import multi_turn_qa  # noqa: E402
import tree_of_thought  # noqa: E402

pytestmark = pytest.mark.model


def test_multi_turn_qa(engine_backend):
    state = multi_turn_qa.multi_turn_qa.run(question="What is a cache?", max_tokens=6, temperature=0,
                                            backend=engine_backend)
    metas = [state.get_meta_info(n) for n in ("answer", "summary")]
    assert metas[1]["cached_tokens"] >= metas[0]["prompt_tokens"]
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant", "user", "assistant"]


def test_agent_tools_and_loop(engine_backend):
    assert agent.calculator("2100 / 100 * 3") == "63.0"
    assert agent.calculator("__import__('os')").startswith("error")
    assert "Paris" in agent.lookup(" Paris ")
    state = agent.agent.run(task="What is 12 * 7? Use the calculator.", max_steps=2, max_tokens=8, temperature=0,
                            backend=engine_backend)
    actions = [v for k, v in state.executor.variables.items() if k.startswith("action_")]
    assert 1 <= len(actions) <= 2 and state.messages()[-1]["role"] in ("assistant", "user")


@needs_logprobs
def test_tree_of_thought(engine_backend):
    state = tree_of_thought.tree_of_thought.run(question="How do I boil an egg?", num_branches=2, max_tokens=6,
                                                temperature=0, backend=engine_backend)
    assert len(state["approach"]) == 2 and set(state["sound"]) <= {"yes", "no"}
    assert state["best"] in ("1", "2")


@needs_grammar
def test_json_extraction(engine_backend):
    states = json_extraction.extract_person.run_batch(
        [{"text": "Ada is 36 and lives in London.", "max_tokens": 48}], backend=engine_backend)
    person = json.loads(states[0]["person"])
    assert set(person) == {"name", "age", "city"} and isinstance(person["age"], int)
