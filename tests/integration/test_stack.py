"""The local service stack (infra/stack.py) with real servers: Prefect, worker, MLflow, moto S3, Ray.

One module-scoped stack serves every test; the last test stops it, so keep it last.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid

import psutil
import pytest
import requests
from typer.testing import CliRunner

from infra import stack, stack_cli

LOOPBACK_IPS = {"127.0.0.1", "::ffff:127.0.0.1"}
ENV_KEYS = {"PREFECT_API_URL", "MLFLOW_TRACKING_URI", "MLFLOW_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
            "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
            "MILES_OBJECT_STORE_URI", "RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_API_SERVER_ADDRESS"}


def test_status_output_masks_secrets(tmp_path):
    """Fast, no services: `status --env` shows the env file without its credentials."""
    secret, key_id = "s3cr3t-" + uuid.uuid4().hex, "MILESLOCAL" + uuid.uuid4().hex[:10].upper()
    stack._write_env_file(tmp_path, {"AWS_SECRET_ACCESS_KEY": secret, "AWS_ACCESS_KEY_ID": key_id,
                                     "PREFECT_API_URL": "http://127.0.0.1:1/api"})
    done = subprocess.Popen(["true"])
    done.wait()  # a pid that is surely not running: the service shows as not alive
    stack._save_state(tmp_path, {"services": {"s3": {
        "pid": done.pid, "cmd": ["moto_server"], "log": str(tmp_path / "s3.log"),
        "url": "http://127.0.0.1:1"}}})
    result = CliRunner().invoke(stack_cli.stack_app, ["status", "--state-dir", str(tmp_path), "--env"])
    assert result.exit_code == 0, result.output
    assert secret not in result.output and key_id not in result.output
    assert "AWS_SECRET_ACCESS_KEY=****" in result.output
    assert "PREFECT_API_URL=http://127.0.0.1:1/api" in result.output
    assert stack.read_env_file(tmp_path)["AWS_SECRET_ACCESS_KEY"] == secret  # `source`-able round trip
    assert (tmp_path / "env").stat().st_mode & 0o077 == 0


@pytest.fixture(scope="module")
def live_stack(tmp_path_factory):
    state_dir = tmp_path_factory.mktemp("stack")
    try:
        info = stack.start_stack(state_dir, ray_num_cpus=1, timeout=180)
    except BaseException:
        stack.stop_stack(state_dir)
        raise
    yield info
    if stack._state_path(state_dir).exists():  # the last test normally stopped it already
        stack.stop_stack(state_dir)


def _records(state_dir) -> dict:
    return json.loads(stack._state_path(state_dir).read_text())["services"]


def _listening(state_dir) -> dict[str, set[tuple[str, int]]]:
    """Listening TCP addresses of every process in each service's session."""
    out = {}
    for name, rec in _records(state_dir).items():
        addrs = set()
        for pid in stack._session_members(rec["pid"]):
            try:
                conns = psutil.Process(pid).net_connections(kind="inet")
            except psutil.Error:
                continue
            addrs |= {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}
        out[name] = addrs
    return out


def _s3(env):
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL_S3"],
                        region_name=env["AWS_DEFAULT_REGION"],
                        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                        config=Config(connect_timeout=5, read_timeout=30, retries={"max_attempts": 3}))


def test_services_healthy_and_on_loopback(live_stack):
    print("startup seconds:", live_stack.startup_s, "notes:", live_stack.notes)
    rows = stack.stack_status(live_stack.state_dir)
    assert {r["service"] for r in rows} == set(stack.ALL_SERVICES)
    assert all(r["alive"] for r in rows), rows
    assert set(stack.read_env_file(live_stack.state_dir)) == ENV_KEYS
    for name, addrs in _listening(live_stack.state_dir).items():
        if name == "worker":
            assert not addrs, addrs  # it only polls the Prefect server
        elif name == "ray":
            assert addrs  # the stack's head listens on every interface, behind its token (see infra/stack.py)
        else:
            assert addrs and {ip for ip, _ in addrs} <= LOOPBACK_IPS, (name, addrs)


LOCAL_RAY_LISTENERS = """
import json, os, sys, time
from flows.cli import local_environment
local_environment(sys.argv[1])
import psutil, ray
from tasks.cluster import _init_ray
_init_ray(ray, None, 1)
ports = {"metrics": ray.get_runtime_context().worker.node.metrics_export_port}
time.sleep(5)  # the dashboard's and autoscaler's metrics servers start after ray.init returns
pids = {p.pid for p in psutil.Process().children(recursive=True)} | {os.getpid()}
ports["listening"] = [[c.laddr.ip, c.laddr.port] for c in psutil.net_connections("tcp")
                      if c.status == psutil.CONN_LISTEN and c.pid in pids]
print(json.dumps(ports))
"""


def test_the_local_ray_of_miles_run_listens_on_loopback_only(tmp_path):
    """Ray's metrics servers answer without the token: `miles run`'s own Ray (local_environment,
    then ensure_ray's ray.init) must not be reachable from other hosts at all."""
    from tests.conftest import REPO, run_env

    env = {k: v for k, v in run_env().items() if not k.startswith("RAY_")}
    proc = subprocess.run([sys.executable, "-c", LOCAL_RAY_LISTENERS, str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    addrs = {(ip, port) for ip, port in found["listening"]}
    assert any(port == found["metrics"] for _, port in addrs), found
    assert {ip for ip, _ in addrs} <= LOOPBACK_IPS, addrs


def test_ray_refuses_clients_without_the_stacks_token(live_stack):
    """Ray runs with token auth (every local user reaches loopback): the Jobs API answers a client
    with the env file's token and refuses one without it."""
    env = stack.read_env_file(live_stack.state_dir)
    assert env["RAY_AUTH_MODE"] == "token" and len(env["RAY_AUTH_TOKEN"]) >= 64
    jobs = env["RAY_API_SERVER_ADDRESS"] + "/api/jobs/"
    assert requests.get(jobs, timeout=10).status_code in (401, 403)
    assert requests.get(jobs, headers={"Authorization": f"Bearer {env['RAY_AUTH_TOKEN']}"}, timeout=10).ok


def test_mlflow_artifact_lands_in_s3(live_stack, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    env = live_stack.env
    monkeypatch.setenv("MLFLOW_TRACKING_URI", env["MLFLOW_TRACKING_URI"])
    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    run = client.create_run(client.create_experiment(f"stack-{uuid.uuid4().hex[:8]}"))
    run_id = run.info.run_id
    client.log_metric(run_id, "loss", 0.5, step=1)
    (tmp_path / "hello.txt").write_text("hello from the stack test")
    client.log_artifact(run_id, str(tmp_path / "hello.txt"))
    client.set_terminated(run_id)
    assert [m.value for m in client.get_metric_history(run_id, "loss")] == [0.5]
    listing = _s3(env).list_objects_v2(Bucket="mlflow-artifacts").get("Contents", [])
    keys = [o["Key"] for o in listing]
    assert any(k.endswith(f"{run_id}/artifacts/hello.txt") for k in keys), keys


def test_fsspec_roundtrip_on_object_store(live_stack):
    import fsspec

    env = live_stack.env
    fs = fsspec.filesystem("s3", key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"],
                           client_kwargs={"endpoint_url": env["AWS_ENDPOINT_URL_S3"],
                                          "region_name": env["AWS_DEFAULT_REGION"]},
                           skip_instance_cache=True)
    path = f"{env['MILES_OBJECT_STORE_URI']}/tests/{uuid.uuid4().hex}.bin"
    with fs.open(path, "wb") as f:
        f.write(b"checkpoint bytes")
    assert fs.cat(path) == b"checkpoint bytes"
    assert path.startswith("s3://miles/")


def test_prefect_client_sees_pool_and_worker(live_stack):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: live_stack.env["PREFECT_API_URL"]}):
        with get_client(sync_client=True) as client:
            pool = client.read_work_pool(stack.POOL)
            workers = client.read_workers_for_work_pool(stack.POOL)
    assert pool.type == "process"
    assert any(w.name == stack.WORKER_NAME for w in workers)


def test_ray_jobs_api_is_up_on_loopback(live_stack, monkeypatch):
    from miles_core.driver.ray_jobs import TimeoutJobClient

    monkeypatch.setenv("RAY_AUTH_TOKEN", live_stack.env["RAY_AUTH_TOKEN"])  # as `source <state dir>/env` does
    address = live_stack.env["RAY_API_SERVER_ADDRESS"]
    assert address.startswith("http://127.0.0.1:")
    assert isinstance(TimeoutJobClient(address).list_jobs(), list)


def test_crashed_run_automations_are_installed_once(live_stack):
    from infra import automations

    api = live_stack.env["PREFECT_API_URL"]
    automations.apply_to_server(api, stack.HEARTBEAT_SECONDS)  # a second `stack up` replaces them, never duplicates

    found = requests.post(f"{api}/automations/filter", json={}, timeout=10).json()
    by_name = {a["name"]: a for a in found}
    assert sorted(a["name"] for a in found) == sorted([automations.CRASH_NAME, automations.RESUME_NAME])
    crash = by_name[automations.CRASH_NAME]
    assert crash["trigger"]["posture"] == "Proactive" and crash["trigger"]["within"] == 3 * stack.HEARTBEAT_SECONDS
    assert crash["actions"][0]["type"] == "change-flow-run-state" and crash["actions"][0]["state"] == "CRASHED"
    resume = by_name[automations.RESUME_NAME]
    assert resume["trigger"]["expect"] == ["prefect.flow-run.Crashed"]
    assert resume["actions"][0]["type"] == "run-deployment" and resume["actions"][0]["source"] == "inferred"
    assert "flow_run.parameters.resume_from" in resume["actions"][0]["parameters"]["resume_from"]


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_down_stops_only_what_it_started(live_stack, tmp_path):
    """Keep last: it stops the module's stack."""
    sd = live_stack.state_dir
    ours = {p for rec in _records(sd).values() for p in stack._session_members(rec["pid"])}
    assert ours
    # Decoys named like Ray's daemons: `ray stop` would kill them by name, `down` must not.
    decoys = []
    for name in ("gcs_server", "raylet"):
        shutil.copy("/bin/sleep", tmp_path / name)
        decoys.append(subprocess.Popen([str(tmp_path / name), "300"], start_new_session=True))
    try:
        stack.stop_stack(sd)
        assert not [p for p in ours if _running(p)]
        # Only the decoys: any other Ray on the box (a test beside this one) may end by itself.
        assert all(d.poll() is None for d in decoys), [d.args for d in decoys]
        assert not stack._state_path(sd).exists() and not (sd / "env").exists()
    finally:
        for d in decoys:
            d.kill()
            d.wait()
