"""Torch trainers sharing the CPU cores: the step time of each, alone and side by side.

    python bench/concurrent_trainers.py --processes 2 --threads 2 --wait-policy passive

Starts --processes copies of the tiny model's FSDP trainer at once, each with --threads torch
threads, and each times --steps GRPO steps on the recipe's batch (64 prompts x 8 samples,
random tokens) after one untimed step. OMP_WAIT_POLICY is set before torch loads in each child:
`default` leaves OpenMP's spin-then-sleep, `passive` sleeps at once, `active` spins. Compare
against `--processes 1` with the same flags, run in the same session. Progress goes to stderr;
the last stdout line is the JSON result.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import json, random, sys, time
from miles_core.config import AlgorithmConfig, TinyModelConfig, TrainingConfig
from miles_core.types import Sample
from miles_core.tiny import build_tiny_model
from miles_core.training.fsdp import FSDPTrainer

threads, steps, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
model_dir = build_tiny_model(TinyModelConfig(), out_dir)
trainer = FSDPTrainer(str(model_dir), TrainingConfig(num_threads=threads, lr=5e-4), AlgorithmConfig(name="grpo"),
                      max_new_tokens=6, group_size=8)
rng = random.Random(0)
samples = [Sample(prompt_index=i // 8, prompt_ids=[rng.randrange(5, 30) for _ in range(14)],
                  response_ids=[rng.randrange(5, 30) for _ in range(4)], label="", reward=float(rng.random() < 0.4),
                  rollout_logprobs=[-2.0] * 4) for i in range(512)]
trainer.train_step(samples)
started = time.perf_counter()
for _ in range(steps):
    trainer.train_step(samples)
print("RESULT", json.dumps({"step_seconds": (time.perf_counter() - started) / steps}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", type=int, default=2, help="trainers started at once")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each trainer")
    p.add_argument("--steps", type=int, default=5, help="timed steps of each trainer")
    p.add_argument("--wait-policy", choices=["default", "passive", "active"], default="default",
                   help="OMP_WAIT_POLICY of the trainers")
    args = p.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env |= {"PYTHONPATH": str(REPO), "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    if args.wait_policy != "default":
        env["OMP_WAIT_POLICY"] = args.wait_policy
    with tempfile.TemporaryDirectory(prefix="miles-concurrent-") as tmp:
        print(f"starting {args.processes} trainers x {args.threads} threads ({args.wait_policy})", file=sys.stderr)
        procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(args.threads), str(args.steps), f"{tmp}/m{i}"],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                 for i in range(args.processes)]
        outputs = [proc.communicate(timeout=1800)[0] for proc in procs]
    if any(proc.returncode for proc in procs):
        raise SystemExit(f"a trainer failed: return codes {[proc.returncode for proc in procs]}")
    seconds = [json.loads(out.split("RESULT ", 1)[1])["step_seconds"] for out in outputs]
    print(json.dumps({"processes": args.processes, "threads": args.threads, "wait_policy": args.wait_policy,
                      "step_seconds": [round(s, 3) for s in seconds],
                      "steps_per_second_total": round(sum(1 / s for s in seconds), 3)}))


if __name__ == "__main__":
    main()
