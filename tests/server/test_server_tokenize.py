"""/tokenize and /apply_chat_template on the shared server, against HF transformers' tokenizer of
the same GGUF; bad bodies are 400s naming the field."""
from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.model
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"},
            {"role": "assistant", "content": "Hello."}, {"role": "developer", "content": "Say more."}]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.headers, timeout=30)


def test_tokenize_equals_hf(server, hf_tokenizer):
    texts = ["Hello world", "  spaces\n\nand <|im_start|> specials", ""]
    got = post(server, "/tokenize", {"prompt": texts, "add_special_tokens": False}).json()
    want = [hf_tokenizer.encode(t, add_special_tokens=False) for t in texts]
    assert got["tokens"] == want and got["count"] == [len(w) for w in want] and got["max_model_len"] > 0
    one = post(server, "/tokenize", {"prompt": texts[0]}).json()
    assert one["tokens"] == hf_tokenizer.encode(texts[0]) and one["count"] == len(one["tokens"])


def test_apply_chat_template_equals_hf(server, hf_tokenizer):
    as_hf = [{**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in MESSAGES]
    for gen_prompt in (False, True):
        got = post(server, "/apply_chat_template", {"messages": MESSAGES, "add_generation_prompt": gen_prompt})
        want = hf_tokenizer.apply_chat_template(as_hf, tokenize=False, add_generation_prompt=gen_prompt)
        assert got.status_code == 200 and got.json()["text"] == want


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/apply_chat_template", {"messages": []}, "messages"),
    ("/apply_chat_template", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
])
def test_bad_bodies_name_the_field(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400
    assert param in (r.json()["error"]["param"] or "")
    assert httpx.get(server.url + "/health").status_code == 200
