"""Tree of thought: fork the conversation into branches that each propose an approach (they run
concurrently and share the prefix's cached KV), let the model judge each branch with `select`,
then select the best approach and answer with it.

    python examples/tree_of_thought.py [--url http://127.0.0.1:30000]
"""
from __future__ import annotations

import hicache.lang as sgl
from common import backend_from_args


@sgl.function
def tree_of_thought(s, question, num_branches=3, max_tokens=48):
    s += sgl.system("You are a careful problem solver.")
    s += sgl.user(question)
    s += sgl.assistant_begin()
    s += f"Let me think of {num_branches} approaches.\n"
    branches = s.fork(num_branches)
    branches += lambda i: f"Approach {i + 1}:"
    branches += sgl.gen("approach", max_tokens=max_tokens, stop="\n")
    branches += "\nIs this approach sound? " + sgl.select("sound", ["yes", "no"])
    branches.join()
    for i, approach in enumerate(s["approach"]):
        s += f"Approach {i + 1}:{approach} (sound: {s['sound'][i]})\n"
    s += "The best approach is number " + sgl.select("best", [str(i + 1) for i in range(num_branches)])
    s += ". So the answer is" + sgl.gen("answer", max_tokens=max_tokens, stop="\n")
    s += sgl.assistant_end()


def main() -> None:
    args = backend_from_args(__doc__)
    state = tree_of_thought.run(question="How can I measure the height of a building with a barometer?",
                                max_tokens=args.max_tokens, temperature=0)
    print(state.text())


if __name__ == "__main__":
    main()
