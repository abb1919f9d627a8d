"""`hicache serve --model-path` picks the architecture from the folder's config.json or the GGUF's
metadata; an architecture it does not run stops the server with an error that lists those it
runs (the subprocess run is `slow`; in-process, tests/runtime/test_weights.py checks the folder's
error and the GGUF's is checked here)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hicache.runtime.model_config import SUPPORTED_ARCHITECTURES
from hicache.runtime.weights import load_model
from hicache.runtime.weights.gguf import SUPPORTED_GGUF_ARCHS
from server_harness import free_port


@pytest.mark.slow
def test_serve_refuses_an_unsupported_architecture_naming_the_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"], "hidden_size": 64}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    cmd = [sys.executable, "-m", "hicache.server.cli", "serve", "--host", "127.0.0.1", "--port", str(free_port()),
           "--model-path", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "unsupported architecture ['FalconForCausalLM']" in proc.stderr
    assert ", ".join(SUPPORTED_ARCHITECTURES) in proc.stderr


def test_gguf_of_an_unsupported_architecture_names_the_supported(tmp_path):
    import gguf

    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'falcon' is not supported.*" + ", ".join(SUPPORTED_GGUF_ARCHS)):
        load_model(path)
