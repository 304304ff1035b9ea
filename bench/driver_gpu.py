"""The RL driver loop with Ray on one GPU: the trainer actor and the embedded engine actor share
the GPU through fractional GPU bundles, exactly as `miles run` places them (TrainingRun, the
loop, the weight transport), on a random Qwen3 of the 0.6B shape or the tiny model.

    python bench/driver_gpu.py --model qwen3-0.6b-shape --steps 4
    python bench/driver_gpu.py --engine sglang --sglang-python /tmp/sgl-python    # auto: cuda_ipc
    python bench/driver_gpu.py --model qwen3-4b-shape --time-sharing --micro-batch 2 \
        --set training.fsdp.activation_checkpointing=true        # issue 40: 4B full-parameter on one GPU
    python bench/driver_gpu.py --model qwen3-4b-shape --engine sglang --sglang-python /tmp/sgl-python \
        --set training.lora.rank=32           # issue 41: LoRA, adapters alone to SGLang by disk

Prints one JSON line: the step-time breakdown (rollout, train, weight sync) per step and the
median over the steps after the first (the first compiles and warms caches).
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
    log,
    median,
    prepare_data,
    prepare_model,
    rounded,
    setup_env,
)

BREAKDOWN = ("time/step_seconds", "time/rollout_seconds", "time/rollout_wait_seconds", "time/train_seconds",
             "weights/sync_seconds", "weights/sync_bytes", "weights/ipc_gbytes",
             "weights/shared_write_seconds", "weights/shared_load_seconds",
             "rollout/tokens_per_second", "train/tokens_per_second", "rollout/train_logprob_abs_diff",
             "rollout/reward_mean", "train/loss",
             # placement.time_sharing: the trainer's offload/onload and the engine's release/resume
             "time/offload_seconds", "time/onload_seconds", "time/engine_release_seconds",
             "time/engine_resume_seconds", "time_sharing/offloaded_gib", "memory/train_peak_gib")


def sglang_overrides(engine: str, python: str | None, time_sharing: bool) -> list[str]:
    """A real SGLang server per engine actor, with the one-GPU recipe's args (the carried kernel
    wheel has no FA3: triton attention); time-sharing releases its memory, hence the saver."""
    if engine != "sglang":
        return []
    python_field = f", python: {python}" if python else ""
    saver = ", enable_memory_saver: true" if time_sharing else ""
    return ["rollout.engine={kind: sglang" + python_field + ", server_args: {attention_backend: triton, "
            "sampling_backend: pytorch, grammar_backend: none, mem_fraction_static: 0.3, skip_server_warmup: true"
            + saver + "}}"]


def plan_phases_gib(cfg, time_sharing: bool) -> dict | None:
    """`miles plan`'s per-GPU peak of each phase for this layout, time-shared or not (None
    without a GPU to share)."""
    from miles_core.memory import phase_peaks, shares_a_gpu

    placement = cfg.placement.model_copy(update={"time_sharing": time_sharing})
    cfg = cfg.model_copy(update={"placement": placement})
    peaks = phase_peaks(cfg) if shares_a_gpu(cfg) else None
    if peaks is None:
        return None
    return {phase: getattr(peaks, phase) / 2**30 for phase in ("rollout", "train", "sync", "peak")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b-shape", choices=["tiny", "qwen3-0.6b-shape", "qwen3-4b-shape"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--transport", default="auto", help="rollout.weight_transport (auto: what miles run picks)",
                        choices=["auto", "object_store", "shared_memory", "broadcast", "disk", "cuda_ipc"])
    parser.add_argument("--engine", default="embedded", choices=["embedded", "sglang"])
    parser.add_argument("--sglang-python", default=None, help="rollout.engine.python for --engine sglang")
    parser.add_argument("--time-sharing", action="store_true",
                        help="placement.time_sharing: trainer and engine take turns on the GPU (sync loop)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="extra dotted override")
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args()
    setup_env()
    import ray
    import torch
    from _common import local_config

    from miles_core.driver.loop import run_loop
    from miles_core.driver.run import RunHooks, TrainingRun

    gpu = torch.cuda.is_available()  # without one (a dry run on a CPU machine) the same layout, CPU only
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="driver-gpu-"))
    model_dir, train_path = prepare_model(args.model, work), prepare_data(work)
    cfg = local_config([
        f"training.num_steps={args.steps}", f"training.micro_batch_size={args.micro_batch}",
        f"rollout.num_prompts_per_step={args.prompts}", f"rollout.num_samples_per_prompt={args.samples}",
        f"rollout.max_new_tokens={args.max_new_tokens}", f"checkpoint.interval_steps={args.steps}",
        "rollout.request_timeout_seconds=900", f"model.source={model_dir}",  # the model's shape for miles plan
        *colocated_overrides(gpu, args.transport),
        *sglang_overrides(args.engine, args.sglang_python, args.time_sharing),
        *(["placement.time_sharing=true"] if args.time_sharing else []), *args.overrides,
    ])
    planned = {name: plan_phases_gib(cfg, shared) for name, shared in (("time_shared", True), ("unshared", False))}
    log(f"miles plan's per-GPU phase peaks (GiB): {planned}")
    ray.init(num_cpus=12, num_gpus=torch.cuda.device_count(), include_dashboard=False, log_to_driver=True)
    log(f"ray up: {ray.cluster_resources()}")
    opened = time.perf_counter()
    progress = RunHooks(on_metrics=lambda step, metrics: log(  # a run stopped by a time limit still reports
        f"step {step}: " + "  ".join(f"{k} {metrics[k]:.3f}" for k in BREAKDOWN if k in metrics)))
    run = TrainingRun.open(cfg, work / f"run-{args.transport}-{time.strftime('%H%M%S')}", str(model_dir),
                           str(train_path), hooks=progress)
    try:
        open_seconds = time.perf_counter() - opened
        log(f"trainer and engine actors up in {open_seconds:.1f} s")
        state, _ = run.resume()
        state = run_loop(run, state)
    finally:
        run.close()
        ray.shutdown()
    steps = [{k: row[k] for k in BREAKDOWN if k in row} for row in state.history]
    warm = steps[1:] or steps
    floor = copy_floor_seconds(model_dir, cfg.model.dtype)
    sync = median(r["weights/sync_seconds"] for r in warm)
    print(json.dumps(rounded({
        "bench": "driver_gpu", "model": args.model, "transport": cfg.rollout.weight_transport.kind, "engine": args.engine,
        "time_sharing": cfg.placement.time_sharing, "overrides": args.overrides,
        **gpu_identity(),
        "prompts": args.prompts, "samples": args.samples, "max_new_tokens": args.max_new_tokens,
        "open_seconds": open_seconds, "plan_phase_gib": planned,
        "steps": steps, "copy_floor_seconds": floor, "sync_over_copy_floor": sync / floor,
        "median_after_first": {k: median(r[k] for r in warm if k in r) for k in BREAKDOWN},
    })), flush=True)


if __name__ == "__main__":
    main()
