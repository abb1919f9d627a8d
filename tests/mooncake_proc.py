"""A real Mooncake master (`mooncake_master` from the wheel, with its HTTP metadata server) for
tests, on 127.0.0.1 and free ports: the `mooncake_master` fixture and tests that need more."""
from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def import_error() -> str | None:
    """Why the Mooncake wheel cannot be used here (None: it can)."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as e:  # no wheel, or a library it links missing (libibverbs)
        return f"mooncake-transfer-engine cannot be imported: {e}"
    return None


class MooncakeMaster:
    """`stop()` kills it (as a crash would; its index is lost), `start()` brings it back on the
    same ports. `options`: the backend's extra config for this master."""

    def __init__(self, workdir: Path):
        import mooncake

        self.binary = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
        self.rpc_port, self.metadata_port, self.metrics_port = free_port(), free_port(), free_port()
        self.workdir = workdir
        self.options = {"master": f"127.0.0.1:{self.rpc_port}", "global_segment_mb": 64, "local_buffer_mb": 16,
                        "metadata_server": f"http://127.0.0.1:{self.metadata_port}/metadata"}
        self.proc = None

    def start(self) -> None:
        cmd = [self.binary, f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
               "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
               f"--http_metadata_server_port={self.metadata_port}", "--metrics_host=127.0.0.1",
               f"--metrics_port={self.metrics_port}"]
        with open(self.workdir / "mooncake_master.log", "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            try:
                for port in (self.rpc_port, self.metadata_port):
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("mooncake_master did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
