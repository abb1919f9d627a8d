"""docs/configuration.md: generated from the parser of `hicache serve` and the L3 extra-config keys."""
from __future__ import annotations

import argparse
from pathlib import Path

from hicache.config import extra_keys, storage_backends
from hicache.server.cli import add_serve_flags
from hicache.server.reference import render

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_committed_reference_is_current():
    assert DOC.read_text() == render(), "docs/configuration.md is stale: regenerate it with `make docs`"


def test_the_reference_has_every_flag_with_its_default_and_every_extra_config_key():
    text = render()
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| `--")}
    flags = [a.option_strings for a in parser._actions if a.dest != "help"]
    assert len(rows) == len(flags)
    for strings in flags:
        assert "| " + " / ".join(f"`{s}`" for s in strings) in rows
    assert "| `--port` | `port` | `30000` | TCP port to listen on. |" in text
    assert "| `--enable-overlap-schedule` / `--disable-overlap-schedule` | `overlap_schedule` | auto |" in text
    for backend in storage_backends():
        for key in extra_keys(backend):
            assert f"| `{key}` |" in text
    assert '| `url` | string | `"redis://127.0.0.1:6379/0"` |' in text
