#!/bin/sh
# On the lent GPU machine (issue 40): a Qwen3-4B-shaped model (random weights), full-parameter
# GRPO, the FSDP2 trainer and one engine time-sharing ONE GPU (bench/driver_gpu.py
# --time-sharing), at the time-sharing recipe's rollout length (4096 new tokens). Install ray and
# tools first (tests/gpu/install.sh), and SGLang's sets for --engine sglang. Results go to $OUT.
#
#   sh tests/gpu/timeshare.sh                                            # embedded engine
#   sh tests/gpu/timeshare.sh --engine sglang --sglang-python /tmp/sgl-python
#   LIMIT=400 sh tests/gpu/timeshare.sh --steps 2                        # seconds before it is stopped
#
# Its JSON has miles plan's per-GPU phase peaks time-shared and not (the unshared peak exceeds
# the card), then per step: rollout, train, sync, offload/onload and release/resume seconds and
# the trainer's peak memory.
set -eu
out=${OUT:-/tmp/out}
mkdir -p "$out"
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
timeout "${LIMIT:-560}" python3 bench/driver_gpu.py --model qwen3-4b-shape --time-sharing --steps 3 \
  --prompts 8 --samples 8 --max-new-tokens 4096 --micro-batch 2 --work-dir /tmp/timeshare \
  --set training.fsdp.activation_checkpointing=true "$@" >"$out/timeshare.json" 2>"$out/timeshare.log" || true
grep -v "^ " "$out/timeshare.log" | tail -c 6000
tail -c 3000 "$out/timeshare.json"
