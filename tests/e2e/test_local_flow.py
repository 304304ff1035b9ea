"""The whole rl-posttrain flow on the embedded default, as a user runs it: `miles run`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import REPO, run_env

pytestmark = pytest.mark.e2e
STEPS = 200  # configs/local.yaml


@pytest.fixture(scope="module")
def finished_run(isolated, shared_work_dir):
    run_dir, sets = isolated.dir / "run", isolated.sets
    # As a bare `miles run`: Prefect's temporary server, and no Ray auth set (the run draws a token).
    env = {k: v for k, v in run_env().items() if not k.startswith("RAY_AUTH")}
    cmd = [sys.executable, "-m", "flows.cli", "run", str(REPO / "configs/local.yaml"), "--run-dir", str(run_dir),
           *[x for o in sets for x in ("--set", o)]]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return shared_work_dir, run_dir, json.loads((run_dir / "summary.json").read_text()), proc.stdout + proc.stderr


def greedy_accuracy(model_dir, eval_path) -> float:
    """Recomputed with plain transformers, independent of the project's engine code."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rows = [json.loads(line) for line in open(eval_path)]
    correct = 0
    for row in rows:
        ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
        correct += text == row["label"]
    return correct / len(rows)


def test_summary_contract_and_learning(finished_run):
    _, run_dir, summary, _ = finished_run
    for key in ("run_key", "status", "eval", "steps", "resumed_from_step", "checkpoint_uri",
                "hf_export_uri", "model_version", "timings"):
        assert key in summary, key
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert summary["eval"]["after"] - summary["eval"]["before"] >= 0.20, summary["eval"]
    assert json.loads((run_dir / "config.resolved.json").read_text())["training"]["num_steps"] == STEPS
    assert (run_dir / "config.resolved.json").stat().st_mode & 0o777 == 0o600


def test_uploaded_export_loads_and_matches_eval(finished_run, tmp_path):
    work, _, summary, _ = finished_run
    from miles_core.storage.object_store import download_dir

    local = download_dir(summary["hf_export_uri"], tmp_path / "export")
    eval_path = summary["data"]["eval_path"]
    accuracy = greedy_accuracy(local, eval_path)
    assert abs(accuracy - summary["eval"]["after"]) <= 0.02, (accuracy, summary["eval"])


def test_checkpoint_manifest_verifies_in_store(finished_run, tmp_path):
    _, _, summary, _ = finished_run
    from miles_core.storage.checkpoint import verify_checkpoint
    from miles_core.storage.object_store import download_dir

    local = download_dir(summary["checkpoint_uri"], tmp_path / "ckpt")
    assert verify_checkpoint(local) is None
    assert json.loads((local / "MANIFEST.json").read_text())["step"] == STEPS


def test_mlflow_has_params_metrics_and_model_version(finished_run, tmp_path):
    from mlflow.tracking import MlflowClient

    _, _, summary, _ = finished_run
    client = MlflowClient(summary["mlflow"]["tracking_uri"], registry_uri=summary["mlflow"]["tracking_uri"])
    run = client.get_run(summary["mlflow"]["run_id"])
    assert run.data.params["training.num_steps"] == str(STEPS)
    for metric in ("rollout/reward_mean", "rollout/reward_std", "rollout/tokens_per_second", "train/loss",
                   "train/pg_loss", "train/ppo_kl", "train/clip_frac", "train/grad_norm", "train/lr",
                   "train/tokens_per_second", "rollout/train_logprob_abs_diff", "time/step_seconds"):
        steps = [m.step for m in client.get_metric_history(run.info.run_id, metric)]
        assert steps == list(range(1, STEPS + 1)), metric
    # the resolved config as one artifact, the same (redacted) values as the params
    config = client.download_artifacts(run.info.run_id, "config/resolved.json", str(tmp_path))
    assert json.loads(Path(config).read_text()) == run.data.params
    assert run.info.status == "FINISHED"
    assert run.data.metrics["eval/after_pass_at_1"] == pytest.approx(summary["eval"]["after"])
    assert run.data.metrics["system/cpu_utilization_percentage"] > 0  # MLflow's system metrics
    assert len(client.get_metric_history(run.info.run_id, "system/system_memory_usage_megabytes")) >= 2
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert run.data.tags["miles.git_commit"] == (commit or "unknown")
    assert run.data.tags["miles.config_digest"] and run.data.tags["miles.run_key"] == summary["run_key"]
    version = client.get_model_version_by_alias(summary["mlflow"]["model_name"], "candidate")
    assert str(version.version) == str(summary["model_version"]) and version.run_id == run.info.run_id
    # the version links its run's eval report, its data and its checkpoint
    report = version.tags["eval_report_uri"]
    assert report == f"{run.info.artifact_uri}/eval/report.json"
    local = client.download_artifacts(run.info.run_id, "eval/report.json", str(tmp_path / "report"))
    rows = {(r["dataset"], r["metric"]): r for r in json.loads(Path(local).read_text())["rows"]}
    assert rows[("heldout", "pass@1")]["after"] == pytest.approx(summary["eval"]["after"])
    assert version.tags["train_data"] == summary["data"]["train_path"]
    assert version.tags["checkpoint_uri"] == summary["checkpoint_uri"]


def test_progress_is_visible(finished_run):
    *_, output = finished_run
    assert "stage train done" in output and "held-out pass@1" in output
    assert "ray (local, auth token) ready" in output  # Ray listens on every interface: the token keeps others out
    # a log file has no progress bar: a line every tracking.log_interval_steps steps (10) and at the end
    progress = [line for line in output.splitlines() if f"/{STEPS}  reward " in line and " step " in line]
    assert len(progress) == STEPS // 10 and f"step {STEPS}/{STEPS}  reward" in progress[-1], progress[-3:]
    # the background upload's lines belong to the train task's run, not Prefect warnings
    assert "uploaded checkpoint step" in output and "without a flow run id" not in output
