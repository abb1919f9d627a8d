"""Private `$HICACHE_HOME` folders for tests (tests/conftest.py gives one to every module and test).

L3 is on by default and lives under $HICACHE_HOME (LMDB in storage/lmdb), so that a test never
reads pages stored by an earlier run or another test, every test module (for its module-scoped
engines and servers) and every test gets a home of its own. The other entries of the real home
(the fetched model, saved tokenizers) are symlinked in, so nothing is fetched twice. Server
processes inherit the variable.
"""
from __future__ import annotations

from pathlib import Path

from hicache.runtime.default_model import hicache_home

REAL_HOME = hicache_home()
SHARED_HOME_ENTRIES = ("models", "tokenizers")


def private_home(base: Path) -> Path:
    """base, made a home whose shared entries link to the real home's."""
    for name in SHARED_HOME_ENTRIES:
        (REAL_HOME / name).mkdir(parents=True, exist_ok=True)
        (base / name).symlink_to(REAL_HOME / name)
    return base
