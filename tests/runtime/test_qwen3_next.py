"""Qwen3-Next (gated DeltaNet layers with a recurrent state, gated attention layers, Qwen2-MoE's
MLP) against HF transformers (fp32, CPU; HF's torch chunked and recurrent delta rules are the
oracle), on a tiny random model built by HF from a Qwen3NextConfig: three linear-attention layers,
then one attention layer, MoE on every other layer. The L1 KV pool holds the attention layer
only; the recurrent states live in the state pool, with snapshots at page boundaries in the radix
tree, so that a cached prefix restores the state instead of recomputing it."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engines import greedy, make_engine, run_together
from families import hf_greedy, save_folder
from hicache.config import HiCacheConfig
from hicache.recurrent import StateSlots
from hicache.runtime.attention.reference import TorchAttention
from hicache.runtime.batch import ForwardBatch, RecurrentBatch
from hicache.runtime.build import build_scheduler
from hicache.runtime.config import RuntimeConfig
from hicache.runtime.model_config import ModelConfig
from hicache.runtime.tokenizer import load_tokenizer
from hicache.runtime.weights import load_model
from hicache.tiers.gpu.pool import DeviceKVPool
from hicache.tiers.gpu.state import RecurrentStatePool

VOCAB = 49152  # the default model's tokenizer
PAGE = 4
NEW_TOKENS = 8
LOGIT_TOL = 1e-4
_CONFIG = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               vocab_size=VOCAB, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, intermediate_size=96,
               moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=48,
               decoder_sparse_step=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
               linear_value_head_dim=8, linear_conv_kernel_dim=4,
               layer_types=["linear_attention"] * 3 + ["full_attention"])


def hf_qwen3_next(seed: int = 0) -> torch.nn.Module:
    """HF's Qwen3-Next with random weights (norms' (1 + weight) around 1; A_log as HF draws it)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3NextConfig(**_CONFIG)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                continue
            p.normal_(1.0 if name.endswith("linear_attn.norm.weight") else 0.0, 0.1)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_path) -> tuple[torch.nn.Module, Path]:
    model = hf_qwen3_next()
    return model, save_folder(model, tmp_path_factory.mktemp("qwen3_next"), load_tokenizer(default_model_path))


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def _state_pool(cfg: ModelConfig, slots: int) -> RecurrentStatePool:
    lin = cfg.linear
    return RecurrentStatePool(slots, len(cfg.recurrent_layers), (lin.conv_dim, lin.conv_kernel - 1),
                              (lin.num_value_heads, lin.key_head_dim, lin.value_head_dim), torch.float32, "cpu")


def test_logits_match_hf_through_chunks_decode_and_a_snapshot(tiny):
    """A 30-token chunk, a chunk of 8 continuing its state (which takes the snapshot at the page
    boundary after token 36), a decode step: HF's logits. Then the snapshot alone, restored into
    a fresh slot, continues from token 36 to HF's logits too."""
    hf, folder = tiny
    loaded = load_model(folder)
    model, cfg = loaded.model, loaded.config
    assert (cfg.recurrent_layers, cfg.kv_layers, cfg.rotary_dim) == ((0, 1, 2), 1, 4)
    ids = _prompts(1, (44,))[0]
    pool = DeviceKVPool(256, 1, cfg.kv_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    states = _state_pool(cfg, 3)
    attn = TorchAttention(cfg.head_dim, cfg.attn_scale)
    slots = torch.randperm(256)[: len(ids)]

    def logits(start: int, end: int, slot: int = 0, mode: str = "extend") -> torch.Tensor:
        batch = ForwardBatch(mode, attn, pool, slots[start:end], [end - start], [slots[:end]],
                             slot_table=slots[:end][None], seq_lens=torch.tensor([end]))
        targets = StateSlots(slot, 1, 1).targets(start, end - start, 12)  # the state at the last multiple of 12
        batch.states = RecurrentBatch.build(states, [slot], [targets], "cpu")
        return model.compute_logits(model(torch.tensor(ids[start:end]), torch.arange(start, end), batch))

    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = torch.cat([logits(0, 30), logits(30, 38), logits(38, 39, mode="decode")])
    assert (got - ref[:39]).abs().max().item() < LOGIT_TOL
    states.copy(1, 2)  # the snapshot after token 36 (page 12: the last boundary of the chunk 30..38)
    assert (logits(36, 44, slot=2) - ref[36:44]).abs().max().item() < LOGIT_TOL


def test_engine_greedy_matches_hf_batched_and_chunked(tiny):
    """Four prompts at once, prefill in chunks of 16 (each chunk continuing its request's state),
    decode batched; then the same prompts again, their prefixes and states from the tree."""
    hf, folder = tiny
    prompts = _prompts(2, (5, 23, 41, 30))
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    with make_engine(folder, max_total_tokens=1024, page_size=PAGE, chunked_prefill_size=16,
                     max_running_requests=8) as engine:
        for _ in range(2):
            outs = engine.generate(input_ids=prompts, sampling_params=greedy(NEW_TOKENS))
            assert [o["output_ids"] for o in outs] == want
            engine.check_integrity()
        device = engine.get_stats()["tiers"]["device"]
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [(len(p) - 1) // PAGE * PAGE for p in prompts]  # 4, 20, ..
    assert device["snapshots"] >= 4 and device["restored_tokens"] == sum(o["meta_info"]["cached_tokens"] for o in outs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_on_cuda_matches_hf(tiny):
    """The recurrent layers and the state pool on CUDA, fp32: HF's greedy tokens, then the same
    prompts again restoring their states from the tree's snapshots."""
    hf, folder = tiny
    prompts = _prompts(7, (9, 27, 33))
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    with make_engine(folder, device="cuda", dtype="float32", max_total_tokens=1024, page_size=PAGE,
                     chunked_prefill_size=16) as engine:
        for _ in range(2):
            outs = engine.generate(input_ids=prompts, sampling_params=greedy(NEW_TOKENS))
            assert [o["output_ids"] for o in outs] == want
            engine.check_integrity()
        assert engine.get_stats()["tiers"]["device"]["restored_tokens"] > 0


def _scheduler(folder: Path, hicache_ratio: float = 2.0, **options):
    rc = RuntimeConfig(model_path=str(folder), **{"max_total_tokens": 512, "max_running_requests": 4,
                                                  "chunked_prefill_size": 16, **options})
    return build_scheduler(rc, HiCacheConfig(page_size=PAGE, hicache_storage_backend="none", hicache_ratio=hicache_ratio,
                                             hicache_load_decision="always"))


def _run(sched, tag: str, prompts: list[list[int]], **sampling) -> list[tuple[list[int], dict]]:
    return run_together(sched, tag, prompts, VOCAB, NEW_TOKENS, **sampling)


def test_conversation_turn_two_restores_the_state(tiny):
    """Turn 2 (turn 1's prompt and answer, then a new user turn) resumes from the snapshot at the
    last page boundary turn 1 computed: it recomputes only the new turn's tokens plus the partial
    page before them, and its greedy answer is HF's on the whole conversation. A third request
    that shares only part of a cached node (no snapshot where its match ends) is cut back to the
    root and recomputes everything, still with HF's answer."""
    hf, folder = tiny
    turn1 = _prompts(3, (42,))[0]
    answer = hf_greedy(hf, turn1, NEW_TOKENS)
    turn2 = turn1 + answer + _prompts(4, (13,))[0]
    sched = _scheduler(folder)
    try:
        assert _run(sched, "t1", [turn1])[0][0] == answer
        before = sched.stats()["tokens"]["prompt"]
        out, meta = _run(sched, "t2", [turn2])[0]
        recomputed = sched.stats()["tokens"]["prompt"] - before
        branch = turn1[:21] + _prompts(5, (9,))[0]
        out3, meta3 = _run(sched, "t3", [branch])[0]
        device = sched.stats()["tiers"]["device"]
    finally:
        sched.close()
    computed1 = len(turn1) + NEW_TOKENS - 1  # turn 1's last answer token was never fed back
    assert meta["cached_tokens"] == computed1 // PAGE * PAGE == 48
    assert recomputed == len(turn2) - meta["cached_tokens"] == 13 + 1 + computed1 % PAGE
    assert out == hf_greedy(hf, turn2, NEW_TOKENS)
    assert meta3["cached_tokens"] == 0 and out3 == hf_greedy(hf, branch, NEW_TOKENS)
    assert device["restored_tokens"] == 48


@pytest.mark.parametrize("overlap", [False, True])
def test_retraction_and_snapshot_eviction(tiny, overlap):
    """An L1 pool too small for four requests' outputs retracts some (their pages and their
    boundary states go to the tree, and they resume from there), and a state pool of 14 slots for
    four running requests (three each) evicts snapshots as others come: HF's outputs throughout,
    then a second round resuming from what survived; with and without overlap scheduling."""
    hf, folder = tiny
    first = _prompts(6, (37, 22, 45, 30))
    second = [p + t for p, t in zip(first, _prompts(7, (5, 3, 6, 4)))]
    pool = (sum(-(-len(p) // PAGE) for p in first) + len(first) + 1) * PAGE
    sched = _scheduler(folder, max_total_tokens=pool, max_mamba_cache_size=14, schedule_conservativeness=0,
                       overlap_schedule=overlap)
    try:
        for tag, prompts in (("a", first), ("b", second)):
            outs = _run(sched, tag, prompts)
            assert [o for o, _ in outs] == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
        stats = sched.stats()
    finally:
        sched.close()
    assert stats["retractions"] > 0, stats
    assert stats["tiers"]["device"]["snapshots_evicted"] > 0, stats["tiers"]["device"]
    assert stats["tiers"]["device"]["restored_tokens"] > 0, stats["tiers"]["device"]


def test_overlapped_step_past_a_stop_leaves_no_wrong_snapshot(tiny):
    """Under overlap scheduling a request that stops at step t has its next position computed by
    the continuation, which here reaches a page boundary and overwrites the state slot of its last
    boundary: that state is past the KV the request caches, so no node keeps it, and the next turn
    resumes from an earlier snapshot with HF's answer."""
    hf, folder = tiny
    prompt = _prompts(12, (41,))[0]
    full = hf_greedy(hf, prompt, NEW_TOKENS)
    k = 2  # the continuation computes output k, position 43: the page boundary at 44 is reached
    assert (len(prompt) + k + 1) % PAGE == 0 and full[k] not in full[:k]
    sched = _scheduler(folder, overlap_schedule=True)
    try:
        (out, _), = _run(sched, "o", [prompt], ignore_eos=False, stop_token_ids=[full[k]])
        assert out == full[:k + 1]
        turn2 = prompt + out + _prompts(13, (7,))[0]
        (out2, meta), = _run(sched, "p", [turn2])
    finally:
        sched.close()
    assert out2 == hf_greedy(hf, turn2, NEW_TOKENS)
    assert meta["cached_tokens"] == (len(prompt) - 1) // PAGE * PAGE == 40  # the prompt's snapshot (its resume point)


def test_shared_prompt_published_while_prefilling(tiny):
    """Three requests with one 70-token prompt at once: two wait while the first computes it in
    chunks, which publishes its pages with the state at their end and at the last page boundary
    before the prompt's last token; they resume there (68 tokens) with HF's answers."""
    hf, folder = tiny
    shared = _prompts(11, (70,))[0]
    prompts = [shared, shared, shared + [5, 6]]
    sched = _scheduler(folder)
    try:
        outs = _run(sched, "s", prompts)
    finally:
        sched.close()
    assert [o for o, _ in outs] == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert sorted(m["cached_tokens"] for _, m in outs) == [0, 68, 68]


def test_config_and_refusals(tiny):
    _, folder = tiny
    cfg = ModelConfig.from_json_file(folder)
    assert cfg.linear.conv_dim == 2 * 2 * 16 + 4 * 8 and cfg.moe.sparse_step == 2
    d = {**_CONFIG, "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next"}
    assert ModelConfig.from_hf_config({**d, "num_experts": 0}).moe is None
    default = {k: v for k, v in d.items() if k != "layer_types"} | {"num_hidden_layers": 8}
    assert ModelConfig.from_hf_config(default).recurrent_layers == (0, 1, 2, 4, 5, 6)
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf_config({**d, "layer_types": ["linear_attention", "sliding_attention"] * 2})
    with pytest.raises(ValueError, match="rope type"):
        ModelConfig.from_hf_config({**d, "rope_parameters": {"rope_type": "linear", "factor": 2.0}})
    with pytest.raises(ValueError, match="max_mamba_cache_size"):
        _scheduler(folder, max_mamba_cache_size=12)
    with pytest.raises(ValueError, match="recurrent"):
        _scheduler(folder, speculative_algorithm="NGRAM")


def test_turn_two_after_l1_eviction_loads_back_from_l2(tiny):
    """Turn 1's pages are evicted from L1 by other requests (their L2 copies stay, and so does the
    snapshot, on L1): turn 2 loads the pages back from L2 up to the snapshot's node, restores the
    state there, and answers as HF does."""
    hf, folder = tiny
    turn1 = _prompts(8, (42,))[0]
    answer = hf_greedy(hf, turn1, NEW_TOKENS)
    turn2 = turn1 + answer + _prompts(9, (6,))[0]
    sched = _scheduler(folder, max_total_tokens=96, hicache_ratio=8.0)
    try:
        assert _run(sched, "t1", [turn1])[0][0] == answer
        for i, other in enumerate(_prompts(10, (60, 60))):
            _run(sched, f"o{i}", [other])
        out, meta = _run(sched, "t2", [turn2])[0]
        stats = sched.stats()
    finally:
        sched.close()
    assert meta["cached_tokens_details"]["host"] > 0 and meta["cached_tokens"] == 48, meta
    assert out == hf_greedy(hf, turn2, NEW_TOKENS)
    assert stats["tiers"]["host"]["loaded_back_tokens"] > 0, stats["tiers"]["host"]
