"""The module-scoped `server` fixture: a real server with a small KV pool and page size 16."""
from __future__ import annotations

import pytest

from server_harness import LIGHT_FLAGS, start_server


@pytest.fixture(scope="module")
def server():
    handle = start_server(*LIGHT_FLAGS)
    try:
        yield handle
    finally:
        handle.stop()
