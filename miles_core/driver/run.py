"""One training run's live parts, owned by one object: `TrainingRun` starts the trainer and
engine actors, the weight transport, the periodic evaluator and the rollout schedule, resumes
from the latest complete checkpoint, and releases everything on close. The loop
(miles_core.driver.loop) drives it; the driver (miles_core.driver.session) opens it from a TrainSpec.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from transformers import AutoTokenizer

from miles_core.config import RunConfig
from miles_core.data import PromptSource, read_prompts
from miles_core.driver.placement import Placement, bundles
from miles_core.driver.trainer_group import kill_trainer, start_trainer_group
from miles_core.evaluation.periodic import PeriodicEvaluator
from miles_core.rollout.engine_group import EngineGroup
from miles_core.rollout.partial_state import PoolRecord, read_pool_state, write_pool_state
from miles_core.storage import checkpoint as ckpt
from miles_core.weight_sync.transports import WeightTransport, make_transport

log = logging.getLogger(__name__)
MetricsFn = Callable[[int, dict[str, float]], None]


def _noop(*_: Any) -> None:
    pass


def _engine_model_dir(cfg: RunConfig, model_dir: str, run_dir: Path) -> str:
    """The directory the rollout engines start from: model_dir, or with rollout.precision=fp8 a
    block-FP8 copy of it in the run directory (SGLang builds FP8 parameters only for a checkpoint
    that declares them; see miles_core.weight_sync.fp8_checkpoint). The embedded engine quantizes
    its own copy at start (--quantization fp8), any shape."""
    if cfg.rollout.precision != "fp8" or cfg.rollout.engine.kind != "sglang":
        return model_dir
    import json

    from miles_core.rollout.engine_group import engine_tp_size
    from miles_core.weight_sync.fp8_checkpoint import block_shape_problems, write_fp8_checkpoint

    tp = engine_tp_size(cfg.rollout.engine, cfg.rollout.gpus_per_engine)
    problems = block_shape_problems(json.loads((Path(model_dir) / "config.json").read_text()), tp)
    if problems:  # SGLang would fail at start-up, after minutes of loading: say why now
        raise ValueError(f"rollout.precision=fp8 quantizes in 128x128 blocks, which this model at tp={tp} does not "
                         f"fit: {'; '.join(problems)}. Use rollout.precision=bf16 (or a smaller tp)")
    return str(write_fp8_checkpoint(model_dir, run_dir / "engine_fp8_model"))


@dataclass
class RunHooks:
    """Where a run reports: metrics per step, each durable checkpoint, each finished step."""

    on_metrics: MetricsFn = _noop
    before_checkpoint: Callable[[int], None] = _noop
    """Called with the step before its checkpoint is written: a resume never recomputes the
    steps a complete checkpoint covers, so what must outlive them goes out here."""
    on_checkpoint: Callable[[int], None] = _noop
    on_step: Callable[[Any], None] = _noop
    """Called with the LoopState after every step (progress displays, stall detection)."""


@dataclass
class LoopState:
    step: int = 0
    weight_version: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    periodic_eval: list[dict[str, float]] = field(default_factory=list)
    """{"step": s, eval/periodic/...: value} per periodic evaluation of this attempt."""
    partial_pool: PoolRecord | None = None
    """rollout.partial: the pool of the checkpoint resumed from, for the producer to continue."""


def _fsdp_trainer() -> type:
    from miles_core.training.fsdp import FSDPTrainer

    return FSDPTrainer


def _megatron_trainer() -> type:
    # Imported only for this backend: megatron-core is an optional extra.
    from miles_core.training.megatron.trainer import MegatronTrainer

    return MegatronTrainer


# training.backend -> the trainer class; both implement the loop's trainer calls.
TRAINER_BACKENDS: dict[str, Callable[[], type]] = {"fsdp2": _fsdp_trainer, "megatron": _megatron_trainer}


def _anywhere(rank: int) -> dict[str, Any]:
    return {}


def start_trainer(cfg: RunConfig, model_dir: str, teacher_dir: str | None = None, megatron_dir: str | None = None,
                  scheduling: Callable[[int], dict[str, Any]] = _anywhere) -> Any:
    """The trainer of training.backend, built with cfg.training and cfg.algorithm: one actor, or
    (world_size > 1) a TrainerGroup of rank actors behind one handle. scheduling(rank): the Ray
    options placing a rank (a Placement's bundle); by default Ray places it (the SFT warm-up,
    which reserves no placement group). megatron_dir: a converted checkpoint to start from (else
    Megatron loads model_dir's HF weights)."""
    t = cfg.training
    trainer_type = TRAINER_BACKENDS[t.backend]()
    backend_kwargs = {"megatron_ckpt": megatron_dir} if t.backend == "megatron" else {}
    args = (model_dir, t, cfg.algorithm, cfg.rollout.temperature, cfg.rollout.max_new_tokens, cfg.seed,
            cfg.rollout.num_samples_per_prompt, teacher_dir)
    if t.world_size == 1:
        actor = ray.remote(num_cpus=t.cpus_per_trainer, num_gpus=t.gpus_per_trainer)(trainer_type)
        return actor.options(**scheduling(0)).remote(*args, **backend_kwargs)
    return start_trainer_group(trainer_type, t.world_size, scheduling, bundles(cfg)[0], args, backend_kwargs)


def _adapters_only(cfg: RunConfig) -> bool:
    """training.lora syncs the adapters alone: through the object store to embedded engines, and
    from disk to SGLang engines (launched to serve adapters, config.lora.check_lora_engines)."""
    kind = cfg.rollout.weight_transport.kind
    return cfg.training.lora_enabled and (kind != "disk" or cfg.rollout.engine.kind == "sglang")


@dataclass
class TrainingRun:
    """Everything one training attempt drives; `open` starts it, `close` releases it."""

    cfg: RunConfig
    run_dir: Path
    tokenizer: Any
    source: PromptSource
    layout: Placement
    trainer: Any
    engines: EngineGroup
    transport: WeightTransport
    evaluator: PeriodicEvaluator
    hooks: RunHooks = field(default_factory=RunHooks)
    run_key: str | None = None
    """Recorded in each checkpoint; only checkpoints of this key (and config) are resumed."""

    @classmethod
    def open(cls, cfg: RunConfig, run_dir: str | Path, model_dir: str, train_path: str, *,
             eval_path: str | None = None, teacher_dir: str | None = None, megatron_dir: str | None = None,
             hooks: RunHooks | None = None, run_key: str | None = None) -> TrainingRun:
        run_dir = Path(run_dir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        source = PromptSource(read_prompts(train_path, cfg.data, tokenizer), seed=cfg.seed)
        layout = Placement(cfg)
        trainer = engines = None
        try:
            trainer = start_trainer(cfg, model_dir, teacher_dir, megatron_dir, scheduling=layout.trainer)
            engines = EngineGroup(cfg, _engine_model_dir(cfg, model_dir, run_dir), scheduling=layout.engine)
            ray.get(trainer.__ray_ready__.remote())
            transport = make_transport(cfg.rollout.weight_transport, run_dir / "weight_sync",
                                       cfg.rollout.verify_weight_sync, ranks_per_engine=engines.tp_size,
                                       api_key=engines.api_key, engine_dtype=cfg.model.dtype,
                                       precision=cfg.rollout.precision,
                                       adapters_only=_adapters_only(cfg), on_adapter=engines.use_lora_adapter)
            evaluator = PeriodicEvaluator(cfg, model_dir, eval_path, trainer, run_dir, tokenizer)
        except BaseException:  # what did start must not hold its CPUs/GPUs for the retry
            if engines is not None:
                engines.shutdown()
            if trainer is not None:
                kill_trainer(trainer)
            layout.release()
            raise
        return cls(cfg, run_dir, tokenizer, source, layout, trainer, engines, transport, evaluator, hooks or RunHooks(),
                   run_key)

    @property
    def checkpoints_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    def push_weights(self, version: int) -> dict[str, float]:
        return self.transport.push(self.trainer, self.engines.targets(), version)

    @property
    def identity(self) -> ckpt.RunIdentity:
        return ckpt.RunIdentity.of(self.run_key, self.cfg)

    def resume(self) -> tuple[LoopState, int | None]:
        """The state after the latest complete checkpoint (restored into trainer, data source
        and engines), and its step; a fresh state and None when there is none. Checkpoints
        after it (incomplete, or from a diverged attempt) are discarded. A checkpoint of another
        run key or config is refused, before anything is discarded."""
        latest = ckpt.latest_complete_checkpoint(self.checkpoints_dir)
        if latest is None:
            ckpt.discard_after(self.checkpoints_dir, -1)
            return LoopState(), None
        step, path = latest
        ckpt.check_resumable(path, self.identity)
        # Read and validated before any state is restored: a bad file fails the resume whole.
        r = self.cfg.rollout
        pool = read_pool_state(path, r.num_samples_per_prompt) if r.partial.enabled else None
        ckpt.discard_after(self.checkpoints_dir, step)
        extra = ray.get(self.trainer.load_state.remote(str(path)))
        self.source.load_state_dict(extra["data"])
        state = LoopState(step=int(extra["step"]), weight_version=int(extra["weight_version"]), partial_pool=pool)
        self.push_weights(state.weight_version)
        log.info("resumed from checkpoint step %d (%s)", step, path)
        return state, step

    def save(self, state: LoopState, cursor: dict, partial: dict | None = None) -> Path:
        """A complete checkpoint of the state after state.step (cursor: the data source's;
        partial: the rollout.partial producer's pool taken with that cursor)."""
        extra = {"step": state.step, "weight_version": state.weight_version, "data": cursor}

        def write(staging: Path) -> None:
            ray.get(self.trainer.save_state.remote(str(staging), extra))
            if partial is not None:  # in the staging dir: sealed by the same manifest, published by the same rename
                write_pool_state(staging, partial)

        path = ckpt.write_checkpoint(self.checkpoints_dir, state.step, self.cfg.digest(), write, self.identity)
        ckpt.prune(self.checkpoints_dir, self.cfg.checkpoint.keep_latest)
        return path

    def export_hf(self) -> Path:
        export_dir = self.run_dir / "hf_export"
        ray.get(self.trainer.export_hf.remote(str(export_dir)))
        return export_dir

    def close(self) -> None:
        """Release actors and bundles: a failed attempt must not hold CPUs/GPUs for the retry."""
        self.evaluator.close()
        self.engines.shutdown()
        kill_trainer(self.trainer)
        self.layout.release()
