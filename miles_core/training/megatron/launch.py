"""Run a function on N local processes joined in one gloo/nccl group (torch.multiprocessing spawn).

Used by the converter (tp > 1 outside a distributed job) and by the CPU tests. The function
must be importable (module level); each process gets (rank, world_size, *args) and the return
value of rank 0 comes back.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from miles_core.net import free_port


def _entry(rank: int, world_size: int, port: int, result_dir: str, fn: Callable, args: tuple,
           env: dict[str, str]) -> None:
    os.environ.update(env)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size)})
    try:
        result = fn(rank, world_size, *args)
        error = None
    except BaseException:  # noqa: BLE001 - reported to the parent
        result, error = None, traceback.format_exc()
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    if rank == 0 or error is not None:
        # Our own result file in our own temporary directory (never read from elsewhere).
        with open(Path(result_dir) / f"rank{rank}.pkl", "wb") as fh:
            pickle.dump({"result": result, "error": error}, fh)


def run_spawned(fn: Callable[..., Any], world_size: int, *args: Any, threads_per_rank: int = 1) -> Any:
    """fn(rank, world_size, *args) on world_size spawned processes; returns rank 0's result."""
    env = {"OMP_NUM_THREADS": str(threads_per_rank)}
    with tempfile.TemporaryDirectory(prefix="miles-spawn-") as result_dir:
        mp.start_processes(_entry, args=(world_size, free_port(), result_dir, fn, args, env),
                           nprocs=world_size, join=True, start_method="spawn")
        results = {}
        for path in sorted(Path(result_dir).glob("rank*.pkl")):
            with open(path, "rb") as fh:
                results[path.stem] = pickle.load(fh)
    errors = [f"{rank}:\n{r['error']}" for rank, r in results.items() if r["error"]]
    if errors:
        raise RuntimeError("a spawned rank failed:\n" + "\n".join(errors))
    return results["rank0"]["result"]
