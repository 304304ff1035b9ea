"""Supervised warm-up: SFT on the training labels before RL begins, optionally stopped at a
probe accuracy (warmup.target_pass_at_1) instead of a fixed step count."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ray

from miles_core.config import AlgorithmConfig, RunConfig
from miles_core.data import sft_samples
from miles_core.driver.run import start_trainer
from miles_core.driver.trainer_group import kill_trainer
from miles_core.types import Prompt

log = logging.getLogger(__name__)
ProgressFn = Callable[[int, float, float | None], None]
"""(step, loss, probe pass@1 or None when not measured at this step)."""


@dataclass
class WarmupResult:
    model_dir: Path
    steps: int
    """SFT steps actually trained."""
    probe_pass_at_1: float | None
    """Greedy pass@1 on the probe prompts at the end (None without a target)."""
    reached_target: bool | None
    """Whether target_pass_at_1 was reached within sft_steps (None without a target)."""


def split_probe(cfg: RunConfig, prompts: list[Prompt]) -> tuple[list[Prompt], list[Prompt]]:
    """(SFT prompts, probe prompts): a seeded sample held out of the warm-up when a target is set."""
    if cfg.warmup.target_pass_at_1 is None:
        return prompts, []
    num_probe = cfg.warmup.num_probe_prompts
    if num_probe >= len(prompts):
        raise ValueError(f"warmup.num_probe_prompts={num_probe} leaves no training prompts for the warm-up "
                         f"({len(prompts)} in all): lower it")
    held = set(random.Random(cfg.seed).sample(range(len(prompts)), num_probe))
    return [p for i, p in enumerate(prompts) if i not in held], [p for i, p in enumerate(prompts) if i in held]


def probe_device(cfg: RunConfig) -> str:
    """Where the probe engine runs: the GPU this process sees when the trainer trains on one
    (a scratchpad task's long answers take minutes to decode on a CPU), else the CPU."""
    import torch

    return "cuda" if cfg.training.gpus_per_trainer > 0 and torch.cuda.is_available() else "cpu"


class _Probe:
    """Greedy pass@1 of the trainer's current weights on the probe prompts, on an embedded
    engine in this process (the warm-up is a small-model stage)."""

    def __init__(self, cfg: RunConfig, model_dir: str, prompts: list[Prompt]):
        from miles_core.engines.embedded.engine import EmbeddedEngine
        from miles_core.rollout.engine_group import embedded_server_args

        self.cfg, self.prompts = cfg, prompts
        # an SGLang recipe's probe is embedded too: only an embedded engine's bounds apply to it
        engine = cfg.rollout.engine
        memory = embedded_server_args(engine).get("mem_fraction_static") if engine.kind == "embedded" else None
        self.engine = EmbeddedEngine(model_dir, cfg.model.dtype, cfg.training.num_threads, device=probe_device(cfg),
                                     mem_fraction_static=memory)

    def score(self, trainer, step: int) -> float:
        from miles_core.evaluation.core import evaluate_greedy

        weights = ray.get(trainer.hf_state_dict.remote(to_cpu=True))
        self.engine.update_weights_from_tensors(weights, f"warmup-{step}")
        e = self.cfg.eval
        return evaluate_greedy(self.engine, self.prompts, self.cfg.rollout.reward, e.max_new_tokens,
                               e.batch_size).pass_at_1


def warmup_config(cfg: RunConfig) -> RunConfig:
    """The recipe as the warm-up trains it: the run's backend and parallel layout, SFT at
    warmup.lr from the first step."""
    # Every weight trains (training.lora is the RL stage's): the warm-up builds the base the
    # adapters then adapt, starting from random weights for the built-in model.
    training = cfg.training.model_copy(update={"lr": cfg.warmup.lr, "lr_warmup_steps": 0, "lora": None})
    # SFT fits the labels with unscaled logits, whatever temperature rollout samples at; and it
    # needs no critic, reference or teacher, whatever the RL objective after it.
    rollout = cfg.rollout.model_copy(update={"temperature": 1.0})
    return cfg.model_copy(update={"training": training, "rollout": rollout, "algorithm": AlgorithmConfig(name="sft")})


def run_sft_warmup(cfg: RunConfig, model_dir: str, prompts: list[Prompt], tokenizer, out_dir: str | Path,
                   on_step: ProgressFn | None = None) -> WarmupResult:
    """Train up to cfg.warmup.sft_steps supervised steps from model_dir in a trainer actor
    (stopping early at warmup.target_pass_at_1), built as the run builds its trainer
    (training.backend); save the result as an HF directory."""
    w = cfg.warmup
    train_prompts, probe_prompts = split_probe(cfg, prompts)
    trainer = start_trainer(warmup_config(cfg), model_dir)
    probe = _Probe(cfg, model_dir, probe_prompts) if probe_prompts else None
    score, steps = None, 0
    try:
        samples = sft_samples(train_prompts, tokenizer, cfg.data.solution_key)
        rng = random.Random(cfg.seed)
        for step in range(w.sft_steps):
            batch = rng.sample(samples, min(w.batch_size, len(samples)))
            loss = ray.get(trainer.sft_step.remote(batch))
            steps = step + 1
            checked = probe is not None and (steps % w.check_interval_steps == 0 or steps == w.sft_steps)
            score = probe.score(trainer, steps) if checked else score
            if on_step:
                on_step(step, loss, score if checked else None)
            if checked and score >= w.target_pass_at_1:
                break
        ray.get(trainer.export_hf.remote(str(out_dir)))
    finally:
        kill_trainer(trainer)
    reached = None if probe is None or score is None else score >= w.target_pass_at_1
    if reached is False:
        log.warning("SFT warm-up ended at its step limit (%d) with probe pass@1 %.3f, below warmup.target_pass_at_1="
                    "%.3f: RL starts weaker than the recipe intends (raise warmup.sft_steps or warmup.lr)",
                    steps, score, w.target_pass_at_1)
    return WarmupResult(Path(out_dir), steps, score, reached)
