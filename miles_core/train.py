"""Training driver: builds the actors, resumes from the latest checkpoint, runs the loop.

miles_core.driver wraps it with metric logging and checkpoint uploads; the flow's train task
runs that inline or as a Ray Job (placement.driver).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import ray
from transformers import AutoTokenizer

from miles_core import checkpoint as ckpt
from miles_core.config import RunConfig
from miles_core.data import PromptSource, read_prompts
from miles_core.loop import LoopState, MetricsFn, run_loop
from miles_core.periodic_eval import PeriodicEvaluator
from miles_core.placement import Placement, bundles
from miles_core.rollout.engine_group import EngineGroup
from miles_core.trainer_group import kill_trainer, start_trainer_group
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
    eval_path: str | None = None
    """Held-out prompts of periodic evaluation (eval.interval_steps); None disables it."""
    megatron_dir: str | None = None
    """Converted torch_dist directory (convert-checkpoint stage) the Megatron trainer starts
    from; None starts it from model_dir's HF weights (fsdp2 always reads model_dir)."""


@dataclass
class TrainResult:
    steps: int
    resumed_from_step: int | None
    final_checkpoint_dir: str
    hf_export_dir: str
    history: list[dict]
    periodic_eval: list[dict] = field(default_factory=list)


def _fsdp_trainer(megatron_dir: str | None) -> tuple[type, dict]:
    from miles_core.training.fsdp import FSDPTrainer

    return FSDPTrainer, {}


def _megatron_trainer(megatron_dir: str | None) -> tuple[type, dict]:
    # Imported only for this backend: megatron-core is an optional extra.
    from miles_core.training.megatron.trainer import MegatronTrainer

    return MegatronTrainer, {"megatron_ckpt": megatron_dir}


# training.backend -> (trainer class, backend-only constructor kwargs); both speak one protocol.
TRAINER_BACKENDS: dict[str, Callable[[str | None], tuple[type, dict]]] = {
    "fsdp2": _fsdp_trainer,
    "megatron": _megatron_trainer,
}


def start_actors(cfg: RunConfig, model_dir: str, teacher_dir: str | None = None, megatron_dir: str | None = None):
    layout = Placement(cfg)
    trainer_type, backend_kwargs = TRAINER_BACKENDS[cfg.training.backend](megatron_dir)
    t = cfg.training
    args = (model_dir, cfg.training, cfg.algorithm, cfg.rollout.temperature, cfg.rollout.max_new_tokens, cfg.seed,
            cfg.rollout.num_samples_per_prompt, teacher_dir)
    if t.world_size == 1:
        trainer_cls = ray.remote(num_cpus=t.cpus_per_trainer, num_gpus=t.gpus_per_trainer)(trainer_type)
        trainer = trainer_cls.options(**layout.trainer(0)).remote(*args, **backend_kwargs)
    else:  # Megatron tp * ep > 1: one actor per rank, driven as one handle
        trainer = start_trainer_group(trainer_type, t.world_size, layout.trainer, bundles(cfg)[0], args,
                                      backend_kwargs)
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
    layout, trainer, engines = start_actors(cfg, spec.model_dir, spec.teacher_dir, spec.megatron_dir)
    evaluator = PeriodicEvaluator(cfg, spec.model_dir, spec.eval_path, trainer, run_dir, tokenizer)
    try:
        return _resume_and_loop(cfg, run_dir, source, tokenizer, trainer, engines, on_metrics, on_checkpoint, on_step,
                                evaluator)
    finally:  # a failed attempt must not leave actors holding CPUs/GPUs for the retry
        evaluator.close()
        engines.shutdown()
        kill_trainer(trainer)
        layout.release()


def _resume_and_loop(cfg: RunConfig, run_dir: Path, source: PromptSource, tokenizer, trainer, engines,
                     on_metrics, on_checkpoint, on_step, evaluator: PeriodicEvaluator) -> TrainResult:
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
                     on_metrics, on_checkpoint, on_step, evaluator)
    export_dir = run_dir / "hf_export"
    ray.get(trainer.export_hf.remote(str(export_dir)))
    final = ckpt.latest_complete_checkpoint(checkpoints)
    return TrainResult(steps=state.step, resumed_from_step=resumed_from, final_checkpoint_dir=str(final[1]),
                       hf_export_dir=str(export_dir), history=state.history, periodic_eval=state.periodic_eval)
