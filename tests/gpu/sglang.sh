#!/bin/sh
# On the lent GPU machine (issue 38): the checks against a real SGLang, once tests/gpu/install.sh
# has put tests/gpu/carry.py's sets in place (sglang-a, sglang-b, tools and megatron for `tests`;
# ray as well for `learn`). Results go to $OUT (or /tmp/out).
#
#   sh tests/gpu/sglang.sh tests                        # test_sglang_real.py, test_routing_replay_sglang.py
#   sh tests/gpu/sglang.sh learn [recipe_learns args]   # configs/gpu-single-sglang.yaml, seed 0
#   LIMIT=400 sh tests/gpu/sglang.sh ...                # seconds before the run is stopped (default 560)
set -eu
out=${OUT:-/tmp/out}
mkdir -p "$out"
export PYTHONPATH=/tmp/site SGLANG_PYTHON=/tmp/sgl-python PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
case "${1:?usage: sglang.sh tests|learn [args...]}" in
  tests)
    timeout "${LIMIT:-560}" python3 -m pytest tests/gpu/test_sglang_real.py tests/gpu/test_routing_replay_sglang.py \
      -v -s -p no:cacheprovider -o addopts="" >"$out/sglang_tests.log" 2>&1 || true
    grep -E "\[sglang-real\]|PASSED|FAILED|ERROR|passed|failed|Error" "$out/sglang_tests.log" | cut -c1-400 \
      || tail -c 4000 "$out/sglang_tests.log" ;;
  learn)
    shift
    work=/tmp/learn-sglang
    timeout "${LIMIT:-560}" python3 bench/recipe_learns.py --config configs/gpu-single-sglang.yaml --seeds 0 \
      --set rollout.engine.python=/tmp/sgl-python --out "$work" "$@" >"$out/stdout.txt" || true
    cp "$work/learn.json" "$out/" 2>/dev/null || true
    cp "$work/seed0/seed.log" "$out/seed0.log" 2>/dev/null || true
    tail -c 5000 "$work/seed0/seed.log" 2>/dev/null || true
    tail -c 2500 "$out/learn.json" 2>/dev/null || true ;;
  *) echo "usage: sglang.sh tests|learn [args...]" >&2; exit 2 ;;
esac
