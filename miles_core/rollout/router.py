"""Spread /generate over several engines: least in-flight first, fail over on dead engines.

A small in-process router for the trainer's rollout workers. On a GPU cluster the Rust
`sglang_router` does the same job with cache-aware routing; see `sglang_router_command`.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import sys
import threading
from dataclasses import dataclass
from typing import Any

from miles_core.rollout.sglang_client import EngineError, SGLangClient

logger = logging.getLogger(__name__)


class NoHealthyEngine(EngineError):
    """Every engine is marked unhealthy (or every attempt failed)."""


@dataclass
class EngineSlot:
    client: SGLangClient
    healthy: bool = True
    in_flight: int = 0
    served: int = 0
    failures: int = 0
    last_error: str | None = None

    @property
    def url(self) -> str:
        return self.client.base_url


class Router:
    """Route each request to the healthy engine with the fewest requests in flight (ties go
    round-robin). An engine that cannot be reached (connection error or timeout) is marked
    unhealthy and the request retried on another; `check_health()` re-admits it once it
    answers /health_generate again."""

    def __init__(self, clients: list[SGLangClient], max_attempts: int | None = None,
                 health_check_interval: float | None = None, health_timeout: float = 5.0):
        if not clients:
            raise ValueError("a Router needs at least one engine")
        self.slots = [EngineSlot(c) for c in clients]
        self.max_attempts = max_attempts or len(clients) + 1
        self.health_timeout = health_timeout
        self._lock = threading.Lock()
        self._turn = itertools.count()
        self._stop = threading.Event()
        self._health_thread: threading.Thread | None = None
        if health_check_interval:
            self.start_health_checks(health_check_interval)

    @classmethod
    def from_urls(cls, urls: list[str], **kwargs: Any) -> "Router":
        client_kwargs = kwargs.pop("client_kwargs", {})
        return cls([SGLangClient(u, **client_kwargs) for u in urls], **kwargs)

    # ---- routing ---------------------------------------------------------------------------

    def _acquire(self, exclude: set[str]) -> EngineSlot:
        with self._lock:
            candidates = [s for s in self.slots if s.healthy and s.url not in exclude]
            if not candidates:
                candidates = [s for s in self.slots if s.healthy]  # retry one we already tried
            if not candidates:
                raise NoHealthyEngine("no healthy engine", ",".join(s.url for s in self.slots))
            least = min(s.in_flight for s in candidates)
            tied = [s for s in candidates if s.in_flight == least]
            slot = tied[next(self._turn) % len(tied)]
            slot.in_flight += 1
            return slot

    def _release(self, slot: EngineSlot, ok: bool) -> None:
        with self._lock:
            slot.in_flight -= 1
            slot.served += ok

    def _mark_unhealthy(self, slot: EngineSlot, error: Exception) -> None:
        with self._lock:
            slot.healthy = False
            slot.failures += 1
            slot.last_error = str(error)
        logger.warning("engine %s marked unhealthy: %s", slot.url, error)

    def generate(self, input_ids: list[int] | list[list[int]], sampling_params: dict[str, Any],
                 return_logprob: bool = True, rid: str | list[str] | None = None,
                 **extra: Any) -> list[dict[str, Any]]:
        """Same contract as SGLangClient.generate. Retried on another engine when the chosen one
        is unreachable or answers 5xx; a 4xx is the caller's error and is raised at once."""
        tried: set[str] = set()
        last_error: Exception | None = None
        for _ in range(self.max_attempts):
            slot = self._acquire(tried)
            tried.add(slot.url)
            ok = False
            try:
                out = slot.client.generate(input_ids, sampling_params, return_logprob, rid, **extra)
                ok = True
                return out
            except EngineError as exc:
                if exc.status is not None and exc.status < 500:
                    raise
                last_error = exc
                if exc.status is None:  # no answer at all: the engine is down or hung
                    self._mark_unhealthy(slot, exc)
            finally:
                self._release(slot, ok)
        raise NoHealthyEngine(f"generate failed on every attempt: {last_error}", ",".join(sorted(tried)))

    # ---- health ----------------------------------------------------------------------------

    def check_health(self) -> dict[str, bool]:
        """Probe every engine once; re-admit those that answer, drop those that do not."""
        results = {}
        for slot in self.slots:
            healthy = slot.client.health(timeout=self.health_timeout)
            with self._lock:
                if healthy and not slot.healthy:
                    logger.info("engine %s re-admitted", slot.url)
                slot.healthy = healthy
            results[slot.url] = healthy
        return results

    def start_health_checks(self, interval: float = 5.0) -> None:
        """Run check_health() every `interval` seconds in a daemon thread until close()."""
        if self._health_thread is not None:
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(interval):
                try:
                    self.check_health()
                except Exception:  # a probe bug must not silently end the loop
                    logger.exception("health check failed")

        self._health_thread = threading.Thread(target=loop, name="router-health", daemon=True)
        self._health_thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._health_thread is not None:
            self._health_thread.join(timeout=10)
            self._health_thread = None

    # ---- fan-out and introspection ---------------------------------------------------------

    def for_each(self, method: str, *args: Any, healthy_only: bool = True, **kwargs: Any) -> dict[str, Any]:
        """Call a client method (pause, resume, update_weights_from_disk, ...) on every engine,
        in order; raises the first failure, because a partial weight update must not go unseen."""
        return {s.url: getattr(s.client, method)(*args, **kwargs)
                for s in self.slots if s.healthy or not healthy_only}

    def stats(self) -> list[dict[str, Any]]:
        with self._lock:
            return [{"url": s.url, "healthy": s.healthy, "in_flight": s.in_flight, "served": s.served,
                     "failures": s.failures, "last_error": s.last_error} for s in self.slots]

    @property
    def healthy_urls(self) -> list[str]:
        with self._lock:
            return [s.url for s in self.slots if s.healthy]

    def __enter__(self) -> "Router":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def sglang_router_available() -> bool:
    """Whether the Rust router (`pip install sglang-router`) is importable here."""
    return importlib.util.find_spec("sglang_router") is not None


def sglang_router_command(worker_urls: list[str], host: str = "127.0.0.1", port: int = 30000,
                          policy: str = "cache_aware", python: str = sys.executable) -> list[str]:
    """Command line for SGLang's router in front of `worker_urls`: prefer it on GPU clusters
    (cache-aware routing keeps shared prompt prefixes on one engine's radix cache). Engines can
    be added later with `POST /workers {"url": ...}`. Start it with SGLangLauncher-like care."""
    return [python, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port),
            "--policy", policy, "--worker-urls", *worker_urls]
