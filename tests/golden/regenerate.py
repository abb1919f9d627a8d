"""Regenerates the golden reference outputs: HF transformers' greedy tokens on packaged GGUFs.

The oracle of the end-to-end tests is HF transformers running the same weights (SmolLM2-135M-Instruct
Q4_1, the GGUF the tests fetch into `$HICACHE_HOME/models`), fp32 on CPU. Decoding with it takes
minutes on a small CPU, so its outputs are checked in here and the tests compare the engine with
them; one test (`tests/runtime/test_engine_parity.py::test_live_hf_oracle`) still runs HF live on
a few of the prompts, so that goldens gone stale (a new transformers, other weights) fail the suite.

Each golden file is JSON:

- `model`: the GGUF's file name and sha256 (the tests refuse goldens made on other weights);
- `generator`: the transformers and torch versions that produced it (for the record);
- `new_tokens` and `cases`: per case the prompt token ids, HF's greedy output ids and, per output
  token, `margins`: HF's top-1 minus top-2 logit there (a near tie, where another fp32 computation
  may rightly pick the other token, shows as a tiny margin in a failure message).

Files:

- `parity.json`: 16 prompts of 5 to 1,500 tokens from the stdlib's `json.decoder` and `threading`
  sources (half of them share a 700-token prefix), 64 new tokens each, every prompt decoded alone
  with its own KV cache (no padding involved).
- `multiturn.json`: a 48-token system prompt and 20 conversations of 6 user turns (64 tokens each,
  `json.decoder`, `threading` and `inspect` sources), each turn answered with 8 greedy tokens and
  the answer kept in the history of the next turn; `cases[c]["turns"][t]` is turn t's user tokens,
  `cases[c]["answers"][t]` HF's answer.
- `gemma3.json` (on Gemma 3 270M Q4_K_M, `--model-path gemma3-270m`): 8 prompts of 6 to 2,000
  tokens from the stdlib's `json.decoder` and `threading` sources, most past its 512-token
  sliding window, two sharing a 900-token prefix, 32 new tokens each, each decoded alone.
- `logits.json`: a summary of HF's logits over whole prompts (one forward each), per position the
  top 3 token ids, their logits and the logsumexp over the vocabulary, for `short`, `chat`, `code`,
  `long` (1,500 tokens; tests/runtime/test_model.py) and `paged` (1,000 tokens of `threading`'s
  source; tests/runtime/test_paged_logits.py).

Prompts are stored as token ids, so the tests need neither the tokenizer nor the stdlib sources of
the Python that made them. Run `make golden` (or `.venv/bin/python tests/golden/regenerate.py
[names...]`) after changing the prompt sets here, the default model, or when the live oracle test
reports HF disagreeing with a golden; review the diff (`git diff --stat tests/golden`) and commit.
"""
from __future__ import annotations

import inspect
import json
import json.decoder
import sys
import threading
from pathlib import Path
from typing import Callable

import torch

HERE = Path(__file__).resolve().parent
PARITY_NEW = 64
SYSTEM, TURN, ANSWER, CONVERSATIONS, TURNS = 48, 64, 8, 20, 6


def load_hf(model_name: str = "smollm2-135m"):
    """(model, tokenizer) from HF transformers on a packaged GGUF, fp32, eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hicache.runtime.default_model import resolve_model_path

    path = resolve_model_path(model_name)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval(), tok


def greedy(model, ids: list[int], new: int) -> tuple[list[int], list[float]]:
    """HF greedy decoding of one prompt with its own KV cache: (output ids, top-1 minus top-2 logit per token)."""
    out, margins = [], []
    with torch.inference_mode():
        res = model(torch.tensor([ids]), use_cache=True)
        for _ in range(new):
            top = res.logits[0, -1].float().topk(2)
            out.append(int(top.indices[0]))
            margins.append(round(float(top.values[0] - top.values[1]), 5))
            res = model(torch.tensor([[out[-1]]]), past_key_values=res.past_key_values, use_cache=True)
    return out, margins


def source_tokens(tok, modules, limit: int | None = None) -> list[int]:
    text = "\n\n".join(inspect.getsource(m) for m in modules)
    return tok(text[:limit] if limit else text)["input_ids"]


def parity_prompts(tok) -> list[list[int]]:
    """8 prompts of 5 to 1,500 tokens, then 8 sharing a 700-token prefix with tails of 5 to 215."""
    corpus = source_tokens(tok, (json.decoder, threading), 60_000)
    assert len(corpus) > 3000
    lengths = torch.linspace(5, 1500, 8).long().tolist()
    solo = [corpus[97 * i: 97 * i + n] for i, n in enumerate(lengths)]
    shared = corpus[1500:2200]
    tails = [corpus[2200 + 40 * i: 2200 + 40 * i + 5 + 30 * i] for i in range(8)]
    return solo + [shared + t for t in tails]


def make_parity(model, tok) -> dict:
    cases = []
    for ids in parity_prompts(tok):
        out, margins = greedy(model, ids, PARITY_NEW)
        cases.append({"prompt": ids, "output": out, "margins": margins})
    return {"new_tokens": PARITY_NEW, "cases": cases}


GEMMA3_NEW = 32


def gemma3_prompts(tok) -> list[list[int]]:
    """6 prompts of 6 to 2,000 tokens, then 2 sharing a 900-token prefix with tails of 100 and 700."""
    corpus = source_tokens(tok, (json.decoder, threading), 60_000)
    assert len(corpus) > 6000
    solo = [corpus[331 * i: 331 * i + n] for i, n in enumerate((6, 300, 511, 700, 1300, 2000))]
    shared = corpus[3000:3900]
    return solo + [shared + corpus[4000:4100], shared + corpus[4200:4900]]


def make_gemma3(model, tok) -> dict:
    cases = []
    for ids in gemma3_prompts(tok):
        out, margins = greedy(model, ids, GEMMA3_NEW)
        cases.append({"prompt": ids, "output": out, "margins": margins})
    return {"new_tokens": GEMMA3_NEW, "cases": cases}


def make_multiturn(model, tok) -> dict:
    corpus = source_tokens(tok, (json.decoder, threading, inspect))
    need = SYSTEM + CONVERSATIONS * TURNS * TURN
    assert len(corpus) >= need
    system, starts = corpus[:SYSTEM], iter(range(SYSTEM, need, TURN))
    cases = []
    for _ in range(CONVERSATIONS):
        turns = [corpus[next(starts):][:TURN] for _ in range(TURNS)]
        history, answers, margins = list(system), [], []
        for user in turns:
            history += user
            out, m = greedy(model, history, ANSWER)
            answers.append(out)
            margins.append(m)
            history += out
        cases.append({"turns": turns, "answers": answers, "margins": margins})
    return {"system": system, "new_tokens": ANSWER, "cases": cases}


PARAGRAPH = (
    "The hierarchical cache keeps every prefix the engine has computed in a radix tree whose pages "
    "live in GPU memory, pinned host memory or a storage tier, and moves pages between tiers "
    "asynchronously so that the scheduler almost never recomputes what some tier still holds. "
)
TOP = 3


def logits_prompts(tok) -> dict[str, list[int]]:
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=True, return_dict=False)
    return {
        "short": tok("The capital of France is")["input_ids"],
        "chat": list(chat),
        "code": tok("def fib(n):\n    if n < 2:\n        return n\n    return")["input_ids"],
        "long": tok(PARAGRAPH * 40)["input_ids"][:1500],
        "paged": source_tokens(tok, (threading,), 8000)[:1000],
    }


def logits_summary(model, ids: list[int]) -> dict:
    """Per position: HF's top TOP ids and logits, and the logsumexp over the vocabulary."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    top = logits.topk(TOP, dim=-1)
    return {"prompt": ids, "top_ids": top.indices.tolist(),
            "top_logits": [[round(v, 5) for v in row] for row in top.values.tolist()],
            "logsumexp": [round(v, 5) for v in logits.logsumexp(-1).tolist()]}


def make_logits(model, tok) -> dict:
    return {"top": TOP, "cases": [{"name": name, **logits_summary(model, ids)}
                                  for name, ids in logits_prompts(tok).items()]}


# name -> (the packaged model it runs on, its maker)
SETS: dict[str, tuple[str, Callable]] = {"parity": ("smollm2-135m", make_parity),
                                         "multiturn": ("smollm2-135m", make_multiturn),
                                         "logits": ("smollm2-135m", make_logits),
                                         "gemma3": ("gemma3-270m", make_gemma3)}


def header(model_name: str) -> dict:
    import transformers

    from hicache.runtime.default_model import PACKAGED_MODELS

    model = PACKAGED_MODELS[model_name]
    return {"model": {"file": model.file_name, "sha256": model.sha256},
            "generator": {"transformers": transformers.__version__, "torch": torch.__version__}}


def write(name: str, content: dict) -> Path:
    """One case per line: diffs stay readable and the file stays small."""
    path = HERE / f"{name}.json"
    body = {**header(SETS[name][0]), **{k: v for k, v in content.items() if k != "cases"}}
    lines = [json.dumps(body)[:-1] + ', "cases": [']
    lines += [json.dumps(c, separators=(",", ":")) + ("," if i < len(content["cases"]) - 1 else "")
              for i, c in enumerate(content["cases"])]
    path.write_text("\n".join(lines) + "\n]}\n")
    json.loads(path.read_text())  # what was written parses
    return path


def main(names: list[str]) -> None:
    unknown = set(names) - set(SETS)
    if unknown:
        raise SystemExit(f"unknown golden set(s) {sorted(unknown)}; known: {sorted(SETS)}")
    torch.manual_seed(0)
    for model_name in dict.fromkeys(SETS[n][0] for n in names or SETS):
        model, tok = load_hf(model_name)
        for name in [n for n in names or SETS if SETS[n][0] == model_name]:
            print(f"{name}: {write(name, SETS[name][1](model, tok))}")


if __name__ == "__main__":
    main(sys.argv[1:])
