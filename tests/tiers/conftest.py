"""Fixtures of the tier tests."""
from __future__ import annotations

import subprocess

import pytest

from test_storage_failsafe import mount_tmpfs


@pytest.fixture
def small_fs(tmp_path):
    """An 8 MiB tmpfs (skipped where it cannot be mounted), unmounted afterwards."""
    fs = mount_tmpfs(tmp_path / "fs", 8)
    try:
        yield fs
    finally:
        subprocess.run(["umount", "-l", str(fs.root)], check=False)
