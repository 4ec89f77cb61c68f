#!/usr/bin/env bash
# One run on a lent GPU machine (no network there): tests/cuda, then benchmarks/cuda_bench.py; logs and results
# under $OUT. Run from the repository root. The machine's python3 holds torch + transformers; what it lacks travels
# in .whl/ (wheels for Python 3.12: fastapi, pydantic, uvicorn, openai, gguf and their needs), the Qwen3.5 tokenizer
# fixture and the demo's config + tokenizer in .gpu/ (made here with benchmarks/cuda_prepare.sh).
#   OUT=/tmp/out bash benchmarks/cuda_run.sh [tests] [bench]      (default: both)
# Sizes (H200, 2026-12-04): tests/cuda ~40 s; the benchmark's stages for Qwen3.5's shape took 15-75 s each
# (compiled 74 s with its compile, transformers 47 s, a served mode ~60 s), the demo's less. A session's device time
# is short: give BENCH_TIMEOUT and BENCH_ARGS (e.g. --stages graphs-triton,graphs,served-graphs-triton --models qwen35) so that
# one call ends well inside it; results.json is written after every stage, so a cut run still returns what it did.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/cuda-run}"
mkdir -p "$OUT"
STEPS="${*:-tests bench}"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
transformers.__version__, torch.cuda.is_available())" | tee -a "$OUT/gpu.txt"
if [[ " $STEPS " == *" tests "* ]]; then
  export ASCENDSERVE_TEST_QWEN3_5_TOKENIZER="$PWD/.gpu/qwen3_5_tokenizer"
  start=$(date +%s)
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -p no:cacheprovider tests/cuda -q -rA --tb=short \
    -o addopts="" >"$OUT/tests.log" 2>&1
  echo "tests/cuda: exit $? in $(( $(date +%s) - start )) s"
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/tests.log" | tail -30
  grep -E "^E " "$OUT/tests.log" | head -20
fi
if [[ " $STEPS " == *" bench "* ]]; then
  start=$(date +%s)
  timeout "${BENCH_TIMEOUT:-330}" python3 benchmarks/cuda_bench.py --work /tmp/cuda-bench --out "$OUT" \
    --demo-dir .gpu/demo --qwen-tokenizer .gpu/qwen3_5_tokenizer ${BENCH_ARGS:-} >"$OUT/bench.log" 2>&1
  echo "cuda_bench: exit $? in $(( $(date +%s) - start )) s"
  grep -vE "Warning|warn\(|^INFO|Loading weights|falling back" "$OUT/bench.log" | tail -60
fi
