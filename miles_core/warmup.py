"""Supervised warm-up: a few SFT steps on the training labels before RL begins."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

import ray

from miles_core.config import RunConfig
from miles_core.data import Prompt, sft_samples
from miles_core.training.fsdp import FSDPTrainer


def run_sft_warmup(cfg: RunConfig, model_dir: str, prompts: list[Prompt], tokenizer, out_dir: str | Path,
                   on_step: Callable[[int, float], None] | None = None) -> Path:
    """Train cfg.warmup.sft_steps supervised steps from model_dir in a trainer actor; save HF."""
    training = cfg.training.model_copy(update={"lr": cfg.warmup.lr, "lr_warmup_steps": 0})
    actor_cls = ray.remote(num_cpus=cfg.training.cpus_per_trainer, num_gpus=cfg.training.gpus_per_trainer)(FSDPTrainer)
    trainer = actor_cls.remote(model_dir, training, cfg.algorithm, seed=cfg.seed)
    try:
        samples = sft_samples(prompts, tokenizer)
        rng = random.Random(cfg.seed)
        for step in range(cfg.warmup.sft_steps):
            batch = rng.sample(samples, min(cfg.warmup.batch_size, len(samples)))
            loss = ray.get(trainer.sft_step.remote(batch))
            if on_step:
                on_step(step, loss)
        ray.get(trainer.export_hf.remote(str(out_dir)))
    finally:
        ray.kill(trainer)
    return Path(out_dir)
