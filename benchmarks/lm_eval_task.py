"""lm-evaluation-harness on a small local multiple-choice task: `local-completions` through
`hicache serve` against lm-eval's own `hf` model on the same weights.

lm-eval scores a choice by the log-probs of its tokens after the context: it sends the
context + choice as token ids to /v1/completions with `echo: true, logprobs: 1, max_tokens: 1` and
sums the prompt log-probs past the context (`LocalCompletionsAPI.parse_logprobs`). Its `hf` model
computes the same sums with HF transformers. Equal accuracies (and log-likelihoods within fp32
noise) mean the prompt log-probs of the server are right end to end.

lm-eval is heavy (datasets, pyarrow, scikit-learn, peft, ...), so it is not a dependency of
ours: this script makes a virtual environment of its own for it (`<workdir>/venv`) that sees this
interpreter's packages (torch, transformers, hicache) through a .pth file and adds lm-eval. Its
datasets come from the Hugging Face hub, which need not be reachable: the task here is a YAML task
over a local JSON-lines file (written by this script), run with the hub offline.

    .venv/bin/python benchmarks/lm_eval_task.py [--workdir DIR]

The default model is converted once to an HF folder (`<workdir>/hf-model`: the GGUF's weights,
dequantized, saved by transformers) for lm-eval's `hf` model and tokenizer; the server serves the
GGUF itself.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import httpx

from compare import Server

LM_EVAL = "lm-eval[api,hf]==0.4.13"
TASK = "hicache_mc"

CAPITALS = [("France", "Paris"), ("Italy", "Rome"), ("Germany", "Berlin"), ("Spain", "Madrid"),
            ("Japan", "Tokyo"), ("Russia", "Moscow"), ("Egypt", "Cairo"), ("Greece", "Athens"),
            ("Portugal", "Lisbon"), ("Austria", "Vienna"), ("Norway", "Oslo"), ("Ireland", "Dublin"),
            ("China", "Beijing"), ("Poland", "Warsaw"), ("Canada", "Ottawa"), ("Kenya", "Nairobi")]
OPPOSITES = [("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("happy", "sad"),
             ("light", "dark"), ("early", "late"), ("open", "closed"), ("rich", "poor"), ("young", "old")]
COLOURS = [("grass", "green"), ("the sky on a clear day", "blue"), ("snow", "white"), ("coal", "black"),
           ("a ripe banana", "yellow"), ("blood", "red")]


def dataset() -> list[dict]:
    """Questions with four choices each (the distractors are the other rows' answers)."""
    docs = []
    for table, question in ((CAPITALS, "The capital of {} is"), (OPPOSITES, "The opposite of {} is"),
                            (COLOURS, "The colour of {} is")):
        answers = [a for _, a in table]
        for i, (subject, answer) in enumerate(table):
            wrong = [answers[(i + k) % len(answers)] for k in (1, 3, 5)]
            choices = [" " + c for c in [answer, *wrong]]
            order = sorted(range(4), key=lambda j: (j * 7 + i) % 4)  # the answer's place varies
            docs.append({"question": question.format(subject), "choices": [choices[j] for j in order],
                         "label": order.index(0)})
    for a, b in [(2, 3), (4, 4), (7, 1), (5, 5), (9, 3), (6, 2), (8, 8), (3, 4)]:
        wrong = [a + b + 1, a + b - 1, a + b + 2]
        choices = [f" {x}" for x in [a + b, *wrong]]
        docs.append({"question": f"{a} + {b} =", "choices": choices, "label": 0})
    return docs


def write_task(folder: Path) -> Path:
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in dataset()))
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: \"{{question}}\"\n"
        "doc_to_choice: choices\n"
        "doc_to_target: label\n"
        "target_delimiter: \"\"\n"
        "metric_list:\n  - metric: acc\n")
    return folder


def lm_eval_venv(workdir: Path) -> Path:
    """`<workdir>/venv` with lm-eval, seeing this interpreter's site-packages (made once)."""
    venv = workdir / "venv"
    python = venv / "bin" / "python"
    if (venv / ".installed").exists():
        return python
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    subprocess.run([str(base), "-m", "venv", str(venv)], check=True)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "hicache-base.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", LM_EVAL], check=True)
    (venv / ".installed").touch()
    return python


def hf_folder(workdir: Path) -> Path:
    """The default GGUF as an HF model folder (fp32 safetensors + tokenizer), made once."""
    folder = workdir / "hf-model"
    if (folder / "config.json").exists():
        return folder
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hicache.runtime.default_model import default_model_path

    path = default_model_path()
    kw = {"gguf_file": path.name}
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=torch.float32, **kw)
    folder.mkdir(parents=True)
    # transformers refuses to save a GGUF-loaded model: its dequantized tensors, as a plain checkpoint
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    AutoTokenizer.from_pretrained(str(path.parent), **kw).save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def run_lm_eval(python: Path, model: str, model_args: str, tasks: Path, out: Path, *extra: str) -> dict:
    """Runs lm-eval; returns {"acc", "loglikelihoods": per doc, per choice}."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [str(python), "-m", "lm_eval", "run", "--model", model, "--model_args", model_args, "--tasks", TASK,
           "--include_path", str(tasks), "--output_path", str(out), "--log_samples", *extra]
    subprocess.run(cmd, check=True, env=env)
    results = json.loads(Path(sorted(glob.glob(f"{out}/**/results_*.json", recursive=True))[-1]).read_text())
    samples = [json.loads(line) for f in glob.glob(f"{out}/**/samples_{TASK}_*.jsonl", recursive=True)
               for line in Path(f).read_text().splitlines()]
    samples.sort(key=lambda s: s["doc_id"])
    return {"acc": results["results"][TASK]["acc,none"],
            "loglikelihoods": [[float(r[0]) for r in s["filtered_resps"]] for s in samples]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "hicache-lm-eval",
                   help="where the venv, the HF folder and the results go (kept between runs)")
    p.add_argument("--tokenizer-backend", default="huggingface", choices=("huggingface", "remote"),
                   help="lm-eval's tokenizer for hicache: the HF folder's, or the server's own (remote: "
                        "its /tokenizer_info, /tokenize and /detokenize)")
    p.add_argument("--server-flags", default="--disable-hierarchical-cache",
                   help="extra flags of `hicache serve` (default: L1 only, a light server)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    python = lm_eval_venv(args.workdir)
    folder = hf_folder(args.workdir)
    tasks = write_task(Path(tempfile.mkdtemp(prefix="task-", dir=args.workdir)))
    hf = run_lm_eval(python, "hf", f"pretrained={folder},dtype=float32", tasks, args.workdir / "out-hf",
                     "--device", "cpu", "--batch_size", "1")
    server = Server(args.server_flags.split(), args.workdir / "server.log")
    try:
        name = httpx.get(server.url + "/v1/models", timeout=60).json()["data"][0]["id"]
        tokenizer = (f"tokenizer={folder},tokenizer_backend=huggingface" if args.tokenizer_backend == "huggingface"
                     else "tokenizer_backend=remote")
        ours = run_lm_eval(python, "local-completions",
                           f"model={name},base_url={server.url}/v1/completions,{tokenizer},"
                           "num_concurrent=1,max_retries=1",
                           tasks, args.workdir / "out-hicache")
    finally:
        server.stop()
    diffs = [abs(a - b) for x, y in zip(ours["loglikelihoods"], hf["loglikelihoods"]) for a, b in zip(x, y)]
    print(json.dumps({"docs": len(hf["loglikelihoods"]), "acc_hicache": ours["acc"], "acc_hf": hf["acc"],
                      "max_abs_loglikelihood_diff": max(diffs)}, indent=1))
    return 0 if ours["acc"] == hf["acc"] else 1


if __name__ == "__main__":
    sys.exit(main())
