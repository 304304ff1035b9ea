"""Held-out gain of RL objectives from the default recipe's warm-up, over seeds and rollout sizes.

What tests/integration/test_algorithms_learn.py asserts (gain >= 0.05 after a short run), run
over several RL seeds and settings, so that a cheaper test setting is chosen on evidence from
more than one seed. One JSON line per run, then a summary line per setting:

    python bench/algorithms_sweep.py --algorithms grpo ppo --seeds 0 1 2 \
        --variant full= --variant half=rollout.num_prompts_per_step=32

A variant's overrides come last, so they win over --algorithms and --steps: a variant that sets
algorithm.name (or training.num_steps) runs that objective (that length), reported as such.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles_core.config import build_config
from miles_core.data import read_prompts
from miles_core.driver.session import TrainSpec, run_training
from miles_core.engines.embedded.engine import EmbeddedEngine
from miles_core.evaluation.core import evaluate_greedy
from miles_core.storage import artifacts

REPO = Path(__file__).resolve().parents[1]


def accuracy(model_dir, prompts) -> float:
    return evaluate_greedy(EmbeddedEngine(str(model_dir), num_threads=2), prompts, "exact_match", 6, 256).pass_at_1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", nargs="+", default=["grpo"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--variant", action="append", default=[],
                        help="name=override[,override...]; repeatable (default: the recipe as is)")
    parser.add_argument("--work-dir", default=None, help="reuse the warm-up across invocations")
    args = parser.parse_args()
    variants = dict(v.split("=", 1) for v in args.variant) or {"recipe": ""}
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="algos-sweep-"))
    recipe = yaml.safe_load((REPO / "configs/local.yaml").read_text())
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    base_cfg = build_config(recipe, [f"storage.work_dir={work}"])
    model, data = artifacts.prepare_model(base_cfg), artifacts.prepare_data(base_cfg)
    warm = artifacts.warm_up(base_cfg, model, data)
    eval_prompts = read_prompts(data.eval_path, base_cfg.data, EmbeddedEngine(warm.model_dir).tokenizer)
    before = accuracy(warm.model_dir, eval_prompts)
    gains: dict[str, list[float]] = {}
    for name, overrides in variants.items():
        for algorithm in args.algorithms:
            for seed in args.seeds:
                sets = [f"algorithm.name={algorithm}", f"training.num_steps={args.steps}", f"seed={seed}",
                        "checkpoint.interval_steps=100000", f"storage.work_dir={work}",
                        *[o for o in overrides.split(",") if o]]
                cfg = build_config(recipe, sets)
                algorithm = cfg.algorithm.name  # a variant may set its own
                started = time.perf_counter()
                result = run_training(TrainSpec(config=cfg, model_dir=warm.model_dir, train_path=data.train_path,
                                                run_dir=str(work / f"run-{name}-{algorithm}-{seed}-{time.time_ns()}")))
                gain = accuracy(result.hf_export_dir, eval_prompts) - before
                gains.setdefault(f"{name}/{algorithm}", []).append(gain)
                rewards = [h["rollout/reward_mean"] for h in result.history]
                print(json.dumps({"variant": name, "algorithm": algorithm, "steps": cfg.training.num_steps,
                                  "seed": seed, "before": before,
                                  "gain": round(gain, 4), "seconds": round(time.perf_counter() - started, 1),
                                  "reward_first10": round(statistics.fmean(rewards[:10]), 4),
                                  "reward_last10": round(statistics.fmean(rewards[-10:]), 4)}),
                      flush=True)
    for key, values in gains.items():
        print(json.dumps({"setting": key, "min_gain": min(values), "median_gain": statistics.median(values),
                          "gains": values}), flush=True)


if __name__ == "__main__":
    main()
