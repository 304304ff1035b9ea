"""FP8 rollout on the embedded engine through the Ray driver: the engines serve a block-FP8
quantization of each pushed policy, the mismatch against the trainer shows in
rollout/train_logprob_abs_diff, and TIS trains on it."""

from miles_core.config import build_config
from miles_core.data import write_arithmetic_task
from miles_core.driver.session import TrainSpec, run_training

STEPS = 3


def _run(tmp_path, tiny_model_dir, name: str, *overrides):
    train, _ = write_arithmetic_task(build_config({}).data.builtin, tmp_path / "data")
    cfg = build_config({}, [f"training.num_steps={STEPS}", f"checkpoint.interval_steps={STEPS}",
                            "rollout.num_prompts_per_step=8", "rollout.num_samples_per_prompt=4",
                            "training.num_threads=1", "rollout.cpus_per_engine=0.5", *overrides])
    return run_training(TrainSpec(config=cfg, model_dir=str(tiny_model_dir), train_path=str(train),
                                  run_dir=str(tmp_path / name)))


def test_fp8_rollout_opens_a_measured_mismatch_that_tis_trains_on(ray_local, tmp_path, tiny_model_dir):
    full = _run(tmp_path, tiny_model_dir, "full")
    fp8 = _run(tmp_path, tiny_model_dir, "fp8", "rollout.precision=fp8", "algorithm.correction.kind=tis")
    assert fp8.steps == full.steps == STEPS
    full_gap = max(h["rollout/train_logprob_abs_diff"] for h in full.history)
    fp8_gaps = [h["rollout/train_logprob_abs_diff"] for h in fp8.history]
    # fp32 engine and trainer agree to rounding; the FP8 engine is off by its quantization, after
    # every push (each step's engine weights are the new policy, quantized).
    print(f"train/rollout log-prob gap: full precision {full_gap:.2e}, fp8 rollout {fp8_gaps}")
    assert full_gap < 1e-4 and all(1e-3 < gap < 0.1 for gap in fp8_gaps), (full_gap, fp8_gaps)
