"""Weight loading: `load_model(model_path, load_format, dtype, device, seed, tp) -> LoadedModel`.

Formats: `gguf` (a .gguf file), `safetensors` (an HF folder), `dummy` (random weights from a
config.json file or folder). `auto` picks by path: a .gguf file, a folder with *.safetensors, or
a folder with exactly one .gguf. `model_path=None` is the embedded default model (a GGUF).
With a tensor-parallel `tp`, the model holds this rank's share and each checkpoint tensor is
sliced to it as it streams in (safetensors read only that share; GGUF tensors are dequantised
whole, then sliced; random weights are drawn whole, then sliced, so they match the unsharded model's).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Iterable, NamedTuple

import torch
from tqdm.auto import tqdm

from hicache.runtime.default_model import resolve_model_path
from hicache.runtime.model_config import ModelConfig
from hicache.runtime.models import LlamaForCausalLM, get_model_class
from hicache.runtime.parallel import SINGLE, TensorParallel
from hicache.runtime.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LoadedModel(NamedTuple):
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Any | None  # a transformers tokenizer; None for dummy weights without tokenizer files
    path: Path
    tp: TensorParallel = SINGLE  # the rank this model is the share of

    @property
    def num_kv_heads(self) -> int:
        """The KV heads this rank holds: what its KV pools are sized for."""
        return self.model.num_kv_heads


def load_model(model_path: str | Path | None = None, load_format: str = "auto",
               dtype: torch.dtype | str = torch.float32, device: torch.device | str = "cpu",
               seed: int = 0, tp: TensorParallel = SINGLE) -> LoadedModel:
    """Build our model (this rank's share of it under `tp`) and fill its weights. dtype/device
    also accept the RuntimeConfig strings ("auto": cuda when present; float32 on CPU, bfloat16 on CUDA).

    Raises FileNotFoundError for a missing path, ValueError for an unknown format, an
    unsupported architecture or a dimension `tp` cannot split, RuntimeError when the default
    model cannot be fetched.
    """
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    path = resolve_model_path(model_path)
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    fmt = detect_format(path) if load_format == "auto" else load_format
    if fmt not in LOAD_FORMATS[1:]:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    t0 = time.perf_counter()
    tok_source = path
    if fmt == "dummy":
        model, config = _load_dummy(path, dtype, device, seed, tp)
    else:
        ckpt = _open_checkpoint(path, fmt)
        tok_source = getattr(ckpt, "path", path)
        config = ckpt.config
        model = get_model_class(config.architecture)(config, dtype=dtype, device=device, tp=tp)
        tensors = ckpt.tensors(lazy=True) if fmt == "safetensors" and tp.sharded else ckpt.tensors()
        loaded = model.load_weights(_progress(tensors, ckpt.num_tensors, config.name))
        model.check_loaded(loaded)
    model.eval()
    tokenizer = load_tokenizer(tok_source)
    logger.info("loaded %s (%s, %s, %s) in %.1f s", path, fmt, dtype, device, time.perf_counter() - t0)
    return LoadedModel(model, config, tokenizer, path, tp)


def detect_format(path: Path) -> str:
    if path.is_file():
        if path.suffix == ".gguf":
            return "gguf"
        if path.name.endswith(".json"):
            raise ValueError(f"{path} is a config file: pass load_format='dummy' for random weights")
        raise ValueError(f"cannot tell the format of {path}: expected a .gguf file or an HF model folder")
    if any(path.glob("*.safetensors")):
        return "safetensors"
    ggufs = list(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return "gguf"
    if (path / "config.json").is_file():
        raise ValueError(f"{path} has a config.json but no *.safetensors weights "
                         "(pass load_format='dummy' for random weights)")
    raise ValueError(f"cannot tell the format of {path}: no *.safetensors, no single .gguf, no config.json")


def resolve_device(device: torch.device | str) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: torch.dtype | str, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def _open_checkpoint(path: Path, fmt: str):
    if fmt == "gguf":
        from hicache.runtime.weights.gguf import GGUFCheckpoint

        if path.is_dir():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) != 1:
                raise ValueError(f"{path} holds {len(ggufs)} .gguf files; pass the file itself")
            path = ggufs[0]
        return GGUFCheckpoint(path)
    from hicache.runtime.weights.safetensors import SafetensorsCheckpoint

    if not path.is_dir():
        raise ValueError(f"safetensors weights are read from an HF model folder, got the file {path}")
    return SafetensorsCheckpoint(path)


def _load_dummy(path: Path, dtype: torch.dtype, device: torch.device, seed: int, tp: TensorParallel):
    from hicache.runtime.weights.dummy import dummy_config, init_dummy

    config = dummy_config(path, seed)
    model = get_model_class(config.architecture)(config, dtype=dtype, device=device, tp=tp)
    init_dummy(model, seed)
    return model, config


def _progress(items: Iterable, total: int, name: str) -> Iterable:
    return tqdm(items, total=total, desc=f"Loading {name}", unit="tensor", leave=False, dynamic_ncols=True)


__all__ = ["LoadedModel", "load_model", "detect_format", "resolve_device", "resolve_dtype", "LOAD_FORMATS"]
