"""Gemma 3 and sliding windows, end to end on tiny random models built by HF transformers
(`from_config`, saved as safetensors), fp32 on CPU: greedy outputs equal HF's, batched, with
chunked prefill, retractions, radix hits and load-backs from L2 that skip the windowed layers'
KV before the window (hicache/window.py). Also Mistral's sliding window, and a
tiny Gemma 3 written as a GGUF file.
The real Gemma 3 270M GGUF is checked in test_gemma3_gguf.py."""
from __future__ import annotations

import random

import pytest
import torch
from test_hicache_l2 import GREEDY, drain, request

from families import write_gguf
from golden.regenerate import greedy
from hicache.config import HiCacheConfig
from hicache.runtime.build import build_scheduler
from hicache.runtime.config import RuntimeConfig
from hicache.runtime.model_config import ModelConfig
from hicache.runtime.models import get_model_class
from hicache.runtime.weights.gguf import GGUFCheckpoint

WINDOW, VOCAB, NEW = 8, 512, 6


def tiny_hf(kind: str, **options):
    """A tiny HF model of `kind` with a sliding window of WINDOW tokens, weights scaled up from
    HF's init so that the outputs depend on every part of the model."""
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=WINDOW,
                  max_position_embeddings=1024, eos_token_id=1, bos_token_id=2) | options
    cls = transformers.Gemma3TextConfig if kind == "gemma3" else transformers.MistralConfig
    model = transformers.AutoModelForCausalLM.from_config(cls(**common), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.5 if "norm" in name else 0.2)
    return model


def save_tiny(kind: str, folder):
    options = dict(sliding_window_pattern=2, query_pre_attn_scalar=24, final_logit_softcapping=30.0)
    model = tiny_hf(kind, **options if kind == "gemma3" else {})
    model.save_pretrained(str(folder))
    return model


def scheduler(folder, total=96, runtime=(), **cache):
    rc = RuntimeConfig(model_path=str(folder), max_total_tokens=total, max_running_requests=6,
                       chunked_prefill_size=16, max_prefill_tokens=32, **dict(runtime))
    return build_scheduler(rc, HiCacheConfig(page_size=4, hicache_ratio=8.0, hicache_storage_backend="none", **cache))


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3")
    return folder, save_tiny("gemma3", folder)


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def run(sched, batch: list[list[int]], tag: str) -> dict:
    for i, p in enumerate(batch):
        sched.add_request(request(f"{tag}{i}", p, dict(GREEDY, max_new_tokens=NEW)))
    return drain(sched)


def test_config_reads_layer_types_and_windows(gemma):
    cfg = ModelConfig.from_json_file(gemma[0])
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.layer_windows == (WINDOW, None, WINDOW, None)
    assert cfg.attn_scale == 24 ** -0.5 and cfg.final_logit_softcapping == 30.0 and cfg.rope_local_theta == 10000.0


def test_batched_chunked_retracted_then_from_host_match_hf(gemma):
    """Round 1: prompts past the window together in a small L1 (chunked prefill, retractions);
    round 2: each prompt extended, its prefix served from the radix tree, loaded back from L2."""
    two_rounds(*gemma, scheduler(gemma[0]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("io", ["none", "direct", "kernel"])
def test_windowed_pool_on_cuda_matches_hf(gemma, io):
    """The CUDA path over the windowed layers' own pool, fp32: the Triton store, extend and decode
    kernels and the decode CUDA graphs reading translated slots; with an L2 (`io`: its copy
    backend), backups, windowed load-backs and window repairs through the window map."""
    runtime = dict(device="cuda", dtype="float32", attention_backend="triton")
    cache = dict(hierarchical_cache=False) if io == "none" else dict(hicache_io_backend=io)
    two_rounds(*gemma, scheduler(gemma[0], runtime=runtime, **cache), host=io != "none")
    branch_after_tombstones(*gemma, scheduler(gemma[0], 256, runtime, **cache), host=io != "none")


def two_rounds(folder, hf, sched, host: bool = True):
    """Six prompts past the window, then each extended and two ending inside others' prefixes:
    greedy outputs equal HF's; with `host`, some prefixes came back from L2, moving fewer bytes
    than every layer's KV of their tokens."""
    first = prompts(1, (5, 20, 33, 40, 27, 12))
    # each prompt extended, and two ending inside prefixes that others load back at the same time
    second = [p + [7, 8, 9, 10, 11] for p in first] + [first[3][:21], first[2][:14] + [5]]
    got1, got2 = run(sched, first, "a"), run(sched, second, "b")
    for i, p in enumerate(first):
        assert got1[f"a{i}"][0] == greedy(hf, p, NEW)[0], i
    for i, p in enumerate(second):
        assert got2[f"b{i}"][0] == greedy(hf, p, NEW)[0], i
    stats = sched.stats()
    assert stats["retractions"] > 0, stats
    if not host:
        return
    host = stats["tiers"]["host"]
    assert host["loaded_back_tokens"] > 0, stats
    assert sum(got2[f"b{i}"][1]["cached_tokens"] for i in range(len(first))) > 0
    # the windowed layers skipped what no continuation reads: fewer bytes than whole tokens
    assert host["loaded_back_bytes"] < host["loaded_back_tokens"] * host["bytes_per_token"], host


def test_mistral_sliding_window_matches_hf(tmp_path):
    hf = save_tiny("mistral", tmp_path)
    assert ModelConfig.from_json_file(tmp_path).layer_windows == (WINDOW,) * 4
    batch = prompts(2, (30, 11))
    got = run(scheduler(tmp_path), batch, "m")
    for i, p in enumerate(batch):
        assert got[f"m{i}"][0] == greedy(hf, p, NEW)[0], i


def test_gguf_loads_as_hf(tmp_path):
    """The gemma3 GGUF loader (llama.cpp's names, norms stored plus one, q/k rows as HF's) on a
    tiny model written as llama.cpp's converter lays it out: the same config and weights as from
    HF's model (whose outputs the tests above check). A GGUF leaves out the layer pattern, local
    RoPE base and attention scale: Gemma3TextConfig's defaults (1 global layer in 6)."""
    hf = tiny_hf("gemma3", num_hidden_layers=6)
    ckpt = GGUFCheckpoint(write_gguf(hf, tmp_path / "gemma3.gguf", "gemma3"))
    want = ModelConfig.from_hf_config(hf.config.to_dict())
    fields = ("architecture", "layer_windows", "attn_scale", "rope_theta", "rope_local_theta", "head_dim",
              "hidden_act", "qk_norm", "final_logit_softcapping", "tie_word_embeddings")
    assert [getattr(ckpt.config, f) for f in fields] == [getattr(want, f) for f in fields]
    assert ckpt.config.layer_windows == (WINDOW,) * 5 + (None,)
    assert ckpt.config.rms_norm_eps == pytest.approx(want.rms_norm_eps)  # stored as float32
    got, ref = get_model_class(ckpt.config.architecture)(ckpt.config), get_model_class(want.architecture)(want)
    got.check_loaded(got.load_weights(ckpt.tensors()))
    ref.check_loaded(ref.load_weights(hf.state_dict().items()))
    for (name, a), b in zip(got.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def window_held(sched) -> list[int]:
    """Per running request: its own slots that hold their window part (windowed layers' KV)."""
    alloc = sched.cache.allocator
    return [int(alloc.window_present(r.lease.slots[r.lease.prefix_len:]).sum()) for r in sched.running]


@pytest.mark.parametrize("kind", ["gemma3", "mistral"])
def test_window_parts_dropped_multi_turn_match_hf(gemma, tmp_path, kind):
    """Without an L2, a running request gives back the window parts of its pages older than
    its last W tokens as it goes (it then holds at most W + a chunk + a page of them), and a
    finished one leaves tombstones before its last W tokens. The next turn matches across those
    tombstones, and every output equals HF's (Mistral: every layer windowed, no global pool)."""
    folder, hf = gemma if kind == "gemma3" else (tmp_path, save_tiny("mistral", tmp_path))
    sched = scheduler(folder, total=256, hierarchical_cache=False)
    assert sched.runner.pool.window_layers == {i for i, w in enumerate(sched.runner.pool.k_buffers)
                                               if w.shape[0] == sched.runner.pool.window_slots}
    first = prompts(3, (30, 41, 17))
    turns, peak = [first, []], 0
    for turn, batch in enumerate(turns):
        for i, p in enumerate(batch):
            sched.add_request(request(f"t{turn}{i}", p, dict(GREEDY, max_new_tokens=NEW)))
        got = {}
        while sched.has_work():
            for o in sched.step():
                got.setdefault(o.rid, [[], None])[0].extend(o.new_token_ids)
                got[o.rid][1] = o.meta
            sched.check_integrity()
            peak = max([peak, *window_held(sched)])
        for i, p in enumerate(batch):
            assert got[f"t{turn}{i}"][0] == greedy(hf, p, NEW)[0], (turn, i)
        if turn == 0:
            turns[1] = [p + got[f"t0{i}"][0] + [9, 10, 11] for i, p in enumerate(first)]
            tree_slots = torch.cat([n.device_slots for n in sched.cache.tree.nodes()])
            assert not bool(sched.cache.allocator.window_present(tree_slots).all())  # tombstones
    assert peak <= WINDOW + 16 + 4, peak
    assert all(got[f"t1{i}"][1]["cached_tokens"] >= len(p) - WINDOW for i, p in enumerate(first))


@pytest.mark.parametrize("host,overlap", [(True, False), (True, True), (False, True)])
def test_branches_inside_tombstoned_prefixes_match_hf(gemma, host, overlap):
    """Prompts that share a 60-token prefix and branch inside it, in a small L1 (retractions):
    with an L2 a branch whose window lies in tombstones gets it back from L2 (a retracted request
    finds what it computed again), without one it recomputes it. Every output equals HF's, with
    overlap scheduling too (without an L2: window parts given back while the next step runs)."""
    folder, hf = gemma
    rng = random.Random(5)
    base = [rng.randrange(3, VOCAB) for _ in range(60)]
    batch = [base + [rng.randrange(3, VOCAB) for _ in range(k)] for k in (3, 9, 14, 0)] + prompts(7, (33, 50))
    sched = scheduler(folder, total=160, runtime=dict(overlap_schedule=overlap),
                      hierarchical_cache=host)
    got = run(sched, batch, "s")
    for i, p in enumerate(batch):
        assert got[f"s{i}"][0] == greedy(hf, p, NEW)[0], i
    assert sched.stats()["retractions"] > 0


@pytest.mark.parametrize("host", [True, False])
def test_branch_inside_tombstones_repaired_from_l2_matches_hf(gemma, host):
    """A finished 70-token request leaves tombstones before its last W tokens, whose window slots
    another request reuses; a prompt that branches off at token 40 finds those 40 tokens cached
    with an L2 (the window parts of tokens 32..39 come back from their L2 copies), none without;
    both outputs equal HF's."""
    branch_after_tombstones(*gemma, scheduler(gemma[0], total=256, hierarchical_cache=host), host)


def branch_after_tombstones(folder, hf, sched, host: bool) -> None:
    rng = random.Random(11)  # (a branch whose greedy output depends on that window)
    base = [rng.randrange(3, VOCAB) for _ in range(70)]
    branch = base[:40] + [rng.randrange(3, VOCAB) for _ in range(9)]
    filler = prompts(10, (60,))  # computed in between, over the window slots the tombstones gave back
    got = {**run(sched, [base], "a"), **run(sched, filler, "f"), **run(sched, [branch], "b")}
    assert got["a0"][0] == greedy(hf, base, NEW)[0] and got["b0"][0] == greedy(hf, branch, NEW)[0]
    assert got["b0"][1]["cached_tokens"] == (40 if host else 0)
