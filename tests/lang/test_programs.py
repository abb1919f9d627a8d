"""SGLang programs on both backends: the same greedy outputs as the direct API calls they stand
for, each step extending the cached prefix of the step before, forks sharing their prefix, and
failures named by program and step."""
from __future__ import annotations

import json
import uuid

import pytest

import hicache.lang as sgl
from lang_support import needs_grammar
from direct import chat_turns, complete

pytestmark = pytest.mark.model


@sgl.function
def multi_turn_qa(s, question, max_tokens=8):
    s += sgl.system("You are a precise assistant.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=max_tokens))
    s += sgl.user("Summarize your answer in one sentence.")
    s += sgl.assistant(sgl.gen("summary", max_tokens=max_tokens))


@sgl.function
def chat(s, nonce):  # every way of writing a role
    s.system(f"You are a terse assistant (session {nonce}).")
    with s.user():
        s += "Name a colour."
    s.assistant(sgl.gen("colour", max_tokens=4))
    s += sgl.user_begin() + "And a fruit?" + sgl.user_end()
    s += sgl.assistant_begin() + sgl.gen("fruit", max_tokens=4) + sgl.assistant_end()
    s += sgl.user("And an animal?")
    s += sgl.assistant(sgl.gen("animal", max_tokens=4))
    s += sgl.user("And a city?")
    s += sgl.assistant(sgl.gen("city", max_tokens=4))
    s += sgl.user("And a river?")
    s += sgl.assistant(sgl.gen("river", max_tokens=4))


@sgl.function
def ideas(s, nonce, topic):
    s += f"Notebook {nonce}. Four short ideas about {topic}, one a line.\n"
    forks = s.fork(4)
    forks += lambda i: f"Idea {i + 1}:"
    forks += sgl.gen("idea", max_tokens=4, stop="\n")
    forks.join()
    return forks


def test_multi_turn_qa_equals_the_chat_api(backend):
    state = multi_turn_qa.run(question="What is the capital of France?", temperature=0, backend=backend)
    assert [state["answer"], state["summary"]] == chat_turns(backend, state.messages(), [8, 8])
    assert state.messages()[0] == {"role": "system", "content": "You are a precise assistant."}


@pytest.mark.slow
def test_the_issue_program_unchanged_equals_the_chat_api(backend):
    @sgl.function
    def multi_turn_qa(s, question):
        s += sgl.system("You are a precise assistant.")
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=256))
        s += sgl.user("Summarize your answer in one sentence.")
        s += sgl.assistant(sgl.gen("summary", max_tokens=64))

    state = multi_turn_qa.run(question="Explain RadixAttention in one paragraph.", temperature=0, backend=backend)
    assert [state["answer"], state["summary"]] == chat_turns(backend, state.messages(), [256, 64])


def test_five_steps_each_extend_the_cached_prefix(backend):
    state = chat.run(nonce=uuid.uuid4().hex, temperature=0, backend=backend)
    names = ["colour", "fruit", "animal", "city", "river"]
    metas = [state.get_meta_info(n) for n in names]
    for before, after in zip(metas, metas[1:]):
        assert after["cached_tokens"] >= before["prompt_tokens"], metas


def test_forks_share_the_cached_prefix_and_equal_direct_calls(backend):
    nonce = uuid.uuid4().hex
    state = ideas.run(nonce=nonce, topic="caching", temperature=0, backend=backend)
    prefix = f"Notebook {nonce}. Four short ideas about caching, one a line.\n"
    prefix_tokens = len(backend.tokenize([prefix])[0])
    for branch in state.ret_value:
        assert branch.get_meta_info("idea")["cached_tokens"] >= prefix_tokens
    want = complete(backend, [prefix + f"Idea {i + 1}:" for i in range(4)],
                    {"max_new_tokens": 4, "stop": ["\n"], "temperature": 0})
    assert state["idea"] == want
    metas = state.get_meta_info("idea")  # gathered into the parent like the variable
    assert metas == [branch.get_meta_info("idea") for branch in state.ret_value] and len(metas) == 4


@sgl.function
def city_json(s, nonce):
    s += f"Record {nonce}. A JSON object describing Paris:\n"
    with s.var_scope("json_output"):
        s += '{\n  "name": ' + sgl.gen("name", max_tokens=6, regex=r'"[A-Za-z ]{1,12}"') + ",\n"
        s += '  "population": ' + sgl.gen("population", max_tokens=6, regex=r"[0-9]{1,8}") + "\n}"
    s += "\nDone."


def test_var_scope_holds_the_text_appended_inside_it(backend):
    """SGLang's `with s.var_scope(name)`: the variable is the text the scope appended, generations
    included (the frontend's JSON examples build an object so)."""
    state = city_json.run(nonce=uuid.uuid4().hex, temperature=0, backend=backend)
    out = state["json_output"]
    assert out == '{\n  "name": ' + state["name"] + ',\n  "population": ' + state["population"] + "\n}"
    assert isinstance(json.loads(out)["population"], int) and state.text().endswith(out + "\nDone.")


@sgl.function
def one_answer(s, question, top_p=1.0):
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=4, top_p=top_p))


def test_run_batch_runs_every_program_and_a_failure_names_its_step(backend):
    questions = ["Name a planet.", "Name a metal.", "Name a bird.", "Name a tree."]
    args = [{"question": q} for q in questions] + [{"question": "Name a fish.", "top_p": 5.0}]
    states = one_answer.run_batch(args, temperature=0, num_threads=4, progress_bar=True, backend=backend)
    want = chat_turns_batch(backend, questions)
    assert [s["answer"] for s in states[:4]] == want
    assert all(s.error() is None for s in states[:4])
    err = states[4].error()
    assert isinstance(err, sgl.ProgramError)
    assert "program 'one_answer' failed at step 2 (gen 'answer')" in str(err) and "top_p" in str(err)
    with pytest.raises(sgl.ProgramError, match="top_p"):
        states[4]["answer"]


def chat_turns_batch(backend, questions):
    return [chat_turns(backend, [{"role": "user", "content": q}, {"role": "assistant", "content": ""}], [4])[0]
            for q in questions]


def test_run_raises_the_named_error(engine_backend):
    @sgl.function
    def broken(s):
        s += "Hello"
        s += sgl.gen("a", max_tokens=2, temperature=-1.0)

    with pytest.raises(sgl.ProgramError, match=r"program 'broken' failed at step 2 \(gen 'a'\).*temperature"):
        broken.run(backend=engine_backend)


def test_streaming_gives_the_text_as_it_grows(endpoint):
    state = multi_turn_qa.run(question="Name a sea.", max_tokens=6, temperature=0, stream=True, backend=endpoint)
    pieces = list(state.text_iter())
    assert "".join(pieces) == state.text() and len(pieces) > 2
    assert "".join(state.text_iter("summary")) == state["summary"]
    assert state.error() is None


@needs_grammar
def test_gen_constraints_reach_the_backend(backend):
    @sgl.function
    def constrained(s):
        s += sgl.user("Give a three digit number and a yes/no answer.")
        s += sgl.assistant(sgl.gen("number", max_tokens=8, regex=r"[0-9]{3}") + " " + sgl.gen_int("n", max_tokens=4))

    state = constrained.run(temperature=0, backend=backend)
    assert state["number"].isdigit() and len(state["number"]) == 3
    int(state["n"].strip())
