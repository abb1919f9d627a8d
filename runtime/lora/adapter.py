"""A PEFT-format LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`), read and
checked against the base model's shapes.

PEFT's delta of a target linear is `lora_B(lora_A(x)) * scaling` with `scaling = lora_alpha / r`
(`lora_alpha / sqrt(r)` with `use_rslora`); dropout is a training-time option and is ignored.
Tensors are named `base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight`.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hicache.runtime.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR_RE = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\."
                        r"(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# options whose non-default values change the computation in ways this runtime does not implement
_REFUSED = {"use_dora": (False, None), "rank_pattern": ({}, None), "alpha_pattern": ({}, None),
            "modules_to_save": (None, []), "bias": ("none", None), "lora_bias": (False, None),
            "fan_in_fan_out": (False, None)}


class AdapterError(ValueError):
    """An adapter that cannot be served: the message names the file, option or tensor at fault."""


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """One loaded adapter. `weights[(layer, module)]` = (A [r, in], B [out, r]) in the model's
    dtype, on its device. `uid` is a digest of the adapter's files: the cache namespace of its KV
    (the same files under another name share it; other files under the same name do not)."""

    name: str
    path: str
    uid: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def modules(self) -> frozenset[str]:
        return frozenset(m for _, m in self.weights)


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target module of the base model."""
    h, i = config.hidden_size, config.intermediate_size
    return {"q_proj": (h, config.q_size), "k_proj": (h, config.kv_size), "v_proj": (h, config.kv_size),
            "o_proj": (config.q_size, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def load_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> LoraAdapter:
    """Reads the adapter folder `path` and checks it against `config`; AdapterError naming what is
    wrong (a missing file, an option not implemented, an unknown module, a rank above `max_rank`,
    a tensor of the wrong shape or layer)."""
    folder = Path(path)
    options = _read_config(folder)
    rank, alpha = options.get("r"), options.get("lora_alpha", 8)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{folder / CONFIG_FILE}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"{folder / CONFIG_FILE}: rank {rank} is above --max-lora-rank {max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise AdapterError(f"{folder / CONFIG_FILE}: lora_alpha must be a number, got {alpha!r}")
    _check_targets(folder, options.get("target_modules"))
    weights = _read_weights(folder, config, rank, dtype, device)
    scaling = alpha / math.sqrt(rank) if options.get("use_rslora") else alpha / rank
    return LoraAdapter(name, str(folder), _digest(folder), rank, float(scaling), weights)


def _read_config(folder: Path) -> dict:
    for f in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / f).is_file():
            raise AdapterError(f"{folder}: no {f} (a PEFT LoRA adapter folder holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        options = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{folder / CONFIG_FILE}: not readable JSON ({e})") from None
    if not isinstance(options, dict):
        raise AdapterError(f"{folder / CONFIG_FILE}: not a JSON object")
    if options.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{folder / CONFIG_FILE}: peft_type {options['peft_type']!r} is not LORA")
    for key, accepted in _REFUSED.items():
        if key in options and options[key] not in accepted:
            raise AdapterError(f"{folder / CONFIG_FILE}: {key}={options[key]!r} is not supported")
    return options


def _check_targets(folder: Path, targets) -> None:
    """target_modules: a list of module names among MODULES, or "all-linear"."""
    if targets == "all-linear":
        return
    if not isinstance(targets, list) or not targets:
        raise AdapterError(f"{folder / CONFIG_FILE}: target_modules must be a list of module names or "
                           f"\"all-linear\", got {targets!r}")
    unknown = sorted(str(t) for t in targets if t not in MODULES)
    if unknown:
        raise AdapterError(f"{folder / CONFIG_FILE}: target_modules {unknown} are not LoRA targets here "
                           f"(supported: {', '.join(MODULES)})")


def _read_weights(folder: Path, config: ModelConfig, rank: int, dtype: torch.dtype, device: torch.device
                  ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(folder / WEIGHTS_FILE))
    except (SafetensorError, OSError) as e:
        raise AdapterError(f"{folder / WEIGHTS_FILE}: not a readable safetensors file ({e})") from None
    shapes, pairs = module_shapes(config), {}
    for tname, t in tensors.items():
        layer, module, which = _parse_name(folder, tname, config.num_layers)
        fan_in, fan_out = shapes[module]
        want = (rank, fan_in) if which == "A" else (fan_out, rank)
        if tuple(t.shape) != want:
            raise AdapterError(f"{folder / WEIGHTS_FILE}: {tname} has shape {tuple(t.shape)}, the base model "
                               f"needs {want}")
        pairs.setdefault((layer, module), {})[which] = t.to(dtype=dtype, device=device).contiguous()
    if not pairs:
        raise AdapterError(f"{folder / WEIGHTS_FILE}: holds no LoRA tensors")
    for (layer, module), ab in pairs.items():
        if len(ab) != 2:
            raise AdapterError(f"{folder / WEIGHTS_FILE}: layer {layer} {module} has lora_{next(iter(ab))} "
                               f"without its lora_{'B' if 'A' in ab else 'A'}")
    return {key: (ab["A"], ab["B"]) for key, ab in sorted(pairs.items())}


def _parse_name(folder: Path, tname: str, num_layers: int) -> tuple[int, str, str]:
    m = _TENSOR_RE.match(tname)
    if m is None or m.group(2) not in MODULES:
        raise AdapterError(f"{folder / WEIGHTS_FILE}: tensor {tname} is not a LoRA weight of a supported module "
                           f"({', '.join(MODULES)})")
    layer = int(m.group(1))
    if layer >= num_layers:
        raise AdapterError(f"{folder / WEIGHTS_FILE}: tensor {tname} names layer {layer}; the base model has "
                           f"{num_layers} layers")
    return layer, m.group(2), m.group(3)


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for f in (CONFIG_FILE, WEIGHTS_FILE):
        with open(folder / f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:32]
