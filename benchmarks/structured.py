"""Output tokens/s of JSON-schema-constrained decoding against unconstrained decoding, on one Engine.

    .venv/bin/python benchmarks/structured.py                       # CPU: the default model, batch 8
    python benchmarks/structured.py --model-path benchmarks/configs/llama-3.1-8b.json \\
        --load-format dummy --batch 64                              # device: 8B-shaped dummy weights

Both runs decode `--batch` prompts of `--prompt-tokens` tokens for `--new-tokens` tokens each,
greedy, all submitted together. The constrained run gives every request a JSON schema (an array
of at least `--new-tokens` objects with a bounded string, a bounded integer and an enum), so that
its grammar cannot end before the length limit and both runs emit the same number of tokens; the
unconstrained run ignores EOS. After a warm-up (which also compiles the schema) the two runs
alternate `--repeats` times; the best time of each counts. Prints both rates and constrained / unconstrained
(target: >= 0.90), and appends a JSON line to `--out` (the machine: the GPU's name on a device; the
commit: `--commit`, else git's HEAD, else "unknown"). `--profile` also prints, for each timed run,
the milliseconds per step in the parts of a step (wrappers around the calls: `StepProfile.PARTS`
says what each times; they nest: `launch` holds `fill wait` and `sampler`, `wait` a `launch`,
`process` the `accept`; `feed` and `fill` run on a thread of its own, beside the scheduler's).

`--compare-jump-forward` adds a second engine with `jump_forward=False` and a third run, the
same constrained requests there (alternating with the other two), and prints the constrained rate
with jump-forward over the rate without it, and each run's model steps (`forward_steps`).
`--long-keys` gives the schema's objects long property names (several tokens each: the text a
grammar forces, which jump-forward appends without a model step per token).

`--like-device` runs a CPU engine as one on a device runs: overlap scheduling on, jump-forward
off. With a tiny model of the 8B's vocabulary the model step costs little, so that the host's
part of a step (planning, sampling, the matchers' accept, the results) shows in `--profile`:

    .venv/bin/python benchmarks/structured.py --model-path benchmarks/configs/tiny-llama-8b-vocab.json \
        --load-format dummy --batch 64 --like-device --profile

Dummy weights come with no tokenizer: the script then copies the config into a temporary folder
beside the default model's tokenizer (its 49152 ids; the model's other ids are never allowed by a
grammar, and decode to nothing).
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from hicache import Engine
from hicache.runtime.grammar import GrammarCompiler

RESULTS = Path(__file__).resolve().parent / "results"


KEYS = ("name", "age", "role")
LONG_KEYS = ("customer_full_legal_name", "customer_age_in_whole_years", "customer_account_access_role")


def schema(min_items: int, keys: tuple[str, str, str] = KEYS) -> dict:
    name, age, role = keys
    item = {"type": "object", "properties": {
        name: {"type": "string", "maxLength": 16},
        age: {"type": "integer", "minimum": 0, "maximum": 120},
        role: {"enum": ["admin", "user", "guest"]}}, "required": list(keys)}
    return {"type": "array", "items": item, "minItems": min_items}


def with_default_tokenizer(config: str, folder: Path, tokenizer: str | None) -> str:
    from hicache.runtime.default_model import default_model_path
    from hicache.runtime.tokenizer import load_tokenizer

    shutil.copy(config, folder / "config.json")
    load_tokenizer(tokenizer or default_model_path()).save_pretrained(str(folder))
    return str(folder / "config.json")


class StepProfile:
    """Seconds and calls of the parts of a step, by wrapping them: the scheduler thread's, but for
    `fill` and `feed` (the bitmask filler's thread beside it, and for a large batch the threads of
    its chunks, whose times add up)."""

    PARTS = {  # name: (owner, attribute, what it times)
        "step": ("scheduler.Scheduler", "step", "Scheduler.step, all of it"),
        "plan": ("scheduler.Scheduler", "continue_decode", "planning a continuation"),
        "forward": ("runner.ModelRunner", "forward", "queuing a forward pass"),
        "launch": ("runner.PendingStep", "launch", "queuing a step's sampling, its fill wait included"),
        "fill wait": ("bitmask.PendingFill", "result", "waiting for a bitmask"),
        "sampler": ("runner.Sampler", "launch", "queuing the sampling (mask applied)"),
        "wait": ("runner.PendingStep", "result", "waiting for a step's tokens (its launch included)"),
        "process": ("scheduler.Scheduler", "process_result", "applying a step's results"),
        "accept": ("grammar.GrammarCompiler", "accept", "recording a step's tokens for the matchers (in process)"),
        "sample": ("runner.ModelRunner", "sample", "preparing a step's sampling"),
        "fill": ("bitmask", "_fill_into", "filling bitmask rows, on the filler's thread (or its chunks')"),
        "feed": ("bitmask", "_feed", "the matchers' batch accept, on the filler's thread before its fill"),
    }

    def __init__(self):
        from hicache.runtime import bitmask, grammar, runner, scheduler

        rooms = {"bitmask": bitmask, "grammar": grammar, "runner": runner, "scheduler": scheduler}
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        for name, (owner, attr, _) in self.PARTS.items():
            room, _, cls = owner.partition(".")
            target = getattr(rooms[room], cls) if cls else rooms[room]
            setattr(target, attr, self._wrap(name, getattr(target, attr)))

    def _wrap(self, name: str, fn):
        def timed_call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
                self.calls[name] += 1
        return timed_call

    def report(self, run: str, wall: float = 0.0) -> str:
        """One line: each part's milliseconds per step (and calls in the run), the time outside
        `Scheduler.step` (the engine delivering outputs, taking requests), then reset."""
        steps = max(1, self.calls["step"])
        parts = [f"{k} {v / steps * 1e3:.2f} ({self.calls[k]})" for k, v in self.seconds.items()]
        outside = f", outside step {(wall - self.seconds['step']) / steps * 1e3:.2f}" if wall else ""
        self.seconds.clear()
        self.calls.clear()
        return f"{run}, ms per step (calls): " + ", ".join(parts) + outside


def timed(prompts: list[list[int]], runs: dict[str, tuple[Engine, dict]], repeats: int,
          profile: StepProfile | None = None) -> dict[str, tuple]:
    """name -> (best seconds, output tokens of one run, model steps of one run). The runs
    alternate, so that a noisy machine slows them alike."""
    for engine, params in runs.values():  # warm-up (and the schema's compilation)
        engine.generate(input_ids=prompts[:2], sampling_params={**params, "max_new_tokens": 4})
    best = {name: (float("inf"), 0, 0) for name in runs}
    for _ in range(repeats):
        for name, (engine, params) in runs.items():
            if profile is not None:
                profile.report(name)
            steps = engine.get_stats()["forward_steps"]
            t0 = time.perf_counter()
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            took = time.perf_counter() - t0
            if profile is not None:
                print(f"{took:.3f} s, {profile.report(name, took)}")
            best[name] = (min(best[name][0], took), sum(len(o["output_ids"]) for o in outs),
                          engine.get_stats()["forward_steps"] - steps)
            if "json_schema" in params:
                refused = refused_outputs(engine, params["json_schema"], outs)
                assert refused == 0, f"{name}: {refused} of {len(outs)} outputs hold a token their grammar refuses"
    return best


def refused_outputs(engine: Engine, schema_text: str | dict, outs: list[dict]) -> int:
    """How many outputs hold a token that a fresh matcher of the schema refuses where it stands."""
    sched = engine.scheduler
    compiler = GrammarCompiler(sched.tokenizer, sched.model_config.vocab_size, sched.model_config.eos_token_ids)
    text = schema_text if isinstance(schema_text, str) else json.dumps(schema_text)
    try:
        refused = 0
        for out in outs:
            grammar = compiler.start("json_schema", text)
            refused += not all(grammar.try_accept(token) for token in out["output_ids"])
        return refused
    finally:
        compiler.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--tokenizer", default=None,
                    help="with dummy weights: a tokenizer folder to use (default: the default model's, fetched)")
    ap.add_argument("--batch", type=int, default=None, help="default: 64 on a device, 8 on CPU")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "structured.jsonl"))
    ap.add_argument("--commit", default=None, help="the commit measured (default: git's HEAD here, if any)")
    ap.add_argument("--profile", action="store_true", help="print where the scheduler thread's time goes")
    ap.add_argument("--compare-jump-forward", action="store_true",
                    help="also time the constrained run on an engine with jump_forward=False")
    ap.add_argument("--long-keys", action="store_true", help="long property names in the schema")
    ap.add_argument("--like-device", action="store_true",
                    help="overlap scheduling on and jump-forward off, as on a device (for a CPU run)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model_path
        if args.load_format == "dummy":
            path = with_default_tokenizer(path, Path(tmp), args.tokenizer)
        profile = StepProfile() if args.profile else None
        offs = [False, True] if args.compare_jump_forward else [False]
        # two engines share the device: each gets an L1 sized for the run instead of a memory fraction
        sized = {"max_total_tokens": 4 * 64 * (args.prompt_tokens + args.new_tokens)} if len(offs) > 1 else {}
        if args.like_device:
            sized.update(overlap_schedule=True)
        engines = [Engine(path, load_format=args.load_format, hierarchical_cache=False,
                          jump_forward=False if off or args.like_device else None, **sized) for off in offs]
        try:
            run(engines, args, profile)
        finally:
            for engine in engines:
                engine.shutdown()


def run(engines: list[Engine], args: argparse.Namespace, profile: StepProfile | None) -> None:
    engine = engines[0]
    device = engine.scheduler.runner.device.type
    batch = args.batch or (64 if device == "cuda" else 8)
    vocab = engine.scheduler.model_config.vocab_size
    prompts = [[(17 + 31 * i + 7 * j) % min(vocab, 49152) for j in range(args.prompt_tokens)] for i in range(batch)]
    base = {"temperature": 0, "max_new_tokens": args.new_tokens}
    constrained = {**base, "json_schema": schema(args.new_tokens, LONG_KEYS if args.long_keys else KEYS)}
    runs = {"free": (engine, {**base, "ignore_eos": True}), "json": (engine, constrained)}
    if len(engines) > 1:
        runs["json_no_jump"] = (engines[1], constrained)
    got = timed(prompts, runs, args.repeats, profile)
    rates = {name: tokens / seconds for name, (seconds, tokens, _) in got.items()}
    free_rate, json_rate = rates["free"], rates["json"]
    row = {"device": device, "machine": _machine(device), "commit": args.commit or _commit(), "batch": batch,
           "new_tokens": args.new_tokens, "long_keys": args.long_keys, "unconstrained_tok_s": round(free_rate, 1),
           "json_schema_tok_s": round(json_rate, 1), "ratio": round(json_rate / free_rate, 3),
           "tokens": [got["free"][1], got["json"][1]], "steps": {name: got[name][2] for name in got}}
    print(f"{device}, batch {batch}, {args.new_tokens} new tokens: unconstrained {free_rate:.1f} tok/s, "
          f"JSON schema {json_rate:.1f} tok/s, ratio {json_rate / free_rate:.3f} (target >= 0.90)")
    if "json_no_jump" in rates:
        row["json_no_jump_tok_s"] = round(rates["json_no_jump"], 1)
        row["jump_forward_ratio"] = round(json_rate / rates["json_no_jump"], 3)
        print(f"JSON schema without jump-forward {rates['json_no_jump']:.1f} tok/s: with / without "
              f"{row['jump_forward_ratio']:.3f}; model steps {row['steps']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")


def _machine(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name()
    return platform.node()


def _commit() -> str:
    """git's short HEAD when this file lies in a checkout of its own repository, else "unknown"."""
    here = Path(__file__).resolve().parent
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, cwd=here)
        if top.returncode != 0 or Path(top.stdout.strip()) != here.parent:
            return "unknown"
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=here).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
