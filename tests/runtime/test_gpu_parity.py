"""End to end on CUDA with the Triton backend (and FlashInfer's where it is installed), with prefix
hits from L1 and load-back from L2, with and without decode CUDA graphs (batches of 3 replay the 4-row graph
with a padding row). Skipped without CUDA.

- SmolLM2 (the default GGUF, when the cache folder holds it): greedy outputs equal HF
  transformers' on the same GGUF, in fp32 and bf16.
- A random Llama checkpoint saved by HF and read back by our safetensors loader: random weights
  fall into repetitive attractors where two tokens nearly tie, so there every token we pick must
  be HF's argmax given the same prefix, up to a tolerance (teacher forcing over our output).
"""
from __future__ import annotations

import copy
import random

import pytest
import torch

from hicache import Engine
from hicache.kernels import flashinfer
from hicache.runtime.attention import SplitAttention
from hicache.runtime.default_model import SMOLLM2, hicache_home

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
TritonAttention = pytest.importorskip("hicache.runtime.attention.triton").TritonAttention  # imports triton
FlashInferAttention = pytest.importorskip("hicache.runtime.attention.flashinfer").FlashInferAttention

VOCAB, NEW = 2048, 12
GREEDY = {"temperature": 0, "ignore_eos": True}


def hf_greedy(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            for _ in range(new):
                nxt = model(ids, use_cache=False).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            outs.append(ids[0, len(p):].tolist())
    return outs


def two_rounds(engine: Engine, prompts: list[list[int]], second: list[list[int]], new: int, filler: int,
               backends: tuple[type, type] = (TritonAttention, TritonAttention)):
    """Round 1; then unrelated prompts push everything out of L1 (L2 keeps it); then round 2."""
    first = engine.generate(input_ids=prompts, sampling_params=dict(GREEDY, max_new_tokens=new))
    for p in range(len(prompts)):
        engine.generate(input_ids=[[9 + p] * filler], sampling_params=dict(GREEDY, max_new_tokens=1))
    again = engine.generate(input_ids=second, sampling_params=dict(GREEDY, max_new_tokens=new))
    engine.check_integrity()
    attn = engine.scheduler.runner.attn  # "auto" was resolved when the engine was built
    prefill, decode = (attn.prefill, attn.decode) if isinstance(attn, SplitAttention) else (attn, attn)
    assert (type(prefill), type(decode)) == backends
    return first, again


def check_tiers(first: list[dict], again: list[dict], prefix: int) -> None:
    assert sum(o["meta_info"]["cached_tokens_details"]["device"] for o in first) > 0  # the shared prefix
    details = [o["meta_info"]["cached_tokens_details"] for o in again]
    assert sum(d["host"] for d in details) > 0, details  # loaded back from L2 (L1 may keep the hot prefix)
    assert all(d["device"] + d["host"] >= prefix for d in details), details


# ---- SmolLM2 --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
    path = hicache_home() / "models" / SMOLLM2.file_name
    if not path.exists():
        pytest.skip("the default GGUF is not in the cache folder (and no registry may be reachable)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=SMOLLM2.file_name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=SMOLLM2.file_name, dtype=torch.float32).eval()
    return path, model, tok


QUESTIONS = ["What is the capital of France?", "Name three prime numbers.", "Why is the sky blue?",
             "Write a haiku about the sea.", "How do I boil an egg?", "What is 12 times 7?"]


@pytest.mark.parametrize("dtype,page_size,graphs", [("float32", 1, True), ("bfloat16", 64, True),
                                                    ("bfloat16", 1, False)])
def test_smollm2_greedy_equals_hf(smollm2, dtype, page_size, graphs):
    """fp32: the same tokens as HF. bf16 against HF's bf16: two bf16 computations round
    differently, so where HF itself nearly ties they may part; every token we pick must then be
    HF's argmax given our prefix, within 2% of the logit range."""
    path, hf_cpu, tok = smollm2
    system = "You are a careful assistant. " + " ".join(f"Rule {i}: answer briefly and exactly." for i in range(40))
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in QUESTIONS]
    prompts = [list(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
               for c in chats]
    second = [p + tok(" Answer again.").input_ids for p in prompts]
    with Engine(str(path), dtype=dtype, page_size=page_size, max_total_tokens=1536, hicache_ratio=8.0,
                max_running_requests=4, chunked_prefill_size=256, disable_cuda_graph=not graphs,
                attention_backend="triton") as engine:
        first, again = two_rounds(engine, prompts, second, 16, filler=700)
        assert (engine.scheduler.runner.graphs is not None) == graphs
    check_tiers(first, again, prefix=256)
    hf = copy.deepcopy(hf_cpu).to("cuda", getattr(torch, dtype))  # Module.to() is in place: a bf16 pass
    # on the shared fixture model would leave its fp32 weights rounded for the tests after it
    try:
        if dtype == "float32":
            assert [o["output_ids"] for o in first] == hf_greedy(hf, prompts, 16)
            assert [o["output_ids"] for o in again] == hf_greedy(hf, second, 16)
        else:
            assert_hf_argmax(hf, prompts, [o["output_ids"] for o in first], 2e-2)
            assert_hf_argmax(hf, second, [o["output_ids"] for o in again], 2e-2)
    finally:
        del hf


# ---- random weights -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(folder, HF model on CPU fp32): 4 layers, 8 query / 2 KV heads of 64, random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                      rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(torch.seed() % 2**31)
    model = LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("llama") / "model"
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def assert_hf_argmax(model, prompts: list[list[int]], outs: list[list[int]], rel_tol: float) -> None:
    """Each token of outs[i] is HF's argmax after prompts[i] + outs[i][:t], or within rel_tol x
    the logit range of it (a near tie)."""
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            logits = model(torch.tensor([p + o], device="cuda"), use_cache=False).logits[0, len(p) - 1:-1].float()
            best = logits.max(-1).values
            mine = logits.gather(1, torch.tensor(o, device="cuda")[:, None])[:, 0]
            spread = logits.max() - logits.min()
            assert bool((best - mine <= rel_tol * spread).all()), (best - mine) / spread


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("page_size,layout,graphs,io", [(1, "layer_first", True, "kernel"),
                                                        (64, "page_first", True, "kernel"),
                                                        (64, "layer_first", False, "kernel"),
                                                        (64, "layer_first", True, "direct"),
                                                        (16, "page_first", False, "direct")])
def test_random_weights_pick_hf_argmax(checkpoint, dtype, page_size, layout, graphs, io):
    run_random_weights(checkpoint, dtype, page_size, layout, graphs, io, "triton", (TritonAttention, TritonAttention))


@pytest.mark.skipif(not flashinfer.available(), reason="needs flashinfer")
@pytest.mark.parametrize("page_size,layout,graphs,io", [(1, "layer_first", True, "direct"),
                                                        (64, "page_first", True, "kernel"),
                                                        (16, "layer_first", False, "direct")])
def test_random_weights_pick_hf_argmax_flashinfer(checkpoint, page_size, layout, graphs, io):
    """The same with FlashInfer's kernels (bf16: they take no fp32), and with what "auto" picks when
    it is installed: FlashInfer's for prefill and extend, Triton's for decode."""
    fi = FlashInferAttention
    run_random_weights(checkpoint, "bfloat16", page_size, layout, graphs, io, "flashinfer", (fi, fi))
    run_random_weights(checkpoint, "bfloat16", page_size, layout, graphs, io, "auto", (fi, TritonAttention))


def run_random_weights(checkpoint, dtype, page_size, layout, graphs, io, backend, backend_classes):
    path, hf_cpu = checkpoint
    rng = random.Random(page_size)
    system = [rng.randrange(3, VOCAB) for _ in range(300)]
    prompts = [system + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(5, 200))] for _ in range(6)]
    second = [p + [5, 6, 7] for p in prompts]
    with Engine(str(path), load_format="safetensors", dtype=dtype, page_size=page_size, hicache_mem_layout=layout,
                max_total_tokens=1280, hicache_ratio=8.0, max_running_requests=4, chunked_prefill_size=256,
                disable_cuda_graph=not graphs, hicache_io_backend=io, attention_backend=backend) as engine:
        first, again = two_rounds(engine, prompts, second, NEW, filler=600, backends=backend_classes)
        assert (engine.scheduler.runner.graphs is not None) == graphs
    hf = copy.deepcopy(hf_cpu).to("cuda", getattr(torch, dtype))  # Module.to() is in place: a bf16 pass
    # on the shared fixture model would leave its fp32 weights rounded for the tests after it
    tol = 1e-4 if dtype == "float32" else 2e-2
    assert_hf_argmax(hf, prompts, [o["output_ids"] for o in first], tol)
    assert_hf_argmax(hf, second, [o["output_ids"] for o in again], tol)
    check_tiers(first, again, prefix=256)


# ---- sliding windows ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma3_checkpoint(tmp_path_factory):
    """(folder, HF model on CPU fp32): a Gemma 3 of 4 layers, windowed (32 keys) and global in
    turn, 4 query / 1 KV heads of 64 (a head size FlashInfer builds), random weights."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=64, sliding_window=32,
                           sliding_window_pattern=2, query_pre_attn_scalar=64, max_position_embeddings=4096,
                           bos_token_id=1, eos_token_id=2)
    torch.manual_seed(torch.seed() % 2**31)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    path = tmp_path_factory.mktemp("gemma3") / "model"
    model.save_pretrained(path, safe_serialization=True)
    return path, model


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_sliding_window_model_picks_hf_argmax(gemma3_checkpoint, backend):
    """Prompts past the window, prefill in chunks, decode in CUDA graphs, then longer prompts over
    the cached prefixes loaded back from L2: every token HF's argmax or a near tie (bf16)."""
    if backend == "flashinfer" and not flashinfer.available():
        pytest.skip("needs flashinfer")
    path, hf_cpu = gemma3_checkpoint
    rng = random.Random(7)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(40, 300))] for _ in range(5)]
    second = [p + [5, 6, 7] for p in prompts]
    cls = FlashInferAttention if backend == "flashinfer" else TritonAttention
    with Engine(str(path), load_format="safetensors", dtype="bfloat16", page_size=16, max_total_tokens=1024,
                hicache_ratio=8.0, max_running_requests=4, chunked_prefill_size=128, attention_backend=backend,
                decode_attention_backend=backend) as engine:
        first, again = two_rounds(engine, prompts, second, NEW, filler=600, backends=(cls, cls))
    hf = copy.deepcopy(hf_cpu).to("cuda", torch.bfloat16)
    try:
        assert_hf_argmax(hf, prompts, [o["output_ids"] for o in first], 2e-2)
        assert_hf_argmax(hf, second, [o["output_ids"] for o in again], 2e-2)
    finally:
        del hf
