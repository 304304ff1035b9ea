"""Ray cluster bring-up. Liveness-dependent: never cached."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks.retry import retry_if_retryable


@task(name="ensure-ray", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[5, 20],
      retry_condition_fn=retry_if_retryable)
def ensure_ray(address: str | None, num_cpus: int | None, work_dir: str) -> dict:
    """Join the Ray cluster at `address`, or start a local one; returns its resources."""
    import ray

    # Local clusters are private to this process tree: no token file written under $HOME.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    address = address or os.environ.get("RAY_ADDRESS")
    if not ray.is_initialized():
        with _sigterm_handler_kept():
            _init_ray(ray, address, num_cpus)
    resources = {k: float(v) for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU", "memory")}
    mode = "existing" if address else "local"
    auth = os.environ["RAY_AUTH_MODE"]
    get_run_logger().info("ray (%s, auth %s) ready: %s", mode, auth, resources)
    return {"mode": mode, "address": address or "local", "resources": resources}


def _init_ray(ray, address: str | None, num_cpus: int | None) -> None:
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True, configure_logging=False)


@contextmanager
def _sigterm_handler_kept() -> Iterator[None]:
    """Give SIGTERM back to the handler it had before ray.init.

    ray.init replaces it: with a Python handler that exits 1 (after killing the local Ray's
    processes itself) and, in the C++ core worker, absl's failure handler, which arms a 3 s alarm
    that aborts the process. A `miles run` stopped after this stage then died with SIGABRT while
    Prefect's hooks and the exit handlers still ran, instead of exiting 143 through the CLI's
    handler (Prefect's, inside a flow). Ray's atexit handler still stops its processes, and
    crash signals (SIGSEGV, ...) keep Ray's stack traces. Only the main thread may set handlers,
    and only there does ray.init replace the Python one.
    """
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if main and previous is not None:  # None: set outside Python, nothing to restore
            signal.signal(signal.SIGTERM, previous)
