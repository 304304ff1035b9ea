"""Splitting a global batch over data-parallel ranks, shared by the FSDP2 and Megatron backends.

Every rank receives the whole batch (the trainer group sends one copy to all) and takes its
micro-batches round-robin, so the split is deterministic and needs no communication. Losses are
normalised by the global token/sequence counts, so summing the ranks' gradients (not averaging
them) gives exactly the single-rank gradient.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from miles_core.training.batches import Batch, select_rows


def filled_rows(batch: Batch, rows: slice, size: int) -> Batch:
    """batch[rows] plus masked copies of row 0 up to `size` rows (they add nothing to any loss)."""
    num_real = rows.stop - rows.start
    index = list(range(rows.start, rows.stop)) + [0] * (size - num_real)
    mb = {k: v[torch.tensor(index, device=v.device)] for k, v in batch.items()}
    mb["mask"][num_real:] = 0
    return mb


def rank_micro_batches(batch: Batch, micro_batch_size: int, rank: int, world: int,
                       equal_shapes: bool) -> Iterator[tuple[slice, Batch]]:
    """(rows, micro-batch) pairs of this rank: micro-batches dealt round-robin over `world` ranks.

    equal_shapes: every rank runs as many micro-batches, all of micro_batch_size rows (short or
    missing ones filled with masked rows), for backends whose every forward is a collective
    (FSDP2 gathers each layer's parameters; expert parallelism exchanges tokens)."""
    num_rows = len(batch["tokens"])
    num_slices = -(-num_rows // micro_batch_size)
    for index in range(rank, -(-num_slices // world) * world, world):
        start = min(index * micro_batch_size, num_rows)
        rows = slice(start, min(start + micro_batch_size, num_rows))
        if equal_shapes:
            yield rows, filled_rows(batch, rows, micro_batch_size)
        elif rows.stop > rows.start:
            yield rows, select_rows(batch, rows)


def sum_over_ranks(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """In-place sum over the group's ranks (nothing to do on one rank)."""
    if dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, group=group)
    return tensor


def sum_metrics_over_ranks(sums: dict[str, float], group=None) -> dict[str, float]:
    """Per-rank metric sums added up over the group (a key a rank lacks counts as 0)."""
    world = dist.get_world_size(group)
    if world == 1:
        return sums
    names: list[list[str]] = [[] for _ in range(world)]
    dist.all_gather_object(names, sorted(sums), group=group)
    keys = sorted(set().union(*names))
    values = sum_over_ranks(torch.tensor([sums.get(k, 0.0) for k in keys], dtype=torch.float64), group)
    return {k: float(v) for k, v in zip(keys, values)}
