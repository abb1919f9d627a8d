"""A real `hicache serve` process on 127.0.0.1 and a free port, on the default model.

`start_server(*flags)` launches `python -m hicache.server.cli serve`, waits for /health and
returns a `ServerHandle`; `handle.stop()` sends SIGTERM and checks that both the server and its
scheduler process are gone. `start_up(*flags)` also records what the server reported as it became
ready (`StartUp`), for tests of its start-up state on a server other tests then use.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import httpx

# L3 in the server's memory: tests of LMDB or Redis name theirs after these flags (the last wins)
LIGHT_FLAGS = ("--max-total-tokens", "8192", "--context-length", "4096", "--page-size", "16",
               "--max-running-requests", "32", "--chunked-prefill-size", "512", "--hicache-storage-backend", "memory")
# Long streams meant to be in flight together (signals and deaths mid-stream): admitted without
# keeping room for their outputs, as they would be with retraction to fall back on
TOGETHER = ("--schedule-conservativeness", "0")
STARTUP_TIMEOUT_S = 600
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1"  # the default model's own name
ALIAS = "smol"  # the shared server's second name (conftest.py)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True


@dataclass
class ServerHandle:
    proc: subprocess.Popen
    url: str
    log: Path
    api_key: str | None = None
    scheduler_pid: int | None = None

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, wait, and check that no process of the server is left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"server ignored SIGTERM for {timeout} s\n{self.log_tail()}") from None
        if self.scheduler_pid is not None:
            deadline = time.monotonic() + 10
            while pid_alive(self.scheduler_pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not pid_alive(self.scheduler_pid), "the scheduler process outlived the server"
        return code


def start_server(*flags: str, api_key: str | None = None, env: dict | None = None,
                 key_flag: bool = True) -> ServerHandle:
    """`env`: variables added to the server's environment; `key_flag=False`: `api_key` is the key
    the server takes from elsewhere (a file, `env`), not put on its command line."""
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="hicache-server-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "hicache.server.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *flags]
    if api_key and key_flag:
        cmd += ["--api-key", api_key]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    handle = ServerHandle(proc, f"http://127.0.0.1:{port}", log, api_key)
    _wait_healthy(handle)
    info = httpx.get(handle.url + "/get_server_info", headers=handle.headers, timeout=30).json()
    handle.scheduler_pid = info["scheduler_pid"]
    return handle


def _wait_healthy(h: ServerHandle) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if h.proc.poll() is not None:
            raise RuntimeError(f"server exited with {h.proc.returncode} during startup\n{h.log_tail()}")
        try:
            if httpx.get(h.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    h.proc.kill()
    raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S} s\n{h.log_tail()}")


class StartUp(NamedTuple):
    """A server as it reported ready: its handle, /hicache/stats and log at that moment."""
    handle: ServerHandle
    stats: dict
    log: str


def start_up(*flags: str, api_key: str | None = None) -> StartUp:
    handle = start_server(*flags, api_key=api_key)
    stats = httpx.get(handle.url + "/hicache/stats", headers=handle.headers, timeout=30).json()
    return StartUp(handle, stats, handle.log.read_text())
