"""Does the default recipe learn whatever the seed, the initial weights, the thread count and
the CPU kernels? Runs `miles run configs/local.yaml` once per variant, as a user would.

    python bench/seed_sweep.py                       # seeds 0-4 under every CPU capability, + perturbations
    python bench/seed_sweep.py --seeds 0 1 --capabilities avx2 --no-perturbations

Variants: each --seeds value under each --capabilities value (ATEN_CPU_CAPABILITY selects
torch's CPU kernels: default, avx2, avx512; those this CPU lacks are skipped), plus, under
the machine's own kernels, another initialisation (`model.tiny.seed`) and one torch thread
(`training.num_threads=1`) for the first seed. Each run has its own work dir, so nothing is
cached between variants. The goal (issue: the recipe learns on every machine): every gain
(held-out pass@1 after - before) >= 0.20. Progress goes to stderr; the last stdout line is
one JSON object: per-run before/after/gain/warm-up steps/seconds, min and median gain, wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOAL_GAIN = 0.20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "configs/local.yaml"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--capabilities", nargs="+", default=["default", "avx2", "avx512"],
                   help="ATEN_CPU_CAPABILITY values (unsupported ones are skipped)")
    p.add_argument("--no-perturbations", action="store_true", help="skip the tiny-seed and one-thread variants")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="extra dotted override")
    p.add_argument("--work-dir", default=None, help="where runs go (default: a temporary directory)")
    return p.parse_args(argv)


def supported_capabilities(wanted: list[str]) -> list[str]:
    """The wanted capabilities this CPU runs (torch falls back silently otherwise: a duplicate)."""
    import torch

    order = ["default", "avx2", "avx512"]
    best = torch.backends.cpu.get_cpu_capability().lower()
    best = best if best in order else "default"
    return [c for c in wanted if c in order and order.index(c) <= order.index(best)]


def variants(args: argparse.Namespace) -> list[dict]:
    native = supported_capabilities(["avx512", "avx2", "default"])[0]
    runs = [{"name": f"seed={s} cap={cap}", "capability": cap, "overrides": [f"seed={s}"]}
            for cap in supported_capabilities(args.capabilities) for s in args.seeds]
    if not args.no_perturbations:
        first = args.seeds[0]
        runs += [{"name": f"seed={first} tiny.seed=1 cap={native}", "capability": native,
                  "overrides": [f"seed={first}", "model.tiny.seed=1"]},
                 {"name": f"seed={first} threads=1 cap={native}", "capability": native,
                  "overrides": [f"seed={first}", "training.num_threads=1"]}]
    return runs


def run_one(variant: dict, config: str, extra: list[str], work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")},
           "ATEN_CPU_CAPABILITY": variant["capability"], "PYTHONPATH": str(REPO)}
    env.pop("MLFLOW_TRACKING_URI", None)
    sets = [x for o in [*variant["overrides"], *extra, f"storage.work_dir={work}"] for x in ("--set", o)]
    started = time.perf_counter()
    with open(work / "miles.log", "w") as log_file:
        proc = subprocess.run([sys.executable, "-m", "flows.cli", "run", config, "--run-dir", str(work / "run"), *sets],
                              cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT, timeout=1800)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        return {"name": variant["name"], "error": f"exit {proc.returncode}, see {work / 'miles.log'}",
                "seconds": round(seconds, 1)}
    summary = json.loads((work / "run" / "summary.json").read_text())
    before, after = summary["eval"]["before"], summary["eval"]["after"]
    return {"name": variant["name"], "before": before, "after": after, "gain": round(after - before, 4),
            "warmup_steps": summary["warmup"]["sft_steps"], "warmup_probe": summary["warmup"]["probe_pass_at_1"],
            "seconds": round(seconds, 1)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    root = Path(args.work_dir or tempfile.mkdtemp(prefix="miles-seed-sweep-"))
    started, results = time.perf_counter(), []
    for i, variant in enumerate(variants(args)):
        result = run_one(variant, args.config, args.overrides, root / f"run{i:02d}")
        results.append(result)
        print(f"[seed_sweep] {json.dumps(result)}", file=sys.stderr, flush=True)
    gains = [r["gain"] for r in results if "gain" in r]
    report = {"bench": "seed_sweep", "config": args.config, "goal_min_gain": GOAL_GAIN, "runs": results,
              "min_gain": min(gains) if gains else None, "median_gain": statistics.median(gains) if gains else None,
              "failed_runs": sum("error" in r for r in results),
              "goal_met": bool(gains) and len(gains) == len(results) and min(gains) >= GOAL_GAIN,
              "wall_seconds": round(time.perf_counter() - started, 1)}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
