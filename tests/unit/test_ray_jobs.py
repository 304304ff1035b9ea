"""Driver-job bookkeeping against an in-memory Jobs API: attempt ids, re-attach, stall
detection, and which endings a task retry may fix. The real Jobs API is exercised by
tests/e2e/test_deployments.py on the local stack."""

import json
import threading
import time
from types import SimpleNamespace

import pytest
from ray.job_submission import JobStatus

from miles_core.config import RunConfig
from miles_core.driver import ray_jobs
from miles_core.driver.session import TrainResult, TrainSpec
from miles_core.errors import is_retryable


class FakeJobs:
    def __init__(self, jobs: dict[str, JobStatus] | None = None):
        self.jobs = dict(jobs or {})
        self.submitted, self.stopped, self.logs = [], [], ""

    def list_jobs(self):
        return [SimpleNamespace(submission_id=sid, status=status) for sid, status in self.jobs.items()]

    def submit_job(self, *, entrypoint, submission_id, **kwargs):
        self.submitted.append((submission_id, entrypoint))
        self.jobs[submission_id] = JobStatus.PENDING
        return submission_id

    def get_job_status(self, sid):
        return self.jobs[sid]

    def get_job_logs(self, sid):
        return self.logs

    def stop_job(self, sid):
        self.stopped.append(sid)
        self.jobs[sid] = JobStatus.STOPPED
        return True


JOB = TrainSpec(config=RunConfig(), model_dir="/m", train_path="/t.jsonl", run_dir="/r", run_key="key",
                mlflow_uri="sqlite:///m.db", mlflow_run_id="abc")


def test_next_attempt_is_submitted_after_finished_ones(tmp_path):
    client = FakeJobs({"miles-key-1": JobStatus.FAILED, "miles-key-2": JobStatus.SUCCEEDED,
                       "miles-other-7": JobStatus.RUNNING, "miles-key-x": JobStatus.RUNNING})
    sid, attached = ray_jobs.submit_or_attach(client, "key", tmp_path, JOB, "/venv/bin/python")
    assert (sid, attached) == ("miles-key-3", False)
    entrypoint = client.submitted[0][1]
    assert entrypoint.startswith("/venv/bin/python -m miles_core.driver.session --spec ")
    assert json.loads((tmp_path / "miles-key-3.job.json").read_text())["mlflow_run_id"] == "abc"


def test_live_job_of_the_run_is_reattached_not_resubmitted(tmp_path):
    client = FakeJobs({"miles-key-1": JobStatus.FAILED, "miles-key-2": JobStatus.RUNNING})
    assert ray_jobs.submit_or_attach(client, "key", tmp_path, JOB, "python") == ("miles-key-2", True)
    assert client.submitted == []


def test_watch_streams_logs_and_steps_until_the_job_ends(tmp_path):
    client = FakeJobs({"miles-key-1": JobStatus.RUNNING})
    files = ray_jobs.JobFiles.of(tmp_path, "miles-key-1")
    steps, lines = [], []

    def driver():
        for step in (1, 2, 3):
            with open(files.progress, "a") as f:
                f.write(json.dumps({"step": step}) + "\n")
            client.logs += f"step {step}\n"
            time.sleep(0.05)
        client.jobs["miles-key-1"] = JobStatus.SUCCEEDED

    thread = threading.Thread(target=driver)
    thread.start()
    status = ray_jobs.watch(client, "miles-key-1", files, 10, 0.01, steps.append, lines.append)
    thread.join()
    assert status == JobStatus.SUCCEEDED
    assert steps == sorted(set(steps)) and steps[-1] == 3
    assert lines == ["step 1", "step 2", "step 3"]


def test_a_job_without_step_progress_is_stopped_as_stalled(tmp_path):
    client = FakeJobs({"miles-key-1": JobStatus.RUNNING})
    files = ray_jobs.JobFiles.of(tmp_path, "miles-key-1")
    files.progress.write_text(json.dumps({"step": 4}) + "\n")
    with pytest.raises(ray_jobs.DriverStalled, match="no step progress") as raised:
        ray_jobs.watch(client, "miles-key-1", files, 0.2, 0.01, lambda s: None, lambda s: None)
    assert client.stopped == ["miles-key-1"]
    assert is_retryable(raised.value)  # the task retries it: resubmit, resume


@pytest.mark.parametrize("status, record, expected, retried", [
    (JobStatus.FAILED, {"error": {"type": "ValueError", "message": "bad", "class_names": ["ValueError", "Exception"]}},
     ray_jobs.DriverJobFailed, False),
    (JobStatus.FAILED, {"error": {"type": "ActorDiedError", "message": "gone",
                                  "class_names": ["ActorDiedError", "RayActorError", "Exception"]}},
     ray_jobs.DriverJobLost, True),
    (JobStatus.FAILED, None, ray_jobs.DriverJobLost, True),  # SIGKILL / OOM: no record at all
    (JobStatus.STOPPED, None, ray_jobs.DriverJobLost, True),
])
def test_job_endings_are_classified_for_retries(tmp_path, status, record, expected, retried):
    files = ray_jobs.JobFiles.of(tmp_path, "miles-key-1")
    if record is not None:
        files.result.write_text(json.dumps(record))
    with pytest.raises(expected) as raised:
        ray_jobs.outcome("miles-key-1", status, files)
    assert is_retryable(raised.value) is retried


def test_success_returns_the_drivers_result(tmp_path):
    files = ray_jobs.JobFiles.of(tmp_path, "miles-key-1")
    result = TrainResult(steps=8, resumed_from_step=4, final_checkpoint_dir="/r/c", hf_export_dir="/r/hf",
                         history=[{"step": 8.0, "train/loss": 0.5}])
    files.result.write_text(result.model_dump_json())
    assert ray_jobs.outcome("miles-key-1", JobStatus.SUCCEEDED, files) == result


def test_cancellation_stops_only_the_runs_live_jobs():
    client = FakeJobs({"miles-key-1": JobStatus.FAILED, "miles-key-2": JobStatus.RUNNING,
                       "miles-other-1": JobStatus.RUNNING})
    assert ray_jobs.stop_live(client, "key") == ["miles-key-2"]
    assert client.stopped == ["miles-key-2"]
