"""Capabilities the frontend language's tests need from other parts of the engine (prompt
logprobs for `select`, grammars for `regex` / `json_schema`): tests that need one skip while it
is absent."""
from __future__ import annotations

import inspect
from dataclasses import fields

import pytest

from hicache import Engine
from hicache.runtime.sampling import SamplingParams

HAS_LOGPROBS = "logprob_start_len" in inspect.signature(Engine.generate).parameters
HAS_GRAMMAR = "regex" in {f.name for f in fields(SamplingParams)}
needs_logprobs = pytest.mark.skipif(not HAS_LOGPROBS, reason="needs the logprobs branch")
needs_grammar = pytest.mark.skipif(not HAS_GRAMMAR, reason="needs the grammar branch")
