"""Remote sources that stop answering: the preflight names them, and a run told to stop stops.

The fake Hub answers model lookups a set number of times, then accepts requests and never
replies, as a wedged endpoint or proxy does.
"""

import json
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from miles_core import preflight as preflight_module
from miles_core.config import load_config
from tests.conftest import REPO, run_env


@pytest.fixture
def wedged_hub(monkeypatch):
    """Returns a setter for how many model lookups are answered before the Hub goes silent; the
    setter's `held` event is set once a request is being held without an answer."""
    answers, release, held = {"left": 0}, threading.Event(), threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if not self.path.startswith("/api/models/"):
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif answers["left"] > 0:
                answers["left"] -= 1
                body = json.dumps({"id": "org/tiny", "sha": "a" * 40, "siblings": []}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                held.set()
                release.wait()

        do_HEAD = do_GET

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    def answer(n: int) -> None:
        answers.update(left=n)

    answer.held = held
    yield answer
    release.set()
    server.shutdown()
    server.server_close()


def test_preflight_names_a_hub_that_does_not_answer(wedged_hub, monkeypatch, tmp_path):
    monkeypatch.setattr(preflight_module, "REMOTE_TIMEOUT_SECONDS", 1.0)
    cfg = load_config(REPO / "configs/local.yaml", ["model.source=hf://org/tiny", f"storage.work_dir={tmp_path}"])
    with pytest.raises(preflight_module.PreflightError, match=r"model.source: hf://org/tiny is not reachable"):
        preflight_module.preflight(cfg)
    assert not list(tmp_path.iterdir())


@pytest.mark.timeout(240)
def test_sigterm_stops_a_run_whose_download_hangs(wedged_hub, tmp_path):
    wedged_hub(2)  # the CLI's and the flow's preflight get answers; the download hangs
    work = tmp_path / "work"
    env = run_env()  # Prefect's temporary server: the run must stop it
    cmd = [sys.executable, "-m", "flows.cli", "run", str(REPO / "configs/local.yaml"),
           "--set", "model.source=hf://org/tiny", "--set", f"storage.work_dir={work}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:  # until the flow is inside the download
        lines.append(line)
        if "stage prepare_model" in line:
            break
    # The download's request is held by the Hub: the run is stuck in it (a fixed 3 s sleep
    # did not say so, and waited longer than needed).
    assert wedged_hub.held.wait(60), "".join(lines)[-3000:]
    proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    output = "".join(lines) + _rest_of_output(proc, timeout_seconds=60)
    assert time.monotonic() - signalled < 30, output[-3000:]
    assert proc.returncode == 128 + signal.SIGTERM and "aborted by a termination signal" in output, output[-3000:]
    assert "marked FAILED" in output  # the MLflow run does not stay RUNNING
    assert "Stopping temporary server" in output  # not orphaned: it would keep serving after the run


@pytest.mark.timeout(300)
def test_sigterm_in_the_train_stage_exits_143(tmp_path):
    """After ensure_ray: ray.init had replaced SIGTERM's handlers (Ray's exit 1, and absl's,
    whose 3 s alarm aborted the process: SIGABRT), and the termination Prefect raises inside
    ray.get comes out as a SystemError."""
    cmd = [sys.executable, "-m", "flows.cli", "run", str(REPO / "configs/local.yaml"),
           "--set", f"storage.work_dir={tmp_path / 'work'}", "--set", "warmup.sft_steps=2",
           "--set", "data.builtin.num_train=1000", "--set", "data.builtin.num_eval=20",
           "--set", "training.num_steps=1000"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "stage train ..." in line:
            break
    time.sleep(5)  # inside the stage: engines and trainers start, then steps run
    proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    output = "".join(lines) + _rest_of_output(proc, timeout_seconds=90)
    assert time.monotonic() - signalled < 60, output[-3000:]
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert "run stopped by SIGTERM" in output and "marked FAILED" in output, output[-3000:]
    assert "Stopping temporary server" in output


def _rest_of_output(proc: subprocess.Popen, timeout_seconds: float) -> str:
    """The run's output until it exits and no child holds the pipe; a run still going after the
    timeout is killed and the test fails with what it printed after the signal."""
    try:
        return proc.communicate(timeout=timeout_seconds)[0]
    except subprocess.TimeoutExpired as exc:
        proc.kill()
        printed = exc.output.decode(errors="replace") if isinstance(exc.output, bytes) else exc.output or ""
        pytest.fail(f"the run did not stop within {timeout_seconds} s of SIGTERM; it printed:\n{printed[-6000:]}")
