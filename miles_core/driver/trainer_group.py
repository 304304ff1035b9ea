"""A trainer of several ranks (Ray actors) behind one actor-like handle: Megatron's tp * pp * ep
ranks, or FSDP2's data-parallel ranks.

Both trainers are SPMD: every rank is built with the same arguments and every method is
called on every rank, in the same order, and rank 0's result is the answer (the others return
the same, or nothing where only rank 0 assembles it: full weights). `TrainerGroup` keeps
the single-actor calling convention of the loop, the weight transports, periodic eval and the
driver: ``ray.get(group.train_step.remote(samples))`` runs train_step on every rank and gives
rank 0's result, or raises if ANY rank raised.

A failed rank is fatal to the whole group, on purpose: its peers may be blocked in a collective
that will never complete (gloo would wait its 30 min timeout, NCCL may wait forever), and after
a partial failure the ranks' states (optimizer step, RNG) no longer agree. So the first error
kills every rank and is re-raised at once; the run fails and the flow's retry resumes from the
latest checkpoint with a fresh group.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import ray


@ray.remote(num_cpus=0)
def _rendezvous_endpoint() -> tuple[str, int]:
    """Runs on rank 0's bundle: the address every rank's process group connects to. The port is
    free now and re-bound by rank 0 moments later (a small race, as torchrun's own)."""
    from miles_core.net import rendezvous_endpoint

    return rendezvous_endpoint()


@ray.remote(num_cpus=0)
def _first_result(refs: list, actors: list) -> Any:
    """Rank 0's result once every rank finished; the first rank error as soon as it happens.

    refs arrive unresolved (inside a list), so they are watched in completion order instead of
    waiting for rank 0, which may be the rank stuck in a collective. Ranks > 0 return None (see
    _RankMixin), so only rank 0's result is copied, once, into this task's return value."""
    results, pending = {}, list(refs)
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            results[ready[0]] = ray.get(ready[0])  # raises this rank's error
    except Exception:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        raise
    return results[refs[0]]


class _RankMixin:
    """Added to the trainer class of each rank actor: calls return rank 0's result only."""

    def group_call(self, name: str, call: tuple[tuple, dict]) -> Any:
        args, kwargs = call
        result = getattr(self, name)(*args, **kwargs)
        # rank 0 holds the answer (see the module docstring); only its result crosses the object store
        return result if os.environ["RANK"] == "0" else None


def rank_actor_class(trainer_type: type) -> type:
    return type(f"{trainer_type.__name__}Rank", (_RankMixin, trainer_type), {})


class _GroupMethod:
    def __init__(self, group: TrainerGroup, name: str):
        self.group, self.name = group, name

    def remote(self, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        return self.group._call(self.name, args, kwargs)


class TrainerGroup:
    """Looks like one trainer actor handle: ``group.<method>.remote(...)`` -> one ObjectRef."""

    def __init__(self, actors: list):
        self.actors = actors
        # Submissions of one call to all ranks must not interleave with another thread's call
        # (the async loops submit from several threads): ranks would enter collectives in
        # different orders and deadlock.
        self._submit = threading.Lock()

    def _call(self, name: str, args: tuple, kwargs: dict) -> ray.ObjectRef:
        call = ray.put((args, kwargs))  # one copy of the batch for all ranks
        with self._submit:
            refs = [actor.group_call.remote(name, call) for actor in self.actors]
        return _first_result.remote(refs, self.actors)

    def __getattr__(self, name: str) -> _GroupMethod:
        if name.startswith("_"):  # keep pickling/copy probes from becoming remote calls
            raise AttributeError(name)
        return _GroupMethod(self, name)

    @property
    def __ray_ready__(self) -> _GroupMethod:
        """Every rank constructed (its __init__ joined the process group and loaded weights);
        Ray gives each actor instance this method, so it dispatches like any other."""
        return _GroupMethod(self, "__ray_ready__")

    def kill(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)


def start_trainer_group(trainer_type: type, world_size: int, scheduling, resources: dict[str, float],
                        args: tuple, kwargs: dict) -> TrainerGroup:
    """world_size rank actors of trainer_type, rank r on scheduling(r) (a Placement bundle),
    all constructed with the same args; their process group meets at rank 0's node."""
    address, port = ray.get(_rendezvous_endpoint.options(**scheduling(0)).remote())
    cls = ray.remote(rank_actor_class(trainer_type))
    actors = []
    for rank in range(world_size):
        # LOCAL_RANK 0: Ray shows each actor only its own GPU (CUDA_VISIBLE_DEVICES), as device 0
        env = {"MASTER_ADDR": address, "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0"}
        actors.append(cls.options(num_cpus=resources["CPU"], num_gpus=resources.get("GPU", 0),
                                  runtime_env={"env_vars": env}, **scheduling(rank)).remote(*args, **kwargs))
    return TrainerGroup(actors)


def kill_trainer(trainer: Any) -> None:
    """Stop the trainer, a plain actor or a TrainerGroup."""
    if isinstance(trainer, TrainerGroup):
        trainer.kill()
    else:
        ray.kill(trainer)
