"""`ModelConfig`: the architecture of a decoder we run: the Llama family (Llama, Mistral, Qwen2/2.5,
Qwen3, and the mixtures of experts Qwen2-MoE, Qwen3-MoE, Mixtral), Gemma 3 text, DeepSeek-V2
(multi-head latent attention, `MLAConfig`) and Qwen3-Next (gated DeltaNet layers holding a
recurrent state, `LinearAttentionConfig`, between gated attention layers), read from an HF
config.json dict.

Only what our model needs, normalised across transformers 4.x (`rope_scaling`, `rope_theta`) and
5.x (`rope_parameters`) spellings. What sets the families apart is a few options: biases on the
q/k/v projections, a per-head RMSNorm of q and k, and a sparse MLP (`MoEConfig`). `fingerprint`
namespaces cache keys (docs/formats.md): two models whose KV could differ never share it.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

SLIDING, FULL, LINEAR = "sliding_attention", "full_attention", "linear_attention"  # HF's layer_types
_GEMMA3_DEFAULTS = {"rms_norm_eps": 1e-6, "tie_word_embeddings": True, "max_position_embeddings": 131072,
                    "head_dim": 256}


class Family(NamedTuple):
    """What an HF architecture adds to the Llama decoder."""
    model_type: str
    qkv_bias: bool  # the q/k/v projections carry biases
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE
    moe: bool  # sparse MLP layers (routed experts)


FAMILIES = {
    "LlamaForCausalLM": Family("llama", False, False, False),
    "MistralForCausalLM": Family("mistral", False, False, False),
    "Qwen2ForCausalLM": Family("qwen2", True, False, False),
    "Qwen3ForCausalLM": Family("qwen3", False, True, False),
    "Qwen2MoeForCausalLM": Family("qwen2_moe", True, False, True),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", False, True, True),
    "MixtralForCausalLM": Family("mixtral", False, False, True),
    "Gemma3ForCausalLM": Family("gemma3_text", False, True, False),  # and its own blocks: models/gemma3.py
    "DeepseekV2ForCausalLM": Family("deepseek_v2", False, False, True),  # MLA and its MoE: models/deepseek.py
    "DeepseekV3ForCausalLM": Family("deepseek_v3", False, False, True),  # V2's, with V3's routing
    "Qwen3NextForCausalLM": Family("qwen3_next", False, True, True),  # recurrent layers: models/qwen3_next.py
}
_DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
_MODEL_TYPES = {f.model_type: arch for arch, f in FAMILIES.items()}
# "freq_factors": llama.cpp's per-dimension divisors of inv_freq (GGUF tensor rope_freqs.weight),
# which is how a Llama-3.1 GGUF carries its llama3 scaling.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors", "yarn")  # yarn: DeepSeek only
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class MoEConfig:
    """The sparse MLP: each token's `top_k` experts by router softmax, their outputs weighted by
    the top-k probabilities (renormalised to sum to 1 when `norm_topk_prob`), plus a
    sigmoid-gated shared expert when `shared_intermediate_size` > 0."""
    num_experts: int
    top_k: int
    intermediate_size: int  # of one routed expert
    norm_topk_prob: bool
    shared_intermediate_size: int = 0
    sparse_step: int = 1  # layer i is sparse when (i + 1) % sparse_step == 0 ...
    dense_layers: tuple[int, ...] = ()  # ... and i is not listed here
    routed_scaling_factor: float = 1.0  # DeepSeek: the top-k weights are multiplied by it
    num_groups: int = 1  # DeepSeek's group-limited routing: experts in `num_groups` groups, the top k
    topk_groups: int = 1  # chosen among the experts of the `topk_groups` groups of highest best score
    routing: str = "softmax"  # or DeepSeek-V3's "noaux_tc": sigmoid scores, chosen with a correction bias

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be in 1..num_experts ({self.num_experts})")
        if self.num_experts % self.num_groups or not 0 < self.topk_groups <= self.num_groups:
            raise ValueError(f"n_group ({self.num_groups}) must divide the experts ({self.num_experts}) and "
                             f"topk_group ({self.topk_groups}) be in 1..n_group")

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0


# MoEConfig fields left out of fingerprints at these values
_MOE_DEFAULTS = {"routed_scaling_factor": 1.0, "num_groups": 1, "topk_groups": 1, "routing": "softmax"}


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2): q through a low-rank projection (`q_lora_rank`,
    or none), K and V of every head up-projected from one latent per token (`kv_lora_rank` values)
    plus one RoPE key shared by the heads (`qk_rope_head_dim`). The KV cache holds the latent and
    the rotated key: `latent_dim` values per token per layer."""
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        if self.latent_dim % 2:
            raise ValueError(f"kv_lora_rank + qk_rope_head_dim must be even, got {self.latent_dim}")

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Qwen3-Next's gated DeltaNet layers: per token, q and k of `num_key_heads` heads of
    `key_head_dim`, v of `num_value_heads` heads of `value_head_dim` (each key head serves
    num_value_heads / num_key_heads value heads), through a causal depthwise convolution of
    `conv_kernel` taps. A request's state per layer is constant-size: the convolution's last
    conv_kernel - 1 inputs [conv_dim, conv_kernel - 1] and the delta rule's matrix per value head
    [num_value_heads, key_head_dim, value_head_dim]."""
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"linear_num_value_heads ({self.num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.num_key_heads})")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v of a token."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None for plain RoPE, else {"rope_type": ..., params}; never mutate
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    architecture: str = "LlamaForCausalLM"
    name: str = ""
    hidden_act: str = "silu"
    sliding_window: int | None = None  # a windowed layer's query at position i sees keys i - W < j <= i
    layer_types: tuple[str, ...] = ()  # SLIDING / FULL per layer; () with a window: every layer windowed
    rope_local_theta: float | None = None  # Gemma 3: RoPE base of the windowed layers (plain RoPE)
    query_pre_attn_scalar: float | None = None  # Gemma 3: attention scale is its -0.5 power
    final_logit_softcapping: float | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None  # then head_dim is the RoPE part of a head (qk_rope_head_dim)
    linear: LinearAttentionConfig | None = None  # Qwen3-Next: the LINEAR layers of layer_types
    rotary_dim: int | None = None  # RoPE rotates the first rotary_dim of a head's dims (None: all)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    def __hash__(self) -> int:  # rope_scaling is a dict: hash the stable fingerprint instead
        return hash(self.fingerprint)

    @property
    def fingerprint(self) -> str:
        """16 hex digits of sha256 over every field but the token ids (they do not change KV).
        Family options at their defaults are left out: a Llama's fingerprint, and the L3 keys it
        seeds, do not depend on which options exist."""
        d = asdict(self)
        d.pop("bos_token_id")
        d.pop("eos_token_ids")
        for option in ("qkv_bias", "qk_norm", "moe", "mla", "linear", "rotary_dim"):
            if not d[option]:
                d.pop(option)
        if "moe" in d:
            d["moe"] = {k: v for k, v in d["moe"].items() if k not in _MOE_DEFAULTS or v != _MOE_DEFAULTS[k]}
        blob = json.dumps(d, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer: its sliding window W, or None for full attention."""
        if self.sliding_window is None:
            return (None,) * self.num_layers
        types = self.layer_types or (SLIDING,) * self.num_layers
        return tuple(self.sliding_window if t == SLIDING else None for t in types)

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        """The layers that hold a recurrent state instead of KV (Qwen3-Next's LINEAR layers)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR) if self.linear is not None else ()

    @property
    def kv_layers(self) -> int:
        """Layers with KV in the cache (the pools' layers): all but the recurrent ones."""
        return self.num_layers - len(self.recurrent_layers)

    @property
    def attn_scale(self) -> float:
        """Of q.k: 1/sqrt(head dim); DeepSeek's with YaRN's mscale(factor, mscale_all_dim) squared."""
        if self.mla is not None:
            s = self.rope_scaling or {}
            mscale = yarn_mscale(float(s["factor"]), float(s.get("mscale_all_dim") or 0)) if s else 1.0
            return self.mla.qk_head_dim ** -0.5 * mscale * mscale
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def cache_heads(self) -> int:
        """KV heads of one token in the L1 pool: `num_kv_heads`, or 1 for a latent (MLA)."""
        return 1 if self.mla is not None else self.num_kv_heads

    @property
    def cache_head_dim(self) -> int:
        """The width of the pool's K and of its V: head_dim, or for MLA half the latent (the pool's K
        holds the first half of each token's latent, its V the second: `attention/latent.py`)."""
        return self.mla.latent_dim // 2 if self.mla is not None else self.head_dim

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, d: dict, name: str | None = None) -> ModelConfig:
        """Build from an HF config.json dict (one of SUPPORTED_ARCHITECTURES).

        Raises ValueError for other architectures and for features our models lack
        (output/MLP biases, other activations, unknown RoPE types).
        """
        arch = _architecture(d)
        family = FAMILIES[arch]
        _check_supported(d, arch, family)
        if arch == "Gemma3ForCausalLM":
            d = {**_GEMMA3_DEFAULTS, **d}
        extra = _gemma3_fields(d) if arch == "Gemma3ForCausalLM" else _window_fields(d)
        if arch in _DEEPSEEK:
            extra = _deepseek_fields(d)
        if arch == "Qwen3NextForCausalLM":
            extra = _qwen3_next_fields(d)
        num_heads = int(d["num_attention_heads"])
        eos = d.get("eos_token_id")
        eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
        rope_theta, rope_scaling = _rope(d if arch != "Gemma3ForCausalLM" else _gemma3_global_rope(d))
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(extra.pop("head_dim", None) or d.get("head_dim") or d["hidden_size"] // num_heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=None if d.get("bos_token_id") is None else int(d["bos_token_id"]),
            eos_token_ids=eos_ids,
            architecture=arch,
            name=name if name is not None else str(d.get("_name_or_path", "") or ""),
            qkv_bias=family.qkv_bias and bool(d.get("qkv_bias", True)),
            qk_norm=family.qk_norm,
            moe=None if not _sparse(d, family) else _deepseek_moe(d, arch) if arch in _DEEPSEEK else _moe(d),
            **extra,
        )

    @classmethod
    def from_json_file(cls, path: str | Path, name: str | None = None) -> ModelConfig:
        """From a config.json file, or a folder holding one."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json at {path}")
        return cls.from_hf_config(json.loads(path.read_text()), name=name)

    def to_hf_config(self) -> dict:
        """An HF LlamaConfig-compatible dict (transformers 4.x spelling, which 5.x also reads)."""
        special = ("Gemma3ForCausalLM", "Qwen3NextForCausalLM", *_DEEPSEEK)
        if self.architecture in special or self.sliding_window is not None:
            raise ValueError(f"no HF config spelling for {self.architecture} with window {self.sliding_window}")
        d = {
            "architectures": [self.architecture],
            "model_type": FAMILIES[self.architecture].model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else dict(self.rope_scaling),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            **_moe_hf_keys(self),
        }
        if self.rope_scaling and self.rope_scaling.get("rope_type") == "freq_factors":
            raise ValueError("freq_factors RoPE (from a GGUF rope_freqs tensor) has no HF config spelling")
        return d


def _architecture(d: dict) -> str:
    archs = d.get("architectures") or []
    for a in archs:
        if a in SUPPORTED_ARCHITECTURES:
            return a
    if not archs and d.get("model_type") in _MODEL_TYPES:
        return _MODEL_TYPES[d["model_type"]]
    got = archs or d.get("model_type")
    raise ValueError(f"unsupported architecture {got!r}: hicache runs {', '.join(SUPPORTED_ARCHITECTURES)}")


def _check_supported(d: dict, arch: str, family: Family) -> None:
    if (d.get("attention_bias") and not family.qkv_bias) or d.get("mlp_bias"):
        raise ValueError(f"{arch} with attention or MLP biases is not supported")
    act, want = _activation(d, arch)
    if act != want:
        raise ValueError(f"hidden_act {act!r} is not supported for {arch} (only {want})")
    if d.get("use_bidirectional_attention") or d.get("attn_logit_softcapping") is not None:
        raise ValueError(f"{arch} with bidirectional attention or attention logit softcapping is not supported")
    if d.get("pretraining_tp", 1) not in (1, None):
        raise ValueError("pretraining_tp > 1 is not supported")
    if arch in _DEEPSEEK and d.get("quantization_config"):  # V3's published weights are FP8 blocks
        raise ValueError(f"{arch} with quantization_config {d['quantization_config'].get('quant_method')!r} is not "
                         "supported: convert the weights to bf16 first")
    if arch == "DeepseekV2ForCausalLM":
        _check_deepseek_v2(d)
    elif arch == "DeepseekV3ForCausalLM":
        _check_deepseek_v3(d)
    elif arch == "Qwen3NextForCausalLM" and _declared_rope_type(d) != "default":
        raise ValueError(f"Qwen3-Next with rope type {_declared_rope_type(d)!r} is not supported (only default)")
    elif _declared_rope_type(d) == "yarn":
        raise ValueError(f"rope type 'yarn' is supported for DeepSeek-V2/V3 only, not {arch}")


def _check_deepseek_v3(d: dict) -> None:
    """V3's routing is always noaux_tc (sigmoid scores, a correction bias, groups by their top two)."""
    if (d.get("scoring_func") or "sigmoid") != "sigmoid" or (d.get("topk_method") or "noaux_tc") != "noaux_tc":
        raise ValueError("DeepSeek-V3 routes by noaux_tc with sigmoid scores only, got topk_method "
                         f"{d.get('topk_method')!r}, scoring_func {d.get('scoring_func')!r}")
    if d.get("rope_interleave") is False:
        raise ValueError("DeepSeek-V3 with rope_interleave false is not supported")
    if int(d.get("moe_layer_freq") or 1) != 1:
        raise ValueError("DeepSeek-V3 with moe_layer_freq != 1 is not supported")


def _check_deepseek_v2(d: dict) -> None:
    method = d.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"DeepSeek-V2 topk_method {method!r} is not supported (greedy, group_limited_greedy)")
    if (d.get("scoring_func") or "softmax") != "softmax":
        raise ValueError(f"DeepSeek-V2 scoring_func {d['scoring_func']!r} is not supported (only softmax)")
    if d.get("norm_topk_prob"):  # transformers' DeepseekV2 ignores it, DeepSeek's own code renormalises
        raise ValueError("DeepSeek-V2 with norm_topk_prob is not supported")
    if int(d.get("moe_layer_freq") or 1) != 1:
        raise ValueError("DeepSeek-V2 with moe_layer_freq != 1 is not supported")


def _activation(d: dict, arch: str) -> tuple[str, str]:
    """(the config's MLP activation, the one our model of `arch` runs)."""
    if arch == "Gemma3ForCausalLM":
        return d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh", "gelu_pytorch_tanh"
    return d.get("hidden_act", "silu"), "silu"


def _window_fields(d: dict) -> dict:
    """The Llama family: a sliding window applies to every layer (Mistral's `sliding_window`; Qwen's
    configs name a window they do not use)."""
    window = d.get("sliding_window")
    if window is None or d.get("use_sliding_window") is False:
        return {}
    return {"sliding_window": int(window)}


def _gemma3_fields(d: dict) -> dict:
    """Gemma 3's fields beyond Llama's, with Gemma3TextConfig's defaults."""
    n = int(d["num_hidden_layers"])
    pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)
    types = d.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    if len(types) != n or set(types) - {SLIDING, FULL}:
        raise ValueError(f"layer_types must name {SLIDING} or {FULL} for each of the {n} layers, got {types}")
    local = (d.get("rope_parameters") or {}).get(SLIDING) or {}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"rope type {local['rope_type']!r} of the sliding layers is not supported (only default)")
    softcap = d.get("final_logit_softcapping")
    return {"hidden_act": "gelu_pytorch_tanh", "sliding_window": int(d.get("sliding_window") or 4096),
            "layer_types": tuple(types),
            "rope_local_theta": float(local.get("rope_theta") or d.get("rope_local_base_freq") or 10000.0),
            "query_pre_attn_scalar": float(d.get("query_pre_attn_scalar") or 256),
            "final_logit_softcapping": None if softcap is None else float(softcap)}


def _gemma3_global_rope(d: dict) -> dict:
    """The config with the global layers' RoPE in the Llama spelling (transformers 5.x nests it
    under rope_parameters.full_attention)."""
    params = d.get("rope_parameters") or {}
    if FULL not in params:
        return {**d, "rope_theta": d.get("rope_theta") or 1_000_000.0}
    return {**d, "rope_parameters": params[FULL], "rope_theta": params[FULL].get("rope_theta")}


def _sparse(d: dict, family: Family) -> bool:
    """Whether the model has routed experts (a Qwen3-Next config may have none)."""
    n = d.get("num_experts")
    return family.moe and (n is None or int(n) > 0)


def _moe(d: dict) -> MoEConfig:
    """Qwen-MoE spelling (num_experts, moe_intermediate_size, ...) or Mixtral's (num_local_experts,
    intermediate_size, always renormalised)."""
    if d.get("moe_intermediate_size") is None:
        return MoEConfig(int(d["num_local_experts"]), int(d["num_experts_per_tok"]), int(d["intermediate_size"]),
                         norm_topk_prob=True)
    return MoEConfig(
        num_experts=int(d.get("num_experts") or d["num_local_experts"]),
        top_k=int(d["num_experts_per_tok"]),
        intermediate_size=int(d["moe_intermediate_size"]),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        shared_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0),
        sparse_step=int(d.get("decoder_sparse_step") or 1),
        dense_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()),
    )


def _deepseek_fields(d: dict) -> dict:
    """DeepSeek-V2's attention: MLA, heads of qk_rope_head_dim for RoPE."""
    q_rank = d.get("q_lora_rank")
    mla = MLAConfig(None if q_rank is None else int(q_rank), int(d["kv_lora_rank"]), int(d["qk_nope_head_dim"]),
                    int(d["qk_rope_head_dim"]), int(d["v_head_dim"]))
    return {"mla": mla, "head_dim": mla.qk_rope_head_dim}


def _qwen3_next_fields(d: dict) -> dict:
    """Qwen3-Next's layer types (a full attention layer every `full_attention_interval` by
    default), its gated DeltaNet and the partial RoPE of its attention heads."""
    n = int(d["num_hidden_layers"])
    interval = int(d.get("full_attention_interval") or 4)
    types = tuple(d.get("layer_types") or (FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)))
    if len(types) != n or set(types) - {LINEAR, FULL}:
        raise ValueError(f"layer_types must name {LINEAR} or {FULL} for each of the {n} layers, got {list(types)}")
    linear = LinearAttentionConfig(int(d["linear_num_key_heads"]), int(d["linear_num_value_heads"]),
                                   int(d["linear_key_head_dim"]), int(d["linear_value_head_dim"]),
                                   int(d.get("linear_conv_kernel_dim") or 4))
    head_dim = int(d.get("head_dim") or int(d["hidden_size"]) // int(d["num_attention_heads"]))
    rope = {**(d.get("rope_parameters") or {}), **(d.get("rope_scaling") or {})}
    factor = float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25)))
    rotary = int(head_dim * factor)
    if rotary % 2 or not 0 < rotary <= head_dim:
        raise ValueError(f"partial_rotary_factor {factor} of head_dim {head_dim} gives an odd or empty rotary part")
    return {"layer_types": types, "linear": linear, "rotary_dim": rotary}


def _deepseek_moe(d: dict, arch: str) -> MoEConfig:
    """Routed experts after the first `first_k_dense_replace` dense layers, `n_shared_experts`
    ungated shared experts (one MLP of their summed width), group-limited routing and scaling;
    V3's routing by noaux_tc, its top-k weights renormalised when `norm_topk_prob`."""
    experts, inter = int(d.get("n_routed_experts") or d["num_experts"]), int(d["moe_intermediate_size"])
    v3 = arch == "DeepseekV3ForCausalLM"
    grouped = v3 or (d.get("topk_method") or "greedy") == "group_limited_greedy"
    return MoEConfig(
        num_experts=experts, top_k=int(d["num_experts_per_tok"]), intermediate_size=inter,
        norm_topk_prob=v3 and bool(d.get("norm_topk_prob", True)), routing="noaux_tc" if v3 else "softmax",
        shared_intermediate_size=inter * int(d.get("n_shared_experts") or 0),
        dense_layers=tuple(range(int(d.get("first_k_dense_replace") or 0))),
        routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
        num_groups=int(d.get("n_group") or 1) if grouped else 1,
        topk_groups=int(d.get("topk_group") or 1) if grouped else 1)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _moe_hf_keys(cfg: ModelConfig) -> dict:
    m = cfg.moe
    if m is None:
        return {}
    if cfg.architecture == "MixtralForCausalLM":
        return {"num_local_experts": m.num_experts, "num_experts_per_tok": m.top_k,
                "intermediate_size": m.intermediate_size}
    return {"num_experts": m.num_experts, "num_experts_per_tok": m.top_k, "moe_intermediate_size": m.intermediate_size,
            "norm_topk_prob": m.norm_topk_prob, "shared_expert_intermediate_size": m.shared_intermediate_size,
            "decoder_sparse_step": m.sparse_step, "mlp_only_layers": list(m.dense_layers)}


def _declared_rope_type(d: dict) -> str:
    merged = {**(d.get("rope_parameters") or {}), **(d.get("rope_scaling") or {})}
    return merged.get("rope_type") or merged.get("type") or "default"


def _rope(d: dict) -> tuple[float, dict | None]:
    params = dict(d.get("rope_parameters") or {})  # transformers 5.x
    scaling = dict(d.get("rope_scaling") or {})  # transformers 4.x
    merged = {**params, **scaling}
    theta = float(d.get("rope_theta") or merged.pop("rope_theta", None) or 10000.0)
    merged.pop("rope_theta", None)
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported ({', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        missing = [k for k in _LLAMA3_KEYS if k not in merged]
        if missing:
            raise ValueError(f"llama3 rope_scaling lacks {missing}")
    if rope_type == "linear" and "factor" not in merged:
        raise ValueError("linear rope_scaling lacks 'factor'")
    if rope_type == "yarn":
        if "original_max_position_embeddings" not in merged:
            raise ValueError("yarn rope_scaling lacks 'original_max_position_embeddings'")
        if merged.get("factor") is None:
            old = merged["original_max_position_embeddings"]
            merged["factor"] = float(d.get("max_position_embeddings", 2048)) / old
    return theta, {"rope_type": rope_type, **merged}
