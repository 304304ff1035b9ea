"""Long-tail rollouts (issue 42): sync vs fully async vs fully async + partial rollouts, one run.

    python bench/long_tail.py --seeds 0,1,2 --steps 20 --skip 3 --out long_tail.json

Workload: the tiny recipe (configs/local.yaml, SFT-warmed tiny model, 2-digit addition) whose
prompts each get their own generation budget (data.max_new_tokens_key), drawn per prompt from a
Pareto distribution (shape --alpha, scale --min-len), rounded down to a power of two and clipped
to --max-len, seeded by the run's seed: most responses are short, a few are very long. The tiny
model answers in about three tokens, so the responses run to their budget past EOS
(rollout.ignore_eos): the answer comes first and the scripted tail after it, and the reward is
`answer_first` below (the response starts with the label), the same in every mode.

For each seed, the three modes run back to back on one local Ray session (modes rotated between
seeds), trainer and engine one CPU and one torch thread each, every mode with
algorithm.correction.kind=tis so that only the loop differs:
- sync: generate, then train;
- fully_async: the producer runs ahead (buffer 1, batches more than --max-weight-staleness
  versions behind dropped); a weight update waits for the producer's running batch, long tail
  included;
- partial: fully_async + rollout.partial: the update aborts the running requests and the cut
  samples continue with the new weights.

Per mode: mean step time (the first --skip steps dropped), generated tokens trained on, tokens
thrown away (rollout/tokens_wasted), tokens by versions behind the batch's newest, share of
mixed-version samples, the reward curve, and held-out greedy pass@1 (exact match, stopping at
EOS, 200 problems) of the final weights and of the start.

How this differs from `miles run`: the same driver session (miles_core.driver.session.run_training,
what the flow's train task runs) on a local Ray session, without Prefect, MLflow, the object store
or the recipe's eval tasks; the SFT warm-up runs in-process for fixed --sft-steps rounds (cached
under --work-dir; the default 250,250 reached 0.625 held-out pass@1 here) instead of the recipe's
probe target; held-out accuracy is measured here, on the
exported weights. Progress goes to stderr; the last stdout line is the JSON result.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c

COMMON = ["rollout.ignore_eos=true", "data.max_new_tokens_key=max_new_tokens", "rollout.reward=long_tail:answer_first",
          "algorithm.correction.kind=tis", "checkpoint.interval_steps=100000", "training.num_threads=1",
          "training.cpus_per_trainer=1", "rollout.cpus_per_engine=1"]
MODES = {"sync": ["rollout.loop=sync"],
         "fully_async": ["rollout.loop=fully_async"],
         "partial": ["rollout.loop=fully_async", "rollout.partial.enabled=true"]}


def answer_first(response: str, label: str) -> float:
    """1.0 when the response starts with the label: the tiny model's answer comes first and the
    scripted tail (generated past EOS, whose text drops the EOS) follows it."""
    return float(bool(label) and response.strip().startswith(label.strip()))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1", help="comma list; each runs every mode on its own workload")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {sorted(MODES)}")
    p.add_argument("--steps", type=int, default=20, help="RL steps per run")
    p.add_argument("--skip", type=int, default=3, help="first steps left out of the step-time mean")
    p.add_argument("--prompts", type=int, default=16, help="rollout.num_prompts_per_step")
    p.add_argument("--samples", type=int, default=4, help="rollout.num_samples_per_prompt")
    p.add_argument("--alpha", type=float, default=1.0, help="Pareto shape of the lengths (smaller: heavier tail)")
    p.add_argument("--min-len", type=int, default=4, help="Pareto scale: the shortest budget")
    p.add_argument("--max-len", type=int, default=192, help="budgets are clipped here (also rollout.max_new_tokens)")
    p.add_argument("--max-weight-staleness", type=int, default=1,
                   help="rollout.loop.max_weight_staleness of both async modes (1: the shipped default)")
    p.add_argument("--sft-steps", default="250,250",
                   help="in-process SFT warm-up, comma list of rounds, each continuing from the last (cached)")
    p.add_argument("--work-dir", default="/tmp/miles-bench")
    p.add_argument("--out", default=None, help="also write the JSON result here")
    args = p.parse_args(argv)
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; choose from {sorted(MODES)}")
    return args


def draw_lengths(count: int, seed: int, alpha: float, min_len: int, max_len: int) -> list[int]:
    """Pareto(alpha) lengths of scale min_len, rounded down to a power of two (one engine call serves
    each length class: the embedded engine takes one budget per call), clipped to max_len."""
    rng = random.Random(seed)
    lengths = []
    for _ in range(count):
        raw = min_len * (1.0 - rng.random()) ** (-1.0 / alpha)
        lengths.append(min(max_len, 2 ** math.floor(math.log2(raw))))
    return lengths


def write_workload(train: Path, out_dir: Path, seed: int, args) -> tuple[Path, dict]:
    """The training rows with a max_new_tokens each (the row key data.max_new_tokens_key reads)."""
    rows = [json.loads(line) for line in train.read_text().splitlines() if line.strip()]
    lengths = draw_lengths(len(rows), seed, args.alpha, args.min_len, args.max_len)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"train-long-tail-seed{seed}.jsonl"
    path.write_text("".join(json.dumps(row | {"max_new_tokens": n}) + "\n" for row, n in zip(rows, lengths)))
    ordered = sorted(lengths)
    stats = {"mean": sum(lengths) / len(lengths), "median": ordered[len(ordered) // 2],
             "p90": ordered[int(0.9 * len(ordered))], "p99": ordered[int(0.99 * len(ordered))], "max": ordered[-1],
             "share_at_max": lengths.count(args.max_len) / len(lengths)}
    return path, stats


def heldout_pass_at_1(model_dir: str, eval_path: Path) -> float:
    """Greedy exact match on the held-out split, stopping at EOS (what `miles run` reports)."""
    from transformers import AutoTokenizer

    from miles_core.data import read_prompts
    from miles_core.engines.embedded.engine import EmbeddedEngine
    from miles_core.evaluation.core import evaluate_greedy

    cfg = c.local_config([])
    engine = EmbeddedEngine(model_dir, "float32", 1)
    prompts = read_prompts(eval_path, cfg.data, AutoTokenizer.from_pretrained(model_dir))
    return evaluate_greedy(engine, prompts, "exact_match", cfg.eval.max_new_tokens, cfg.eval.batch_size).pass_at_1


def run_mode(args, mode: str, seed: int, start_dir: Path, workload: Path, work: Path) -> dict:
    from miles_core.driver.session import TrainSpec, run_training

    cfg = c.local_config([f"seed={seed}", f"training.num_steps={args.steps}", f"rollout.max_new_tokens={args.max_len}",
                          f"rollout.num_prompts_per_step={args.prompts}", f"rollout.num_samples_per_prompt={args.samples}",
                          *COMMON, *MODES[mode],
                          *([f"rollout.loop.max_weight_staleness={args.max_weight_staleness}"] if mode != "sync" else [])])
    spec = TrainSpec(config=cfg, model_dir=str(start_dir), train_path=str(workload),
                     run_dir=str(work / f"run-{mode}-{seed}-{time.time_ns()}"))
    started = time.perf_counter()
    result = run_training(spec, on_metrics=lambda step, m: c.log(
        f"seed {seed} {mode} step {step}: {m['time/step_seconds']:.2f} s (wait {m['time/rollout_wait_seconds']:.2f}, "
        f"train {m['time/train_seconds']:.2f}), reward {m['rollout/reward_mean']:.3f}, "
        f"wasted {m['rollout/tokens_wasted']:.0f}, mixed {m['rollout/mixed_version_sample_frac']:.2f}"))
    wall = time.perf_counter() - started
    summary = summarize(result.history, args)
    summary |= {"run_wall_seconds": wall,
                "heldout_pass_at_1_after": heldout_pass_at_1(result.hf_export_dir, args.eval_path)}
    c.log(f"seed {seed} {mode}: {summary['step_seconds_mean']:.2f} s/step, wasted {summary['tokens_wasted']:.0f}, "
          f"pass@1 after {summary['heldout_pass_at_1_after']:.3f}")
    return summary


def summarize(history: list[dict], args) -> dict:
    from miles_core.metrics import (
        ASYNC_DROPPED_TOKENS,
        PARTIAL_TOKENS_THROWN_AWAY,
        REWARD_MEAN,
        STEP_SECONDS,
        TOKENS_UNUSED_AT_END,
        TOKENS_WASTED,
    )

    timed = history[args.skip:]
    batch = args.prompts * args.samples
    behind: dict[str, float] = {}
    for h in history:
        for key, value in h.items():
            if key.startswith("rollout/tokens_behind_"):
                behind[key.rsplit("_", 1)[1]] = behind.get(key.rsplit("_", 1)[1], 0.0) + value
    trained = sum(h["rollout/response_len_mean"] * batch for h in history)
    return {"steps": len(history), "step_seconds_mean": statistics.fmean(h[STEP_SECONDS] for h in timed),
            "step_seconds_all": [h[STEP_SECONDS] for h in history],
            "loop_seconds": sum(h[STEP_SECONDS] for h in history),
            "rollout_wait_seconds_mean": statistics.fmean(h["time/rollout_wait_seconds"] for h in timed),
            "train_seconds_mean": statistics.fmean(h["time/train_seconds"] for h in timed),
            # the rest of a step is the weight update: waiting for the engines (fully_async: the
            # producer's running batch, long tail included), the push, the health check
            "update_seconds_mean": statistics.fmean(h[STEP_SECONDS] - h["time/rollout_wait_seconds"]
                                                    - h["time/train_seconds"] for h in timed),
            "tokens_trained": trained, "tokens_wasted": history[-1][TOKENS_WASTED],
            # where the waste comes from: stale batches the schedule dropped, or partial groups thrown away
            "tokens_wasted_stale_batches": history[-1].get(ASYNC_DROPPED_TOKENS, 0.0),
            "tokens_wasted_partial_groups": history[-1].get(PARTIAL_TOKENS_THROWN_AWAY, 0.0),
            # generated ahead of a step that never came (fully async): not trained, not in the waste
            "tokens_unused_at_end": history[-1].get(TOKENS_UNUSED_AT_END, 0.0),
            "tokens_by_versions_behind": dict(sorted(behind.items(), key=lambda kv: int(kv[0]))),
            "mixed_version_sample_frac_mean": statistics.fmean(h["rollout/mixed_version_sample_frac"] for h in history),
            "staleness_mean": statistics.fmean(h.get("async/staleness", 0.0) for h in history),
            "dropped_batches": history[-1].get("async/dropped_batches", 0.0),
            "reward_curve": [h[REWARD_MEAN] for h in history],
            "reward_first5_mean": statistics.fmean(h[REWARD_MEAN] for h in history[:5]),
            "reward_last5_mean": statistics.fmean(h[REWARD_MEAN] for h in history[-5:]),
            "response_len_mean": statistics.fmean(h["rollout/response_len_mean"] for h in history)}


def aggregate(runs: dict[str, dict[str, dict]]) -> dict:
    """Per mode, the mean over seeds of each scalar, and each ratio against sync."""
    out = {}
    for mode in next(iter(runs.values())):
        per_seed = [r[mode] for r in runs.values()]
        out[mode] = {key: statistics.fmean(r[key] for r in per_seed)
                     for key, value in per_seed[0].items() if isinstance(value, (int, float))}
    if "sync" in out:
        for mode in out:
            out[mode]["step_seconds_over_sync"] = out[mode]["step_seconds_mean"] / out["sync"]["step_seconds_mean"]
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    c.setup_env()
    import ray

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model_dir, train = c.prepare_model("tiny", work), c.prepare_data(work)
    args.eval_path = train.parent / "eval.jsonl"
    start_dir = model_dir
    for steps in map(int, args.sft_steps.split(",")):  # rounds: each cached, a longer warm-up reuses the shorter
        start_dir = c.sft_warmup(start_dir, train, steps, work, "cpu")
    before = heldout_pass_at_1(str(start_dir), args.eval_path)
    seeds, modes = [int(s) for s in args.seeds.split(",")], args.modes.split(",")
    load_before, started = c.load_average(), time.perf_counter()
    runs, workloads = {}, {}
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            for i, seed in enumerate(seeds):
                workload, workloads[seed] = write_workload(train, work / "long-tail", seed, args)
                order = modes[i % len(modes):] + modes[: i % len(modes)]  # drift over time hits each mode alike
                runs[seed] = {mode: run_mode(args, mode, seed, start_dir, workload, work) for mode in order}
    finally:
        ray.shutdown()
    result = {"per_mode_mean_over_seeds": aggregate(runs), "runs": runs, "workload_lengths": workloads,
              "heldout_pass_at_1_before": before, "args": {k: v for k, v in vars(args).items() if k != "eval_path"},
              "commit": _commit(), "cpu_count": os.cpu_count(), "load_average_before": load_before,
              "load_average_after": c.load_average(), "wall_seconds": time.perf_counter() - started}
    text = json.dumps(c.rounded(result, 4))
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text, flush=True)
    return result


def _commit() -> str:
    return subprocess.run(["git", "-C", str(c.REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


if __name__ == "__main__":
    main()
