"""A checkpoint is resumed only by the run that wrote it, under its config (a resume may
extend num_steps): another run key or another config is refused, naming both."""

import pytest

from miles_core.config import build_config
from miles_core.data import write_arithmetic_task
from miles_core.driver.session import TrainSpec, run_training
from miles_core.storage.checkpoint import CheckpointMismatchError


def test_a_checkpoint_is_resumed_only_by_its_own_run_and_config(ray_local, tmp_path, tiny_model_dir):
    train, _ = write_arithmetic_task(build_config({}).data.builtin, tmp_path / "data")

    def spec(run_key: str, *overrides: str) -> TrainSpec:
        cfg = build_config({}, ["training.num_steps=2", "checkpoint.interval_steps=2", "rollout.num_prompts_per_step=4",
                                "rollout.num_samples_per_prompt=2", "training.num_threads=1", *overrides])
        return TrainSpec(config=cfg, model_dir=str(tiny_model_dir), train_path=str(train),
                         run_dir=str(tmp_path / "run"), run_key=run_key)

    assert run_training(spec("run-a")).steps == 2
    with pytest.raises(CheckpointMismatchError, match=r"belongs to run 'run-a' \(config digest \w+\), not to this "
                                                      r"run 'run-b'"):
        run_training(spec("run-b"))
    with pytest.raises(CheckpointMismatchError, match=r"run 'run-a' \(config digest (\w+)\), not to this "
                                                      r"run 'run-a' \(config digest (?!\1)\w+\)"):
        run_training(spec("run-a", "training.lr=0.5"))
    resumed = run_training(spec("run-a", "training.num_steps=3"))
    assert resumed.resumed_from_step == 2 and resumed.steps == 3
