"""/tokenize, /detokenize, /tokenizer_info and /apply_chat_template on the shared server, against HF transformers' tokenizer of
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


def test_detokenize_equals_hf(server, hf_tokenizer):
    ids = hf_tokenizer.encode("Hello <|im_end|> world", add_special_tokens=False)
    for path in ("/detokenize", "/v1/detokenize"):
        one = post(server, path, {"tokens": ids}).json()
        want = hf_tokenizer.decode(ids, skip_special_tokens=True)
        assert one["text"] == want and one["prompt"] == want  # SGLang's key and vLLM's (lm-eval reads it)
    kept = post(server, "/detokenize", {"tokens": [ids, ids[:1], []], "skip_special_tokens": False}).json()
    assert kept["text"] == [hf_tokenizer.decode(ids), hf_tokenizer.decode(ids[:1]), ""]
    assert post(server, "/v1/tokenize", {"prompt": "Hello"}).json()["tokens"] == hf_tokenizer.encode("Hello")


def test_tokenizer_info_serves_lm_eval_remote_tokenizer(server, hf_tokenizer):
    """What lm-eval's `RemoteTokenizer` reads: the special tokens and the chat template, and its
    round trip through /tokenize and /detokenize."""
    r = httpx.get(server.url + "/tokenizer_info", headers={"Content-Type": "application/json", **server.headers})
    info = r.json()
    assert r.status_code == 200
    assert info["eos_token"] == hf_tokenizer.eos_token and info["bos_token"] == hf_tokenizer.bos_token
    assert info["pad_token"] == hf_tokenizer.pad_token and info["chat_template"] == hf_tokenizer.chat_template
    assert info["tokenizer_class"] == type(hf_tokenizer).__name__ and info["model_max_length"] > 0
    eos_id = post(server, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"][0]
    assert eos_id == hf_tokenizer.eos_token_id
    assert info["added_tokens_decoder"][str(eos_id)] == info["eos_token"]


@pytest.mark.parametrize("path, body, param", [
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": [1], "skip_special_tokens": "no"}, "skip_special_tokens"),
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
