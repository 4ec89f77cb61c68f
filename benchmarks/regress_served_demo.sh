#!/bin/bash
# Served demo throughput of the working tree against an earlier commit, on this machine, the two alternating:
#   bash benchmarks/regress_served_demo.sh BASE_REV [ROUNDS]
# Each round starts `ascendserve serve` (the demo, --max-model-len 1024) on the base commit (a temporary worktree put
# first on PYTHONPATH) and then on the working tree, and runs `ascendserve bench serve` (the working tree's client for
# both) at C=8 (16 prompts) and C=64 (128 prompts), random 256 in / 128 out, ignore_eos. Prints output tok/s and the
# median TTFT / TPOT of each. Run it with nothing else on the machine.
set -u
BASE=${1:?usage: regress_served_demo.sh BASE_REV [ROUNDS]}
ROUNDS=${2:-2}
cd "$(dirname "$0")/.."
WT=$(mktemp -d /tmp/ascendserve-base-XXXX)
git worktree add -q "$WT" "$BASE" || exit 1
trap 'git worktree remove --force "$WT"' EXIT
PORT=${PORT:-8765}

run() {  # $1 label, $2 PYTHONPATH for the server ("" for the working tree)
  PYTHONPATH=$2 .venv/bin/ascendserve serve --port "$PORT" --host 127.0.0.1 --max-model-len 1024 --seed 0 \
      --disable-log-stats --uvicorn-log-level warning > "/tmp/regress_server_$1.log" 2>&1 &
  local server=$!
  for _ in $(seq 300); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
  for C in 8 64; do
    local n=$((C * 2)); [ "$C" -eq 64 ] && n=128
    .venv/bin/ascendserve bench serve --base-url "http://127.0.0.1:$PORT" --dataset-name random --num-prompts $n \
        --random-input-len 256 --random-output-len 128 --max-concurrency $C --ignore-eos --temperature 0 \
        --seed $((C + 7)) --disable-tqdm --metric-percentiles 50 2>/dev/null \
      | grep -E "Output token throughput|Median TTFT|Median TPOT" | sed "s/^/$1 C=$C /"
  done
  kill $server; wait $server 2>/dev/null
}

for _ in $(seq "$ROUNDS"); do
  run base "$WT"
  run head ""
done
