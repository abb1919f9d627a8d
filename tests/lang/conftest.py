"""Backends for the frontend language's tests, one of each for the whole session: a real
`hicache serve` (page size 1, so that every cached prefix counts to the token) reached through
`RuntimeEndpoint`, and an in-process `Engine`. `backend` runs a test on both."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

import hicache.lang as sgl
from hicache import Engine
from homes import private_home

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "server"))
from server_harness import LIGHT_FLAGS, start_server  # noqa: E402


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
