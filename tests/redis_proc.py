"""A real `redis-server` process for tests (the `redis_server` fixture and tests that need more)."""
from __future__ import annotations

from pathlib import Path


class RedisServer:
    """A real `redis-server` on 127.0.0.1 and a free port, no persistence; `stop()` kills it (as
    a crash would), `start()` brings it back on the same port, empty. With `password`, clients
    must authenticate (`url` is the caller's to set then)."""

    def __init__(self, workdir: Path, password: str | None = None):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.workdir, self.password = workdir, password
        self.proc = None

    def start(self) -> None:
        import subprocess
        import time

        import redis

        self.proc = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), *(["--requirepass", self.password] if self.password else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
