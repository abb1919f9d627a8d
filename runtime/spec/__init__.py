"""Speculative decoding in named parts: drafts for a decode batch (`drafter.py`, from the request's
own n-grams, `context.py`, and from the index over the radix tree's tokens, `hicache/ngram.py`),
and their exact verification (`verify.py`). The scheduler's `DecodePlanner` asks for drafts and
plans a verify step; `ModelRunner.verify` runs it; `OutputProcessor` appends what was accepted."""
from __future__ import annotations
