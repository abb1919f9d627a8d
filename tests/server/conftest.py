"""The session-scoped `server` fixture: one real server with a small KV pool and page size 16 that
every module using it shares (test_server_openai.py, test_server_native.py, test_server_tools.py,
test_server_anthropic*.py, test_server_ollama*.py, ...): their tests neither depend on a fresh
server nor leave it unusable. It starts without the warm-up request (`--skip-server-warmup`) and
answers to a second model name (`server_harness.ALIAS`), and `server_start` keeps its state at
start-up for the test of that flag (test_server_lifecycle.py); the servers tests start themselves
warm up. Tests that need other flags, or stop or kill their server, start their own
(server_harness.start_server)."""
from __future__ import annotations

import openai
import pytest

from homes import private_home
from server_harness import ALIAS, LIGHT_FLAGS, MODEL_NAME, start_up


@pytest.fixture(scope="session")
def server_start(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # set up before any module's home: its own
        mp.setenv("HICACHE_HOME", str(private_home(tmp_path_factory.mktemp("server-home"))))
        started = start_up(*LIGHT_FLAGS, "--skip-server-warmup", "--served-model-name", MODEL_NAME, ALIAS)
    try:
        yield started
    finally:
        started.handle.stop()


@pytest.fixture(scope="session")
def server(server_start):
    return server_start.handle


@pytest.fixture(scope="session")
def oai(server):
    """An `openai` client of the session's server."""
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="session")
def client(oai):
    """The OpenAI-route tests' client (a module of another API names its own `client`)."""
    return oai


@pytest.fixture(scope="session")
def model(oai):
    """The served model's name, as /v1/models lists it."""
    return oai.models.list().data[0].id
