"""`select` picks the choice with the highest mean log probability per token, as HF transformers
scores it (fp32, CPU) on the same weights and the same tokens: the prompt's tokens, then the
choice's."""
from __future__ import annotations

import pytest
import torch

import hicache.lang as sgl
from lang_support import needs_logprobs

pytestmark = [pytest.mark.model, needs_logprobs]

CASES = [
    ("The capital of France is", [" Paris", " Berlin", " Madrid"]),
    ("2 + 2 =", [" 4", " 5", " 22"]),
    ("The opposite of hot is", [" cold", " warm", " blue"]),
    ("Water freezes at 0 degrees", [" Celsius", " Fahrenheit", " Kelvin"]),
    ("The first month of the year is", [" January", " March", " December"]),
    ("A baby cat is called a", [" kitten", " puppy", " calf"]),
    ("The sun rises in the", [" east", " west", " north", " south"]),
    ("Python is a programming", [" language", " snake", " book"]),
    ("Question: Is the sky blue? Answer:", [" yes", " no"]),
    ("Question: Is fire cold? Answer:", [" yes", " no"]),
    ("The plural of mouse is", [" mice", " mouses", " meese"]),
    ("Monday, Tuesday,", [" Wednesday", " Friday", " Sunday"]),
    ("One, two, three,", [" four", " five", " ten"]),
    ("The chemical symbol for gold is", [" Au", " Ag", " Fe", " Go"]),
    ("Roses are red, violets are", [" blue", " green", " red"]),
    ("The largest planet in our solar system is", [" Jupiter", " Mars", " Earth", " Pluto"]),
    ("Shakespeare wrote Romeo and", [" Juliet", " Hamlet", " Macbeth"]),
    ("The color of grass is", [" green", " purple", " orange"]),
    ("Dogs like to chase", [" cats", " clouds", " numbers"]),
    ("The boiling point of water is 100 degrees", [" Celsius", " Fahrenheit"]),
    ("Sentiment of 'I loved this film!':", [" positive", " negative", " neutral"]),
    ("Sentiment of 'This was a waste of time.':", [" positive", " negative", " neutral"]),
    ("Is 7 a prime number? Answer:", [" Yes, it is prime", " No, it is not"]),
    ("Translate 'bonjour' to English:", [" hello", " goodbye", " thank you very much"]),
]


@sgl.function
def pick(s, prompt, choices):
    s += prompt
    s += sgl.select("pick", choices)


def hf_choice_scores(hf, prompt: str, choices: list[str]) -> list[float]:
    """Mean log probability of each choice's tokens after the prompt's, one padded HF batch."""
    tok, model = hf.tokenizer, hf.model
    head = tok.encode(prompt, add_special_tokens=False)
    seqs = [head + tok.encode(c, add_special_tokens=False) for c in choices]
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)
    scores = []
    for row, s in enumerate(seqs):
        picked = [logprobs[row, j - 1, s[j]].item() for j in range(len(head), len(s))]
        scores.append(sum(picked) / len(picked))
    return scores


def test_select_picks_what_hf_scores_highest(backend, hf_reference):
    states = pick.run_batch([{"prompt": p, "choices": c} for p, c in CASES], num_threads=8, backend=backend)
    decisive = 0
    for (prompt, choices), state in zip(CASES, states):
        hf = hf_choice_scores(hf_reference, prompt, choices)
        ours = state.get_meta_info("pick")["normalized_prompt_logprobs"]
        assert ours == pytest.approx(hf, abs=1e-3), prompt
        ranked = sorted(hf, reverse=True)
        if ranked[0] - ranked[1] > 1e-3:  # a near tie may go either way within float error
            assert state["pick"] == choices[hf.index(ranked[0])], (prompt, hf, ours)
            decisive += 1
    assert decisive >= 20
