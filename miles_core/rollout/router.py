"""Spread /generate over several engines: least in-flight first, fail over on dead engines.

A small in-process router for the trainer's rollout workers, the same for embedded and
SGLang engines: it only speaks SGLang's HTTP API, through one SGLangClient per engine.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from miles_core.engines.sglang.client import EngineError, SGLangClient

logger = logging.getLogger(__name__)


def generate_in_shards(pool: Executor, generate: Callable[[list[list[int]], list[dict]], list[dict]],
                       input_ids: list[list[int]], sampling_params: list[dict], num_engines: int) -> list[dict]:
    """`generate` over contiguous shards of the prompts, one per engine (the router sends each
    to a free one), all in flight at once through `pool`; the outputs in prompt order."""
    num_shards = max(1, min(len(input_ids), num_engines))
    bounds = [len(input_ids) * i // num_shards for i in range(num_shards + 1)]
    futures = [pool.submit(generate, input_ids[lo:hi], sampling_params[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]
    return [out for future in futures for out in future.result()]


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
        self.lora_path: str | None = None
        """The LoRA adapter every request names (SGLang's `lora_path`, an adapter's name), set by the
        adapter sync (miles_core.weight_sync.transports.DiskTransport with adapters_only); None: the base weights."""
        if health_check_interval:
            self.start_health_checks(health_check_interval)

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
        if self.lora_path is not None:
            extra.setdefault("lora_path", self.lora_path)
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

    # ---- engines and introspection ---------------------------------------------------------

    def replace_client(self, index: int, client: SGLangClient) -> None:
        """Point engine `index` at a new server (a restarted engine), out of rotation until
        check_health() finds it answering."""
        with self._lock:
            slot = self.slots[index]
            slot.client, slot.healthy = client, False

    def stats(self) -> list[dict[str, Any]]:
        with self._lock:
            return [{"url": s.url, "healthy": s.healthy, "in_flight": s.in_flight, "served": s.served,
                     "failures": s.failures, "last_error": s.last_error} for s in self.slots]

    @property
    def healthy_urls(self) -> list[str]:
        with self._lock:
            return [s.url for s in self.slots if s.healthy]

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
