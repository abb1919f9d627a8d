"""Multi-turn question answering: each turn's prompt extends the one before, so the server
computes only the new turn (the rest is in its radix cache).

    python examples/multi_turn_qa.py [--url http://127.0.0.1:30000]
"""
from __future__ import annotations

import hicache.lang as sgl
from common import backend_from_args


@sgl.function
def multi_turn_qa(s, question, max_tokens=64):
    s += sgl.system("You are a precise assistant.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=max_tokens))
    s += sgl.user("Summarize your answer in one sentence.")
    s += sgl.assistant(sgl.gen("summary", max_tokens=max_tokens))


def main() -> None:
    args = backend_from_args(__doc__)
    state = multi_turn_qa.run(question="Explain what a KV cache is in one paragraph.", max_tokens=args.max_tokens,
                              temperature=0)
    for name in ("answer", "summary"):
        meta = state.get_meta_info(name)
        print(f"{name} ({meta['cached_tokens']} of {meta['prompt_tokens']} prompt tokens cached):\n{state[name]}\n")


if __name__ == "__main__":
    main()
