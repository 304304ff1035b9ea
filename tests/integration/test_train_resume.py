"""The training driver on real Ray: a resumed run continues exactly where it stopped."""

import json

import pytest
from safetensors.torch import load_file

from miles_core.config import build_config
from miles_core.data import write_arithmetic_task
from miles_core.driver.session import TrainSpec, run_training


def spec_for(tmp_path, tiny_model_dir, run_dir, num_steps, *overrides):
    train, _ = write_arithmetic_task(build_config({}).data.builtin, tmp_path / "data")
    cfg = build_config({}, [f"training.num_steps={num_steps}", "checkpoint.interval_steps=2",
                            "rollout.num_prompts_per_step=8", "rollout.num_samples_per_prompt=4",
                            "rollout.verify_weight_sync=true", "training.num_threads=1", *overrides])
    return TrainSpec(config=cfg, model_dir=str(tiny_model_dir), train_path=str(train),
                     run_dir=str(run_dir))


def test_resume_continues_bit_exactly(ray_local, tmp_path, warm_tiny):
    # A model that already scores: its rewards vary and its weights move, so an equal history
    # and equal weights prove the resume restored weights, optimizer, data cursor and RNG.
    tiny_model_dir = warm_tiny["warm"]
    straight = run_training(spec_for(tmp_path, tiny_model_dir, tmp_path / "straight", 6))
    assert len({h["rollout/reward_mean"] for h in straight.history}) > 1
    assert straight.steps == 6 and straight.resumed_from_step is None

    first = run_training(spec_for(tmp_path, tiny_model_dir, tmp_path / "resumed", 4))
    assert first.steps == 4
    # A dead attempt's leftovers beyond the checkpoint must be discarded on resume.
    (tmp_path / "resumed" / "checkpoints" / "step_000005.partial").mkdir()
    resumed = run_training(spec_for(tmp_path, tiny_model_dir, tmp_path / "resumed", 6))
    assert resumed.resumed_from_step == 4 and resumed.steps == 6
    assert [h["step"] for h in resumed.history] == [5, 6]
    assert [h["rollout/reward_mean"] for h in resumed.history] == [h["rollout/reward_mean"] for h in straight.history[4:]]

    a = load_file(f"{straight.final_checkpoint_dir}/model.safetensors")
    b = load_file(f"{resumed.final_checkpoint_dir}/model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    initial = load_file(f"{tiny_model_dir}/model.safetensors")
    assert any(not (a[k] == initial[k]).all() for k in a)  # training moved the weights
    state = json.loads(open(f"{resumed.final_checkpoint_dir}/trainer_state.json").read())
    assert state["step"] == 6 and state["weight_version"] == 6


def test_rollout_and_trainer_logprobs_agree(ray_local, tmp_path, warm_tiny):
    # TIS needs the old log-probs before the update: a separate scoring pass, which must agree
    # with the update's own forward (ppo_kl 0) and with the engine's log-probs.
    spec = spec_for(tmp_path, warm_tiny["warm"], tmp_path / "run", 1, "algorithm.correction.kind=tis")
    result = run_training(spec)
    assert result.history[0]["rollout/train_logprob_abs_diff"] <= 1e-4
    assert result.history[0]["train/ppo_kl"] == pytest.approx(0.0, abs=1e-7)


def test_same_seed_twice_gives_the_same_numbers(ray_local, tmp_path, warm_tiny):
    def numbers(run_dir):
        result = run_training(spec_for(tmp_path, warm_tiny["warm"], run_dir, 3))
        return [{k: v for k, v in h.items() if not k.endswith(("_seconds", "per_second"))}
                for h in result.history]

    first, second = numbers(tmp_path / "a"), numbers(tmp_path / "b")
    assert first == second and len({h["rollout/reward_mean"] for h in first}) > 1


def test_a_driver_killed_once_its_checkpoint_is_complete_loses_no_metrics_and_no_upload(
        ray_local, tmp_path, warm_tiny, monkeypatch):
    # A resume never recomputes the steps a complete checkpoint covers, so their metrics must
    # be in MLflow before the checkpoint is, and the checkpoint it resumes from must reach the
    # store even when the kill came before its upload.
    from mlflow.tracking import MlflowClient

    from miles_core.storage import checkpoint, uploads

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("resume")).info.run_id
    store_uri = (tmp_path / "store").as_uri()
    write_checkpoint = checkpoint.write_checkpoint

    class Killed(BaseException):  # what the driver's own except clauses cannot swallow
        pass

    def killed_once_complete(checkpoints_dir, step, *args):
        write_checkpoint(checkpoints_dir, step, *args)
        raise Killed(f"killed once step {step} is complete")

    def spec(num_steps):
        return spec_for(tmp_path, warm_tiny["warm"], tmp_path / "run", num_steps).model_copy(
            update={"mlflow_uri": uri, "mlflow_run_id": run_id, "store_uri": store_uri, "run_key": "killed"})

    monkeypatch.setattr(checkpoint, "write_checkpoint", killed_once_complete)
    with pytest.raises(Killed):
        run_training(spec(4))
    monkeypatch.setattr(checkpoint, "write_checkpoint", write_checkpoint)
    resumed = run_training(spec(2))  # nothing left to train: only what the kill left undone
    assert resumed.resumed_from_step == 2 and resumed.history == []
    steps = [m.step for m in client.get_metric_history(run_id, "time/step_seconds")]
    assert sorted(steps) == [1, 2]
    assert uploads.read_latest(store_uri, "killed", spec(2).config.checkpoint)["step"] == 2
