"""bench/time_to_accuracy.py end to end on CPU, from a recipe_learns-shaped result of ours:
TRL starts from the same warm model and is scored by the same evaluator (its step-0 pass@1 is
ours' start), trains with its periodic eval off the clock, and the report holds both sides."""

import json
import subprocess
import sys

from miles_core.evaluation.core import HELDOUT, evaluate_all
from tests.conftest import REPO


def test_trl_reaches_a_target_from_ours_start_and_is_timed_against_ours(warm_tiny, tmp_path):
    cfg = warm_tiny["cfg"]
    before = evaluate_all(cfg, warm_tiny["warm"], warm_tiny["eval"])[HELDOUT].pass_at_1
    ours = {"seed": cfg.seed, "warm_model_dir": str(warm_tiny["warm"]), "train_path": str(warm_tiny["train"]),
            "eval_path": str(warm_tiny["eval"]), "before": before, "rl_steps": 2,
            "median_per_step": {"time/step_seconds": 0.5},
            "curve": [{"step": 0, "rl_seconds": 0.0, "train_seconds": 0.0, "pass@1": before},
                      {"step": 2, "rl_seconds": 1.5, "train_seconds": 1.0, "pass@1": before}]}
    (tmp_path / "seed0").mkdir()
    (tmp_path / "seed0" / "result.json").write_text(json.dumps(ours))
    overrides = ["rollout.num_prompts_per_step=8", "rollout.num_samples_per_prompt=4", "training.micro_batch_size=16",
                 "eval.interval_steps=1"]
    # a target below the start: reached at TRL's first eval and at ours' step 2
    proc = subprocess.run(
        [sys.executable, "bench/time_to_accuracy.py", "--config", "configs/local.yaml",
         "--ours-result", str(tmp_path / "seed0" / "result.json"), "--target-gain", "-1", "--trl-configs", "fp32",
         "--probe-steps", "2", "--max-minutes", "2", "--out", str(tmp_path / "tta"),
         *[x for o in overrides for x in ("--set", o)]],
        cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["start"] == {"ours": before, "trl": before, "tolerance": report["start"]["tolerance"], "agree": True}
    assert report["trl"]["config"] == "fp32" and len(report["trl_probes"]["fp32"]["step_seconds"]) == 2
    assert report["trl"]["stopped"] == "target" and report["trl"]["steps_to_target"] == 1
    trl_seconds = report["trl"]["seconds_to_target"]
    assert 0 < trl_seconds < report["trl"]["wall_seconds"]  # its eval is off the clock
    assert report["ours"]["seconds_to_target"] == 1.0
    assert report["ratio_trl_over_ours"] == round(trl_seconds / 1.0, 4)
    assert report["trl_version"] and report["num_warnings"] == 1  # no learn.json beside ours' result
    assert json.loads((tmp_path / "tta" / "tta.json").read_text())["trl"]["curve"][0]["pass@1"] == before
