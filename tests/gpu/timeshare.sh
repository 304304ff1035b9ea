#!/bin/sh
# On the lent GPU machine (issue 40): a Qwen3-4B-shaped model (random weights), full-parameter
# GRPO, the FSDP2 trainer and one engine time-sharing ONE GPU (bench/driver_gpu.py
# --time-sharing). Install ray and tools first (tests/gpu/install.sh), and SGLang's sets for
# --engine sglang. Results go to $OUT; each step is logged as it ends.
#
#   sh tests/gpu/timeshare.sh                                            # embedded engine, 1024 new tokens
#   sh tests/gpu/timeshare.sh --engine sglang --sglang-python /tmp/sgl-python --max-new-tokens 4096
#   LIMIT=400 sh tests/gpu/timeshare.sh --steps 1                        # seconds before it is stopped
#
# The recipe's rollout length is 4096 new tokens; with the embedded engine one rollout of 8 x 8
# such samples did not end within 7.8 min on an H100 (2026-12-07), past a call's 10 min with
# the model's build and start-up, so the embedded default is 1024 (miles plan: 63.3 GiB
# time-shared, 96.3 GiB unshared on one GPU).
#
# Its JSON has miles plan's per-GPU phase peaks time-shared and not (the unshared peak exceeds
# the card), then per step: rollout, train, sync, offload/onload and release/resume seconds and
# the trainer's peak memory.
set -eu
out=${OUT:-/tmp/out}
mkdir -p "$out"
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
# An H200 (139 GiB) holds the 8-prompt layout unshared (96.3 GiB); 32 prompts do not fit it
# unshared (150.3 GiB by miles plan) and do time-shared (79.5 GiB). A later --prompts wins.
prompts=8
if [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -gt 100000 ]; then prompts=32; fi
timeout "${LIMIT:-560}" python3 bench/driver_gpu.py --model qwen3-4b-shape --time-sharing --steps 2 \
  --prompts "$prompts" --samples 8 --max-new-tokens 1024 --micro-batch 2 --work-dir /tmp/timeshare \
  --set training.fsdp.activation_checkpointing=true "$@" >"$out/timeshare.json" 2>"$out/timeshare.log" || true
grep -v "^ " "$out/timeshare.log" | tail -c 6000
tail -c 3000 "$out/timeshare.json"
