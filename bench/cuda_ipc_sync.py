"""The cuda_ipc weight transport's hand-over against the copy floor, on one GPU, in one run.

    python bench/cuda_ipc_sync.py [--bucket-megabytes 512] [--syncs 6] [--layers 28]

The sender is miles_core.sglang_ipc as the trainer runs it: per bucket, one fused cast-copy of
the fp32 weights into a bf16 buffer and a dump of its CUDA IPC handle. The receiver is a second
process that reads each payload as SGLang does (tests/sglang_reader.py: its unpickler's
allow-list, GPU-UUID devices, the flattened-bucket slicing) and copies every weight into its own
bf16 parameter, where SGLang's load_weights ends. SGLang itself is not here: its loader's own work
(name mapping, fused qkv / gate_up writes) comes on top. The floor is one torch._foreach_copy_ of
the same fp32 weights into bf16 tensors in this process. Prints one JSON line: the median sync
over the syncs after the first (which opens the IPC handles), the floor, and sync / floor. GPU only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import QWEN3_06B_SHAPE, log, median, rounded, setup_env


def receive(conn, shapes: dict[str, tuple[int, ...]]) -> None:
    """The engine's side: bf16 parameters, refilled from each bucket's payloads; at the end
    (None) it answers with the sum of its weights."""
    import torch

    from tests.sglang_reader import map_device_uuids, read_as_sglang

    map_device_uuids()
    params = {name: torch.empty(shape, dtype=torch.bfloat16, device="cuda") for name, shape in shapes.items()}
    while (payloads := conn.recv()) is not None:
        for payload in payloads:
            for name, tensor in read_as_sglang(payload):
                params[name].copy_(tensor)
        torch.cuda.synchronize()
        conn.send(True)
    conn.send(sum(float(p.float().sum()) for p in params.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bucket-megabytes", type=int, default=512)
    parser.add_argument("--syncs", type=int, default=6)
    parser.add_argument("--layers", type=int, default=QWEN3_06B_SHAPE["num_hidden_layers"])
    args = parser.parse_args()
    setup_env()
    import torch
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM, Qwen3Config

    from miles_core.sglang_ipc import flatten_bucket, serialize_bucket
    from miles_core.weights import bucket_names

    if not torch.cuda.is_available():
        raise SystemExit("bench/cuda_ipc_sync.py needs a GPU")
    config = Qwen3Config(**{**QWEN3_06B_SHAPE, "num_hidden_layers": args.layers})
    state = {k: v for k, v in AutoModelForCausalLM.from_config(config).cuda().state_dict().items()
             if k != "lm_head.weight"}  # tied: the engine loads the embedding once
    bucket_bytes, nbytes = args.bucket_megabytes << 20, sum(t.numel() * 2 for t in state.values())
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    engine = ctx.Process(target=receive, args=(theirs, {k: tuple(v.shape) for k, v in state.items()}))
    engine.start()
    seconds = []
    try:
        for sync in range(args.syncs):
            torch.cuda.synchronize()
            started = time.perf_counter()
            buffers = []
            for names in bucket_names(state, bucket_bytes, torch.bfloat16):
                flat, entries = flatten_bucket([(n, state[n]) for n in names], torch.bfloat16)
                torch.cuda.current_stream().synchronize()
                buffers.append(flat)  # held until the engine answers, as the sender holds it
                ours.send([serialize_bucket(flat, entries)])
                ours.recv()
            seconds.append(time.perf_counter() - started)
            log(f"sync {sync}: {seconds[-1] * 1e3:.1f} ms ({len(buffers)} buckets, {nbytes / 2**20:.0f} MiB bf16)")
        ours.send(None)
        received = ours.recv()
    finally:
        engine.join(timeout=60)
        if engine.is_alive():
            engine.kill()
    expected = sum(float(t.to(torch.bfloat16).float().sum()) for t in state.values())
    if abs(received - expected) > 1e-3 * max(1.0, abs(expected)):
        raise SystemExit(f"the engine's weights differ from the trainer's: sum {received} vs {expected}")
    source = list(state.values())
    target = [torch.empty_like(t, dtype=torch.bfloat16) for t in source]
    floor = []
    for _ in range(10):
        torch.cuda.synchronize()
        started = time.perf_counter()
        torch._foreach_copy_(target, source)
        torch.cuda.synchronize()
        floor.append(time.perf_counter() - started)
    sync_s, floor_s = median(seconds[1:]), median(floor[2:])
    print(json.dumps(rounded({"bench": "cuda_ipc_sync", "device": torch.cuda.get_device_name(),
                              "weights_mib_bf16": nbytes / 2**20, "bucket_megabytes": args.bucket_megabytes,
                              "sync_s": sync_s, "first_sync_s": seconds[0], "copy_floor_s": floor_s,
                              "sync_over_floor": sync_s / floor_s})))


if __name__ == "__main__":
    main()
