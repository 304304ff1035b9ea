"""The evaluation task of both flows: every dataset of the recipe (held-out + eval.datasets),
pass@k per dataset."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from miles_core.config import RunConfig
from miles_core.evaluation.core import EvalResults, evaluate_on_engines


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate(cfg: RunConfig, model_dir: str, eval_path: str, phase: str) -> EvalResults:
    """{dataset name: result}; "heldout" is data.eval_path (or the built-in split). Generation
    runs on rollout engines in the Ray cluster (ensure-ray ran before)."""
    results = evaluate_on_engines(cfg, model_dir, eval_path)
    for name, result in results.items():
        prompts = "?" if result.num_prompts is None else result.num_prompts
        get_run_logger().info("eval %s %s: pass@1 %.3f on %s prompts", phase, name, result.pass_at_1, prompts)
    return results
