"""placement.time_sharing: the trainer and the engines take turns on the same GPUs.

Per step, with the trainer offloaded while the engines generate:

    rollout -> release engines (weights, kv_cache) -> onload trainer -> train
            -> resume engine weights -> push weights -> offload trainer -> resume kv_cache

The engines resume their weights before the push because a weight update writes into them
(SGLang refuses an update into released weights); the KV cache comes back only after the
trainer has left, so the trainer's update and the KV cache never hold the GPU together. The
engines are released through SGLang's own routes, so the same schedule drives real SGLang
(launched with --enable-memory-saver) and the embedded engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray

WEIGHTS, KV_CACHE = "weights", "kv_cache"


class NoTimeSharing:
    """Trainer and engines keep their memory: every call is a no-op."""

    enabled = False

    def start(self) -> dict[str, float]:
        return {}

    def before_train(self) -> dict[str, float]:
        return {}

    def push(self, push_weights: Callable[[], dict[str, float]]) -> dict[str, float]:
        return push_weights()


class TimeSharing:
    """Drives the hand-overs of one run's trainer (actor or rank group) and engine group."""

    enabled = True

    def __init__(self, trainer: Any, engines: Any):
        self.trainer, self.engines = trainer, engines

    def _engines(self, call: str, tags: list[str]) -> float:
        """SGLang's route on every engine at once; returns the seconds it took."""
        started = time.perf_counter()
        clients = [self.engines.client(url) for _, url in self.engines.targets()]
        with ThreadPoolExecutor(max(1, len(clients))) as pool:
            list(pool.map(lambda c: getattr(c, call)(tags), clients))
        return time.perf_counter() - started

    def start(self) -> dict[str, float]:
        """Before the first rollout: the trainer leaves the engines' GPUs."""
        return ray.get(self.trainer.offload.remote())

    def before_train(self) -> dict[str, float]:
        """After a rollout: dead engines are replaced while the others are still whole (a
        released engine answers 503, which would read as dead), then they release everything
        and the trainer comes back."""
        restarts = float(len(self.engines.heal()))
        released = self._engines("release_memory", [WEIGHTS, KV_CACHE])
        onload = ray.get(self.trainer.onload.remote())
        return {"rollout/engine_restarts": restarts, "time/engine_release_seconds": released, **onload}

    def push(self, push_weights: Callable[[], dict[str, float]]) -> dict[str, float]:
        """After the update: engine weights back, new weights in, trainer out, KV cache back."""
        resumed = self._engines("resume_memory", [WEIGHTS])
        metrics = push_weights()
        metrics |= ray.get(self.trainer.offload.remote())
        resumed += self._engines("resume_memory", [KV_CACHE])
        return metrics | {"time/engine_resume_seconds": resumed}


def time_sharing(cfg: Any, trainer: Any, engines: Any) -> TimeSharing | NoTimeSharing:
    return TimeSharing(trainer, engines) if cfg.placement.time_sharing else NoTimeSharing()
