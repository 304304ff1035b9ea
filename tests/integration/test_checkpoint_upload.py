"""Checkpoint uploads (miles_core/storage/uploads.py) against file:// and a real moto S3 server behind a
fault-injecting HTTP proxy: retries, read-back verification, the latest.json pointer, pruning,
permanent failures, and resuming a run from the store."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from miles_core.config import CheckpointConfig
from miles_core.errors import is_retryable
from miles_core.storage import checkpoint as ckpt
from miles_core.storage import uploads
from tests.conftest import REPO, run_env

MiB = 1 << 20
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection", "te", "upgrade"}
FAULT_BODIES = {
    500: b"<Error><Code>InternalError</Code><Message>injected fault</Message></Error>",
    503: b"<Error><Code>ServiceUnavailable</Code><Message>injected fault</Message></Error>",
    403: b"<Error><Code>AccessDenied</Code><Message>injected: Access Denied</Message></Error>",
}


class FaultProxy:
    """Forwards HTTP to moto, failing requests as fail() arranged: 500, 503, 403, or "hang"
    (no answer for hang_seconds, then the connection is dropped)."""

    def __init__(self, upstream: tuple[str, int], hang_seconds: float = 2.5) -> None:
        self.upstream, self.hang_seconds = upstream, hang_seconds
        self.rules: list[tuple[object, list]] = []
        self.requests: list[tuple[str, str]] = []
        self.faults: list[tuple[int, object, str, str]] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def fail(self, kinds: list, match=lambda method, path: True) -> None:
        """The next len(kinds) requests that match get these fates in turn (None: forwarded).
        Rules are tried in the order they were added."""
        with self.lock:
            self.rules.append((match, list(kinds)))

    def _decide(self, method: str, path: str):
        with self.lock:
            n = len(self.requests)
            self.requests.append((method, path))
            rule = next((kinds for match, kinds in self.rules if kinds and match(method, path)), None)
            kind = rule.pop(0) if rule else None
            if kind is not None:
                self.faults.append((n, kind, method, path))
            return kind

    def _handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while (size := int(self.rfile.readline().split(b";")[0], 16)) > 0:
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                    self.rfile.readline()
                    return b"".join(chunks)
                return self.rfile.read(int(self.headers.get("Content-Length", 0)))

            def _handle(self) -> None:
                body = self._body()
                kind = proxy._decide(self.command, self.path)
                if kind == "hang":
                    time.sleep(proxy.hang_seconds)
                    self.close_connection = True
                    return
                if kind is not None:
                    self._reply(kind, {"Content-Type": "application/xml"}, FAULT_BODIES[kind])
                    return
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                conn.request(self.command, self.path, body=body if body or self.command in ("PUT", "POST") else None,
                             headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                self._reply(resp.status, dict(resp.getheaders()), data)

            def _reply(self, status: int, headers: dict, data: bytes) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    if k.lower() not in HOP_BY_HOP | {"content-length", "date", "server"}:
                        self.send_header(k, v)
                # HEAD answers carry the object's size and no body (s3fs reads sizes from HEAD).
                length = headers.get("Content-Length", headers.get("content-length", "0")) \
                    if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

        return Handler

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def moto_s3():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    yield server.get_host_and_port()
    server.stop()


def s3_env(endpoint_url: str) -> dict[str, str]:
    # Fake credentials, valid only against this moto server.
    return {"AWS_ENDPOINT_URL_S3": endpoint_url, "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def direct_client(moto_s3):
    """boto3 straight to moto (bypassing the proxy and its faults), for the test's own checks."""
    import boto3

    env = s3_env(f"http://{moto_s3[0]}:{moto_s3[1]}")
    return boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL_S3"], region_name=env["AWS_DEFAULT_REGION"],
                        aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])


@pytest.fixture
def s3_store(moto_s3, monkeypatch):
    """(store_uri, proxy, direct client): a fresh bucket reached through a fault proxy."""
    bucket = f"ckpt-{uuid.uuid4().hex[:8]}"
    client = direct_client(moto_s3)
    client.create_bucket(Bucket=bucket)
    proxy = FaultProxy(moto_s3)
    for k, v in s3_env(proxy.url).items():
        monkeypatch.setenv(k, v)
    yield f"s3://{bucket}/store", proxy, client
    proxy.close()


def fast_cfg(**overrides) -> CheckpointConfig:
    return CheckpointConfig(**{"upload_part_megabytes": 5, "upload_attempts": 6, "upload_backoff_seconds": 0.05,
                               "upload_timeout_seconds": 1.0, "store_keep_latest": 2, **overrides})


def make_checkpoint(checkpoints_dir: Path, step: int, big_bytes: int = 64 * 1024) -> Path:
    def write(staging: Path) -> None:
        (staging / "model.safetensors").write_bytes(os.urandom(big_bytes))
        (staging / "trainer_state.json").write_text(json.dumps({"step": step}))

    return ckpt.write_checkpoint(checkpoints_dir, step, "digest", write)


def store_steps(fs_root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in fs_root.glob("step_*"))


def test_file_store_uploads_prunes_and_restores(tmp_path):
    store_uri, key, cfg = (tmp_path / "store").as_uri(), "run-a", fast_cfg(store_keep_latest=2)
    uploader = uploads.CheckpointUploader(store_uri, key, cfg, tmp_path / "run" / "upload_staging")
    for step in (10, 20, 30):
        uploader.submit(step, make_checkpoint(tmp_path / "run" / "checkpoints", step))
        uploader.wait(30)
    uploader.close()
    remote = tmp_path / "store" / "runs" / key / "checkpoints"
    latest = json.loads((remote / "latest.json").read_text())
    assert latest["step"] == 30 and latest["uri"].endswith("checkpoints/step_000030")
    assert store_steps(remote) == [20, 30]  # keep-latest-2 in the store
    assert ckpt.verify_checkpoint(remote / "step_000030") is None
    assert not list((tmp_path / "run" / "upload_staging").glob("*"))  # hard-linked snapshots cleaned up
    assert uploader.stats.checkpoints == [10, 20, 30] and uploader.stats.retries == 0

    # Already there (e.g. upload-artifacts after the train task uploaded it): not uploaded again.
    pointer, uploaded = uploads.upload_checkpoint(store_uri, key, 30, remote / "step_000030", cfg)
    assert not uploaded and pointer["step"] == 30

    fresh = tmp_path / "new-machine" / "checkpoints"
    assert uploads.restore_latest(store_uri, key, fresh, cfg) == 30
    assert ckpt.latest_complete_checkpoint(fresh)[0] == 30
    assert uploads.restore_latest(store_uri, key, fresh, cfg) is None  # a complete local one wins
    (fresh / "step_000030" / "model.safetensors").write_bytes(b"torn")  # the only local one is corrupt
    assert uploads.restore_latest(store_uri, key, fresh, cfg) == 30
    assert ckpt.verify_checkpoint(fresh / "step_000030") is None
    assert uploads.restore_latest(store_uri, "no-such-run", tmp_path / "other", cfg) is None

    # latest.json is trusted only to name this run's own step directory
    shutil.copytree(remote, tmp_path / "elsewhere")
    (remote / "latest.json").write_text(json.dumps(latest | {"uri": (tmp_path / "elsewhere").as_uri()}))
    with pytest.raises(uploads.storage.UploadVerificationError, match="refusing to download"):
        uploads.restore_latest(store_uri, key, tmp_path / "third-machine" / "checkpoints", cfg)
    assert not (tmp_path / "third-machine").exists()


def test_queued_checkpoints_are_superseded_by_the_newest(tmp_path, monkeypatch):
    release, real = threading.Event(), uploads.upload_checkpoint

    def slow_first(*args, **kwargs):
        release.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(uploads, "upload_checkpoint", slow_first)
    uploader = uploads.CheckpointUploader((tmp_path / "store").as_uri(), "k", fast_cfg(),
                                          tmp_path / "run" / "upload_staging")
    for step in (1, 2, 3):
        uploader.submit(step, make_checkpoint(tmp_path / "run" / "checkpoints", step))
        time.sleep(0.1)
    # The local keep-latest pruning deletes step 1 while it waits: the hard links keep it whole.
    ckpt.prune(tmp_path / "run" / "checkpoints", keep_latest=1)
    release.set()
    stats = uploader.wait(30)
    uploader.close()
    assert stats.checkpoints == [1, 3] and not stats.failures


class PointerWatcher:
    """Polls latest.json straight from moto while uploads run and checks that the checkpoint it
    names is complete every time (all manifest files present with their sizes)."""

    def __init__(self, client, bucket: str, prefix: str) -> None:
        self.client, self.bucket, self.prefix = client, bucket, prefix
        self.seen: list[int] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _get(self, key: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None

    def check_once(self) -> None:
        raw = self._get(f"{self.prefix}/latest.json")
        if raw is None:
            return
        pointer = json.loads(raw)
        step_prefix = pointer["uri"].removeprefix(f"s3://{self.bucket}/")
        manifest_raw = self._get(f"{step_prefix}/MANIFEST.json")
        if manifest_raw is None or hashlib.sha256(manifest_raw).hexdigest() != pointer["manifest_sha256"]:
            self.errors.append(f"latest.json -> step {pointer['step']} whose manifest is missing or different")
            return
        for rel, meta in json.loads(manifest_raw)["files"].items():
            size = self.client.head_object(Bucket=self.bucket, Key=f"{step_prefix}/{rel}")["ContentLength"]
            if size != meta["size"]:
                self.errors.append(f"latest.json -> step {pointer['step']}: {rel} has {size} bytes")
        if not self.seen or self.seen[-1] != pointer["step"]:
            self.seen.append(pointer["step"])

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                self.check_once()
            except Exception as exc:  # noqa: BLE001 - a pruned file between reads shows as a missing object
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.check_once()


def test_s3_multipart_upload_survives_errors_and_timeouts(s3_store, tmp_path):
    store_uri, proxy, client = s3_store
    bucket, key = store_uri[5:].split("/")[0], "run-s3"
    cfg = fast_cfg(store_keep_latest=2, upload_timeout_seconds=1.0)
    prefix = f"store/runs/{key}/checkpoints"
    watcher = PointerWatcher(client, bucket, prefix)
    uploader = uploads.CheckpointUploader(store_uri, key, cfg, tmp_path / "run" / "upload_staging")
    clean = uploads.UploadStats()  # baseline: the same checkpoint size without faults
    uploads.upload_checkpoint(store_uri, "run-clean", 1,
                              make_checkpoint(tmp_path / "clean", 1, big_bytes=12 * MiB), cfg, clean)
    local = {}
    for step in (1, 2, 3):
        local[step] = make_checkpoint(tmp_path / "run" / "checkpoints", step, big_bytes=12 * MiB)
        # Errors and hangs in the middle of each upload: on multipart parts, and on anything.
        proxy.fail([None, 500, "hang", 503], match=lambda method, path: "partNumber=" in path)
        proxy.fail([None, None, 503, 500, "hang", 500, None, 503, 500, 500])
        uploader.submit(step, local[step])
        uploader.wait(120)
    uploader.close()
    watcher.stop()
    stats = uploader.stats
    print(f"\nno faults: {clean.bytes / 1e6:.1f} MB in {clean.seconds:.2f} s ({clean.megabytes_per_second():.1f} MB/s, "
          f"upload + sha256 read-back); with faults: {stats.bytes / 1e6:.1f} MB in {stats.seconds:.1f} s "
          f"({stats.megabytes_per_second():.1f} MB/s), {stats.retries} file-level retries, "
          f"{len(proxy.faults)} injected faults, {len(proxy.requests)} requests")
    assert len(proxy.faults) == 3 * (3 + 7) and stats.retries >= 3 and not stats.failures
    assert sum("partNumber=" in path for *_, path in proxy.faults) == 9
    assert stats.checkpoints == [1, 2, 3]
    assert any(m == "POST" and "uploads" in p for m, p in proxy.requests), "no multipart upload was started"
    big = client.head_object(Bucket=bucket, Key=f"{prefix}/step_000003/model.safetensors")
    assert big["ETag"].strip('"').endswith("-3")  # 12 MiB in 5 MiB parts
    assert watcher.errors == [] and watcher.seen == sorted(watcher.seen) and watcher.seen[-1] == 3
    listed = {o["Key"].split("/")[-2] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
              if "/step_" in o["Key"]}
    assert listed == {"step_000002", "step_000003"}  # keep-latest-2 in the store
    restored = tmp_path / "restored" / "checkpoints"
    assert uploads.restore_latest(store_uri, key, restored, cfg) == 3
    assert (restored / "step_000003" / "model.safetensors").read_bytes() == \
        (local[3] / "model.safetensors").read_bytes()


@pytest.mark.parametrize("fault, error_type, retried", [(500, uploads.StoreUnavailable, True),
                                                         (403, uploads.UploadFailed, False)])
def test_permanent_failure_surfaces_and_keeps_previous_latest(s3_store, tmp_path, fault, error_type, retried):
    store_uri, proxy, client = s3_store
    bucket, key = store_uri[5:].split("/")[0], "run-fail"
    cfg = fast_cfg(upload_attempts=3)
    uploader = uploads.CheckpointUploader(store_uri, key, cfg, tmp_path / "run" / "upload_staging")
    uploader.submit(1, make_checkpoint(tmp_path / "run" / "checkpoints", 1))
    uploader.wait(60)
    proxy.fail([None] * 3 + [fault] * 1000)  # the store breaks after latest.json is read
    uploader.submit(2, make_checkpoint(tmp_path / "run" / "checkpoints", 2))
    with pytest.raises(error_type) as caught:
        uploader.wait(60)
    uploader.close()
    message = str(caught.value)
    assert "step 2" in message
    assert ("after 3 attempts" in message) if retried else ("not retried" in message)
    assert is_retryable(caught.value) == retried  # what Prefect's retry condition decides
    assert (uploader.stats.retries > 0) == retried
    pointer = json.loads(client.get_object(Bucket=bucket, Key=f"store/runs/{key}/checkpoints/latest.json")["Body"].read())
    assert pointer["step"] == 1


@pytest.mark.e2e
def test_flow_survives_store_faults_and_resumes_from_store(s3_store, prefect_api, tmp_path):
    """`miles run` with an S3 store that fails and hangs, then `--resume` on a fresh run dir."""
    store_uri, proxy, client = s3_store
    env = run_env(prefect_api, **s3_env(proxy.url))
    sets = ["training.num_steps=10", "checkpoint.interval_steps=5", "warmup.sft_steps=0",
            "rollout.num_prompts_per_step=8", "rollout.num_samples_per_prompt=4",
            "data.builtin.num_eval=40", f"storage.object_store_uri={store_uri}",
            f"storage.work_dir={tmp_path / 'work'}", "checkpoint.upload_timeout_seconds=2",
            "checkpoint.upload_backoff_seconds=0.2"]

    def miles(run_dir: Path, more_sets: tuple[str, ...] = (), args: tuple[str, ...] = ()) -> dict:
        cmd = [sys.executable, "-m", "flows.cli", "run", str(REPO / "configs/local.yaml"), "--run-dir", str(run_dir),
               *[x for s in [*sets, *more_sets] for x in ("--set", s)], *args]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return json.loads((run_dir / "summary.json").read_text())

    # Every third store request of the first 45 fails (503/500), one of them hangs past the timeout.
    proxy.fail([(503, 500, "hang")[i // 3 % 3] if i % 3 == 2 else None for i in range(45)])
    first = miles(tmp_path / "run1")
    assert first["steps"] == 10 and len(proxy.faults) > 0
    key = first["run_key"]
    assert first["checkpoint_uri"] == f"{store_uri}/runs/{key}/checkpoints/step_000010"
    shutil.rmtree(tmp_path / "run1")  # the machine is gone: only the store remains

    second = miles(tmp_path / "run2", ("training.num_steps=15",), ("--resume", key))
    print(f"\nfaults injected {len(proxy.faults)} of {len(proxy.requests)} requests; stage seconds: "
          f"first {first['timings']}, resumed {second['timings']}")
    assert second["resumed_from_step"] == 10 and second["steps"] == 15
    bucket = store_uri[5:].split("/")[0]
    pointer = json.loads(client.get_object(Bucket=bucket, Key=f"store/runs/{key}/checkpoints/latest.json")["Body"].read())
    assert pointer["step"] == 15
