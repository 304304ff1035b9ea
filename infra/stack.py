"""The local service stack: Prefect server + process worker, MLflow server, S3 (moto), Ray head.

`miles stack up` starts what is missing, `status` shows it, `down` stops only what it started.
Everything lives under one state directory (default `.miles/stack`): `stack.json` records each
service's pid, ports, command line and log; `env` is a file to `source` (it holds the per-stack
fake S3 credentials, so it is written 0600 and never printed unmasked).

Every server binds 127.0.0.1, except Ray: `ray start` replaces a loopback --node-ip-address with
the machine's address, and its GCS/raylet listen on all interfaces. Ray's single-host mode
(RAY_LOOPBACK_ONLY) would keep the head on loopback, but then the flow runs the worker starts,
which join the head as Ray clients, are sent to the machine's address and never connect. So Ray
runs with token authentication (RAY_AUTH_MODE=token): the token is drawn per stack and kept in
`env`, and a client without it is refused.

Each service is started with start_new_session=True, so its pid is also its session id; `down`
signals every process of that session (Ray's workers change their process group but not their
session) and nothing else. `ray stop` is never used: it kills every Ray process of the machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import requests
from rich.console import Console

from miles_core.net import free_ports
from miles_core.storage.object_store import write_private_text
from miles_core.tracking.redaction import is_secret_name, redact_text

DEFAULT_STATE_DIR = Path(".miles/stack")
ALL_SERVICES = ("s3", "prefect", "mlflow", "ray", "worker")  # launch order
NEEDS = {"worker": ("prefect",), "mlflow": ("s3",)}
PORTS_NEEDED = {"s3": 1, "prefect": 1, "mlflow": 1, "worker": 0, "ray": 4}
LOOPBACK = "127.0.0.1"
# Ray's single-host mode (its macOS/Windows default): the node address is 127.0.0.1, so the GCS,
# raylets, workers, agents and the metrics servers (metrics export port, dashboard and autoscaler
# metrics, which answer without the token) bind loopback instead of every interface. No other
# process can join such a cluster as a client from outside it: only for the Ray a `miles run`
# starts in its own process (flows/cli.py), never for the stack's head or a cluster's. Read by
# Ray at import, and by each of its processes.
RAY_LOOPBACK_ONLY = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
POOL = "local-process"
WORKER_NAME = "miles-stack-worker"
HEARTBEAT_SECONDS = 60
"""Flow-run heartbeat period of the stack's worker (Prefect's minimum is 30 s); the crash
automation fires after three missed beats."""
BUCKETS = ("miles", "mlflow-artifacts")
REGION = "us-east-1"
# Ray puts unix sockets under <temp>/session_<date>_<pid>/sockets/; AF_UNIX paths stop at 107 bytes.
RAY_TEMP_MAX = 38

console = Console(stderr=True)


class StackError(RuntimeError):
    """A service could not be started or stopped; the message says which and why."""


@dataclass
class StackInfo:
    state_dir: Path
    urls: dict[str, str]
    env: dict[str, str]
    startup_s: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------- state, env and processes


def _state_path(sd: Path) -> Path:
    return sd / "stack.json"


def _load_state(sd: Path) -> dict:
    path = _state_path(sd)
    return json.loads(path.read_text()) if path.exists() else {"services": {}}


def _save_state(sd: Path, state: dict) -> None:
    tmp = _state_path(sd).with_suffix(".tmp")  # write-then-rename: a crash never leaves half a file
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(_state_path(sd))


def read_env_file(sd: Path) -> dict[str, str]:
    path = Path(sd) / "env"
    env = {}
    if path.exists():
        for line in path.read_text().splitlines():
            parts = shlex.split(line, comments=True)
            if len(parts) == 2 and parts[0] == "export" and "=" in parts[1]:
                key, value = parts[1].split("=", 1)
                env[key] = value
    return env


def _write_env_file(sd: Path, env: dict[str, str]) -> None:
    lines = ["# Written by `miles stack up`: source it to reach the local stack.",
             "# The S3 credentials are fake, generated for this stack, and only valid against it."]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())]
    write_private_text(sd / "env", "\n".join(lines) + "\n")


CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "RAY_AUTH_TOKEN")


def mask_env(env: dict[str, str]) -> dict[str, str]:
    """Values of secret-looking keys (and secrets inside the other values, such as a URL's
    credentials) replaced, so that status output never shows them."""
    return {k: ("****" if is_secret_name(k) else redact_text(v)) for k, v in env.items()}


def _credentials(sd: Path) -> dict[str, str]:
    """The S3 keys and Ray's auth token (every local user reaches loopback, so every Ray client
    must present the token). A second `up` reuses them, so running clients keep working."""
    old = read_env_file(sd)
    if all(old.get(k) for k in CREDENTIALS):
        return {k: old[k] for k in CREDENTIALS}
    return {"AWS_ACCESS_KEY_ID": "MILESLOCAL" + secrets.token_hex(5).upper(),
            "AWS_SECRET_ACCESS_KEY": secrets.token_urlsafe(30), "RAY_AUTH_TOKEN": secrets.token_hex(32)}


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (one still exiting counts)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.decode(errors="replace").rstrip("\0").split("\0") if raw and _alive(pid) else None


def _runs(cmdline: list[str] | None, cmd: list[str]) -> bool:
    """Whether a /proc command line is `cmd`; a script shows up behind its interpreter."""
    if not cmdline or len(cmdline) < len(cmd):
        return False
    head = cmdline[: len(cmdline) - len(cmd) + 1]
    return cmdline[len(head):] == cmd[1:] and any(Path(a).name == Path(cmd[0]).name for a in head)


def _is_ours(rec: dict | None) -> bool:
    """The recorded pid is alive and still runs the command we started (pids get reused)."""
    return bool(rec) and _runs(_cmdline(rec["pid"]), rec["cmd"])


def _session_members(sid: int) -> list[int]:
    """The session's processes that have not exited. One still exiting counts: its command line
    is already empty, but it holds its ports and files until it is a zombie."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid and _alive(int(entry.name)):
                    members.append(int(entry.name))
            except OSError:
                continue
    return members


def _reap(pid: int) -> None:
    # When the stack was started from this process (tests), its children become zombies.
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _bin(name: str) -> str:
    local = Path(sys.executable).parent / name  # the venv's own console scripts first
    found = str(local) if local.exists() else shutil.which(name)
    if not found:
        hint = ' (pip install "moto[server]")' if name == "moto_server" else ""
        raise StackError(f"`{name}` not found{hint}")
    return found


def _tail(path: str, n: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _launch(name: str, cmd: list[str], env: dict[str, str], sd: Path) -> dict:
    log = sd / "logs" / f"{name}.log"
    with open(log, "ab") as f:
        f.write(f"\n=== {time.strftime('%F %T')} {shlex.join(cmd)}\n".encode())
        f.flush()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, **env}, start_new_session=True)
    return {"pid": proc.pid, "cmd": cmd, "log": str(log),
            "started_at": time.time(), "note": ""}


# ---------------------------------------------------------------- ports, commands, health


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))  # all interfaces: a port another program holds on any address is taken
            return True
        except OSError:
            return False


def _pick_ports(n: int, previous: list[int] | None) -> list[int]:
    # Keep a restarted service on its old ports when we can, so running clients reconnect.
    if previous and len(previous) == n and all(_port_free(p) for p in previous):
        return previous
    return free_ports(n, LOOPBACK)


def _ray_temp_dir(sd: Path) -> Path:
    wanted = sd / "ray"
    if len(str(wanted)) <= RAY_TEMP_MAX:
        return wanted
    digest = hashlib.sha1(str(sd).encode()).hexdigest()[:10]  # stable across `up` calls
    return Path("/tmp") / f"miles-ray-{digest}"


def _command(name: str, ports: list[int], sd: Path, opts: dict) -> list[str]:
    port = str(ports[0]) if ports else ""
    if name == "s3":
        return [_bin("moto_server"), "-H", LOOPBACK, "-p", port]
    if name == "prefect":
        return [_bin("prefect"), "server", "start", "--host", LOOPBACK, "--port", port]
    if name == "mlflow":
        return [_bin("mlflow"), "server", "--host", LOOPBACK, "--port", port, "--workers", "1",
                "--backend-store-uri", f"sqlite:///{sd}/mlflow.db",
                "--artifacts-destination", opts.get("mlflow_artifacts", "s3://mlflow-artifacts/")]
    if name == "worker":
        return [_bin("prefect"), "worker", "start", "--pool", POOL, "--type", "process",
                "--name", WORKER_NAME]
    gcs, client, dash, agent = map(str, ports)
    # --block keeps `ray start` as the session leader, so the whole head has one recorded pid.
    return [_bin("ray"), "start", "--head", "--block", "--port", gcs,
            "--ray-client-server-port", client, "--dashboard-host", LOOPBACK,
            "--dashboard-port", dash, "--dashboard-agent-listen-port", agent,
            "--include-dashboard", "true", "--num-cpus", str(opts["ray_num_cpus"]),
            "--temp-dir", str(opts["ray_temp_dir"]), "--disable-usage-stats"]


def _service_env(name: str, sd: Path, user_env: dict[str, str]) -> dict[str, str]:
    prefect = {"PREFECT_HOME": str(sd / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    if name == "prefect":
        url = f"sqlite+aiosqlite:///{sd}/prefect/prefect.db"
        return {**user_env, **prefect, "PREFECT_API_DATABASE_CONNECTION_URL": url}
    if name == "mlflow":
        return {**user_env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    if name == "ray":  # a RAY_ADDRESS in the environment would make `ray start --head` fail
        return {k: v for k, v in user_env.items() if k != "RAY_ADDRESS"}
    if name == "worker":  # flow runs inherit the worker's environment: give them the whole stack
        return {**user_env, **prefect, "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_SECONDS)}
    return user_env


def _worker_online(api_url: str) -> bool:
    r = requests.post(f"{api_url}/work_pools/{POOL}/workers/filter", json={}, timeout=5)
    return r.ok and any(w["name"] == WORKER_NAME and w.get("status") == "ONLINE" for w in r.json())


def _ray_address(rec: dict) -> str | None:
    path = Path(rec["temp_dir"]) / "ray_current_cluster"  # written once the head is up
    if not path.exists():
        return None
    return path.read_text().strip() or None


def _healthy(name: str, rec: dict, ray_token: str | None = None) -> bool:
    try:
        if name in ("prefect", "mlflow"):
            return requests.get(f"{rec['url']}/health", timeout=5).status_code == 200
        if name == "s3":
            return requests.get(f"{rec['url']}/", timeout=5).status_code < 500
        if name == "worker":
            return _worker_online(rec["api_url"])
        address = _ray_address(rec)
        if address:
            host, port = address.rsplit(":", 1)
            socket.create_connection((host, int(port)), timeout=3).close()
            rec["url"] = address
            auth = {"Authorization": f"Bearer {ray_token}"} if ray_token else {}
            requests.get(f"{_ray_jobs_url(rec['ports'])}/api/version", headers=auth, timeout=5).raise_for_status()
        return bool(address)
    except (requests.RequestException, OSError, ValueError):
        return False


# ---------------------------------------------------------------- post-start setup


def _create_buckets(url: str, creds: dict[str, str]) -> None:
    import boto3
    from botocore.config import Config

    s3 = boto3.client("s3", endpoint_url=url, region_name=REGION,
                      aws_access_key_id=creds["AWS_ACCESS_KEY_ID"],
                      aws_secret_access_key=creds["AWS_SECRET_ACCESS_KEY"],
                      config=Config(connect_timeout=5, read_timeout=30,
                                    retries={"max_attempts": 5, "mode": "standard"}))
    existing = {b["Name"] for b in s3.list_buckets().get("Buckets", [])}
    for bucket in BUCKETS:  # moto keeps buckets in memory: a restarted S3 needs them again
        if bucket not in existing:
            s3.create_bucket(Bucket=bucket)


def _ensure_pool(api_url: str, env: dict[str, str]) -> None:
    if requests.get(f"{api_url}/work_pools/{POOL}", timeout=10).status_code == 200:
        return
    cmd = [_bin("prefect"), "work-pool", "create", POOL, "--type", "process"]
    t0 = time.time()
    with console.status(f"creating work pool {POOL}"):
        res = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True,
                             timeout=180)
    if res.returncode != 0 and "already exists" not in res.stdout + res.stderr:
        raise StackError(f"`{shlex.join(cmd)}` failed:\n{res.stdout}\n{res.stderr}")
    console.print(f"[green]✓[/] work pool {POOL} created in {time.time() - t0:.1f} s")


def _ray_jobs_url(ports: list[int]) -> str:
    """The Ray Jobs API (the dashboard) of a head started with these ports."""
    return f"http://{LOOPBACK}:{ports[2]}"


def _user_env(urls: dict[str, str], creds: dict[str, str], state: dict | None = None) -> dict[str, str]:
    env = {**creds, "AWS_DEFAULT_REGION": REGION, "RAY_AUTH_MODE": "token"}
    if "s3" in urls:
        env.update(MLFLOW_S3_ENDPOINT_URL=urls["s3"], AWS_ENDPOINT_URL_S3=urls["s3"],
                   MILES_OBJECT_STORE_URI="s3://miles")
    if "prefect" in urls:
        env["PREFECT_API_URL"] = urls["prefect"]
    if "mlflow" in urls:
        env["MLFLOW_TRACKING_URI"] = urls["mlflow"]
    if "ray" in urls:
        env["RAY_ADDRESS"] = urls["ray"]
        ray_rec = (state or {}).get("services", {}).get("ray") or {}
        if ray_rec.get("ports"):  # the driver jobs of placement.driver=ray_job go here
            env["RAY_API_SERVER_ADDRESS"] = _ray_jobs_url(ray_rec["ports"])
    return env


# ---------------------------------------------------------------- public API


def _resolve_services(services) -> list[str]:
    wanted = set(services.split(",") if isinstance(services, str) else services) - {""}
    unknown = wanted - set(ALL_SERVICES)
    if unknown:
        raise StackError(f"unknown services {sorted(unknown)}; choose from {list(ALL_SERVICES)}")
    for name in list(wanted):
        wanted.update(NEEDS.get(name, ()))
    return [s for s in ALL_SERVICES if s in wanted]


def _plan(sd: Path, state: dict, names: list[str], opts: dict) -> dict[str, dict]:
    """Which services to launch, with their ports; live ones are kept as they are."""
    plan = {}
    for name in names:
        rec = state["services"].get(name)
        if _is_ours(rec):
            continue
        ports = _pick_ports(PORTS_NEEDED[name], (rec or {}).get("ports"))
        # Ray's address is only known once the head runs; the worker serves nothing.
        url = f"http://{LOOPBACK}:{ports[0]}" if name in ("s3", "prefect", "mlflow") else ""
        plan[name] = {"ports": ports, "url": url + ("/api" if name == "prefect" else "")}
    if "ray" in plan:
        opts["ray_temp_dir"] = _ray_temp_dir(sd)
    return plan


def start_stack(state_dir=DEFAULT_STATE_DIR, services=ALL_SERVICES, *,
                ray_num_cpus: int | None = None, timeout: float = 120.0) -> StackInfo:
    """Start the missing services (and those they need), wait until healthy, write the env file."""
    sd = Path(state_dir).resolve()
    (sd / "logs").mkdir(parents=True, exist_ok=True)
    names, state, creds = _resolve_services(services), _load_state(sd), _credentials(sd)
    opts = {"ray_num_cpus": ray_num_cpus or os.cpu_count() or 1}
    plan = _plan(sd, state, names, opts)
    urls = {n: r["url"] for n, r in state["services"].items()
            if n not in plan and r.get("url") and _is_ours(r)}
    urls.update({n: p["url"] for n, p in plan.items() if p["url"]})
    user_env = _user_env(urls, creds)
    _write_env_file(sd, user_env)  # written early: credentials are known before S3 starts
    for name in [n for n in plan if n != "worker"]:  # launched together: their waits overlap
        _start_one(sd, state, name, plan[name], user_env, opts)
    _wait_all(sd, state, [n for n in names if n != "worker"], creds, user_env, opts, timeout)
    urls.update({n: state["services"][n]["url"] for n in names if n != "worker"})
    user_env = _user_env(urls, creds, state)  # now with Ray's real address and Jobs API
    _write_env_file(sd, user_env)
    if "prefect" in names:
        from infra import automations

        automations.apply_to_server(urls["prefect"], HEARTBEAT_SECONDS)
    if "worker" in names:
        _ensure_pool(urls["prefect"], _service_env("worker", sd, user_env))
        if "worker" in plan:
            _start_one(sd, state, "worker", plan["worker"], user_env, opts)
        _wait_all(sd, state, ["worker"], creds, user_env, opts, timeout)
    recs = state["services"]
    return StackInfo(sd, {n: recs[n].get("url", "") for n in names}, user_env,
                     {n: recs[n].get("startup_s", 0.0) for n in names},
                     {n: recs[n]["note"] for n in names if recs[n].get("note")})


def _start_one(sd: Path, state: dict, name: str, plan: dict, user_env: dict, opts: dict) -> None:
    if name == "ray":  # a stale address file would make a new head look ready at once
        (opts["ray_temp_dir"] / "ray_current_cluster").unlink(missing_ok=True)
    rec = _launch(name, _command(name, plan["ports"], sd, opts), _service_env(name, sd, user_env), sd)
    rec.update(ports=plan["ports"], url=plan["url"])
    opts.setdefault("fresh", set()).add(name)  # started by this `up`: its startup gets timed
    if name == "ray":
        rec["temp_dir"] = str(opts["ray_temp_dir"])
    if name == "worker":
        rec["api_url"] = user_env["PREFECT_API_URL"]
    state["services"][name] = rec
    _save_state(sd, state)  # recorded before waiting: a failed `up` can still be cleaned by `down`


def _wait_all(sd: Path, state: dict, names: list[str], creds: dict, user_env: dict,
              opts: dict, timeout: float) -> None:
    """Poll every pending service in turn, so each one's startup time is its own."""
    pending = list(names)
    with console.status("waiting for " + ", ".join(pending)) as spinner:
        while pending:
            for name in list(pending):
                rec = state["services"][name]
                if _healthy(name, rec, creds.get("RAY_AUTH_TOKEN")):
                    pending.remove(name)
                    _on_ready(sd, state, name, creds, name in opts.get("fresh", ()))
                elif not _is_ours(rec):
                    _on_exit(sd, state, name, user_env, opts)
                elif time.time() - rec["started_at"] > timeout:
                    raise StackError(f"{name} was not healthy after {timeout:.0f} s; "
                                     f"last lines of {rec['log']}:\n{_tail(rec['log'])}")
            spinner.update("waiting for " + ", ".join(pending))
            time.sleep(0.5)


def _on_ready(sd: Path, state: dict, name: str, creds: dict, fresh: bool) -> None:
    rec = state["services"][name]
    if fresh:
        rec["startup_s"] = round(time.time() - rec["started_at"], 1)
        console.print(f"[green]✓[/] {name} ready in {rec['startup_s']} s  {rec.get('url', '')}")
    else:
        console.print(f"[green]✓[/] {name} already running (pid {rec['pid']})")
    if name == "s3":
        _create_buckets(rec["url"], creds)
    _save_state(sd, state)


def _on_exit(sd: Path, state: dict, name: str, user_env: dict, opts: dict) -> None:
    rec = state["services"][name]
    if name != "mlflow" or "mlflow_artifacts" in opts:
        raise StackError(f"{name} exited; last lines of {rec['log']}:\n{_tail(rec['log'])}")
    # MLflow refused the S3 destination: keep tracking usable with artifacts on local disk.
    opts["mlflow_artifacts"] = str(sd / "mlflow-artifacts")
    console.print(f"[yellow]mlflow exited with S3 artifacts; retrying with {opts['mlflow_artifacts']}")
    _start_one(sd, state, name, {"ports": rec["ports"], "url": rec["url"]}, user_env, opts)
    note = f"artifacts in local dir {opts['mlflow_artifacts']} (S3 destination failed)"
    state["services"][name]["note"] = note


def _terminate(name: str, rec: dict, grace: float) -> list[int]:
    """Signal the recorded session; returns the pids still alive at the end (should be none)."""
    sid = rec["pid"]
    leader_cmd = _cmdline(sid)
    if leader_cmd is not None and not _runs(leader_cmd, rec["cmd"]):
        console.print(f"[yellow]{name}: pid {sid} now runs something else; not touching it")
        return []
    # A session id cannot be handed out again while a member lives, so members are ours.
    for sig in (signal.SIGTERM, signal.SIGKILL):
        # `ray start --block` stops its children in order on SIGTERM; a SIGTERM to all of them
        # at once left gcs_server and raylet hanging. Other services take it session-wide.
        first = sig == signal.SIGTERM and name == "ray" and leader_cmd
        targets = [sid] if first else _session_members(sid)
        for pid in targets:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + grace
        while time.time() < deadline:
            _reap(sid)
            if not _session_members(sid):
                return []
            time.sleep(0.3)
    return _session_members(sid)


def stop_stack(state_dir=DEFAULT_STATE_DIR, grace: float = 15.0) -> None:
    """Stop every recorded service (worker first), then remove the state and env files."""
    sd = Path(state_dir).resolve()
    state = _load_state(sd)
    left = {}
    for name in reversed(ALL_SERVICES):
        rec = state["services"].get(name)
        if rec:
            with console.status(f"stopping {name} (pid {rec['pid']})"):
                survivors = _terminate(name, rec, grace)
            if survivors:
                left[name] = survivors
            console.print(f"[green]✓[/] {name} stopped" if not survivors else f"[red]{name}: {survivors} alive")
    if left:
        raise StackError(f"processes still alive after SIGKILL: {left}")
    ray_tmp = state["services"].get("ray", {}).get("temp_dir")
    if ray_tmp and not Path(ray_tmp).is_relative_to(sd):  # the short /tmp one: don't leak it
        shutil.rmtree(ray_tmp, ignore_errors=True)
    _state_path(sd).unlink(missing_ok=True)
    (sd / "env").unlink(missing_ok=True)  # its URLs and credentials point at nothing now


def stack_status(state_dir=DEFAULT_STATE_DIR) -> list[dict]:
    sd = Path(state_dir).resolve()
    rows, token = [], read_env_file(sd).get("RAY_AUTH_TOKEN")
    for name, rec in _load_state(sd)["services"].items():
        alive = _is_ours(rec) and _healthy(name, rec, token)
        rows.append({"service": name, "url": rec.get("url", ""), "pid": rec["pid"],
                     "alive": alive, "log": rec["log"], "note": rec.get("note", "")})
    return rows
