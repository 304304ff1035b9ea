"""Weight sync time of each transport against the copy floor, in one run: the real trainer actor
and embedded engine actor (TrainingRun, placed as `miles run` places a colocated run), pushing
weights with no rollouts in between.

    python bench/weight_sync.py --model qwen3-0.6b-shape --transports shared_memory object_store disk
    python bench/weight_sync.py --backend megatron --transports shared_memory object_store

The floor is one `torch._foreach_copy_` of the same weights into the engine's dtype, on the same
device, measured in this process. Prints one JSON line: per transport the median sync over the
pushes after the first (the first lays out buffers and groups), its write/load split where the
transport reports one, and sync / floor.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    colocated_overrides,
    copy_floor_seconds,
    gpu_identity,
    local_config,
    log,
    median,
    prepare_data,
    prepare_model,
    rounded,
    setup_env,
)

TRANSPORTS = ("shared_memory", "object_store", "disk", "broadcast")


def time_transport(transport: str, backend: str, model_dir: Path, train_path: Path, work: Path, gpu: bool,
                   pushes: int) -> dict:
    from miles_core.driver.run import TrainingRun

    cfg = local_config(["training.num_steps=1", f"training.backend={backend}", *colocated_overrides(gpu, transport)])
    run = TrainingRun.open(cfg, work / f"run-{backend}-{transport}", str(model_dir), str(train_path))
    try:
        rows = []
        for version in range(1, pushes + 1):
            rows.append(run.push_weights(version))
            log(f"{transport} push {version}: " + "  ".join(f"{k} {v * 1e3:.2f} ms" for k, v in rows[-1].items()))
    finally:
        run.close()
    warm = rows[1:] or rows
    return {key.removeprefix("weights/"): median(row[key] for row in warm) for key in rows[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b-shape", choices=["tiny", "qwen3-0.6b-shape"])
    parser.add_argument("--transports", nargs="+", default=list(TRANSPORTS[:3]), choices=TRANSPORTS)
    parser.add_argument("--pushes", type=int, default=6, help="pushes per transport (the first is not counted)")
    parser.add_argument("--backend", default="fsdp2", choices=["fsdp2", "megatron"], help="the sending trainer")
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args()
    setup_env()
    import ray
    import torch

    gpu = torch.cuda.is_available()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="weight-sync-"))
    model_dir, train_path = prepare_model(args.model, work), prepare_data(work)
    ray.init(num_cpus=12, num_gpus=torch.cuda.device_count(), include_dashboard=False, log_to_driver=True)
    results = {}
    try:
        for transport in args.transports:
            started = time.perf_counter()
            results[transport] = time_transport(transport, args.backend, model_dir, train_path, work, gpu, args.pushes)
            log(f"{transport}: {results[transport]} ({time.perf_counter() - started:.0f} s with actor start)")
    finally:
        ray.shutdown()
    engine_dtype = "bfloat16" if gpu else "float32"
    floor = copy_floor_seconds(model_dir, engine_dtype)
    for row in results.values():
        row["over_copy_floor"] = row["sync_seconds"] / floor
    print(json.dumps(rounded({
        "bench": "weight_sync", "backend": args.backend, "model": args.model,
        **gpu_identity(),
        "engine_dtype": engine_dtype, "pushes": args.pushes, "copy_floor_seconds": floor, "transports": results,
    }, digits=6)), flush=True)


if __name__ == "__main__":
    main()
