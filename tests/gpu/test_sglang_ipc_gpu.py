"""The cuda_ipc transport's payload on a lent GPU (not run in CI): another process, reading it as
SGLang does (its unpickler's allow-list, its GPU-UUID device mapping, its flattened-bucket
slicing), maps the trainer's device buffer and finds every weight cast to the engine dtype.

    python -m pytest tests/gpu/test_sglang_ipc_gpu.py -s
"""

from __future__ import annotations

import base64
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def _receive(rank: int, world_size: int, payloads: list[str]) -> dict:
    from tests.sglang_reader import SGLangUnpickler, map_device_uuids

    map_device_uuids()
    sums, devices, started = {}, set(), time.perf_counter()
    for payload in payloads:
        unpickler = SGLangUnpickler(base64.b64decode(payload))
        bucket = unpickler.load()
        flat = bucket["flattened_tensor"]
        devices.add(str(flat.device))
        for m in bucket["metadata"]:
            weight = flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape).clone()  # the engine's load
            sums[m.name] = (str(weight.dtype), float(weight.float().sum()))
    torch.cuda.synchronize()
    return {"sums": sums, "devices": sorted(devices), "seconds": time.perf_counter() - started,
            "globals": sorted(unpickler.globals)}


def test_another_process_reads_the_buckets_as_sglang_does():
    from miles_core.training.megatron.launch import run_spawned
    from miles_core.weight_sync.cuda_ipc import flatten_bucket, serialize_bucket
    from miles_core.weight_sync.transports import bucket_names

    g = torch.Generator(device="cuda").manual_seed(0)
    state = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(3072, 1024, device="cuda", generator=g)
             for i in range(8)} | {"model.norm.weight": torch.randn(1024, device="cuda", generator=g)}
    started = time.perf_counter()
    buckets, payloads = [], []
    for names in bucket_names(state, 16 << 20, torch.bfloat16):
        flat, entries = flatten_bucket([(n, state[n]) for n in names], torch.bfloat16)
        buckets.append(flat)  # alive until the reader is done, as the sender keeps it until SGLang answers
        payloads.append(serialize_bucket(flat, entries))
    torch.cuda.synchronize()
    sent_seconds = time.perf_counter() - started
    got = run_spawned(_receive, 1, payloads)
    assert len(payloads) == 4 and got["devices"] == ["cuda:0"]  # two 6 MiB weights per 16 MiB bucket
    assert ("torch.multiprocessing.reductions", "rebuild_cuda_tensor") in got["globals"]
    for name, tensor in state.items():
        dtype, total = got["sums"][name]
        assert dtype == "torch.bfloat16"
        assert total == pytest.approx(float(tensor.to(torch.bfloat16).float().sum()), rel=1e-3, abs=1e-2)
    print(f"\n{sum(b.numel() for b in buckets) / 2**20:.0f} MiB in {len(payloads)} buckets: "
          f"flatten + serialize {sent_seconds * 1e3:.1f} ms, map + copy in another process {got['seconds'] * 1e3:.1f} ms")
