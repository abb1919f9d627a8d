"""HF model folders: config.json plus one `*.safetensors` file or shards listed in
`model.safetensors.index.json`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from hicache.runtime.model_config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"


class SafetensorsCheckpoint:
    """An HF folder: `config`, `num_tensors`, and `tensors()` yielding (hf_name, CPU tensor), or
    with `lazy` (hf_name, safetensors slice): indexing one reads only the bytes it selects."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if not (self.folder / "config.json").is_file():
            raise FileNotFoundError(f"{self.folder} has no config.json")
        self.config = ModelConfig.from_json_file(self.folder, name=self.folder.name)
        self.files = shard_files(self.folder)

    @property
    def num_tensors(self) -> int:
        from safetensors import safe_open

        total = 0
        for f in self.files:
            with safe_open(str(f), framework="pt") as sf:
                total += len(list(sf.keys()))
        return total

    def tensors(self, lazy: bool = False) -> Iterator[tuple[str, Any]]:
        from safetensors import safe_open

        for f in self.files:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for name in sf.keys():
                    yield name, sf.get_slice(name) if lazy else sf.get_tensor(name)


def shard_files(folder: Path) -> list[Path]:
    """The weight files of a folder, from the index if there is one, else every *.safetensors."""
    index = folder / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{INDEX_FILE} names shards that are missing: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no *.safetensors files")
    return files
