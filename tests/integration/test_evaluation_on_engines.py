"""Before/after evaluation runs on rollout engines in the Ray cluster, not in the calling
process, and scores what the in-process engine scores."""

import time

import ray

from miles_core.config import EvalDatasetConfig
from miles_core.evaluation.core import evaluate_all, evaluate_on_engines


def test_engine_side_eval_scores_like_the_in_process_engine(ray_local, warm_tiny):
    sampled = EvalDatasetConfig(name="sampled", path=str(warm_tiny["eval"]), num_samples_per_prompt=4,
                                temperature=1.0)
    recipe = warm_tiny["cfg"]
    cfg = recipe.model_copy(update={"eval": recipe.eval.model_copy(update={"pass_k": [1, 4], "datasets": [sampled]})})
    in_process = evaluate_all(cfg, warm_tiny["warm"], warm_tiny["eval"])
    on_engines = evaluate_on_engines(cfg, warm_tiny["warm"], warm_tiny["eval"])
    # the engines were stopped: their CPUs are free again
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 2
    # greedy decoding is deterministic: the same responses, hence the same score
    heldout = in_process["heldout"]
    assert heldout.pass_at_1 > 0.1  # a model that scores, so equal scores mean something
    assert on_engines["heldout"].pass_at_1 == heldout.pass_at_1
    assert [e["responses"] for e in on_engines["heldout"].examples] == [e["responses"] for e in heldout.examples]
    # sampled: equal within the noise of 200 prompts (std of each estimate about 0.035)
    for k in (1, 4):
        assert abs(on_engines["sampled"].pass_at_k[k] - in_process["sampled"].pass_at_k[k]) <= 0.15, k
    assert on_engines["sampled"].num_samples_per_prompt == 4
    assert on_engines["sampled"].num_prompts == heldout.num_prompts
