"""Backends for the frontend language's tests, one of each for the whole session: a real
`hicache serve` (page size 1, so that every cached prefix counts to the token) reached through
`RuntimeEndpoint`, and an in-process `Engine`. `backend` runs a test on both.

Capabilities that other parts of the engine bring (prompt logprobs for `select`, grammars for
`regex` / `json_schema`) are detected, and the tests that need them skip while they are absent."""
from __future__ import annotations

import inspect
import sys
from dataclasses import fields
from pathlib import Path

import pytest

import hicache.lang as sgl
from hicache import Engine
from hicache.runtime.sampling import SamplingParams
from homes import private_home

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "server"))
from server_harness import LIGHT_FLAGS, start_server  # noqa: E402

HAS_LOGPROBS = "logprob_start_len" in inspect.signature(Engine.generate).parameters
HAS_GRAMMAR = "regex" in {f.name for f in fields(SamplingParams)}
needs_logprobs = pytest.mark.skipif(not HAS_LOGPROBS, reason="needs the logprobs branch")
needs_grammar = pytest.mark.skipif(not HAS_GRAMMAR, reason="needs the grammar branch")


@pytest.fixture(scope="session")
def lang_server(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HICACHE_HOME", str(private_home(tmp_path_factory.mktemp("lang-server-home"))))
        handle = start_server(*LIGHT_FLAGS, "--page-size", "1", "--skip-server-warmup")
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture(scope="session")
def endpoint(lang_server):
    backend = sgl.RuntimeEndpoint(lang_server.url)
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def engine(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HICACHE_HOME", str(private_home(tmp_path_factory.mktemp("lang-engine-home"))))
        eng = Engine(hicache_storage_backend="memory", max_total_tokens=8192, context_length=4096)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def engine_backend(engine):
    return sgl.EngineBackend(engine)


@pytest.fixture(params=["endpoint", "engine"])
def backend(request):
    return request.getfixturevalue("endpoint" if request.param == "endpoint" else "engine_backend")
