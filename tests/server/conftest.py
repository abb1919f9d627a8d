"""The session-scoped `server` fixture: one real server with a small KV pool and page size 16 that
every module using it shares (test_server_openai.py, test_server_native.py): their tests neither
depend on a fresh server nor leave it unusable. Tests that need other flags, or stop or kill their
server, start their own (server_harness.start_server)."""
from __future__ import annotations

import pytest

from homes import private_home
from server_harness import LIGHT_FLAGS, start_server


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # set up before any module's home: its own
        mp.setenv("HICACHE_HOME", str(private_home(tmp_path_factory.mktemp("server-home"))))
        handle = start_server(*LIGHT_FLAGS)
    try:
        yield handle
    finally:
        handle.stop()
