"""Tokenizer routes: SGLang's `/tokenize` and `/detokenize` (also under `/v1/`), vLLM's
`/tokenizer_info` (what lm-eval's remote tokenizer reads), and `/apply_chat_template`, which
renders a conversation with the model's chat template as text (the frontend language frames its
roles with it)."""
from __future__ import annotations

import asyncio
from typing import Optional, Union

from fastapi import APIRouter, Request
from jinja2 import TemplateError
from pydantic import Field, StrictBool, StrictInt

from hicache.server.openai_api import tm_of
from hicache.server.bodies import Body, ChatMessage, Strict
from hicache.server.protocol import APIError, parse_body
from hicache.server.serving import check_prompt

router = APIRouter()


class TokenizeReqInput(Body):
    model: Optional[str] = None
    prompt: Union[str, list[str]]
    add_special_tokens: StrictBool = True


class DetokenizeReqInput(Strict):
    model: Optional[str] = None
    tokens: Union[list[StrictInt], list[list[StrictInt]]]
    skip_special_tokens: StrictBool = True


class ChatTemplateReqInput(Body):
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool = False


@router.post("/tokenize")
@router.post("/v1/tokenize")
async def tokenize(request: Request) -> dict:
    """`{"tokens", "count", "max_model_len"}`: lists of lists for a list of prompts."""
    body = await parse_body(request, TokenizeReqInput)
    tm = tm_of(request)
    texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    try:
        tokens = [await asyncio.to_thread(tm.encode, t, body.add_special_tokens) for t in texts]
    except ValueError as e:
        raise APIError(400, str(e), param="prompt", code="invalid_value") from None
    counts = [len(t) for t in tokens]
    one = isinstance(body.prompt, str)
    return {"tokens": tokens[0] if one else tokens, "count": counts[0] if one else counts,
            "max_model_len": tm.info.context_length}


@router.post("/detokenize")
@router.post("/v1/detokenize")
async def detokenize(request: Request) -> dict:
    """`{"text", "prompt"}` (SGLang's key and vLLM's, the same text): a list of texts for a list of
    token lists; special tokens dropped unless `skip_special_tokens` is false."""
    body = await parse_body(request, DetokenizeReqInput)
    tm = tm_of(request)
    one = not body.tokens or isinstance(body.tokens[0], int)
    lists = [body.tokens] if one else body.tokens
    for ids in lists:
        if ids:
            check_prompt(tm, ids, "tokens")
    try:
        texts = [tm.decode(ids, body.skip_special_tokens) for ids in lists]
    except ValueError as e:
        raise APIError(400, str(e), param="tokens", code="invalid_value") from None
    text = texts[0] if one else texts
    return {"text": text, "prompt": text}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict:
    """The tokenizer's class, special tokens, added tokens, context length and chat template
    (vLLM's `/tokenizer_info`)."""
    tm = tm_of(request)
    try:
        return tm.tokenizer_info()
    except ValueError as e:
        raise APIError(400, str(e), code="invalid_value") from None


@router.post("/apply_chat_template")
async def apply_chat_template(request: Request) -> dict:
    """`{"text"}`: the messages rendered by the chat template (with the assistant's generation
    prompt when `add_generation_prompt`)."""
    body = await parse_body(request, ChatTemplateReqInput)
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
    try:
        text = tm_of(request).render_chat(messages, body.add_generation_prompt)
    except (ValueError, TemplateError) as e:  # no template, or one that refuses these messages
        raise APIError(400, str(e), param="messages", code="invalid_value") from None
    return {"text": text}
