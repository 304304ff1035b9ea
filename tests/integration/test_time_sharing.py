"""placement.time_sharing end to end on CPU: real trainer and engine actors take turns, and the
run ends with the same weights, bit for bit, as the same run without time-sharing."""

import pytest
from safetensors.torch import load_file

from miles_core.config import build_config
from miles_core.data import write_arithmetic_task
from miles_core.driver import time_sharing
from miles_core.driver.session import TrainSpec, run_training


@pytest.fixture
def run(tmp_path, tiny_model_dir):
    train, _ = write_arithmetic_task(build_config({}).data.builtin, tmp_path / "data")

    def run(name: str, *overrides: str):
        cfg = build_config({}, ["training.num_steps=2", "checkpoint.interval_steps=1", "rollout.num_prompts_per_step=4",
                                "rollout.num_samples_per_prompt=2", "training.num_threads=1",
                                "placement.layout=colocated", *overrides])
        return run_training(TrainSpec(config=cfg, model_dir=str(tiny_model_dir), train_path=str(train),
                                      run_dir=str(tmp_path / name), run_key=name))

    return run


def _same_weights(a_dir: str, b_dir: str) -> bool:
    a, b = load_file(f"{a_dir}/model.safetensors"), load_file(f"{b_dir}/model.safetensors")
    return a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_time_shared_steps_train_the_same_weights_as_unshared_ones(ray_local, run):
    shared = run("shared", "placement.time_sharing=true")
    unshared = run("unshared")
    assert shared.steps == unshared.steps == 2
    for step in shared.history:
        assert step["time/offload_seconds"] >= 0 and step["time/onload_seconds"] >= 0
        assert step["time/engine_release_seconds"] >= 0 and step["time/engine_resume_seconds"] >= 0
        print({k: round(v, 4) for k, v in step.items() if k.startswith(("time/", "time_sharing/"))})
    assert "time/offload_seconds" not in unshared.history[0]
    assert _same_weights(shared.final_checkpoint_dir, unshared.final_checkpoint_dir)
    assert [s["rollout/reward_mean"] for s in shared.history] == [s["rollout/reward_mean"] for s in unshared.history]


def test_a_run_killed_mid_hand_over_resumes_and_ends_as_an_unkilled_one(ray_local, run, monkeypatch):
    """Killed in step 2 with the engines' weights resumed empty and the trainer on the device: the
    retry resumes from step 1's checkpoint with new engines and ends with the same weights."""
    real_push, pushes = time_sharing.TimeSharing.push, []

    def killed_in_step_2(self, push_weights):
        pushes.append(1)
        if len(pushes) == 2:
            self._engines("resume_memory", [time_sharing.WEIGHTS])
            raise RuntimeError("killed mid-phase")
        return real_push(self, push_weights)

    monkeypatch.setattr(time_sharing.TimeSharing, "push", killed_in_step_2)
    with pytest.raises(RuntimeError, match="killed mid-phase"):
        run("killed", "placement.time_sharing=true")
    monkeypatch.setattr(time_sharing.TimeSharing, "push", real_push)
    resumed = run("killed", "placement.time_sharing=true")
    assert resumed.resumed_from_step == 1 and resumed.steps == 2
    assert _same_weights(resumed.final_checkpoint_dir, run("unkilled").final_checkpoint_dir)
