"""Does a recipe learn, over seeds, run the way `miles run` runs it? The flow's stages in order
(prepare model and data, SFT warm-up, held-out eval, the train task's driver `run_training`
with periodic eval, held-out eval of the export), without Prefect and MLflow, which the lent
GPU machine lacks: the same functions the flow's tasks call.

    python bench/recipe_learns.py --config configs/gpu-single.yaml --seeds 0 1 2 --out /tmp/learn
    python bench/recipe_learns.py --config configs/local.yaml --seeds 0 --set training.num_steps=20

Each seed runs in a process of its own, with its own local Ray and work dir (--parallel N runs
N at once: on one GPU the small recipes leave most of it idle). The goal of issue 39: every
seed's held-out pass@1 rises by at least --goal-gain within --goal-minutes of RL. Progress goes
to stderr; the last stdout line is one JSON object (per-seed curves, gains, the GPU and library
versions); --out also gets it as learn.json and, with matplotlib, the curves as learn.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c

TRACKED = ("rollout/train_logprob_abs_diff", "rollout/response_len_mean", "rollout/reward_mean",
           "time/step_seconds", "time/rollout_seconds", "time/train_seconds", "weights/sync_seconds")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(c.REPO / "configs/gpu-single.yaml"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--parallel", type=int, default=1, help="seeds run at once")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="extra dotted override")
    p.add_argument("--goal-gain", type=float, default=0.25)
    p.add_argument("--goal-minutes", type=float, default=15.0, help="of RL (after the warm-up)")
    p.add_argument("--num-cpus", type=int, default=None, help="each seed's local Ray (default: CPUs / parallel)")
    p.add_argument("--out", type=Path, default=None, help="folder for learn.json, learn.png and the seeds' logs")
    p.add_argument("--one-seed", type=int, default=None, help=argparse.SUPPRESS)  # a child process's seed
    p.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def stages(cfg, work: Path) -> dict:
    """One seed: the flow's stages, timed; returns its curve and figures."""
    import ray

    from miles_core.driver.session import HELDOUT_PASS_AT_1, TrainSpec, run_training
    from miles_core.evaluation.core import HELDOUT, evaluate_on_engines
    from miles_core.metrics import PERIODIC_EVAL_SECONDS
    from miles_core.storage.artifacts import prepare_data, prepare_model, warm_up

    model, data = prepare_model(cfg), prepare_data(cfg)
    started = time.perf_counter()
    warmed = warm_up(cfg, model, data)
    warm_seconds = time.perf_counter() - started
    c.log(f"seed {cfg.seed}: warm-up {warmed.sft_steps} steps, probe {warmed.probe_pass_at_1} in {warm_seconds:.0f} s")
    before = evaluate_on_engines(cfg, warmed.model_dir, data.eval_path)[HELDOUT].pass_at_1
    c.log(f"seed {cfg.seed}: held-out pass@1 before RL {before:.3f}")
    stamps: dict[int, float] = {}
    rl_started = time.perf_counter()

    def stepped(state) -> None:
        stamps[state.step] = time.perf_counter() - rl_started
        row = state.history[-1] if state.history else {}
        c.log(f"seed {cfg.seed}: step {state.step} reward {row.get('rollout/reward_mean', float('nan')):.3f} "
              f"len {row.get('rollout/response_len_mean', float('nan')):.0f} {stamps[state.step]:.0f} s")

    spec = TrainSpec(config=cfg, model_dir=warmed.model_dir, train_path=data.train_path,
                     run_dir=str(work / f"run-{time.strftime('%Y%m%d-%H%M%S')}"), eval_path=data.eval_path)
    result = run_training(spec, on_step=stepped)
    rl_seconds = time.perf_counter() - rl_started
    after = evaluate_on_engines(cfg, result.hf_export_dir, data.eval_path)[HELDOUT].pass_at_1
    ray.shutdown()
    curve = [{"step": 0, "rl_seconds": 0.0, "train_seconds": 0.0, "pass@1": before}]
    eval_seconds = 0.0
    for row in result.periodic_eval:
        eval_seconds += row.get(PERIODIC_EVAL_SECONDS, 0.0)
        stamp = stamps.get(int(row["step"]))
        curve.append({"step": int(row["step"]), "rl_seconds": stamp, "pass@1": row[HELDOUT_PASS_AT_1],
                      "train_seconds": None if stamp is None else stamp - eval_seconds})
    tracked = {k: c.median(row[k] for row in result.history if k in row) for k in TRACKED}
    return {"seed": cfg.seed, "warm_model_dir": warmed.model_dir, "train_path": data.train_path,
            "eval_path": data.eval_path, "warmup_steps": warmed.sft_steps, "warmup_probe_pass_at_1": warmed.probe_pass_at_1,
            "warmup_seconds": warm_seconds, "before": before, "after": after, "gain": after - before,
            "rl_steps": result.steps, "rl_seconds": rl_seconds, "curve": curve, "median_per_step": tracked}


def run_one_seed(args: argparse.Namespace) -> None:
    c.setup_env()
    import logging

    import ray

    # the warm-up's and periodic eval's progress lines reach seed.log as the run goes
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(name)s: %(message)s", datefmt="%H:%M:%S")
    import torch

    from miles_core.config import load_config

    work = args.result.parent
    cfg = load_config(args.config, [*args.overrides, f"seed={args.one_seed}", f"storage.work_dir={work}"])
    ray.init(num_cpus=args.num_cpus or os.cpu_count(), num_gpus=torch.cuda.device_count(), include_dashboard=False,
             log_to_driver=False)
    args.result.write_text(json.dumps(c.rounded(stages(cfg, work))))


def spawn(args: argparse.Namespace, seed: int, root: Path, num_cpus: int) -> dict:
    work = root / f"seed{seed}"
    work.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, __file__, "--config", args.config, "--one-seed", str(seed),
               "--result", str(work / "result.json"), "--num-cpus", str(num_cpus),
               *[x for o in args.overrides for x in ("--set", o)]]
    started = time.perf_counter()
    with open(work / "seed.log", "w") as log_file:
        proc = subprocess.run(command, stdout=log_file, stderr=subprocess.STDOUT, cwd=c.REPO)
    if proc.returncode != 0:
        tail = (work / "seed.log").read_text()[-3000:]
        c.log(f"seed {seed} failed (exit {proc.returncode}):\n{tail}")
        return {"seed": seed, "error": f"exit {proc.returncode}, see {work / 'seed.log'}",
                "seconds": round(time.perf_counter() - started, 1)}
    result = json.loads((work / "result.json").read_text())
    c.log(f"seed {seed}: before {result['before']:.3f} after {result['after']:.3f} gain {result['gain']:+.3f}")
    return result


def minutes_to_gain(curve: list[dict], gain: float) -> float | None:
    """RL minutes until held-out pass@1 first stood `gain` above its start (None: never)."""
    start = curve[0]["pass@1"]
    hit = next((p for p in curve[1:] if p["pass@1"] - start >= gain and p["rl_seconds"] is not None), None)
    return None if hit is None else hit["rl_seconds"] / 60


def plot(runs: list[dict], path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        if "curve" in run:
            points = [p for p in run["curve"] if p["rl_seconds"] is not None]
            ax.plot([p["rl_seconds"] / 60 for p in points], [p["pass@1"] for p in points], marker="o",
                    label=f"seed {run['seed']}")
    ax.set(xlabel="RL minutes", ylabel="held-out pass@1 (greedy)")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return True


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.one_seed is not None:
        run_one_seed(args)
        return {}
    c.setup_env()
    root = args.out or Path(tempfile.mkdtemp(prefix="miles-learn-"))
    root.mkdir(parents=True, exist_ok=True)
    num_cpus = args.num_cpus or max(2, (os.cpu_count() or 2) // args.parallel)
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        runs = list(pool.map(lambda s: spawn(args, s, root, num_cpus), args.seeds))
    for run in runs:
        if "curve" in run:
            run["minutes_to_goal_gain"] = minutes_to_gain(run["curve"], args.goal_gain)
    gains = [r["gain"] for r in runs if "gain" in r]
    on_time = [r.get("minutes_to_goal_gain") for r in runs]
    report = c.rounded({
        "bench": "recipe_learns", "config": args.config, "overrides": args.overrides, **c.gpu_identity(),
        "parallel": args.parallel, "goal_gain": args.goal_gain, "goal_minutes": args.goal_minutes,
        "runs": runs, "min_gain": min(gains) if gains else None,
        "goal_met": len(gains) == len(runs) and all(m is not None and m <= args.goal_minutes for m in on_time),
        "wall_seconds": time.perf_counter() - started})
    (root / "learn.json").write_text(json.dumps(report, indent=1))
    report["plot"] = str(root / "learn.png") if plot(runs, root / "learn.png") else None
    print(json.dumps(report), flush=True)
    return report


if __name__ == "__main__":
    main()
