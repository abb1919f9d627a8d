"""`Engine`: the in-process front end. A background thread runs the scheduler loop; callers
submit requests and receive outputs through per-request callbacks."""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import uuid
from typing import Any, AsyncIterator, Callable

from hicache.config import HiCacheConfig
from hicache.runtime.config import RuntimeConfig
from hicache.runtime.messages import AbortRequest, GenerateRequest, TokenOutput, expand_n
from hicache.runtime.build import build_scheduler
from hicache.runtime.logprob_meta import sglang_logprobs
from hicache.runtime.sampling import SamplingParams
from hicache.runtime.stop import trim_stop
from hicache.runtime.tokenizer import apply_chat_template

logger = logging.getLogger(__name__)


def split_options(options: dict) -> tuple[RuntimeConfig, HiCacheConfig]:
    """Route snake_case CLI-style options to the config dataclass that owns each."""
    rc_names = {f.name for f in dataclasses.fields(RuntimeConfig)}
    cc_names = {f.name for f in dataclasses.fields(HiCacheConfig)}
    unknown = set(options) - rc_names - cc_names
    for name in sorted(unknown):
        flag, _, field = name.partition("_")
        if flag in ("enable", "disable") and field in rc_names | cc_names:
            raise TypeError(f"Engine option {name} is the --{name.replace('_', '-')} flag: pass {field}="
                            f"{flag == 'enable'} ({field}=None, the default, leaves it automatic)")
    if unknown:
        raise TypeError(f"unknown Engine option(s): {', '.join(sorted(unknown))}")
    rc = RuntimeConfig(**{k: v for k, v in options.items() if k in rc_names})
    cc = HiCacheConfig(**{k: v for k, v in options.items() if k in cc_names})
    return rc, cc


class Engine:
    """`Engine(model_path=None, **options)`: options are the CLI flags in snake_case."""

    def __init__(self, model_path: str | None = None, **options: Any):
        rc, cc = split_options({"model_path": model_path, **options})
        self.scheduler = build_scheduler(rc, cc)
        self.tokenizer = self.scheduler.tokenizer
        self._inbox: queue.Queue = queue.Queue()
        self._listeners: dict[str, Callable[[TokenOutput], None]] = {}
        self._ids = itertools.count()
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="hicache-scheduler", daemon=True)
        self._thread.start()

    # ---- public API -----------------------------------------------------------------------

    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool = False,
                 top_logprobs_num: int = 0, cache_salt: str = "", logprob_start_len: int = -1,
                 return_text_in_logprobs: bool = False, lora_path: str | list[str | None] | None = None,
                 bootstrap: tuple[str, int, int] | None = None) -> dict | list[dict]:
        """Generate for one prompt (returns a dict) or a list (returns a list; n > 1 also gives a
        list). Bad input raises ValueError naming the field before anything is queued. With
        `return_logprob`, meta_info holds SGLang's log-prob fields (runtime/logprob_meta.py),
        prompt tokens from `logprob_start_len` on included. `lora_path`: the name of a loaded LoRA
        adapter for every prompt, or a list of one (or None: the base model) per prompt.
        `bootstrap`: (host, port, room) of one prompt's other half on an engine in a
        disaggregation mode (runtime/disagg/), as sglang-router's PD mode sets them."""
        msgs, single = self._requests(prompt, input_ids, sampling_params, return_logprob, top_logprobs_num, cache_salt,
                                      logprob_start_len, lora_path)
        if bootstrap is not None:
            if len(msgs) != 1:
                raise ValueError("bootstrap: one prompt with n = 1")
            msgs = [dataclasses.replace(msgs[0], bootstrap_host=bootstrap[0], bootstrap_port=bootstrap[1],
                            bootstrap_room=bootstrap[2])]
        done = threading.Event()
        results: dict[str, list[TokenOutput]] = {m.rid: [] for m in msgs}
        remaining = [len(msgs)]
        lock = threading.Lock()

        def on_output(out: TokenOutput) -> None:
            results[out.rid].append(out)
            if out.finish_reason is not None:
                with lock:
                    remaining[0] -= 1
                    if remaining[0] == 0:
                        done.set()

        self._submit(msgs, on_output)
        while not done.wait(0.5):
            self._raise_if_dead()
        outs = [self._result(m, results[m.rid], return_text_in_logprobs) for m in msgs]
        return outs[0] if single else outs

    async def async_generate(self, prompt: str | None = None, sampling_params: dict | None = None,
                             input_ids: list[int] | None = None, return_logprob: bool = False,
                             top_logprobs_num: int = 0, cache_salt: str = "", logprob_start_len: int = -1,
                             return_text_in_logprobs: bool = False, lora_path: str | None = None
                             ) -> AsyncIterator[dict]:
        """Stream one request: yields cumulative results ({"text", "output_ids", "meta_info"})."""
        msgs, _ = self._requests(prompt, input_ids, sampling_params, return_logprob, top_logprobs_num, cache_salt,
                                 logprob_start_len, lora_path)
        if len(msgs) != 1:
            raise ValueError("async_generate streams one prompt with n = 1")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._submit(msgs, lambda out: loop.call_soon_threadsafe(q.put_nowait, out))
        seen: list[TokenOutput] = []
        try:
            while not seen or seen[-1].finish_reason is None:
                seen.append(await q.get())
                yield self._result(msgs[0], seen, return_text_in_logprobs)
        finally:
            if not seen or seen[-1].finish_reason is None:
                self.abort(msgs[0].rid)

    def chat(self, messages: list[dict], sampling_params: dict | None = None, **kw: Any) -> dict:
        if self.tokenizer is None:
            raise ValueError("chat() needs a tokenizer; this model has none")
        ids = apply_chat_template(self.tokenizer, messages)
        return self.generate(input_ids=ids, sampling_params=sampling_params, **kw)

    def abort(self, rid: str) -> None:
        self._inbox.put(AbortRequest(rid))

    def flush_cache(self) -> bool:
        return self._call(self.scheduler.flush_cache)

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, str]:
        """Loads the PEFT adapter folder `lora_path` as `lora_name` (ValueError naming what is
        wrong); returns the loaded adapters' name -> path."""
        return self._call(lambda: self.scheduler.load_lora_adapter(lora_name, lora_path))

    def unload_lora_adapter(self, lora_name: str) -> dict[str, str]:
        return self._call(lambda: self.scheduler.unload_lora_adapter(lora_name))

    def get_stats(self) -> dict:
        return self._call(self.scheduler.stats)

    def check_integrity(self) -> None:
        self._call(self.scheduler.check_integrity)

    def shutdown(self) -> None:
        self._stopped = True
        self._inbox.put(None)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self.scheduler.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- internals ------------------------------------------------------------------------

    def _requests(self, prompt, input_ids, sampling_params, return_logprob, top_logprobs_num, cache_salt,
                  logprob_start_len, lora_path=None):
        """The messages to queue, checked here: the scheduler thread only checks what needs it."""
        single = not (isinstance(prompt, list) or (input_ids and isinstance(input_ids[0], list)))
        ids = self._token_ids(prompt, input_ids)
        params = self._sampling_params(sampling_params, len(ids))
        loras = lora_path if isinstance(lora_path, list) else [lora_path] * len(ids)
        if len(loras) != len(ids) or not all(x is None or isinstance(x, str) for x in loras):
            raise ValueError(f"lora_path: a name, or a list of one name (or None) per prompt ({len(ids)}), "
                             f"got {lora_path!r}")
        if isinstance(top_logprobs_num, bool) or not isinstance(top_logprobs_num, int) or top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num must be an integer >= 0, got {top_logprobs_num!r}")
        msgs = []
        for one_ids, p, lora in zip(ids, params, loras):
            base = GenerateRequest(f"eng-{next(self._ids)}-{uuid.uuid4().hex[:8]}", one_ids, p,
                                   return_logprob, top_logprobs_num, cache_salt, logprob_start_len, lora_path=lora)
            for m in expand_n(base):
                self.scheduler.validate(m)
                msgs.append(m)
        return msgs, single and len(msgs) == 1

    def _sampling_params(self, given: dict | list[dict] | None, num_prompts: int) -> list[SamplingParams]:
        """One parsed `SamplingParams` per prompt (a dict or None applies to all of them)."""
        given = given if isinstance(given, list) else [given] * num_prompts
        if len(given) != num_prompts:
            raise ValueError(f"sampling_params: {len(given)} given for {num_prompts} prompts")
        vocab = self.scheduler.model_config.vocab_size
        return [SamplingParams.from_dict(p, vocab) for p in given]

    def _token_ids(self, prompt, input_ids) -> list[list[int]]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt and input_ids")
        if input_ids is not None:
            seqs = input_ids if input_ids and isinstance(input_ids[0], list) else [input_ids]
            for s in seqs:
                if not all(isinstance(t, int) and not isinstance(t, bool) for t in s):
                    raise ValueError("input_ids: must be a list of integers")
            return [list(s) for s in seqs]
        prompts = prompt if isinstance(prompt, list) else [prompt]
        if self.tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; pass input_ids")
        for p in prompts:
            if not isinstance(p, str) or not p:
                raise ValueError("prompt: must be a non-empty string")
        return [self.tokenizer(p).input_ids for p in prompts]

    def _result(self, msg: GenerateRequest, outs: list[TokenOutput], text_in_logprobs: bool = False) -> dict:
        last = outs[-1]
        if last.error:  # refused as asked (400), or a peer it needed failed (a prefill server)
            raise (ValueError if last.error_status == 400 else RuntimeError)(last.error)
        ids = [t for o in outs for t in o.new_token_ids]
        p = msg.sampling_params
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)
            text = trim_stop(text, last.finish_reason, p.no_stop_trim)
        meta = dict(last.meta, id=msg.rid, finish_reason=last.finish_reason)
        if msg.return_logprob:
            prompt = next((o.input_logprobs for o in outs if o.input_logprobs is not None), None)
            decode = (lambda t: self.tokenizer.decode([t])) if text_in_logprobs and self.tokenizer else None
            meta.update(sglang_logprobs(msg.input_ids, prompt, ids, [lp for o in outs for lp in (o.logprobs or [])],
                                        msg.top_logprobs_num, decode))
        return {"text": text, "output_ids": ids, "meta_info": meta}

    def _submit(self, msgs: list[GenerateRequest], callback: Callable[[TokenOutput], None]) -> None:
        self._raise_if_dead()
        for m in msgs:
            self._listeners[m.rid] = callback
            self._inbox.put(m)

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the scheduler thread (the only thread that may touch the scheduler); a
        ValueError it raises is raised here, the loop unharmed."""
        box: queue.Queue = queue.Queue()

        def call() -> None:
            try:
                box.put((fn(), None))
            except ValueError as e:
                box.put((None, e))

        self._inbox.put(call)
        while True:
            self._raise_if_dead()
            try:
                value, error = box.get(timeout=0.5)
            except queue.Empty:
                continue
            if error is not None:
                raise error
            return value

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise RuntimeError("the engine's scheduler loop failed") from self._error
        if self._stopped:
            raise RuntimeError("the engine has been shut down")

    def _loop(self) -> None:
        sched = self.scheduler
        try:
            while not self._stopped:
                sched.check_health()
                self._drain(block=not sched.has_work())
                for out in sched.step():
                    cb = self._listeners.get(out.rid)
                    if out.finish_reason is not None:
                        self._listeners.pop(out.rid, None)
                    if cb is not None:
                        self._deliver(cb, out)
        except BaseException as e:  # surfaced to every caller by _raise_if_dead
            logger.exception("scheduler loop failed")
            self._error = e

    def _deliver(self, cb: Callable[[TokenOutput], None], out: TokenOutput) -> None:
        """A caller that went away (closed event loop, dead consumer) costs its request, never the loop."""
        try:
            cb(out)
        except Exception as e:
            logger.warning("dropping output of %s: its consumer failed (%s); aborting it", out.rid, e)
            self._listeners.pop(out.rid, None)
            self.scheduler.abort(out.rid)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=1.0) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            if isinstance(item, GenerateRequest):
                self.scheduler.add_request(item)
            elif isinstance(item, AbortRequest):
                self.scheduler.abort(item.rid)
            elif callable(item):
                item()
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
