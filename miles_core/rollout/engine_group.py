"""Rollout engines as Ray actors serving SGLang's HTTP API, behind a health-aware router.

The driver talks HTTP to every engine (embedded here, SGLang on a cluster: same client,
same router, same failure handling). `EngineGroup.heal` replaces dead or hung engines and
brings them to the current weights, while the router keeps the run going on the others.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray

from miles_core.config import RunConfig
from miles_core.config.rollout import EngineConfig
from miles_core.engines.interface import RolloutEngine
from miles_core.engines.sglang.client import EngineError, SGLangClient, SGLangLauncher
from miles_core.rollout.router import Router

if TYPE_CHECKING:
    from miles_core.engines.embedded.http_limits import ServerLimits

log = logging.getLogger(__name__)


# The version an engine serves before the first sync: the model it was started from. SGLang
# would otherwise start at "default", which no rollout of the run's versions matches.
INITIAL_WEIGHT_VERSION = "0"
TIME_SHARED_MEM_FRACTION_STATIC = 0.8
"""The --mem-fraction-static of an embedded engine that time-shares its GPU and sets none: it
generates while the trainer's state is off the GPU, so its KV cache may take what is free less
20% of the GPU (CUDA contexts, what the offloaded trainer keeps), as `miles plan`'s rollout phase
assumes every sample decoding at once. The default otherwise, 40% of what is free, decoded a
4B-shaped model's 64 samples of 4224 tokens in two rounds on an H100."""


def engine_tp_size(engine: EngineConfig, gpus_per_engine: float) -> int:
    """Ranks one engine has in a weight-update group (SGLang joins each TP rank)."""
    if engine.kind != "sglang":
        return 1
    return int(engine.server_args.get("tp_size", max(1, int(gpus_per_engine))))


def launch_engine(engine: EngineConfig, model_dir: str, host: str, dtype: str, num_threads: int,
                  gpus_per_engine: float, api_key: str, precision: str = "bf16") -> RolloutEngine:
    """Start the configured engine (`rollout.engine`) on `host` (a free port) and return once it
    serves: the embedded engine in this process, or SGLang as a child process (GPU clusters).
    Every route but the health probes needs api_key. precision (rollout.precision): an embedded
    engine gets SGLang's --quantization fp8 for "fp8"; SGLang has it in its server_args already."""
    if engine.kind == "sglang":
        server_args = {"dtype": dtype, "weight_version": INITIAL_WEIGHT_VERSION,
                       **engine.server_args, "tp_size": engine_tp_size(engine, gpus_per_engine)}
        launcher = SGLangLauncher(model_dir, server_args, host=host, module=engine.server_module, api_key=api_key,
                                  python=engine.python or sys.executable)
        launcher.start()
        return launcher
    from miles_core.engines.embedded.http_server import serve  # torch and transformers: engine processes only

    return serve(model_dir, host=host, port=0, dtype=dtype, num_threads=num_threads,
                 server_args=embedded_server_args(engine, precision), weight_version=INITIAL_WEIGHT_VERSION,
                 api_key=api_key,
                 limits=embedded_server_limits(engine))


def placed_engine(cfg: RunConfig) -> EngineConfig:
    """rollout.engine as its actors start it: time-shared (placement.time_sharing), an embedded
    engine without mem_fraction_static gets TIME_SHARED_MEM_FRACTION_STATIC."""
    engine = cfg.rollout.engine
    if cfg.placement.time_sharing and engine.kind == "embedded" and engine.mem_fraction_static is None:
        return engine.model_copy(update={"mem_fraction_static": TIME_SHARED_MEM_FRACTION_STATIC})
    return engine


def embedded_server_args(engine: EngineConfig, precision: str = "bf16") -> dict:
    """The SGLang flags an embedded engine's config sets (its memory bounds, and --quantization
    fp8 for rollout.precision=fp8), for its server."""
    flags = {"mem_fraction_static": engine.mem_fraction_static, "max_running_requests": engine.max_running_requests,
             "quantization": "fp8" if precision == "fp8" else None}
    return {k: v for k, v in flags.items() if v is not None}


def embedded_server_limits(engine: EngineConfig) -> ServerLimits:
    """The client bounds an embedded engine's config sets, as its server's ServerLimits."""
    from miles_core.engines.embedded.http_limits import ServerLimits  # the web stack: engine processes only

    return ServerLimits(max_request_bytes=engine.max_request_bytes,
                        max_prompts_per_request=engine.max_prompts_per_request,
                        request_read_timeout=engine.request_read_timeout_seconds)


class EngineActor:
    """Hosts one rollout engine in a Ray worker; callers reach it over HTTP at `url()`, and
    through this actor for what HTTP does not carry (see interface.py)."""

    def __init__(self, model_dir: str, dtype: str, num_threads: int, bind_host: str, engine: EngineConfig,
                 gpus_per_engine: float, api_key: str, precision: str = "bf16"):
        host = ray.util.get_node_ip_address() if bind_host == "node_ip" else "127.0.0.1"
        self.engine = launch_engine(engine, model_dir, host, dtype, num_threads, gpus_per_engine, api_key, precision)

    def url(self) -> str:
        return self.engine.url

    def stop(self) -> None:
        """Stop the server (and, for SGLang, its whole process group). ray.kill runs no shutdown
        hook, so EngineGroup calls this before killing the actor."""
        self.engine.stop()

    def __ray_shutdown__(self) -> None:
        self.engine.stop()

    def pid(self) -> int:
        return os.getpid()

    def update_weights_from_tensors(self, named_tensors: dict, weight_version: str) -> dict:
        """Same-node path: tensors arrive through Ray's object store."""
        return self.engine.update_weights_from_tensors(named_tensors, weight_version)

    def map_shared_weights(self, handle: Any) -> dict:
        """Same-GPU (or same-machine) path: map the trainer's shared weight buffer."""
        return self.engine.map_shared_weights(handle)

    def load_shared_weights(self, weight_version: str) -> dict:
        return self.engine.load_shared_weights(weight_version)

    def weights_sha256(self) -> str:
        return self.engine.weights_sha256()


class EngineGroup:
    """N engine actors, their HTTP clients and a router; restarts the ones that die. The group's
    engines share a random API key, which every caller of their HTTP API (router, weight
    transports) sends: whoever reaches an engine's port cannot load weights or join its groups."""

    def __init__(self, cfg: RunConfig, model_dir: str, scheduling: Callable[[int], dict] = lambda rank: {}):
        self.cfg, self.model_dir, self.scheduling = cfg, model_dir, scheduling
        self.api_key = secrets.token_urlsafe(32)
        self.actor_cls = ray.remote(num_cpus=cfg.rollout.cpus_per_engine, num_gpus=cfg.rollout.gpus_per_engine,
                                    max_restarts=0)(EngineActor)
        self.actors = [self._start(rank) for rank in range(cfg.rollout.num_engines)]
        self.urls = ray.get([a.url.remote() for a in self.actors])
        self.router = Router([self.client(u) for u in self.urls],
                             health_timeout=cfg.rollout.health_timeout_seconds)

    def _start(self, rank: int):
        r = self.cfg.rollout
        return self.actor_cls.options(name=None, **self.scheduling(rank)).remote(
            self.model_dir, self.cfg.model.dtype, self.cfg.training.num_threads, r.bind_host, placed_engine(self.cfg),
            r.gpus_per_engine, self.api_key, r.precision)

    def client(self, url: str) -> SGLangClient:
        """A client of one of this group's engines."""
        return SGLangClient(url, timeout_seconds=self.cfg.rollout.request_timeout_seconds, api_key=self.api_key)

    @property
    def tp_size(self) -> int:
        """Weight-update group ranks per engine."""
        return engine_tp_size(self.cfg.rollout.engine, self.cfg.rollout.gpus_per_engine)

    def generate(self, input_ids: list[list[int]], sampling_params: dict[str, Any], **extra: Any) -> list[dict]:
        """extra: further /generate request fields, e.g. return_routed_experts=True."""
        return self.router.generate(input_ids, sampling_params, return_logprob=True, **extra)

    def use_lora_adapter(self, name: str | None) -> None:
        """Every request from now on names LoRA adapter `name` (SGLang's lora_path; None: the
        base weights): the adapter sync calls it once every engine has loaded the new version."""
        self.router.lora_path = name

    def pause(self, mode: str = "abort") -> None:
        """/pause_generation on every engine (rollout.partial: mode=abort returns running requests
        with what they have); an engine that does not answer is left to the health checks."""
        self._each(lambda client: client.pause(mode))

    def resume(self) -> None:
        """/continue_generation on every engine."""
        self._each(lambda client: client.resume())

    def _each(self, call: Callable[[SGLangClient], None]) -> None:
        for url in self.urls:
            try:
                call(self.client(url))
            except EngineError as exc:
                log.warning("engine at %s: %s", url, exc)

    @property
    def num_healthy(self) -> int:
        return len(self.router.healthy_urls)

    def dead_ranks(self) -> list[int]:
        """Engines whose process is gone or whose server no longer answers."""
        health = self.router.check_health()
        return [rank for rank, url in enumerate(self.urls) if not health.get(url, False)]

    def targets(self) -> list[tuple[Any, str]]:
        return list(zip(self.actors, self.urls))

    def heal(self) -> list[int]:
        """Kill and restart every dead or hung engine; the caller then pushes the current
        weights to all engines (which re-admits the new ones once healthy)."""
        replaced = self.dead_ranks()
        for rank in replaced:
            log.warning("engine %d at %s is down; restarting it", rank, self.urls[rank])
            _stop_actor(self.actors[rank])
            self.actors[rank] = self._start(rank)
            self.urls[rank] = ray.get(self.actors[rank].url.remote())
            self.router.replace_client(rank, self.client(self.urls[rank]))
        if replaced:
            self.wait_all_healthy()
            self.router.check_health()  # re-admits the new engines
        return replaced

    def wait_all_healthy(self, timeout_seconds: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_seconds
        while self.dead_ranks():
            if time.monotonic() > deadline:
                raise TimeoutError(f"engines {self.dead_ranks()} not healthy after {timeout_seconds} s")
            time.sleep(0.5)

    def shutdown(self) -> None:
        self.router.close()
        for actor in self.actors:
            _stop_actor(actor)


def _stop_actor(actor: Any, timeout_seconds: float = 60.0) -> None:
    """Stop the actor's server, then kill the actor. A hung or dead actor is killed anyway
    (its SGLang server then gets SIGTERM from the parent-death signal set at launch)."""
    try:
        ray.get(actor.stop.remote(), timeout=timeout_seconds)
    except (ray.exceptions.RayError, TimeoutError) as exc:  # fault boundary: the kill below still runs
        log.warning("engine actor did not stop cleanly (%s); killing it", type(exc).__name__)
    ray.kill(actor, no_restart=True)
