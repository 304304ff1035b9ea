"""Supervised warm-up: a few SFT steps on the training labels before RL begins."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

from miles_core.config import RunConfig
from miles_core.data import Prompt, Sample
from miles_core.training.fsdp import FSDPTrainer


def sft_samples(prompts: list[Prompt], tokenizer) -> list[Sample]:
    eos = tokenizer.eos_token_id
    return [Sample(p.index, p.input_ids, tokenizer(p.label, add_special_tokens=False)["input_ids"] + [eos], p.label)
            for p in prompts]


def run_sft_warmup(cfg: RunConfig, model_dir: str, prompts: list[Prompt], out_dir: str | Path,
                   on_step: Callable[[int, float], None] | None = None) -> Path:
    """Train cfg.warmup.sft_steps supervised steps from model_dir and save an HF dir."""
    training = cfg.training.model_copy(update={"lr": cfg.warmup.lr, "lr_warmup_steps": 0})
    trainer = FSDPTrainer(model_dir, training, cfg.algorithm, seed=cfg.seed)
    samples = sft_samples(prompts, trainer.tokenizer)
    rng = random.Random(cfg.seed)
    for step in range(cfg.warmup.sft_steps):
        loss = trainer.sft_step(rng.sample(samples, min(cfg.warmup.batch_size, len(samples))))
        if on_step:
            on_step(step, loss)
    try:
        return trainer.export_hf(out_dir)
    finally:
        trainer.close()
