"""Training driver: builds the actors, resumes from the latest checkpoint, runs the loop.

This is what a Ray Job runs on a cluster (`python -m miles_core.train --spec spec.json`)
and what the flow's train task calls inline in local mode.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import ray
from transformers import AutoTokenizer

from miles_core import checkpoint as ckpt
from miles_core.config import RunConfig
from miles_core.data import PromptSource, read_prompts
from miles_core.loop import LoopState, MetricsFn, run_loop
from miles_core.placement import Placement
from miles_core.rollout.engine_group import EngineGroup
from miles_core.training.fsdp import FSDPTrainer
from miles_core.weights import make_transport

log = logging.getLogger(__name__)


@dataclass
class TrainSpec:
    """Everything the driver needs, as plain data (it crosses process boundaries)."""

    config: dict
    model_dir: str
    train_path: str
    run_dir: str
    teacher_dir: str | None = None


@dataclass
class TrainResult:
    steps: int
    resumed_from_step: int | None
    final_checkpoint_dir: str
    hf_export_dir: str
    history: list[dict]


def start_actors(cfg: RunConfig, model_dir: str, teacher_dir: str | None = None):
    layout = Placement(cfg)
    trainer_cls = ray.remote(num_cpus=cfg.training.cpus_per_trainer, num_gpus=cfg.training.gpus_per_trainer)(FSDPTrainer)
    trainer = trainer_cls.options(**layout.trainer(0)).remote(
        model_dir, cfg.training, cfg.algorithm, cfg.rollout.temperature, cfg.rollout.max_new_tokens, cfg.seed,
        cfg.rollout.num_samples_per_prompt, teacher_dir)
    engines = EngineGroup(cfg, model_dir, scheduling=layout.engine)
    ray.get(trainer.__ray_ready__.remote())
    return layout, trainer, engines


def run_training(spec: TrainSpec, on_metrics: MetricsFn = lambda step, m: None,
                 on_checkpoint: Callable[[int], None] = lambda step: None,
                 on_step: Callable[[LoopState], None] = lambda s: None) -> TrainResult:
    cfg = RunConfig.model_validate(spec.config)
    run_dir = Path(spec.run_dir)
    tokenizer = AutoTokenizer.from_pretrained(spec.model_dir)
    source = PromptSource(read_prompts(spec.train_path, cfg.data, tokenizer), seed=cfg.seed)
    layout, trainer, engines = start_actors(cfg, spec.model_dir, spec.teacher_dir)
    try:
        return _resume_and_loop(cfg, run_dir, source, tokenizer, trainer, engines, on_metrics, on_checkpoint, on_step)
    finally:  # a failed attempt must not leave actors holding CPUs/GPUs for the retry
        engines.shutdown()
        ray.kill(trainer)
        layout.release()


def _resume_and_loop(cfg: RunConfig, run_dir: Path, source: PromptSource, tokenizer, trainer, engines,
                     on_metrics, on_checkpoint, on_step) -> TrainResult:
    checkpoints = run_dir / "checkpoints"
    r = cfg.rollout
    transport = make_transport(r.weight_transport, str(run_dir), r.broadcast_bucket_megabytes, r.verify_weight_sync)
    state, resumed_from = LoopState(), None
    latest = ckpt.latest_complete_checkpoint(checkpoints)
    if latest is not None:
        resumed_from, path = latest
        ckpt.discard_after(checkpoints, resumed_from)
        extra = ray.get(trainer.load_state.remote(str(path)))
        source.load_state_dict(extra["data"])
        state = LoopState(step=int(extra["step"]), weight_version=int(extra["weight_version"]))
        transport.push(trainer, engines.targets(), state.weight_version)
        log.info("resumed from checkpoint step %d (%s)", resumed_from, path)
    else:
        ckpt.discard_after(checkpoints, -1)
    state = run_loop(cfg, trainer, engines, transport, source, run_dir, state, tokenizer,
                          on_metrics, on_checkpoint, on_step)
    export_dir = run_dir / "hf_export"
    ray.get(trainer.export_hf.remote(str(export_dir)))
    final = ckpt.latest_complete_checkpoint(checkpoints)
    return TrainResult(steps=state.step, resumed_from_step=resumed_from, final_checkpoint_dir=str(final[1]),
                       hf_export_dir=str(export_dir), history=state.history)


def main() -> None:
    parser = argparse.ArgumentParser(description="Run the RL training driver from a spec file.")
    parser.add_argument("--spec", required=True, help="JSON file with a TrainSpec")
    parser.add_argument("--result", required=True, help="where to write the TrainResult JSON")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    spec = TrainSpec(**json.loads(Path(args.spec).read_text()))
    ray.init(address="auto", ignore_reinit_error=True)
    result = run_training(spec)
    Path(args.result).write_text(json.dumps(asdict(result)))


if __name__ == "__main__":
    main()
