#!/usr/bin/env bash
# SGLang's own `bench_serving` against one engine on a GPU machine, the two engines configured alike:
# L1 of $L1 tokens, L2 twice that, page 64, Triton attention, CUDA graphs, chunked prefill 8192,
# at most 32 running requests, 32 in flight. Run it once per engine in the same machine lease and
# compare what it prints (bench_serving's JSON lines and hicache's stats land in OUT_DIR).
#
#   bash benchmarks/bench_serving.sh ENGINE MODEL_DIR OUT_DIR [WORKLOAD ...]
#
# ENGINE: hicache (this checkout, installed) or sglang (SGLang 0.5.17 in $SITE, as
# ../shared/device/sglang/join.sh installs it). MODEL_DIR: a Llama-3.1-8B-shaped folder with a real
# tokenizer (../shared/device/sglang/tokenizer_model_dir.py), served with dummy weights. hicache's
# packages that the GPU machine lacks: `../shared/device/wheels.sh crc32c` (crc32c for L3 values).
# WORKLOAD: gsp (shared prefixes: 32 system prompts of 4,096 tokens, 16 questions of 256 each,
# 64 output tokens: a working set of 2x L1 that L1 + L2 holds), gsp-l3 (64 system prompts: 4x L1,
# beyond L1 + L2, with L3 on: hicache's LMDB, SGLang's `file`), random (random-ids, 2,048 in and
# 128 out, no reuse). Default: gsp random. Seeds $SEEDS (default 1 2 3); `--flush-cache` before each.
set -euo pipefail
engine=$1 model=$2 out=$3; shift 3
if [ $# -gt 0 ]; then workloads=("$@"); else workloads=(gsp random); fi
PY=${PY:-/opt/torch/.venv/bin/python3}; [ -x "$PY" ] || PY=python3
SITE=${SITE:-/tmp/site}; WH=${WH:-/tmp/wh}; PORT=${PORT:-30000}; L1=${L1:-65536}; SEEDS=${SEEDS:-1 2 3}
mkdir -p "$out"
url=http://127.0.0.1:$PORT

declare -A DATA=(
  [gsp]="--dataset-name generated-shared-prefix --gsp-num-groups 32 --gsp-prompts-per-group 16
         --gsp-system-prompt-len 4096 --gsp-question-len 256 --gsp-output-len 64"
  [gsp-l3]="--dataset-name generated-shared-prefix --gsp-num-groups 64 --gsp-prompts-per-group 8
            --gsp-system-prompt-len 4096 --gsp-question-len 256 --gsp-output-len 64"
  [random]="--dataset-name random-ids --random-input-len 2048 --random-output-len 128
            --random-range-ratio 1 --num-prompts 256"
)

start() {  # $1: none | l3
  local log=$out/$engine-server-$1.log
  if [ "$engine" = hicache ]; then
    local store=(--hicache-storage-backend none)
    [ "$1" = l3 ] && store=(--hicache-storage-backend lmdb)
    HICACHE_HOME=$(mktemp -d) "$PY" -m hicache.server.cli serve --model-path "$model" --load-format dummy \
      --attention-backend triton --page-size 64 --max-total-tokens "$L1" --hicache-ratio 2 \
      --chunked-prefill-size 8192 --max-running-requests 32 --context-length 16384 --port "$PORT" \
      "${store[@]}" >"$log" 2>&1 &
  else
    local store=""; [ "$1" = l3 ] && store="--hicache-storage-backend file"
    sed -e 's/--cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled//' \
      "$WH/start_server.sh" >"$WH/start_server_graphs.sh"
    MODEL=$model MAX_TOTAL_TOKENS=$L1 EXTRA_ARGS="--context-length 16384 --chunked-prefill-size 8192 \
      --max-running-requests 32 $store" bash "$WH/start_server_graphs.sh" triton >"$log" 2>&1 &
  fi
  server=$!
  local t0=$SECONDS
  until curl -sf "$url/health" >/dev/null; do
    kill -0 $server 2>/dev/null || { tail -30 "$log"; exit 1; }
    [ $((SECONDS - t0)) -lt 400 ] || { tail -30 "$log"; exit 1; }
    sleep 2
  done
  echo "$engine ($1) healthy in $((SECONDS - t0)) s"
}

stop() { kill $server 2>/dev/null || true; wait $server 2>/dev/null || true; pkill -f sglang.launch_server || true; }
trap stop EXIT

store=none
for w in "${workloads[@]}"; do
  want=none; [ "$w" = gsp-l3 ] && want=l3
  if [ -z "${server:-}" ] || [ "$want" != "$store" ]; then
    if [ -n "${server:-}" ]; then stop; fi
    store=$want; start "$store"
  fi
  for seed in $SEEDS; do
    # shellcheck disable=SC2086
    PYTHONPATH=$SITE "$PY" -m sglang.bench_serving --backend sglang --host 127.0.0.1 --port "$PORT" \
      --model "$model" --tokenizer "$model" ${DATA[$w]} --max-concurrency 32 --seed "$seed" \
      --flush-cache --output-file "$out/$engine-$w.jsonl" --tag "$engine-$w-$seed" 2>&1 |
      grep -E "Benchmark duration|Request throughput|Median TTFT|Median ITL|Successful requests" |
      sed "s/^/$engine $w seed $seed: /"
    if [ "$engine" = hicache ]; then curl -s "$url/hicache/stats" >"$out/hicache-$w-$seed-stats.json"; fi
  done
done
