"""A tiny random HF Llama (benchmarks/configs/tiny-llama.json) saved as an HF folder, and random
PEFT LoRA adapters on it saved as PEFT writes them: HF transformers + PEFT are the oracle."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

# name -> (rank, alpha, target modules, rslora)
ADAPTERS = {
    "attn4": (4, 8, ["q_proj", "v_proj", "o_proj"], False),
    "mlp8": (8, 16, ["k_proj", "gate_proj", "up_proj", "down_proj"], True),
}


def tiny_hf_llama(config_path: Path, seed: int = 0) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(**json.loads(config_path.read_text()))
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    return model


def peft_adapter(base: torch.nn.Module, rank: int, alpha: int, targets: list[str], rslora: bool, seed: int,
                 folder: Path) -> torch.nn.Module:
    """PEFT's model of a random adapter on a copy of `base` (its LoRA weights large enough to change
    greedy outputs), saved to `folder` (adapter_config.json, adapter_model.safetensors)."""
    import peft

    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.1,
                             use_rslora=rslora, init_lora_weights=False)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(str(folder))
    return model.eval()


def hf_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             min_new_tokens=new_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()
