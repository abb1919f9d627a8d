"""JSON extraction with a schema: the generation is constrained to JSON that the schema accepts.

    python examples/json_extraction.py [--url http://127.0.0.1:30000]
"""
from __future__ import annotations

import json

import hicache.lang as sgl
from common import backend_from_args

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                   "city": {"type": "string"}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


@sgl.function
def extract_person(s, text, max_tokens=64):
    s += sgl.system("Extract the person the user describes as JSON with their name, age and city.")
    s += sgl.user(text)
    s += sgl.assistant(sgl.gen("person", max_tokens=max_tokens, temperature=0, json_schema=json.dumps(PERSON)))


def main() -> None:
    args = backend_from_args(__doc__)
    texts = ["Ada is 36 and lives in London.", "Grace, aged 45, works in Arlington."]
    states = extract_person.run_batch([{"text": t, "max_tokens": args.max_tokens} for t in texts], progress_bar=True)
    for state in states:
        print(json.loads(state["person"]))


if __name__ == "__main__":
    main()
