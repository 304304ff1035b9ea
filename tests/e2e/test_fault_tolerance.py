"""Fault injection on whole `miles run` processes: kills, corrupt checkpoints, bad input."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import REPO
from tests.e2e.conftest import Workspace

pytestmark = pytest.mark.e2e
NUM_STEPS = 20
# A quarter of the recipe's rollout per step: these tests compare runs number for number, they
# do not measure learning.
SHORT = [f"training.num_steps={NUM_STEPS}", "checkpoint.interval_steps=5", "checkpoint.keep_latest=3",
         "rollout.num_prompts_per_step=16"]


@pytest.fixture(scope="module")
def work_dir(isolated) -> Workspace:
    return isolated


@pytest.fixture(scope="module")
def uninterrupted(work_dir) -> dict:
    """The same run with no fault: what a run that survived one must match."""
    run_dir = work_dir.dir / "uninterrupted"
    finish(miles(work_dir, "run", str(REPO / "configs/local.yaml"), "--run-dir", str(run_dir)))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == NUM_STEPS and summary["resumed_from_step"] is None
    assert len(set(summary["reward_curve"])) > 1  # a run that learns something: resumes are compared with it
    return summary


def assert_continues_like(summary: dict, uninterrupted: dict) -> None:
    """A resume restores weights, optimizer, data cursor, RNG and step: the run is the
    uninterrupted one, number for number, and its reward curve is whole across the resume."""
    assert summary["reward_curve"] == uninterrupted["reward_curve"]
    assert summary["eval"]["after"] == uninterrupted["eval"]["after"]


def miles(work: Workspace, *args: str, overrides=SHORT) -> subprocess.Popen:
    """Start `miles ...` in its own session; output goes to a file (a pipe nobody reads
    while the test polls would fill up and block the child)."""
    sets = [x for o in [*overrides, *work.sets] for x in ("--set", o)]
    log = open(work.dir / f"miles-{time.time_ns()}.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *args, *sets], cwd=REPO, env=work.env,
                            stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    proc.log = log
    return proc


def output(proc: subprocess.Popen) -> str:
    proc.log.seek(0)
    return proc.log.read()


def finish(proc: subprocess.Popen, timeout: float = 900) -> str:
    proc.wait(timeout=timeout)
    out = output(proc)
    assert proc.returncode == 0, out[-4000:]
    return out


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"miles exited ({proc.returncode}) before {what}:\n{output(proc)[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def trainer_actors(proc: subprocess.Popen) -> list[int]:
    """The trainer actor processes of this run (its local Ray's workers descend from it)."""
    found = []
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if "ray::FSDPTrainer" in " ".join(child.cmdline()):
                found.append(child.pid)
        except psutil.Error:  # exited since it was listed
            pass
    return found


def complete_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.parent.name[5:]) for p in (run_dir / "checkpoints").glob("step_*/MANIFEST.json"))


def assert_metrics_exactly_once(summary: dict) -> None:
    client = MlflowClient(summary["mlflow"]["tracking_uri"])
    steps = [m.step for m in client.get_metric_history(summary["mlflow"]["run_id"], "rollout/reward_mean")]
    assert steps == list(range(1, NUM_STEPS + 1)), steps


def test_trainer_killed_after_checkpoint_task_retry_resumes(work_dir, uninterrupted):
    run_dir = work_dir.dir / "killed-trainer"
    proc = miles(work_dir, "run", str(REPO / "configs/local.yaml"), "--run-dir", str(run_dir))
    wait_for(lambda: complete_steps(run_dir), 600, "the first checkpoint", proc)
    trainer_pids = wait_for(lambda: trainer_actors(proc), 60, "the trainer actor")
    for pid in trainer_pids:
        os.kill(pid, signal.SIGKILL)
    # No checkpoint completes without the trainer, and the retry waits >= 5 s (backoff with
    # jitter): what is complete now is what the retry must resume from.
    time.sleep(2)
    last_complete = complete_steps(run_dir)[-1]
    out = finish(proc)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == NUM_STEPS and summary["resumed_from_step"] == last_complete
    assert "Retry 1/" in out
    assert_metrics_exactly_once(summary)
    assert_continues_like(summary, uninterrupted)


def test_whole_process_killed_then_resume_skips_cached_stages(work_dir, uninterrupted):
    run_dir = work_dir.dir / "killed-run"
    proc = miles(work_dir, "run", str(REPO / "configs/local.yaml"), "--run-dir", str(run_dir))
    wait_for(lambda: len(complete_steps(run_dir)) >= 2, 600, "two checkpoints", proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    run_key = (run_dir / "RUN_KEY").read_text()
    steps = complete_steps(run_dir)
    # The newest checkpoint is corrupted too: the resume must fall back to the previous one.
    newest = run_dir / "checkpoints" / f"step_{steps[-1]:06d}" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])
    out = finish(miles(work_dir, "run", str(REPO / "configs/local.yaml"), "--run-dir", str(run_dir),
                       "--resume", run_key))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["run_key"] == run_key and summary["steps"] == NUM_STEPS
    assert summary["resumed_from_step"] == steps[-2]
    assert "skipping checkpoint" in out
    for stage in ("prepare-model", "sft-warmup"):
        assert any(stage in line and "Cached" in line for line in out.splitlines()), stage
    assert_metrics_exactly_once(summary)
    assert_continues_like(summary, uninterrupted)


def test_bad_config_fails_fast_with_one_message(work_dir, tmp_path):
    proc = miles(work_dir, "run", str(REPO / "configs/local.yaml"), "--run-dir", str(tmp_path / "bad"),
                 overrides=["training.lr=-1"])
    proc.wait(timeout=120)
    out = output(proc)
    assert proc.returncode == 2
    assert "training.lr" in out and "greater than 0" in out and "Traceback" not in out
    assert not (tmp_path / "bad").exists()


def test_missing_model_path_fails_before_anything_is_written(work_dir, tmp_path):
    proc = miles(work_dir, "run", str(REPO / "configs/local.yaml"), "--run-dir", str(tmp_path / "nomodel"),
                 overrides=[f"model.source={tmp_path / 'no-such-model'}"])
    proc.wait(timeout=120)
    out = output(proc)
    assert proc.returncode == 2
    assert "no-such-model" in out and "does not exist" in out and "Traceback" not in out
    assert not (tmp_path / "nomodel").exists()


def test_a_model_that_cannot_load_fails_without_retries(work_dir, tmp_path, tiny_model_dir):
    """Past the preflight (config.json is there), the weights are not: a permanent failure."""
    broken = tmp_path / "no-weights"
    broken.mkdir()
    for path in Path(tiny_model_dir).iterdir():
        if path.suffix != ".safetensors":
            (broken / path.name).write_bytes(path.read_bytes())
    proc = miles(work_dir, "run", str(REPO / "configs/local.yaml"), "--run-dir", str(tmp_path / "nomodel"),
                 overrides=[f"model.source={broken}"])
    proc.wait(timeout=300)
    out = output(proc)
    assert proc.returncode != 0
    assert "Retry 1/" not in out
    # the run's MLflow run ends FAILED, not RUNNING forever
    run_key = (tmp_path / "nomodel" / "RUN_KEY").read_text()
    client = MlflowClient(f"sqlite:///{work_dir.dir / 'mlflow.db'}")
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()],
                               filter_string=f"tags.`miles.run_key` = '{run_key}'")
    assert run.info.status == "FAILED"
