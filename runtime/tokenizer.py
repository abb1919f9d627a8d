"""Tokenizers: from a GGUF file (transformers reads vocab, merges and chat template from its
metadata) or from an HF model folder.

Building a tokenizer from GGUF metadata takes seconds; a saved copy loads in a small fraction of
that. So the first load saves the tokenizer under `$HICACHE_HOME/tokenizers/<key>/` (key: the
file's path, size, mtime and the transformers version) and later loads read that folder. A folder
with no tokenizer files (e.g. dummy weights from a bare config.json) yields None: callers must
then pass input_ids themselves.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from hicache.runtime.default_model import hicache_home

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str | os.PathLike) -> Any | None:
    """A transformers tokenizer for a .gguf file or an HF folder; None if the folder has none."""
    p = Path(path).expanduser().resolve()
    if p.is_file() and p.suffix == ".gguf":
        st = p.stat()
        return _gguf_tokenizer(str(p), st.st_size, st.st_mtime_ns)
    if p.is_file():  # a config.json: look beside it
        p = p.parent
    if not p.is_dir():
        raise FileNotFoundError(f"no tokenizer source at {path}")
    if not any((p / f).exists() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(p))


def apply_chat_template(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Token ids of `messages` rendered with the tokenizer's chat template, ending with the
    assistant generation prompt; `tools` (OpenAI function specs) go to templates that take them.
    Raises ValueError if the tokenizer has no chat template."""
    _require_template(tokenizer)
    out = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    if isinstance(out, Mapping):  # transformers 5 returns a BatchEncoding by default
        out = out["input_ids"]
    return [int(t) for t in out]


def render_chat_template(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """`messages` rendered with the tokenizer's chat template, as text. ValueError without a template."""
    _require_template(tokenizer)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)


SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def describe_tokenizer(tokenizer: Any) -> dict:
    """What a remote client needs to stand in for `tokenizer` (vLLM's `/tokenizer_info` keys): its
    class, special tokens (None where it has none), added tokens by id, chat template and
    whether encoding adds BOS / EOS."""
    info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__}
    info.update({name: getattr(tokenizer, name, None) for name in SPECIAL_TOKENS})
    info["added_tokens_decoder"] = {str(i): t.content for i, t in tokenizer.added_tokens_decoder.items()}
    info["chat_template"] = getattr(tokenizer, "chat_template", None)
    for flag in ("add_bos_token", "add_eos_token", "clean_up_tokenization_spaces"):
        if isinstance(getattr(tokenizer, flag, None), bool):
            info[flag] = getattr(tokenizer, flag)
    return info


def _require_template(tokenizer: Any) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")


@lru_cache(maxsize=8)
def _gguf_tokenizer(path: str, size: int, mtime_ns: int) -> Any:
    from transformers import AutoTokenizer, __version__

    key = hashlib.sha256(f"{path}|{size}|{mtime_ns}|{__version__}".encode()).hexdigest()[:20]
    saved = hicache_home() / "tokenizers" / key
    if (saved / "tokenizer_config.json").exists():
        try:
            return AutoTokenizer.from_pretrained(str(saved))
        except Exception as e:  # a damaged copy: rebuild it below
            logger.warning("cached tokenizer at %s is unreadable (%s); rebuilding", saved, e)
            shutil.rmtree(saved, ignore_errors=True)
    p = Path(path)
    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    _save_atomically(tok, saved)
    return tok


def _save_atomically(tok: Any, dest: Path) -> None:
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tok-", dir=dest.parent))
        tok.save_pretrained(str(tmp))
        try:
            os.rename(tmp, dest)  # atomic; fails if another process got there first
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:  # a read-only cache only costs speed
        logger.warning("could not cache the tokenizer at %s: %s", dest, e)
