#!/bin/sh
# On the lent GPU machine (issue 39): the one-GPU recipe over seeds, run the way `miles run`
# runs it (bench/recipe_learns.py), and the engine numerics test beside it. Carry .whl/gpu/ray
# and .whl/gpu/tools (tests/gpu/carry.py builds them). Results go to $OUT (or /tmp/out).
#
#   sh tests/gpu/learn.sh [SEEDS] [extra recipe_learns args...]     # default seeds: "0 1 2"
#   NUMERICS=0 sh tests/gpu/learn.sh                                 # without the numerics test
set -eu
out=${OUT:-/tmp/out}
seeds=${1:-0 1 2}
[ $# -gt 0 ] && shift
mkdir -p "$out"
# sets carried with this call (a warm machine keeps those of earlier calls)
for set_name in ray tools; do if [ -d ".whl/gpu/$set_name" ]; then sh tests/gpu/install.sh ".whl/gpu/$set_name"; fi; done
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
if [ "${NUMERICS:-1}" = 1 ]; then
  python3 -m pytest tests/gpu/test_engine_numerics.py -s -p no:cacheprovider -o addopts="" \
    >"$out/numerics.log" 2>&1 &
fi
# The runs' models and checkpoints stay on the machine: $OUT brings back at most 8 files.
work=/tmp/learn
# shellcheck disable=SC2086
timeout 520 python3 bench/recipe_learns.py --config configs/gpu-single.yaml --seeds $seeds --parallel "$(echo $seeds | wc -w)" \
  --out "$work" "$@" >"$out/stdout.txt" || true
wait
cp "$work/learn.json" "$out/" 2>/dev/null || tail -c 3000 "$out/stdout.txt"
cp "$work/learn.png" "$out/" 2>/dev/null || true
for s in $seeds; do cp "$work/seed$s/seed.log" "$out/seed$s.log" 2>/dev/null || true; done
tail -c 1500 "$out/numerics.log" 2>/dev/null || true
tail -c 2500 "$out/learn.json" 2>/dev/null || true
