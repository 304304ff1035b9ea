"""Sync vs one-step-off rollouts on the tiny recipe, and the cost of weight sync.

    python bench/async_vs_sync.py --steps 12 --repeats 2

Runs configs/local.yaml (from an SFT-warmed tiny model, or random with --sft-steps 0) on one
local Ray session: rollout.loop=sync and rollout.loop=one_step_off (+ correction tis) back to
back, alternating for --repeats rounds, each actor with one torch thread and one Ray CPU so
that generation and training can overlap on two cores. From the sync runs' histories, R is
the median rollout time and T the median train time of a step; the one-step-off loop is
ideal when a step takes max(R, T) (goal: async / max(R, T) <= 1.10).

Weight sync: "weights/sync_seconds" of the sync runs (object_store) and of extra sync runs
with rollout.weight_transport=broadcast (gloo), against a plain in-memory copy of the same
state dict (torch.cat into one buffer, and a per-tensor clone) measured in this process.
Progress goes to stderr; the last stdout line is the JSON result.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c

LOOPS = {"sync": ["rollout.loop=sync"],
         "one_step_off": ["rollout.loop=one_step_off", "algorithm.correction.kind=tis"]}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12, help="steps per run (the first --skip are dropped)")
    p.add_argument("--skip", type=int, default=2, help="warm-up steps dropped from each run")
    p.add_argument("--repeats", type=int, default=1, help="rounds of sync then one_step_off")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each actor")
    p.add_argument("--sft-steps", type=int, default=250, help="SFT warm-up steps (0 = random model)")
    p.add_argument("--transport-steps", type=int, default=6, help="steps of each extra transport run")
    p.add_argument("--transports", default="broadcast", help="extra transports to time (comma list; '' = none)")
    p.add_argument("--copy-reps", type=int, default=50, help="repetitions of the plain-copy baseline")
    p.add_argument("--work-dir", default="/tmp/miles-bench")
    return p.parse_args(argv)


def run_config(args, steps: int, overrides: list[str]):
    return c.local_config([f"training.num_steps={steps}", "checkpoint.interval_steps=100000",
                           f"training.num_threads={args.threads}", "training.cpus_per_trainer=1",
                           "rollout.cpus_per_engine=1", *overrides])


def run_once(args, name: str, steps: int, overrides: list[str], model_dir: Path, train: Path, work: Path):
    from miles_core.driver.session import TrainSpec, run_training

    cfg = run_config(args, steps, overrides)
    spec = TrainSpec(config=cfg, model_dir=str(model_dir), train_path=str(train),
                     run_dir=str(work / f"run-{time.time_ns()}"))
    started = time.perf_counter()
    history = run_training(spec, on_metrics=lambda step, m: c.log(
        f"{name} step {step}: {m['time/step_seconds']:.3f} s (rollout {m['time/rollout_seconds']:.3f}, "
        f"wait {m['time/rollout_wait_seconds']:.3f}, train {m['time/train_seconds']:.3f}, "
        f"sync {m['weights/sync_seconds'] * 1e3:.1f} ms)")).history
    c.log(f"{name}: {steps} steps in {time.perf_counter() - started:.1f} s (actors' start included)")
    return history[args.skip:]


def column(history: list[dict], key: str) -> list[float]:
    return [h[key] for h in history if key in h]


def loop_summary(history: list[dict]) -> dict:
    keys = {"step": "time/step_seconds", "rollout": "time/rollout_seconds", "train": "time/train_seconds",
            "rollout_wait": "time/rollout_wait_seconds", "sync": "weights/sync_seconds"}
    out = {f"{name}_seconds_median": c.median(column(history, key)) for name, key in keys.items()}
    out["steps"] = len(history)
    out["step_seconds_all"] = column(history, "time/step_seconds")
    return out


def overlap_report(loops: dict[str, list[dict]]) -> dict:
    sync, asyn = loop_summary(loops["sync"]), loop_summary(loops["one_step_off"])
    r, t = sync["rollout_seconds_median"], sync["train_seconds_median"]
    bound = max(r, t)
    ratio = asyn["step_seconds_median"] / bound
    return {"sync": sync, "one_step_off": asyn, "R_rollout_seconds": r, "T_train_seconds": t,
            "async_over_max_RT": ratio, "sync_over_async": sync["step_seconds_median"] / asyn["step_seconds_median"],
            "ideal_sync_over_async": (r + t) / bound, "sync_over_max_RT": sync["step_seconds_median"] / bound,
            "goal_async_over_max_RT": 1.10, "goal_met": ratio <= 1.10,
            # Where the gap to max(R, T) comes from: the two sides slow each other down on shared
            # cores, and the weight push runs after training, never overlapped.
            "train_inflation_async_over_sync": asyn["train_seconds_median"] / t,
            "rollout_inflation_async_over_sync": asyn["rollout_seconds_median"] / r,
            "push_share_of_max_RT": asyn["sync_seconds_median"] / bound}


def timed_median(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return c.median(samples)


def plain_copy_baseline(model_dir: Path, reps: int, threads: int) -> dict:
    """In-memory copies of the bytes a push moves (the HF state dict, tied head dropped, as
    the trainer's hf_state_dict and the exported safetensors hold it)."""
    import torch
    from safetensors.torch import load_file

    torch.set_num_threads(threads)
    state = load_file(str(model_dir / "model.safetensors"))
    flat = [t.reshape(-1).view(torch.uint8) for t in state.values()]
    nbytes = sum(t.numel() for t in flat)
    cat = timed_median(lambda: torch.cat(flat), reps)
    clone = timed_median(lambda: {k: v.clone() for k, v in state.items()}, reps)
    return {"bytes": nbytes, "num_tensors": len(state), "cat_seconds": cat, "clone_seconds": clone,
            "cat_gbytes_per_second": nbytes / cat / 1e9, "clone_gbytes_per_second": nbytes / clone / 1e9}


def in_process_push(model_dir: Path, reps: int, threads: int) -> dict:
    """The two halves of an object-store push without Ray: the trainer gathering its FSDP2
    shards into a full HF state dict, and the engine copying it into its model."""
    from miles_core.engines.embedded.engine import EmbeddedEngine
    from miles_core.training.fsdp import FSDPTrainer

    cfg = run_config(argparse.Namespace(threads=threads), 1, [])
    trainer = FSDPTrainer(str(model_dir), cfg.training, cfg.algorithm, seed=cfg.seed)
    engine = EmbeddedEngine(str(model_dir), cfg.model.dtype, threads)
    state = trainer.hf_state_dict()
    try:
        return {"trainer_hf_state_dict_seconds": timed_median(trainer.hf_state_dict, reps),
                "engine_load_seconds": timed_median(lambda: engine.update_weights_from_tensors(state, "1"), reps)}
    finally:
        trainer.close()


def transport_report(histories: dict[str, list[dict]], copy: dict, local: dict) -> dict:
    out = {"plain_copy": copy, "in_process_push_parts": local}
    for name, history in histories.items():
        seconds = c.median(column(history, "weights/sync_seconds"))
        entry = {"bytes": copy["bytes"], "sync_seconds_median": seconds, "steps": len(history),
                 "gbytes_per_second": copy["bytes"] / seconds / 1e9,
                 "ratio_over_plain_cat": seconds / copy["cat_seconds"],
                 "ratio_over_plain_clone": seconds / copy["clone_seconds"]}
        if column(history, "weights/broadcast_seconds"):
            entry["broadcast_seconds_median"] = c.median(column(history, "weights/broadcast_seconds"))
            entry["bytes_reported_by_broadcast"] = int(c.median(column(history, "weights/broadcast_gbytes")) * 1e9)
        out[name] = entry
    return out


def run_all(args, model_dir: Path, train: Path, work: Path) -> tuple[dict, dict]:
    loops: dict[str, list[dict]] = {name: [] for name in LOOPS}
    for repeat in range(args.repeats):
        for name, overrides in LOOPS.items():
            c.log(f"round {repeat + 1}/{args.repeats}: loop {name}")
            loops[name] += run_once(args, name, args.steps, overrides, model_dir, train, work)
    transports = {"object_store": loops["sync"]}
    for kind in filter(None, args.transports.split(",")):
        c.log(f"transport {kind} (sync loop)")
        transports[kind] = run_once(args, f"sync+{kind}", args.transport_steps,
                                    ["rollout.loop=sync", f"rollout.weight_transport={kind}"], model_dir, train, work)
    return loops, transports


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the tiny recipe is a CPU benchmark
    c.setup_env()
    import ray

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model_dir, train = c.prepare_model("tiny", work), c.prepare_data(work)
    start_dir = c.sft_warmup(model_dir, train, args.sft_steps, work, "cpu")
    load_before, started = c.load_average(), time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            loops, transports = run_all(args, start_dir, train, work)
    finally:
        ray.shutdown()
    copy = plain_copy_baseline(start_dir, args.copy_reps, args.threads)
    local = in_process_push(start_dir, args.copy_reps, args.threads)
    result = {"overlap": overlap_report(loops), "weight_sync": transport_report(transports, copy, local),
              "start_model": "random" if args.sft_steps == 0 else f"sft_warmup_{args.sft_steps}_steps",
              "steps_per_run": args.steps, "skipped_warmup_steps": args.skip, "repeats": args.repeats,
              "threads_per_actor": args.threads, "ray_cpus": 2, "cpu_count": os.cpu_count(),
              "load_average_before": load_before, "load_average_after": c.load_average(),
              "wall_seconds": time.perf_counter() - started}
    print(json.dumps(c.rounded(result, 5)), flush=True)
    return result


if __name__ == "__main__":
    main()
