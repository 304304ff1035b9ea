"""placement.time_sharing end to end on CPU: real trainer and engine actors take turns, and the
run ends with the same weights, bit for bit, as the same run without time-sharing."""

from safetensors.torch import load_file

from miles_core.config import build_config
from miles_core.data import write_arithmetic_task
from miles_core.driver import TrainSpec, run_training


def test_time_shared_steps_train_the_same_weights_as_unshared_ones(ray_local, tmp_path, tiny_model_dir):
    train, _ = write_arithmetic_task(build_config({}).data.builtin, tmp_path / "data")

    def run(name: str, *overrides: str):
        cfg = build_config({}, ["training.num_steps=2", "checkpoint.interval_steps=1", "rollout.num_prompts_per_step=4",
                                "rollout.num_samples_per_prompt=2", "training.num_threads=1",
                                "placement.layout=colocated", *overrides])
        return run_training(TrainSpec(config=cfg, model_dir=str(tiny_model_dir), train_path=str(train),
                                      run_dir=str(tmp_path / name), run_key=name))

    shared = run("shared", "placement.time_sharing=true")
    unshared = run("unshared")
    assert shared.steps == unshared.steps == 2
    for step in shared.history:
        assert step["time/offload_seconds"] >= 0 and step["time/onload_seconds"] >= 0
        assert step["time/engine_release_seconds"] >= 0 and step["time/engine_resume_seconds"] >= 0
        print({k: round(v, 4) for k, v in step.items() if k.startswith(("time/", "time_sharing/"))})
    assert "time/offload_seconds" not in unshared.history[0]
    a = load_file(f"{shared.final_checkpoint_dir}/model.safetensors")
    b = load_file(f"{unshared.final_checkpoint_dir}/model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert [s["rollout/reward_mean"] for s in shared.history] == [s["rollout/reward_mean"] for s in unshared.history]
