"""Ray placement: one placement group, bundles 0..W-1 = trainer ranks, then engines (rank order).

W is the trainer's world size (training.world_size): dp for FSDP2, tp * pp * dp for Megatron;
above 1, a trainer group of one actor per rank (trainer_group.py).

Deterministic mapping means a restarted engine lands in its own bundle again, and `miles
plan` can print exactly what the cluster will be asked for.
"""

from __future__ import annotations

from typing import Any

from miles_core.config import RunConfig


def bundles(cfg: RunConfig) -> list[dict[str, float]]:
    t, r, p = cfg.training, cfg.rollout, cfg.placement
    ranks = t.world_size
    # cpus/gpus_per_trainer are the trainer's totals (what infra sizes nodes by): split over ranks
    trainer = {"CPU": t.cpus_per_trainer / ranks,
               **({"GPU": t.gpus_per_trainer / ranks} if t.gpus_per_trainer else {}), **p.trainer_resources}
    engine = {"CPU": r.cpus_per_engine, **({"GPU": r.gpus_per_engine} if r.gpus_per_engine else {}),
              **p.engine_resources}
    return [dict(trainer) for _ in range(ranks)] + [dict(engine) for _ in range(r.num_engines)]


def strategy(cfg: RunConfig) -> str:
    return "STRICT_PACK" if cfg.placement.layout == "colocated" else "SPREAD"


def describe(cfg: RunConfig) -> list[tuple[str, str]]:
    """(trainer parallelism) and (bundle, role and resources) rows for `miles plan`."""
    t = cfg.training
    if t.backend == "megatron":
        m = t.megatron
        actors = "one trainer actor" if t.world_size == 1 else f"a group of {t.world_size} trainer actors"
        parallel = (f"megatron tp={m.tensor_parallel_size} pp={m.pipeline_parallel_size} "
                    f"cp={m.context_parallel_size} ep={m.expert_parallel_size} dp={t.dp} ({actors}), "
                    f"recompute {'on' if m.recompute_activations else 'off'}")
    else:
        dp = t.dp
        parallel = (f"fsdp2 dp={dp}, parameters sharded over {dp} trainer actors" if dp > 1
                    else "fsdp2 dp=1 (one trainer actor, nothing sharded)")
    rows, ranks = [("trainer parallelism", parallel)], t.world_size
    for index, bundle in enumerate(bundles(cfg)):
        role = f"trainer rank {index}" if index < ranks else f"engine rank {index - ranks}"
        rows.append((f"bundle {index}", f"{role}: " + ", ".join(f"{k}={v:g}" for k, v in bundle.items())))
    return rows


class Placement:
    """Reserves the bundles up front so that a run either gets its whole layout or waits."""

    def __init__(self, cfg: RunConfig):
        import ray
        from ray.util.placement_group import placement_group

        self.trainer_ranks = cfg.training.world_size
        self.pg = placement_group(bundles(cfg), strategy=strategy(cfg), name="")
        try:
            ray.get(self.pg.ready(), timeout=cfg.placement.ready_timeout_seconds)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"the Ray cluster could not fit {bundles(cfg)} ({strategy(cfg)}) within "
                               f"{cfg.placement.ready_timeout_seconds:g} s; `miles plan` shows the layout") from None

    def _option(self, bundle_index: int) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            self.pg, placement_group_bundle_index=bundle_index, placement_group_capture_child_tasks=False)}

    def trainer(self, rank: int) -> dict[str, Any]:
        return self._option(rank)

    def engine(self, rank: int) -> dict[str, Any]:
        return self._option(self.trainer_ranks + rank)

    def release(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.pg)
