"""Weight loaders: safetensors round trip of SmolLM2, dummy weights, format detection, tokenizer."""
from __future__ import annotations

import json
import time

import pytest
import torch

from hicache.runtime.model_config import SUPPORTED_ARCHITECTURES
from hicache.runtime.tokenizer import apply_chat_template, load_tokenizer
from hicache.runtime.weights import detect_format, load_model


def _save_two_shards(state: dict[str, torch.Tensor], folder) -> None:
    from safetensors.torch import save_file

    names = sorted(state)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(halves):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: state[n].contiguous() for n in part}, str(folder / fname), metadata={"format": "pt"})
        weight_map |= {n: fname for n in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def smollm2_folder(hf_reference, tmp_path_factory):
    """SmolLM2 (dequantised by HF from the GGUF) as an HF folder: 2 shards + index, config, tokenizer."""
    folder = tmp_path_factory.mktemp("smollm2-hf")
    model = hf_reference.model
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    _save_two_shards(state, folder)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    hf_reference.tokenizer.save_pretrained(str(folder))
    return folder


@pytest.mark.model
def test_safetensors_round_trip(smollm2_folder, default_model, prompt_logits):
    assert detect_format(smollm2_folder) == "safetensors"
    t0 = time.perf_counter()
    loaded = load_model(smollm2_folder)
    print(f"safetensors load: {time.perf_counter() - t0:.2f}s")
    assert loaded.config.tie_word_embeddings and loaded.config.num_layers == 30
    ids = apply_chat_template(loaded.tokenizer, [{"role": "user", "content": "Name three colours."}])
    assert ids == apply_chat_template(default_model.tokenizer, [{"role": "user", "content": "Name three colours."}])
    ours, ref = prompt_logits(loaded.model, ids), prompt_logits(default_model.model, ids)
    assert torch.equal(ours, ref)  # same fp32 weights, same code: bit-identical


@pytest.mark.model
def test_gguf_tokenizer_and_chat_template(default_model, hf_tokenizer):
    tok = default_model.tokenizer
    for text in ["Hello world", "def f(x):\n    return x ** 2\n", "Ünïcödé 日本語 🙂"]:
        assert tok(text)["input_ids"] == hf_tokenizer(text)["input_ids"]
    msgs = [{"role": "user", "content": "Hi"}]
    ids = apply_chat_template(tok, msgs)
    assert ids == list(hf_tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                        tokenize=True, return_dict=False))
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    t0 = time.perf_counter()
    assert load_tokenizer(default_model.path) is tok  # cached in-process
    assert time.perf_counter() - t0 < 0.5


def test_dummy_deterministic_per_seed(tiny_config_path, prompt_logits):
    a = load_model(tiny_config_path, load_format="dummy", seed=1)
    b = load_model(tiny_config_path.parent / tiny_config_path.name, load_format="dummy", seed=1)
    c = load_model(tiny_config_path, load_format="dummy", seed=2)
    assert a.tokenizer is None
    params = (a.model.named_parameters(), b.model.named_parameters(), c.model.named_parameters())
    for (n, p), (_, q), (_, r) in zip(*params):
        assert torch.equal(p, q), n
        if p.dim() >= 2:
            assert not torch.equal(p, r), n
            assert 0.015 < p.float().std().item() < 0.025
    ids = list(range(1, 50))
    la = prompt_logits(a.model, ids)
    assert torch.isfinite(la).all() and torch.equal(la, prompt_logits(b.model, ids))
    assert a.config.fingerprint == b.config.fingerprint != c.config.fingerprint


def test_dummy_from_folder_bf16(tiny_config_path, tmp_path, prompt_logits):
    (tmp_path / "config.json").write_text(tiny_config_path.read_text())
    lm = load_model(tmp_path, load_format="dummy", dtype="bfloat16")
    assert lm.model.layers[0].self_attn.qkv_proj.dtype == torch.bfloat16
    logits = prompt_logits(lm.model, [3, 4, 5])
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_dummy_8b_shape_is_lazy_on_meta(llama31_config_path):
    """The 8B shape builds without touching memory on the meta device (init is per-parameter)."""
    from hicache.runtime.model_config import ModelConfig
    from hicache.runtime.models import LlamaForCausalLM

    cfg = ModelConfig.from_json_file(llama31_config_path)
    model = LlamaForCausalLM(cfg, dtype=torch.bfloat16, device="meta")
    n = sum(p.numel() for p in model.parameters())
    assert 8.0e9 < n < 8.1e9


def test_bad_paths(tmp_path, tiny_config_path):
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "nope")
    (tmp_path / "config.json").write_text(tiny_config_path.read_text())
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="dummy"):
        load_model(tmp_path / "config.json")
    with pytest.raises(ValueError, match="load_format"):
        load_model(tmp_path, load_format="pickle")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="format"):
        load_model(tmp_path / "notes.txt")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError):
        load_model(empty)


def test_unsupported_architecture(tmp_path, tiny_config_path):
    d = json.loads(tiny_config_path.read_text())
    d["architectures"] = ["FalconForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="unsupported architecture.*" + ", ".join(SUPPORTED_ARCHITECTURES)):
        load_model(tmp_path, load_format="dummy")
    (tmp_path / "model.safetensors").write_bytes(b"")  # auto-detected as a folder of safetensors
    with pytest.raises(ValueError, match="unsupported architecture.*Qwen3ForCausalLM"):
        load_model(tmp_path)


def test_missing_tensor_is_an_error(tmp_path, tiny_config_path):
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(tiny_config_path.read_text())
    save_file({"model.embed_tokens.weight": torch.zeros(512, 64)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks"):
        load_model(tmp_path)


@pytest.mark.model
def test_gguf_header_reader_matches_gguf_package(default_model_path):
    """Our fast header parser agrees with gguf.GGUFReader on every field and tensor layout."""
    import numpy as np
    from gguf import GGUFReader, dequantize

    from hicache.runtime.weights.gguf import GGUFFile

    ours, ref = GGUFFile(default_model_path), GGUFReader(str(default_model_path))
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        assert ours.fields[key] == (value.item() if isinstance(value, np.generic) else value), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in list(zip(ours.tensors, ref.tensors))[:12]:
        assert a.tensor_type == b.tensor_type
        assert np.array_equal(dequantize(a.data, a.tensor_type), dequantize(b.data, b.tensor_type)), a.name


def test_gguf_rejects_non_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(ValueError, match="not a GGUF"):
        load_model(bad)
