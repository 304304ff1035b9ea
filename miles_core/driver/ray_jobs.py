"""The training driver as a Ray Job: submit or re-attach, watch, detect stalls, stop.

Submission ids are `miles-<run_key>-<n>`, n counting the run's driver jobs: a retried task (or
a resumed run) finds a job of its run key that is still alive and attaches to it instead of
starting a second driver; otherwise it submits attempt n+1, which resumes from the latest
checkpoint. The job writes one JSON line per step to its progress file (the stall clock) and
its result, or the exception it died of, to its result file; both live in
`<run_dir>/driver/`, which the task and the cluster share, as they share the run directory.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ray.job_submission import JobStatus, JobSubmissionClient

from miles_core.config import PlacementConfig
from miles_core.driver.session import TrainResult, TrainSpec
from miles_core.errors import InfrastructureError, is_retryable_class

log = logging.getLogger(__name__)
PREFIX = "miles-"
LOG_POLL_SECONDS = 10.0


class DriverStalled(InfrastructureError):
    """The driver job reported no step within the stall limit; it was stopped (retryable)."""


class DriverJobLost(InfrastructureError):
    """The driver job ended without a result or error of its own (killed, OOM, node lost,
    stopped by someone else): an infrastructure failure, so the task retries."""


class DriverJobFailed(RuntimeError):
    """The driver raised a non-infrastructure error (bad input, a bug): not retried."""


def jobs_client(placement: PlacementConfig) -> TimeoutJobClient:
    """The cluster's Jobs API client: placement.ray_jobs_address, else RAY_API_SERVER_ADDRESS."""
    address = placement.ray_jobs_address or os.environ.get("RAY_API_SERVER_ADDRESS")
    if not address:
        raise ValueError("placement.driver=ray_job needs the cluster's Jobs API: set placement.ray_jobs_address "
                         "(e.g. http://head:8265) or RAY_API_SERVER_ADDRESS (`miles stack up` sets it)")
    return TimeoutJobClient(address)


class TimeoutJobClient(JobSubmissionClient):
    """JobSubmissionClient whose every HTTP call has a timeout (the SDK sets none) and carries
    the cluster's token ($RAY_AUTH_TOKEN) when there is one, whatever auth mode this process's
    Ray settled on when it was first imported."""

    def __init__(self, address: str, timeout_seconds: float = 30.0):
        self.timeout_seconds = timeout_seconds
        token = os.environ.get("RAY_AUTH_TOKEN")
        super().__init__(address, headers={"Authorization": f"Bearer {token}"} if token else None)

    def _do_request(self, *args, **kwargs):
        kwargs.setdefault("timeout", self.timeout_seconds)
        return super()._do_request(*args, **kwargs)


@dataclass
class JobFiles:
    job: Path
    progress: Path
    result: Path

    @classmethod
    def of(cls, driver_dir: Path, submission_id: str) -> JobFiles:
        return cls(*(driver_dir / f"{submission_id}.{kind}" for kind in ("job.json", "progress.jsonl", "result.json")))


def run_jobs(client: JobSubmissionClient, run_key: str) -> list[tuple[int, str, JobStatus]]:
    """(attempt, submission id, status) of every driver job of run_key, in attempt order."""
    prefix = f"{PREFIX}{run_key}-"
    found = []
    for job in client.list_jobs():
        sid = job.submission_id or ""
        if sid.startswith(prefix) and sid[len(prefix):].isdigit():
            found.append((int(sid[len(prefix):]), sid, job.status))
    return sorted(found)


def submit_or_attach(client: JobSubmissionClient, run_key: str, driver_dir: Path, spec: TrainSpec,
                     python: str) -> tuple[str, bool]:
    """Attach to the run's live driver job, else submit the next attempt; (submission id, attached)."""
    jobs = run_jobs(client, run_key)
    live = [sid for _, sid, status in jobs if not status.is_terminal()]
    if live:
        return live[-1], True
    sid = f"{PREFIX}{run_key}-{jobs[-1][0] + 1 if jobs else 1}"
    files = JobFiles.of(driver_dir, sid)
    files.job.write_text(spec.model_dump_json())
    entrypoint = shlex.join([python, "-m", "miles_core.driver.session", "--spec", str(files.job),
                             "--progress", str(files.progress), "--result", str(files.result)])
    client.submit_job(entrypoint=entrypoint, submission_id=sid, entrypoint_num_cpus=0,
                      metadata={"miles.run_key": run_key})
    return sid, False


def watch(client: JobSubmissionClient, sid: str, files: JobFiles, stall_seconds: float, poll_seconds: float,
          on_step: Callable[[int], None], on_log: Callable[[str], None]) -> JobStatus:
    """Follow the job until it ends, streaming its log lines and step progress; a job with no
    new step for stall_seconds is stopped and DriverStalled raised."""
    last_step, last_progress = None, time.monotonic()
    log_offset, progress_offset, logs_read_at = 0, 0, -LOG_POLL_SECONDS
    while True:
        status = client.get_job_status(sid)
        # The Jobs API returns the whole log each time: read it less often than the status.
        if status.is_terminal() or time.monotonic() - logs_read_at >= LOG_POLL_SECONDS:
            logs, logs_read_at = client.get_job_logs(sid), time.monotonic()
            for line in logs[log_offset:].splitlines():
                on_log(line)
            log_offset = len(logs)
        lines, progress_offset = _new_lines(files.progress, progress_offset)
        if lines:
            step = json.loads(lines[-1])["step"]
            if step != last_step:
                last_step, last_progress = step, time.monotonic()
                on_step(step)
        if status.is_terminal():
            return status
        if time.monotonic() - last_progress > stall_seconds:
            client.stop_job(sid)
            raise DriverStalled(f"driver job {sid} made no step progress for {stall_seconds:.0f} s "
                                f"(last step {last_step}); stopped it (placement.job_stall_seconds)")
        time.sleep(poll_seconds)


def outcome(sid: str, status: JobStatus, files: JobFiles) -> TrainResult:
    """The result of a finished job, or the error it ended with, classified for retries."""
    record = json.loads(files.result.read_text()) if files.result.is_file() else None
    if status == JobStatus.SUCCEEDED and record and "error" not in record:
        return TrainResult.model_validate(record)
    if record and "error" in record:
        error = record["error"]
        message = f"driver job {sid} failed: {error['type']}: {error['message']}"
        raise (DriverJobLost if is_retryable_class(error["class_names"]) else DriverJobFailed)(message)
    raise DriverJobLost(f"driver job {sid} ended {status.value} without a result (killed, out of memory, "
                        "or its node was lost); the retry resumes from the latest checkpoint")


def stop_live(client: JobSubmissionClient, run_key: str) -> list[str]:
    """Stop every live driver job of run_key (flow cancellation); returns their ids."""
    live = [sid for _, sid, status in run_jobs(client, run_key) if not status.is_terminal()]
    for sid in live:
        client.stop_job(sid)
    return live


def _new_lines(path: Path, offset: int) -> tuple[list[str], int]:
    """Complete lines appended to path since offset (a half-written last line waits)."""
    if not path.is_file():
        return [], offset
    with open(path) as f:
        f.seek(offset)
        chunk = f.read()
    complete = chunk[: chunk.rfind("\n") + 1]
    return complete.splitlines(), offset + len(complete)
