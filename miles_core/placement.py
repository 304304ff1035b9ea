"""Ray placement: one placement group, bundle 0 = trainer, bundles 1..N = engines (rank order).

Deterministic mapping means a restarted engine lands in its own bundle again, and `miles
plan` can print exactly what the cluster will be asked for.
"""

from __future__ import annotations

from typing import Any

from miles_core.config import RunConfig


def bundles(cfg: RunConfig) -> list[dict[str, float]]:
    t, r, p = cfg.training, cfg.rollout, cfg.placement
    trainer = {"CPU": t.cpus_per_trainer, **({"GPU": t.gpus_per_trainer} if t.gpus_per_trainer else {}),
               **p.trainer_resources}
    engine = {"CPU": r.cpus_per_engine, **({"GPU": r.gpus_per_engine} if r.gpus_per_engine else {}),
              **p.engine_resources}
    return [trainer] + [dict(engine) for _ in range(r.num_engines)]


def strategy(cfg: RunConfig) -> str:
    return "STRICT_PACK" if cfg.placement.layout == "colocated" else "SPREAD"


def describe(cfg: RunConfig) -> list[tuple[str, str]]:
    """(bundle, role and resources) rows for `miles plan`."""
    rows = []
    for index, bundle in enumerate(bundles(cfg)):
        role = "trainer rank 0" if index == 0 else f"engine rank {index - 1}"
        rows.append((f"bundle {index}", f"{role}: " + ", ".join(f"{k}={v:g}" for k, v in bundle.items())))
    return rows


class Placement:
    """Reserves the bundles up front so that a run either gets its whole layout or waits."""

    def __init__(self, cfg: RunConfig):
        import ray
        from ray.util.placement_group import placement_group

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
        return self._option(1 + rank)

    def release(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.pg)
