"""Credentials never leave the server: a Redis URL's password is masked in what the backend says
about itself (status, description, error messages), in /health (open to all), /get_server_info,
/hicache/stats, /metrics, `hicache stats` and the logs of both processes, whether the Redis is down
or up.
"""
from __future__ import annotations

import json
import socket
import time
from urllib.parse import quote

import httpx
import pytest

from hicache.runtime.redact import redact, redact_obj, url_password
from hicache.server import stats_cli
from redis_proc import RedisServer
from server_harness import LIGHT_FLAGS, start_server

PASSWORD = "Tr0ub4dor&3-s3cr3t@pw"  # "&" and "@" are percent-encoded in the URL
FORMS = (PASSWORD, quote(PASSWORD, safe=""), "s3cr3t", "Tr0ub4dor")
NS = "00112233445566aa"


def assert_no_password(text: str, where: str) -> None:
    leaked = [form for form in FORMS if form in text]
    assert not leaked, f"the password shows in {where}: {text[:2000]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def url_for(port: int, user: str = "default") -> str:
    return f"redis://{user}:{quote(PASSWORD, safe='')}@127.0.0.1:{port}/0"


# ---- the helper -----------------------------------------------------------------------------


@pytest.mark.parametrize("text, shown", [
    ("redis://user:pass@host:6379/0", "redis://user:***@host:6379/0"),
    ("redis://:pass@host", "redis://:***@host"),
    ("rediss://u:p@ss@host:1/0 is down", "rediss://u:***@host:1/0 is down"),  # the last "@" ends it
    ('{"url": "redis://:pw@h:1", "key_prefix": "a@b"}', '{"url": "redis://:***@h:1", "key_prefix": "a@b"}'),
    ("redis://host:6379/0?password=pw&db=1", "redis://host:6379/0?password=***&db=1"),
    ("redis://user@host:6379/0", "redis://user@host:6379/0"),
    ("http://127.0.0.1:30000/health", "http://127.0.0.1:30000/health"),
])
def test_redact_masks_url_passwords_only(text, shown):
    assert redact(text) == shown


def test_redact_masks_literal_secrets_in_every_encoding():
    assert redact("AUTH failed for Tr0ub4dor&3-s3cr3t@pw", [PASSWORD]) == "AUTH failed for ***"
    assert redact(f"url {url_for(1)} no", [PASSWORD]) == "url redis://default:***@127.0.0.1:1/0 no"
    assert url_password(url_for(1)) == PASSWORD and url_password("redis://h:1/0") is None
    obj = {"a": [url_for(2)], "b": {"c": f"x {PASSWORD}"}, "n": 3}
    assert redact_obj(obj, [PASSWORD]) == {"a": ["redis://default:***@127.0.0.1:2/0"], "b": {"c": "x ***"}, "n": 3}


# ---- the backend ----------------------------------------------------------------------------


@pytest.fixture
def auth_redis(tmp_path):
    import shutil

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer(tmp_path, PASSWORD)  # stopped until the test starts it
    server.url = url_for(server.port)
    try:
        yield server
    finally:
        server.stop()


def test_the_backend_says_nothing_of_its_password(auth_redis, caplog):
    import torch

    from hicache.tiers.remote import make_backend
    from hicache.tiers.remote.worker import StorageWorker
    from hicache.tiers.host.pool import HostKVPool

    pool = HostKVPool(16, 4, num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32, layout="page_first",
                      pin=False)
    with caplog.at_level("DEBUG", logger="hicache"):
        b = make_backend("redis", NS, url=auth_redis.url, socket_timeout=0.5, connect_timeout=0.5)  # down
        w = StorageWorker(b, pool)
        w.query(["00" * 32])
        deadline = time.monotonic() + 10
        while not (done := w.poll()) and time.monotonic() < deadline:
            w.wait(0.1)
        assert done and not done[0].ok
        assert b.status().startswith(f"degraded: redis://default:***@127.0.0.1:{auth_redis.port}/0: ConnectionError")
        texts = [b.status(), w.status(), b.describe(), done[0].error or ""]
        auth_redis.start()
        wrong = make_backend("redis", NS, url=url_for(auth_redis.port).replace("s3cr3t", "wrong"))
        texts.append(wrong.status())
        assert "AuthenticationError" in wrong.status()
        b.probe()
        assert b.status() == "ok"
        w.close()
        wrong.close()
    for text in texts + [r.getMessage() for r in caplog.records]:
        assert_no_password(text, "the backend's messages")


# ---- a real server --------------------------------------------------------------------------


def responses(url: str) -> dict[str, str]:
    return {path: httpx.get(url + path, timeout=30).text
            for path in ("/health", "/get_server_info", "/hicache/stats", "/metrics")}


def cli_output(url: str, capsys) -> str:
    assert stats_cli.run(url, None, False, None) == 0
    assert stats_cli.run(url, None, True, None) == 0
    return capsys.readouterr().out


@pytest.mark.model
def test_a_server_shows_no_redis_password_down_or_up(auth_redis, capsys):
    extra = {"url": auth_redis.url, "socket_timeout": 0.5, "connect_timeout": 0.5, "prefetch_threshold": 32}
    server = start_server(*LIGHT_FLAGS, "--hicache-storage-backend", "redis",
                          "--hicache-storage-backend-extra-config", json.dumps(extra))
    try:
        down = responses(server.url)
        health = json.loads(down["/health"])["details"]["storage"]
        assert health.startswith(f"degraded: redis://default:***@127.0.0.1:{auth_redis.port}/0: "), health
        assert "redis://default:***@127.0.0.1" in down["/get_server_info"]
        r = httpx.post(server.url + "/generate", json={"text": "Hello there. " * 20,
                                                        "sampling_params": {"max_new_tokens": 4}}, timeout=120)
        assert r.status_code == 200
        texts = [*down.values(), cli_output(server.url, capsys)]

        auth_redis.start()
        deadline = time.monotonic() + 30
        while json.loads(httpx.get(server.url + "/health", timeout=30).text)["details"]["storage"] != "ok":
            assert time.monotonic() < deadline, "storage did not resume"
            time.sleep(0.2)
        r = httpx.post(server.url + "/generate", json={"text": "A longer prompt to store. " * 20,
                                                        "sampling_params": {"max_new_tokens": 4}}, timeout=120)
        assert r.status_code == 200
        deadline = time.monotonic() + 30
        while httpx.get(server.url + "/hicache/stats", timeout=30).json()["tiers"]["storage"]["backed_up_tokens"] == 0:
            assert time.monotonic() < deadline, "nothing reached the password-protected Redis"
            time.sleep(0.2)
        texts += [*responses(server.url).values(), cli_output(server.url, capsys)]
    finally:
        server.stop()
    log = server.log.read_text(errors="replace")
    assert "L3 redis storage: redis://default:***@127.0.0.1" in log  # both processes' output is in it
    for i, text in enumerate(texts):
        assert_no_password(text, f"response {i}")
    assert_no_password(log, "the server's log")
