"""Unit tests of the server's parts that need no server: detokenizer, IPC codec, CLI flags,
metrics rendering, stats table."""
from __future__ import annotations

import ctypes
import dataclasses

import msgpack
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hicache.config import HiCacheConfig
from hicache.runtime.config import RuntimeConfig
from hicache.runtime.messages import AbortRequest, GenerateRequest, TokenOutput
from hicache.runtime.sampling import SamplingParams
from hicache.server import scheduler_process, stats_cli
from hicache.server.cli import build_parser
from hicache.server.config import ServerConfig
from hicache.server.detokenizer import IncrementalDetokenizer, StopStringBuffer
from hicache.server.flags import config_from_args
from hicache.server.ipc import ControlReply, ControlRequest, SchedulerFailed, SchedulerReady, pack, unpack
from hicache.server.metrics import ServerMetrics

TRICKY = ["héllo wörld", "emoji 😀🎉👩‍👩‍👧 end", "中文测试，世界你好。", "mixed: 日本語 and 한국어 ✓", "  spaces  \n\ttabs"]


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    from hicache.runtime.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path)


# ---- detokenizer ----------------------------------------------------------------------------


@pytest.mark.parametrize("text", TRICKY)
def test_detokenizer_one_token_at_a_time_never_splits_a_character(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([t]) for t in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == detok.text


def test_detokenizer_multi_byte_char_waits_for_all_its_tokens(tokenizer):
    ids = tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE splits the emoji: the interesting case
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == "😀"


def test_detokenizer_in_uneven_batches(tokenizer):
    text = " ".join(TRICKY)
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    out, i, step = [], 0, 1
    while i < len(ids):
        out.append(detok.add(ids[i:i + step]))
        i, step = i + step, step % 3 + 1
    out.append(detok.flush())
    assert "".join(out) == tokenizer.decode(ids)


def test_detokenizer_flush_releases_incomplete_tail(tokenizer):
    ids = tokenizer.encode("a😀", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(ids[:-1]) == ""  # ends mid-character: held back
    assert detok.flush() == tokenizer.decode(ids[:-1])  # the request ended: release it as rendered


def test_detokenizer_skips_special_tokens(tokenizer):
    ids = tokenizer.encode("Hi", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert IncrementalDetokenizer(tokenizer).add(ids) == "Hi"
    assert IncrementalDetokenizer(tokenizer, skip_special_tokens=False).add(ids).endswith(tokenizer.eos_token)


def test_detokenizer_without_tokenizer_yields_no_text():
    d = IncrementalDetokenizer(None)
    assert d.add([1, 2, 3]) == "" and d.flush() == ""


def test_stop_buffer_holds_back_possible_stop_prefix():
    buf = StopStringBuffer(["STOP"])
    assert buf.push("hello S") == "hello "
    assert buf.push("T") == ""
    assert buf.push("x") == "STx"  # not a stop after all: released
    assert buf.push(" ST") == " "
    assert buf.finish("STOP") == "ST"  # finished without the stop string in the text: all released


def test_stop_buffer_cuts_at_matched_stop():
    buf = StopStringBuffer(["</s>", "\n\n"])
    out = buf.push("answer</") + buf.push("s> tail")
    assert out == "answer"
    assert buf.finish("</s>") == "" and buf.final_text == "answer"
    keep = StopStringBuffer(["END"])
    assert keep.push("abc") + keep.push("END") + keep.finish("END", trim=False) == "abcEND"


def test_stop_buffer_without_stops_passes_through():
    buf = StopStringBuffer()
    assert buf.push("abc") == "abc" and buf.finish(None) == ""


# ---- IPC codec ------------------------------------------------------------------------------


MESSAGES = [
    GenerateRequest(rid="r1", input_ids=[1, 2, 3], sampling_params=SamplingParams(temperature=0.5, stop=("x",), seed=7),
                    return_logprob=True, top_logprobs_num=2, cache_salt="tenant"),
    AbortRequest(rid="r1"),
    TokenOutput(rid="r1", new_token_ids=[7], finish_reason={"type": "stop", "matched": 2},
                meta={"prompt_tokens": 3, "cached_tokens_details": {"device": 1}}, logprobs=[[-0.1, [[7, -0.1]]]]),
    TokenOutput(rid="r2", new_token_ids=[], finish_reason={"type": "abort"}, error="bad"),
    ControlRequest(id="c", kind="stats"),
    ControlReply(id="c", ok=True, data={"tiers": {"device": {"used_tokens": 5}}}),
    SchedulerReady(model_name="m", context_length=8, vocab_size=10, eos_token_ids=[2], pid=1),
    SchedulerFailed(error="boom"),
]


def test_codec_round_trips_every_message_type():
    assert unpack(pack(MESSAGES)) == MESSAGES


def test_codec_frames_are_plain_msgpack():
    items = msgpack.unpackb(pack(MESSAGES[:2]), raw=False)
    assert items == [["GenerateRequest", MESSAGES[0].to_wire()], ["AbortRequest", {"rid": "r1"}]]
    assert items[0][1]["sampling_params"]["stop"] == ["x"] and items[0][1]["sampling_params"]["temperature"] == 0.5


def test_codec_rebuilds_typed_sampling_params():
    (req,) = unpack(pack(MESSAGES[:1]))
    assert isinstance(req.sampling_params, SamplingParams) and req.sampling_params == MESSAGES[0].sampling_params


def test_codec_converts_numpy_values():
    reply = ControlReply(id="c", ok=True, data={"n": np.int64(3), "arr": np.arange(3)})
    assert unpack(pack([reply]))[0].data == {"n": 3, "arr": [0, 1, 2]}


@pytest.mark.parametrize("frame", [
    msgpack.packb([["Pickle", {}]]), msgpack.packb({"not": "a list"}), msgpack.packb([["AbortRequest"]]),
    msgpack.packb([["AbortRequest", {"rid": "x", "extra": 1}]]),
    msgpack.packb([["GenerateRequest", {"rid": "x", "input_ids": [1], "sampling_params": {"bogus": 1}}]]),
    msgpack.packb([["GenerateRequest", {"rid": "x", "input_ids": [1], "sampling_params": 5}]]),
])
def test_codec_rejects_unknown_or_malformed(frame):
    with pytest.raises((ValueError, TypeError)):
        unpack(frame)


def test_codec_refuses_unregistered_types():
    @dataclasses.dataclass
    class Other:
        x: int

    with pytest.raises(TypeError):
        pack([Other(1)])


# ---- CLI flags ------------------------------------------------------------------------------


def test_serve_flags_come_from_the_dataclasses():
    parser = build_parser()
    args = parser.parse_args(["serve"])
    assert config_from_args(RuntimeConfig, args) == RuntimeConfig()
    assert config_from_args(HiCacheConfig, args) == HiCacheConfig()
    assert config_from_args(ServerConfig, args) == ServerConfig()
    args = parser.parse_args(["serve", "--page-size", "64", "--disable-radix-cache", "--max-total-tokens", "4096",
                              "--port", "8080", "--api-key", "k", "--mem-fraction-static", "0.5"])
    assert config_from_args(HiCacheConfig, args).page_size == 64
    assert config_from_args(HiCacheConfig, args).disable_radix_cache is True
    assert config_from_args(RuntimeConfig, args).max_total_tokens == 4096
    assert config_from_args(RuntimeConfig, args).mem_fraction_static == 0.5
    assert config_from_args(ServerConfig, args).api_key == "k"


def test_serve_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for cls in (RuntimeConfig, HiCacheConfig, ServerConfig):
        for f in dataclasses.fields(cls):
            flag = f.name.replace("_", "-")
            tri_state = f.type == "bool | None"
            assert (f"--enable-{flag}, --disable-{flag}" if tri_state else f"--{flag}") in text
    assert "Tokens per KV page" in text


def test_bad_flag_values_are_rejected(capsys):
    from hicache.server.cli import main

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--port", "abc"])
    assert main(["serve", "--page-size", "0"]) == 2
    assert "page_size" in capsys.readouterr().err


# ---- metrics and stats rendering ------------------------------------------------------------


STATS = {"running": 1, "queued": 2, "pages_held": 3, "page_size": 16, "retractions": 0,
         "tiers": {"device": {"used_tokens": 100, "capacity_tokens": 1000, "hit_tokens": 40, "evicted_tokens": 5,
                              "bytes_per_token": 1024, "loaded_back_bytes": 2048, "in_flight": 1,
                              "write_policy": "write_through"},
                   "host": {"used_tokens": 0, "capacity_tokens": 0, "enabled": False},
                   "storage": {"used_tokens": 0, "capacity_tokens": 0, "enabled": False}},
         "tokens": {"prompt": 60, "generation": 10, "cached": {"device": 40, "host": 0, "storage": 0}},
         "server": {"prompt_tokens": 100, "generation_tokens": 10, "requests": 2,
                    "cached_tokens": {"device": 40, "host": 10, "storage": 0}}}


def test_metrics_render_scheduler_and_request_series():
    m = ServerMetrics()
    m.observe_finished({"prompt_tokens": 10, "completion_tokens": 3, "cached_tokens_details": {"device": 4}}, 0.5)
    m.ttft.observe(0.1)
    families = {f.name: f for f in text_string_to_metric_families(m.render(STATS).decode())}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("hicache_prompt_tokens_total", ())] == 10
    assert samples[("hicache_cached_tokens_total", (("tier", "device"),))] == 4
    assert samples[("hicache_cached_tokens_total", (("tier", "storage"),))] == 0
    assert samples[("hicache_num_queued_reqs", ())] == 2
    assert samples[("hicache_tier_capacity_tokens", (("tier", "device"),))] == 1000
    assert samples[("hicache_tier_evicted_tokens_total", (("tier", "device"),))] == 5
    assert families["hicache_tier_used_tokens"].type == "gauge"
    assert families["hicache_tier_loaded_back_bytes"].type == "counter"
    assert families["hicache_tier_in_flight"].type == "gauge"


def test_metrics_and_the_cli_show_speculative_decoding():
    spec = {"drafts": 10, "draft_tokens": 40, "accepted_tokens": 25,
            "accepted_per_draft": {"0": 2, "1": 1, "2": 3, "3": 1, "4": 3}}
    m = ServerMetrics()
    families = {f.name: f for f in text_string_to_metric_families(m.render({**STATS, "speculative": spec}).decode())}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("hicache_spec_accepted_tokens_total", ())] == 25
    assert samples[("hicache_spec_drafts_total", ())] == 10
    assert families["hicache_spec_accepted_per_draft"].type == "histogram"
    assert samples[("hicache_spec_accepted_per_draft_bucket", (("le", "1"),))] == 3
    assert samples[("hicache_spec_accepted_per_draft_bucket", (("le", "+Inf"),))] == 10
    assert samples[("hicache_spec_accepted_per_draft_sum", ())] == 25
    from rich.console import Console

    console = Console(width=160, record=True)
    console.print(stats_cli.render({**STATS, "speculative": spec}, "http://x"))
    text = console.export_text()
    assert "accepted 25 of 40 draft tokens" in text and "3.50 tokens" in text
    assert "accepted per draft" in text and "0: 2  1: 1  2: 3  3: 1  4: 3" in text  # the histogram


def test_stats_hit_rates_and_table():
    assert stats_cli.hit_rates(STATS) == {"device": 0.4, "host": 0.1, "storage": 0.0}
    no_server = {k: v for k, v in STATS.items() if k != "server"}
    assert stats_cli.hit_rates(no_server)["device"] == 0.4  # computed 60 + cached 40
    from rich.console import Console

    console = Console(width=160, record=True)
    console.print(stats_cli.render(STATS, "http://x"))
    text = console.export_text()
    for word in ("device", "host", "storage", "40.0%", "10.0%", "disabled", "loaded back", "2.0 KiB", "1000.0 KiB"):
        assert word in text, word


def test_stats_hit_tokens_are_the_counts_of_the_hit_rate():
    """A tier's hit tokens and its hit rate come from one count: the finished requests' (the
    scheduler's count also holds aborted requests' hits)."""
    from rich.console import Console

    stats = {**STATS, "tiers": {**STATS["tiers"], "device": {**STATS["tiers"]["device"], "hit_tokens": 654}}}
    console = Console(width=160, record=True)
    console.print(stats_cli.render(stats, "http://x"))
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in console.export_text().splitlines() if line.count("│") >= 3}
    assert rows["hit rate"] == "40.0%" and rows["hit tokens"] == "40"
    assert "654" not in console.export_text()


@pytest.mark.skipif(scheduler_process._MALLOC_TRIM is None, reason="glibc's malloc_trim")
def test_the_scheduler_hands_freed_heap_memory_back():
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
    blocks = [libc.malloc(64 << 10) for _ in range(1024)]  # 64 MiB under glibc's mmap threshold: on the heap
    for b in blocks:
        ctypes.memset(b, 1, 64 << 10)
    for b in blocks[:-1]:  # the last one holds the heap's top: nothing is returned by itself
        libc.free(b)
    before = anon_kib()
    scheduler_process._trim_heap()
    assert before - anon_kib() > 32 << 10
    libc.free(blocks[-1])


def anon_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon"))
