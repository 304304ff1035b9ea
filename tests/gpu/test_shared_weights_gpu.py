"""The shared weight buffer over CUDA IPC on a lent GPU (not run in CI): another process maps
the trainer's device buffer and sees each write; the numbers the driver bench reports
(bench/driver_gpu.py --transport shared_memory) rest on this.

    python -m pytest tests/gpu/test_shared_weights_gpu.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def _sums_in_another_process(rank: int, world_size: int, handle) -> list[float]:
    from miles_core.weight_sync.shared import SharedWeights

    mapped = SharedWeights.open(handle)
    assert mapped.flat.is_cuda
    return [float(view.float().sum()) for view in mapped.views.values()]


def test_another_process_maps_the_device_buffer():
    from miles_core.training.megatron.launch import run_spawned
    from miles_core.weight_sync.shared import SharedWeights

    weights = {f"layer{i}.weight": torch.randn(256, 128, device="cuda") for i in range(4)}
    shared = SharedWeights.create(weights, torch.bfloat16)
    assert shared.handle.cuda_ipc is not None and shared.handle.shm_path is None
    shared.write(weights)
    expected = [float(w.to(torch.bfloat16).float().sum()) for w in weights.values()]
    assert run_spawned(_sums_in_another_process, 1, shared.handle) == pytest.approx(expected, rel=1e-3)
    for w in weights.values():
        w.mul_(-1)
    shared.write(weights)
    assert run_spawned(_sums_in_another_process, 1, shared.handle) == pytest.approx([-e for e in expected], rel=1e-3)
