"""Periodic evaluation during training, on the rollout engines and on dedicated engines."""

import pytest
import torch
from safetensors.torch import load_file

from miles_core.config import build_config
from miles_core.data import write_arithmetic_task
from miles_core.driver.session import TrainSpec, run_training
from miles_core.evaluation.core import evaluate_all

KEY = "eval/periodic/heldout/pass_at_1"



def run(tmp_path, tiny_model_dir, name, overrides):
    train, heldout = write_arithmetic_task(build_config({}).data.builtin, tmp_path / "data")
    # The recipe's RL lr (configs/local.yaml), which its warm-up is tuned for: the default 1e-3 on
    # 8 prompts a step took the warm model to pass@1 0.000 by step 4 on some CPUs (and then equal
    # scores prove nothing); 5e-4 kept it scoring on seeds 0-2 and 42 there.
    cfg = build_config({}, ["training.num_steps=4", "checkpoint.interval_steps=2", "eval.interval_steps=2",
                            "rollout.num_prompts_per_step=8", "rollout.num_samples_per_prompt=4",
                            "training.num_threads=1", "training.lr=5e-4", *overrides])
    events = []
    result = run_training(
        TrainSpec(config=cfg, model_dir=str(tiny_model_dir), train_path=str(train), run_dir=str(tmp_path / name),
                  eval_path=str(heldout)),
        on_metrics=lambda step, m: events.extend(("eval", step) for k in m if k == KEY),
        on_checkpoint=lambda step: events.append(("checkpoint", step)))
    return cfg, heldout, result, events


def final_export_score(cfg, heldout, result):
    return evaluate_all(cfg, result.hf_export_dir, heldout)["heldout"].pass_at_1


@pytest.mark.parametrize("overrides", [
    ["rollout.loop=sync"],
    ["rollout.loop=fully_async", "eval.periodic_engines=dedicated",
     "algorithm.correction.kind=tis"],
], ids=["rollout-engines-sync", "dedicated-engines-async"])
def test_periodic_eval_scores_the_step_weights_and_is_durable_with_its_checkpoint(
        ray_local_3cpus, tmp_path, warm_tiny, overrides):
    # A model that already scores (a random one scores 0.0 with any weights): the weights move
    # each step, so equal scores mean the eval saw this step's weights.
    cfg, heldout, result, events = run(tmp_path, warm_tiny["warm"], "run", overrides)
    assert [row["step"] for row in result.periodic_eval] == [2, 4]
    # Each step's eval is handed to the metrics logger before it is flushed ahead of that step's checkpoint.
    assert events == [("eval", 2), ("checkpoint", 2), ("eval", 4), ("checkpoint", 4)]
    # Greedy decoding of the final weights: the in-training eval equals a fresh eval of the export.
    assert result.periodic_eval[-1][KEY] == pytest.approx(final_export_score(cfg, heldout, result), abs=1e-9)
    assert result.periodic_eval[0][KEY] > 0 and result.periodic_eval[-1][KEY] > 0
    initial = load_file(f"{warm_tiny['warm']}/model.safetensors")
    exported = load_file(f"{result.hf_export_dir}/model.safetensors")
    assert any(not torch.equal(exported[k], initial[k]) for k in initial)


def test_no_eval_path_means_no_periodic_eval(ray_local_3cpus, tmp_path, tiny_model_dir):
    train, _ = write_arithmetic_task(build_config({}).data.builtin, tmp_path / "data")
    cfg = build_config({}, ["training.num_steps=2", "eval.interval_steps=1", "rollout.num_prompts_per_step=4",
                            "rollout.num_samples_per_prompt=2", "training.num_threads=1"])
    result = run_training(TrainSpec(config=cfg, model_dir=str(tiny_model_dir), train_path=str(train),
                                    run_dir=str(tmp_path / "run")))
    assert result.steps == 2 and result.periodic_eval == []
