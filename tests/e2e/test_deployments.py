"""The deployments of prefect.yaml on the real local stack (`miles stack up`): deploy with the
Prefect CLI, run them through workers, the concurrency guard, and a resume through
`resume_from` that keeps one MLflow run on the stack's MLflow server.

The prod deployment's `gpu-cluster` pool is served here by a second local process worker:
the same deployment, parameters and guard as on the cluster, with CPU-sized work.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from mlflow.tracking import MlflowClient
from ray.job_submission import JobSubmissionClient

from infra import stack
from miles_core.driver import ray_jobs
from tests.conftest import REPO

pytestmark = pytest.mark.e2e
PREFECT = str(Path(sys.executable).parent / "prefect")
TINY = ["warmup.sft_steps=50", "checkpoint.interval_steps=4", "rollout.num_prompts_per_step=16",
        "rollout.num_samples_per_prompt=4"]
WORKER_POLL_SECONDS = "1"  # workers pick a run up within 1 s, not Prefect's 10


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """Stack up, a project copy as the deployments' working directory (its .miles work dir
    stays out of the repo), a worker for the gpu-cluster pool, `prefect deploy --all`."""
    root = tmp_path_factory.mktemp("deployments")
    project = root / "project"
    for name in ("configs", "flows", "tasks"):
        shutil.copytree(REPO / name, project / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "prefect.yaml", project / "prefect.yaml")
    state_dir = root / "stack"
    worker = None
    try:
        with pytest.MonkeyPatch.context() as patch:  # the stack's worker inherits it
            patch.setenv("PREFECT_WORKER_QUERY_SECONDS", WORKER_POLL_SECONDS)
            info = stack.start_stack(state_dir, ray_num_cpus=3, timeout=240)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "AWS_"))}
        env |= info.env | {"PREFECT_HOME": str(state_dir / "prefect"), "MILES_PROJECT_DIR": str(project),
                           "PYTHONPATH": str(REPO), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                           "PREFECT_WORKER_QUERY_SECONDS": WORKER_POLL_SECONDS}
        cli(env, project, "work-pool", "create", "gpu-cluster", "--type", "process", "--overwrite")
        log = open(root / "gpu-worker.log", "w")
        worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", "gpu-cluster", "--type", "process",
                                   "--name", "test-gpu-cluster-worker"], cwd=project, env=env, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
        out = cli(env, project, "--no-prompt", "deploy", "--all")
        assert "rl-posttrain/prod" in out and "rl-posttrain/smoke" in out, out
        yield {"env": env, "project": project, "api": info.env["PREFECT_API_URL"]}
    finally:
        if worker is not None:  # its runs are over; a graceful stop takes Prefect's worker ~10 s
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=30)
        stack.stop_stack(state_dir)


def cli(env: dict, cwd: Path, *args: str, check: bool = True, timeout: float = 900) -> str:
    done = subprocess.run([PREFECT, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    out = done.stdout + done.stderr
    if check:
        assert done.returncode == 0, out[-4000:]
    return out


def run_deployment(d: dict, name: str, params: dict | None = None, watch: bool = True, check: bool = True) -> str:
    """`prefect deployment run NAME [--params JSON] [--watch]`; returns the flow run id."""
    args = ["deployment", "run", name, *(["--params", json.dumps(params)] if params else [])]
    args += ["--watch", "--watch-timeout", "900"] if watch else []
    out = cli(d["env"], d["project"], *args, check=check)
    return re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)


def flow_state(d: dict, run_id: str) -> str:
    return requests.get(f"{d['api']}/flow_runs/{run_id}", timeout=10).json()["state"]["type"]


def wait_state(d: dict, run_id: str, wanted: set[str], timeout_seconds: float = 900) -> str:
    deadline = time.monotonic() + timeout_seconds
    while (state := flow_state(d, run_id)) not in wanted:
        assert time.monotonic() < deadline, f"flow run {run_id} still {state}"
        assert state not in {"FAILED", "CRASHED", "CANCELLED"} - wanted, f"flow run {run_id} ended {state}"
        time.sleep(0.5)
    return state


def summary(d: dict, run_key: str) -> dict:
    return json.loads((d["project"] / ".miles" / "runs" / run_key / "summary.json").read_text())


def test_smoke_deployment_completes_on_the_local_stack(deployed):
    run_id = run_deployment(deployed, "rl-posttrain/smoke")
    assert flow_state(deployed, run_id) == "COMPLETED"
    result = summary(deployed, run_id)
    assert result["steps"] == 20
    assert result["checkpoint_uri"].startswith("s3://miles/runs/")  # the stack's object store
    assert result["mlflow"]["tracking_uri"] == deployed["env"]["MLFLOW_TRACKING_URI"]
    # the cached stages' Prefect results are persisted in the object store too
    records = s3_listing(deployed, "miles/prefect-results")
    assert any(name.startswith("model-") for name in records) and any(name.startswith("data-") for name in records)


def test_a_secret_parameter_is_refused_before_prefect_stores_it(deployed):
    for override in ("tracking.tracking_uri=http://user:hunter2@mlflow:5000", "model.hf_token=hf_hunter2"):
        out = cli(deployed["env"], deployed["project"], "deployment", "run", "rl-posttrain/smoke",
                  "--params", json.dumps({"overrides": [override]}), check=False)
        assert "Error creating flow run" in out, out[-2000:]
    stored = requests.post(f"{deployed['api']}/flow_runs/filter", json={}, timeout=10).json()
    assert stored and not [run["parameters"] for run in stored if "hunter2" in json.dumps(run["parameters"])]


def s3_listing(d: dict, prefix: str) -> list[str]:
    """Names under s3://prefix in the stack's object store (its endpoint and keys from its env)."""
    import fsspec

    env = d["env"]
    fs = fsspec.filesystem("s3", key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"],
                           client_kwargs={"endpoint_url": env["AWS_ENDPOINT_URL_S3"],
                                          "region_name": env["AWS_DEFAULT_REGION"]}, skip_instance_cache=True)
    return [path.rsplit("/", 1)[-1] for path in fs.ls(prefix)]


def complete_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.parent.name[5:]) for p in (run_dir / "checkpoints").glob("step_*/MANIFEST.json"))


def wait_for(predicate, timeout_seconds: float, what: str):
    deadline = time.monotonic() + timeout_seconds
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


def test_prod_runs_its_driver_as_ray_job_survives_a_kill_guards_concurrency_and_resumes(deployed):
    """prod on the stack with the training driver as a Ray Job: a second run is cancelled by
    the concurrency guard; the driver SIGKILLed after a checkpoint is resubmitted by the task
    retry and resumes; resume_from continues the run; one MLflow run throughout."""
    driver = ["placement.driver=ray_job", "placement.job_poll_seconds=0.5"]
    params = {"config_path": "configs/local.yaml", "overrides": [*TINY, *driver, "training.num_steps=10"]}
    first = run_deployment(deployed, "rl-posttrain/prod", params, watch=False)
    wait_state(deployed, first, {"RUNNING"})
    # A second prod run while one is running: cancelled by the deployment's limit (CANCEL_NEW).
    second = run_deployment(deployed, "rl-posttrain/prod", params, check=False)
    assert wait_state(deployed, second, {"CANCELLED"}, 300) == "CANCELLED"

    token = deployed["env"]["RAY_AUTH_TOKEN"]  # the stack's Ray requires it
    jobs = JobSubmissionClient(deployed["env"]["RAY_API_SERVER_ADDRESS"], headers={"Authorization": f"Bearer {token}"})
    run_dir = deployed["project"] / ".miles" / "runs" / first
    wait_for(lambda: complete_steps(run_dir), 600, "the first checkpoint")
    pid = wait_for(lambda: getattr(jobs.get_job_info(f"miles-{first}-1").driver_info, "pid", None), 60,
                   "the driver job's pid")
    os.kill(int(pid), signal.SIGKILL)
    killed_after = complete_steps(run_dir)[-1]
    assert wait_state(deployed, first, {"COMPLETED"}) == "COMPLETED"
    result = summary(deployed, first)
    assert result["steps"] == 10 and result["resumed_from_step"] == killed_after
    assert [(n, s.value) for n, _, s in ray_jobs.run_jobs(jobs, first)] == [(1, "FAILED"), (2, "SUCCEEDED")]

    # resume_from: the same run key continues from its last checkpoint to the new step count.
    longer = {**params, "overrides": [*TINY, *driver, "training.num_steps=14"], "resume_from": first}
    third = run_deployment(deployed, "rl-posttrain/prod", longer)
    assert flow_state(deployed, third) == "COMPLETED"
    resumed = summary(deployed, first)
    assert resumed["resumed_from_step"] == 10 and resumed["steps"] == 14
    assert ray_jobs.run_jobs(jobs, first)[-1][0] == 3

    client = MlflowClient(deployed["env"]["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("rl-posttrain-local")
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.`miles.run_key` = '{first}'")
    assert len(runs) == 1  # the resumed flow run attached to the first one's MLflow run
    steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, "time/step_seconds")]
    assert sorted(steps) == list(range(1, 15))  # contiguous, each exactly once, across the kill
    params_logged = runs[0].data.params
    assert params_logged["training.num_steps"] == "10"  # params are logged once, by the first run
