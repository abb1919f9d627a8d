"""Secrets off the command line: `--api-key-file`, `--hicache-storage-secret-file` and
`--hicache-storage-backend-extra-config-file`, the API key also from $HICACHE_API_KEY; a real server given them that way shows them in no
process's command line and no log."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from hicache.config import HiCacheConfig
from hicache.server.cli import build_parser, main, serve_configs
from hicache.server.config import ServerConfig
from hicache.server.flags import config_from_args
from hicache.server.secret_flags import SECRETS, resolve_secrets
from server_harness import LIGHT_FLAGS, start_server

KEY, SECRET = "key-0f-the-server-7d1c", "storage-secret-9a8b7c6d5e"
REDIS = "redis://:hunter2-pass@127.0.0.1:1/0"


def configs(*argv: str, environ: dict | None = None):
    args = build_parser().parse_args(["serve", *argv])
    resolve_secrets(args, environ or {})
    return config_from_args(ServerConfig, args), config_from_args(HiCacheConfig, args)


def test_each_secret_comes_from_its_file_or_its_variable(tmp_path):
    (tmp_path / "key").write_text(KEY + "\n")
    (tmp_path / "secret").write_text(SECRET)
    (tmp_path / "extra").write_text(json.dumps({"url": REDIS}))
    server, cache = configs("--hicache-storage-backend", "redis", "--api-key-file", str(tmp_path / "key"), "--hicache-storage-secret-file",
                            str(tmp_path / "secret"), "--hicache-storage-backend-extra-config-file",
                            str(tmp_path / "extra"))
    assert (server.api_key, cache.hicache_storage_secret, cache.backend_options["url"]) == (KEY, SECRET, REDIS)
    environ = {"HICACHE_API_KEY": KEY}
    server, cache = configs("--hicache-storage-backend", "redis", environ=environ)
    assert server.api_key == KEY and cache.hicache_storage_secret is None
    server, _ = configs("--hicache-storage-backend", "redis", "--api-key", "from-the-flag", environ=environ)  # the flag wins over the variable
    assert server.api_key == "from-the-flag"
    assert KEY not in repr(server) and SECRET not in repr(cache)
    assert [s.env for s in SECRETS] == ["HICACHE_API_KEY", None, None]  # L3's secrets: a file or the flag


def test_the_variable_is_read_when_the_command_line_is_parsed(monkeypatch):
    args = build_parser().parse_args(["serve"])
    monkeypatch.setenv("HICACHE_API_KEY", KEY)  # set after import and after parsing
    assert serve_configs(args)[0].api_key == KEY


def test_a_bad_secret_source_is_an_error_that_never_shows_the_value(tmp_path):
    key, empty = tmp_path / "key", tmp_path / "empty"
    key.write_text(KEY)
    empty.write_text("\n")
    cases = [(["--api-key", KEY, "--api-key-file", str(key)], "give --api-key or --api-key-file, not both"),
             (["--api-key-file", str(tmp_path / "absent")], "--api-key-file: cannot read"),
             (["--hicache-storage-secret-file", str(empty)], "--hicache-storage-secret-file: .* is empty"),
             (["--hicache-storage-backend-extra-config-file", str(key)], "not valid JSON")]
    for argv, message in cases:
        with pytest.raises(ValueError, match=message) as e:
            serve_configs(build_parser().parse_args(["serve", *argv]))
        assert KEY not in str(e.value)
    assert main(["serve", "--api-key", KEY, "--api-key-file", str(key)]) == 2  # the command's exit code


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").iterdir():
            children = (task / "children").read_text().split()
            out += map(int, children)
            todo += map(int, children)
    return out


@pytest.mark.model
def test_a_server_given_its_secrets_by_file_and_environment_shows_them_nowhere(tmp_path):
    secret, extra = tmp_path / "secret", tmp_path / "extra"
    secret.write_text(SECRET + "\n")
    extra.write_text(json.dumps({"path": str(tmp_path / "lmdb")}))
    for f in (secret, extra):
        f.chmod(0o600)
    flags = (*LIGHT_FLAGS, "--hicache-storage-backend", "lmdb", "--hicache-storage-secret-file", str(secret),
             "--hicache-storage-backend-extra-config-file", str(extra))
    env = {"HICACHE_API_KEY": KEY}
    server = start_server(*flags, api_key=KEY, env=env, key_flag=False)
    try:
        assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 401
        r = httpx.post(server.url + "/generate", headers=server.headers, timeout=120,
                       json={"text": "Hello", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200
        procs = [server.proc.pid, *descendants(server.proc.pid)]
        assert server.scheduler_pid in procs and len(procs) >= 3  # the scheduler's and the L3 storage process
        assert any("process_main" in cmdline(p) for p in procs)
        for pid in procs:
            assert KEY not in cmdline(pid) and SECRET not in cmdline(pid)
        info = httpx.get(server.url + "/get_server_info", headers=server.headers, timeout=30).text
        assert KEY not in info and SECRET not in info
    finally:
        server.stop()
    log = server.log.read_text()
    assert KEY not in log and SECRET not in log
