"""Minimal GRPO: miles_core's pieces wired together in one process, without Prefect or Ray.

Read this first. `miles run configs/local.yaml` does the same things with a Prefect flow
(cached stages, checkpoints, MLflow) and Ray actors (trainer and engines in their own
processes); here every piece is a plain object, so the RL loop fits on one screen:

    tiny Qwen3 + addition task -> SFT warm-up -> GRPO steps -> held-out pass@1 before and after

    .venv/bin/python examples/minimal_grpo.py            # a few minutes on 2 CPU cores
    .venv/bin/python examples/minimal_grpo.py --set rollout.num_prompts_per_step=16  # any recipe field

It runs on CPU: a GPU would be hidden below, because the trainer takes a GPU by itself when it
sees one while this example keeps the engine on CPU.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
from pathlib import Path

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch is imported (see the docstring)

import torch
from transformers import AutoTokenizer
from transformers.utils import logging as hf_logging

from miles_core import algorithms as algo
from miles_core.config import AlgorithmConfig, RunConfig, load_config
from miles_core.data import PromptSource, read_prompts, sft_samples, write_arithmetic_task
from miles_core.engines.embedded.engine import EmbeddedEngine
from miles_core.evaluation.core import HELDOUT, EngineAsGroup, evaluate_all, evaluate_greedy
from miles_core.rollout.manager import RolloutManager
from miles_core.tiny import build_tiny_model
from miles_core.training.fsdp import FSDPTrainer

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "local.yaml"


def push_weights(trainer: FSDPTrainer, engine: EmbeddedEngine, version: str) -> None:
    """The trainer's full weights under HF names, loaded into the engine in place; with
    training.lora only the adapters, which the engine merges into its base copy."""
    state = trainer.adapter_state_dict() if trainer.lora is not None else trainer.hf_state_dict(to_cpu=True)
    result = engine.update_weights_from_tensors(state, version)
    assert result["success"], result["message"]


def sft_warmup(cfg: RunConfig, model_dir: Path, prompts, engine: EmbeddedEngine, out_dir: Path) -> Path:
    """Supervised steps on the labels until greedy pass@1 on probe problems (held out of SFT)
    reaches warmup.target_pass_at_1: GRPO learns nothing from groups whose samples are all
    wrong, and the recipe's RL settings are tuned for a start near that level."""
    w = cfg.warmup
    probe, train = prompts[: w.num_probe_prompts], prompts[w.num_probe_prompts :]  # the task file is shuffled
    # The warm-up trains every weight (training.lora is the RL stage's): it builds the base the
    # adapters then adapt, starting from random weights for the built-in model.
    training = cfg.training.model_copy(update={"lr": w.lr, "lr_warmup_steps": 0, "lora": None})
    trainer = FSDPTrainer(str(model_dir), training, AlgorithmConfig(name="sft"), seed=cfg.seed)  # SFT loss only
    samples, rng = sft_samples(train, trainer.tokenizer), random.Random(cfg.seed)
    target = w.target_pass_at_1 or float("inf")  # None: train all sft_steps
    step, loss, score = 0, float("nan"), 0.0
    while step < w.sft_steps and score < target:
        loss, step = trainer.sft_step(rng.sample(samples, min(w.batch_size, len(samples)))), step + 1
        if step % w.check_interval_steps == 0 or step == w.sft_steps:
            push_weights(trainer, engine, f"sft-{step}")
            score = evaluate_greedy(engine, probe, cfg.rollout.reward, cfg.eval.max_new_tokens,
                                    cfg.eval.batch_size).pass_at_1
    print(f"SFT warm-up: {step} steps, loss {loss:.3f}, probe pass@1 {score:.3f}", flush=True)
    trainer.export_hf(out_dir)  # an HF directory: what the RL trainer loads
    trainer.close()
    return out_dir


def heldout_pass_at_1(cfg: RunConfig, engine: EmbeddedEngine, eval_path: Path) -> float:
    """Greedy pass@1 on the held-out problems, through the engine that generates rollouts."""
    return evaluate_all(cfg, None, eval_path, engine=engine)[HELDOUT].pass_at_1


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="GRPO steps (the recipe trains 200)")
    p.add_argument("--work-dir", type=Path, default=None, help="where model and data go (default: a temp dir)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe field")
    args = p.parse_args(argv)
    hf_logging.disable_progress_bar()

    cfg = load_config(RECIPE, [f"seed={args.seed}", *args.set])
    r = cfg.rollout
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="minimal-grpo-"))
    model_dir = build_tiny_model(cfg.model.tiny, work / "model")  # random weights, char tokenizer
    train_path, eval_path = write_arithmetic_task(cfg.data.builtin, work / "data")  # "a+b=" -> "c"
    prompts = read_prompts(train_path, cfg.data, AutoTokenizer.from_pretrained(model_dir))
    # The engine generates rollouts and evaluates; it gets every new policy by an in-process
    # weight push (on a cluster: SGLang servers, over NCCL or shared memory).
    engine = EmbeddedEngine(str(model_dir), cfg.model.dtype, cfg.training.num_threads, device="cpu")
    warm_dir = sft_warmup(cfg, model_dir, prompts, engine, work / "warm")

    # The RL trainer (FSDP2, world size 1 here) starts from the warm-up's weights, which the engine holds.
    trainer = FSDPTrainer(str(warm_dir), cfg.training, cfg.algorithm, r.temperature, r.max_new_tokens, cfg.seed,
                          r.num_samples_per_prompt)
    before = heldout_pass_at_1(cfg, engine, eval_path)

    manager = RolloutManager(EngineAsGroup(engine), r, r.reward)  # seeded sampling, then the reward
    source = PromptSource(prompts, cfg.seed)  # shuffled, endless
    for step in range(1, args.steps + 1):
        # n samples per prompt, grouped; per-step seeds as miles_core.driver.loop draws them (reproducible).
        samples = manager.generate(source.next_batch(r.num_prompts_per_step), seed=cfg.seed * 100_003 + step * 97)
        rewards = torch.tensor([s.reward for s in samples])
        # GRPO's signal: each reward minus its group's mean (train_step computes the same from
        # the samples' rewards); a group whose samples all score alike teaches nothing.
        advantages = algo.grpo_advantages(rewards, r.num_samples_per_prompt, cfg.algorithm.normalize_std)
        useful = algo.dynamic_sampling_keep(rewards, r.num_samples_per_prompt).float().mean()
        metrics = trainer.train_step(samples)  # score, advantages, clipped policy-gradient update
        # Weight sync: the engine must sample from the policy just trained (on-policy GRPO).
        push_weights(trainer, engine, str(step))
        print(f"step {step}: reward {rewards.mean():.3f}, groups with signal {useful:.2f}, "
              f"|advantage| {advantages.abs().mean():.3f}, loss {metrics['train/loss']:.4f}", flush=True)

    after = heldout_pass_at_1(cfg, engine, eval_path)
    trainer.close()
    print(f"held-out pass@1 {before:.3f} -> {after:.3f}")


if __name__ == "__main__":
    main()
