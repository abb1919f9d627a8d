"""Shared fixtures.

- `default_model_path`: the embedded default GGUF (fetched once into the user's cache folder).
- `default_model`: our SmolLM2 (fp32, CPU), loaded once per session.
- `hf_reference`: HF transformers' model + tokenizer on the same GGUF (the oracle), once per session;
  the suite compares with its outputs through tests/golden and runs it live in one comparison
  (test_engine_parity.py::test_live_hf_oracle; test_weights.py also saves its weights).
- `hf_tokenizer`: HF transformers' tokenizer of the GGUF alone.
- `tiny_config_path` / `llama31_config_path`: configs under benchmarks/configs.
- `prompt_logits`: fn(model, ids: list[int]) -> [T, vocab] fp32 logits of a whole prompt, through
  a test-only single-sequence attention backend (`SimpleAttention`).
- autouse: a private `$HICACHE_HOME` per test module and per test (tests/homes.py).
- `redis_server`: a real redis-server on a free port, stopped after the test (`RedisServer`).
- `mooncake_master`: a real Mooncake master on free ports for the module (`MooncakeMaster`).
- autouse: one intra-op thread for tests not marked `model` (see `_torch_threads`); OpenMP
  threads wait passively (tests/omp_env.py).
- Hypothesis profiles: `default` sized for `make test`, `thorough` (`--hypothesis-profile
  thorough`, which `make test-all` passes) with more examples.
"""
from __future__ import annotations

import omp_env  # noqa: F401  (first: OpenMP reads its wait policy when torch loads it)
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import settings

from homes import private_home
from mooncake_proc import MooncakeMaster, import_error as mooncake_import_error
from redis_proc import RedisServer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def _module_home(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HICACHE_HOME", str(private_home(tmp_path_factory.mktemp("home"))))
        yield


@pytest.fixture(autouse=True)
def _test_home(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HICACHE_HOME", str(private_home(tmp_path_factory.mktemp("home"))))


@pytest.fixture(autouse=True)
def _torch_threads(request):
    """Tests on tiny models and small tensors run torch on one intra-op thread: their operations are
    too small to gain from a second, and OpenMP threads that spin at every barrier slow them many
    times over whenever another process (a server under test, a neighbour) holds a core. Tests
    marked `model` (SmolLM2's real matrix products) keep every thread."""
    if request.node.get_closest_marker("model"):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


settings.register_profile("default", max_examples=50, stateful_step_count=50, deadline=None)
settings.register_profile("thorough", max_examples=300, stateful_step_count=100, deadline=None)
settings.load_profile("default")  # the hypothesis plugin loads --hypothesis-profile after this


class SimpleAttention:
    """Test-only backend: one sequence, per-layer contiguous K/V, causal SDPA with GQA."""

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    def forward(self, q, k, v, layer_id, batch):
        if self.k[layer_id] is None:
            self.k[layer_id], self.v[layer_id] = k.clone(), v.clone()
        else:
            self.k[layer_id] = torch.cat([self.k[layer_id], k])
            self.v[layer_id] = torch.cat([self.v[layer_id], v])
        keys, vals = self.k[layer_id], self.v[layer_id]
        rep = q.shape[1] // keys.shape[1]
        keys, vals = keys.repeat_interleave(rep, 1), vals.repeat_interleave(rep, 1)
        prefix = keys.shape[0] - q.shape[0]
        qt, kt, vt = (t.transpose(0, 1)[None] for t in (q, keys, vals))  # [1, H, T, D]
        if prefix == 0:  # is_causal takes the fast (flash) CPU kernel
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        else:
            mask = torch.ones(q.shape[0], keys.shape[0], dtype=torch.bool, device=q.device).tril(prefix)
            out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
        return out[0].transpose(0, 1)


def make_batch(model) -> SimpleNamespace:
    return SimpleNamespace(attn=SimpleAttention(model.config.num_layers))


def run_prompt(model, ids, batch=None, start: int = 0) -> torch.Tensor:
    """Logits [len(ids), vocab] fp32 for tokens at positions start.. (batch keeps the KV)."""
    batch = batch if batch is not None else make_batch(model)
    x = torch.as_tensor(ids, dtype=torch.int64, device=model.device)
    pos = torch.arange(start, start + len(ids), dtype=torch.int64, device=model.device)
    return model.compute_logits(model.forward(x, pos, batch))


@pytest.fixture(scope="session")
def prompt_logits():
    return run_prompt


@pytest.fixture(scope="session")
def simple_batch():
    return make_batch


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from hicache.runtime.default_model import default_model_path as fetch

    return fetch()


@pytest.fixture(scope="session")
def default_model(default_model_path):
    from hicache.runtime.weights import load_model

    return load_model(default_model_path, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="session")
def hf_tokenizer(default_model_path):
    """HF transformers' tokenizer, reading the GGUF."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_path.parent), gguf_file=default_model_path.name)


@pytest.fixture(scope="session")
def hf_reference(default_model_path, hf_tokenizer):
    """(model, tokenizer) from HF transformers, reading the same GGUF."""
    from transformers import AutoModelForCausalLM

    d, name = str(default_model_path.parent), default_model_path.name
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    model.eval()
    return SimpleNamespace(model=model, tokenizer=hf_tokenizer)


@pytest.fixture(scope="session")
def tiny_config_path() -> Path:
    return REPO / "benchmarks" / "configs" / "tiny-llama.json"


@pytest.fixture(scope="session")
def llama31_config_path() -> Path:
    return REPO / "benchmarks" / "configs" / "llama-3.1-8b.json"


@pytest.fixture
def redis_server(tmp_path):
    """A running real Redis (skipped where redis-server is not installed; CI installs it)."""
    import shutil

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory):
    """A running real Mooncake master for the module (skipped where the wheel cannot be imported,
    e.g. without libibverbs; CI installs both)."""
    why = mooncake_import_error()
    if why:
        pytest.skip(why)
    master = MooncakeMaster(tmp_path_factory.mktemp("mooncake"))
    master.start()
    try:
        yield master
    finally:
        master.stop()
