"""Ray cluster bring-up. Liveness-dependent: never cached."""

from __future__ import annotations

import os

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
        if address:
            ray.init(address=address, log_to_driver=True)
        else:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True, configure_logging=False)
    resources = {k: float(v) for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU", "memory")}
    mode = "existing" if address else "local"
    auth = os.environ["RAY_AUTH_MODE"]
    get_run_logger().info("ray (%s, auth %s) ready: %s", mode, auth, resources)
    return {"mode": mode, "address": address or "local", "resources": resources}
