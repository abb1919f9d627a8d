"""A tool-using agent loop: the model names a tool and its argument on one line, the program
runs the tool and appends the result as the next user turn, until the model answers (or the
step budget runs out). Every turn extends the cached conversation.

    python examples/agent.py [--url http://127.0.0.1:30000]
"""
from __future__ import annotations

import ast
import operator

import hicache.lang as sgl
from common import backend_from_args

FACTS = {"paris": "Paris is the capital of France; about 2.1 million people live there.",
         "everest": "Mount Everest is 8,849 metres high."}
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """Arithmetic on numbers only (+ - * /), evaluated from the syntax tree: never `eval`."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.operand))
        raise ValueError("only numbers and + - * / are allowed")
    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"


def lookup(word: str) -> str:
    return FACTS.get(word.strip().lower(), f"nothing is known about {word!r}")


TOOLS = {"calculator": calculator, "lookup": lookup}
SYSTEM = ("You solve tasks with tools. Answer with exactly one line: `calculator: <arithmetic>`, "
          "`lookup: <one word>`, or `answer: <the final answer>`.")


@sgl.function
def agent(s, task, max_steps=3, max_tokens=32):
    s += sgl.system(SYSTEM)
    s += sgl.user(task)
    for step in range(max_steps):
        s += sgl.assistant(sgl.gen(f"action_{step}", max_tokens=max_tokens, stop="\n"))
        tool, _, argument = s[f"action_{step}"].partition(":")
        if tool.strip().lower() not in TOOLS:
            break
        s += sgl.user(f"Result: {TOOLS[tool.strip().lower()](argument)}")


def main() -> None:
    args = backend_from_args(__doc__)
    state = agent.run(task="How many people live in Paris, in thousands? Use the tools.", max_tokens=args.max_tokens,
                      temperature=0)
    for message in state.messages():
        print(f"{message['role']}: {message['content']}")


if __name__ == "__main__":
    main()
