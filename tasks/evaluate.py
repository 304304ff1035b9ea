"""Held-out evaluation task (greedy pass@1)."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from miles_core.config import RunConfig


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate(config: dict, model_dir: str, eval_path: str, phase: str) -> dict:
    from miles_core.data import read_prompts
    from miles_core.evaluation import evaluate_greedy
    from miles_core.rollout.engine import EmbeddedEngine

    cfg = RunConfig.model_validate(config)
    engine = EmbeddedEngine(model_dir, cfg.model.dtype, cfg.training.num_threads)
    prompts = read_prompts(eval_path, cfg.data, engine.tokenizer)
    result = evaluate_greedy(engine, prompts, cfg.rollout.reward, cfg.eval.max_new_tokens, cfg.eval.batch_size)
    get_run_logger().info("eval %s: pass@1 %.3f on %d prompts", phase, result["pass@1"], result["num_prompts"])
    return result
