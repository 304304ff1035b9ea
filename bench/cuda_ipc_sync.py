"""The cuda_ipc weight transport's hand-over against the copy floor, on one GPU, in one run.

    python bench/cuda_ipc_sync.py [--bucket-megabytes 512] [--syncs 6] [--layers 28] [--http10]

The sender is the trainer's own, miles_core.weight_sync.cuda_ipc.send_weights_over_cuda_ipc: per bucket,
one fused cast-copy of the fp32 weights into a bf16 buffer and a POST of its CUDA IPC handle. The
receiver is a second process serving SGLang's weight-update routes on loopback: it reads each
payload as SGLang does (tests/sglang_reader.py: its unpickler's allow-list, GPU-UUID devices, the
flattened-bucket slicing) and copies every weight into its own bf16 parameter, where SGLang's
load_weights ends. Like SGLang's server (uvicorn), it keeps HTTP/1.1 connections alive;
`--http10` closes each one, as a plain http.server does. SGLang itself is not here: its loader's own work
(name mapping, fused qkv / gate_up writes) comes on top. The floor is one torch._foreach_copy_ of
the same fp32 weights into bf16 tensors in this process. Prints one JSON line: the median sync
over the syncs after the first (which opens the IPC handles), the floor, and sync / floor, with the
split: the receiver's time reading payloads (unpickling opens the IPC handles) and copying, and
one HTTP round trip to it. GPU only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import QWEN3_06B_SHAPE, foreach_copy_seconds, gpu_identity, log, median, rounded, start_gpu_bench


def serve(conn, shapes: dict[str, tuple[int, ...]], keep_alive: bool) -> None:
    """The engine's side: bf16 parameters, refilled from each /update_weights_from_tensor; sends
    its port, then, when told to stop, the sum of its weights and its seconds per update
    (reading payloads, copying)."""
    import threading

    import torch

    from tests.sglang_reader import map_device_uuids, read_as_sglang

    map_device_uuids()
    params = {name: torch.empty(shape, dtype=torch.bfloat16, device="cuda") for name, shape in shapes.items()}
    updates = []  # (read seconds, copy seconds) per update

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1" if keep_alive else "HTTP/1.0"
        disable_nagle_algorithm = True  # as uvicorn's asyncio transports do (TCP_NODELAY)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/update_weights_from_tensor":
                started = time.perf_counter()
                named = [pair for payload in body["serialized_named_tensors"] for pair in read_as_sglang(payload)]
                read = time.perf_counter()
                for name, tensor in named:
                    params[name].copy_(tensor)
                torch.cuda.synchronize()
                updates.append((read - started, time.perf_counter() - read))
                del named  # let go of the mapping before answering, as SGLang does when load_weights returns
            answer = json.dumps({"success": True, "message": "ok"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    conn.send(server.server_address[1])
    conn.recv()
    server.shutdown()
    conn.send((sum(float(p.float().sum()) for p in params.values()), updates))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bucket-megabytes", type=int, default=512)
    parser.add_argument("--syncs", type=int, default=6)
    parser.add_argument("--layers", type=int, default=QWEN3_06B_SHAPE["num_hidden_layers"])
    parser.add_argument("--http10", action="store_true", help="the receiver closes every connection (HTTP/1.0)")
    args = parser.parse_args()
    start_gpu_bench(__file__)
    import torch
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM, Qwen3Config

    from miles_core.engines.sglang.client import SGLangClient
    from miles_core.weight_sync.cuda_ipc import send_weights_over_cuda_ipc

    config = Qwen3Config(**{**QWEN3_06B_SHAPE, "num_hidden_layers": args.layers})
    state = {k: v for k, v in AutoModelForCausalLM.from_config(config).cuda().state_dict().items()
             if k != "lm_head.weight"}  # tied: the engine loads the embedding once
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    engine = ctx.Process(target=serve, args=(theirs, {k: tuple(v.shape) for k, v in state.items()},
                                                         not args.http10))
    engine.start()
    seconds = []
    try:
        url = f"http://127.0.0.1:{ours.recv()}"
        for sync in range(args.syncs):
            torch.cuda.synchronize()
            started = time.perf_counter()
            sent = send_weights_over_cuda_ipc(state, [url], str(sync), args.bucket_megabytes << 20, torch.bfloat16)
            seconds.append(time.perf_counter() - started)
            log(f"sync {sync}: {seconds[-1] * 1e3:.1f} ms ({sent / 2**20:.0f} MiB bf16)")
        round_trip_s = http_round_trip_seconds(SGLangClient(url))
        sender_split = sender_seconds(state, args.bucket_megabytes << 20)
        ours.send(None)
        received, updates = ours.recv()
    finally:
        engine.join(timeout=60)
        if engine.is_alive():
            engine.kill()
    expected = sum(float(t.to(torch.bfloat16).float().sum()) for t in state.values())
    if abs(received - expected) > 1e-3 * max(1.0, abs(expected)):
        raise SystemExit(f"the engine's weights differ from the trainer's: sum {received} vs {expected}")
    sync_s, floor_s = median(seconds[1:]), foreach_copy_seconds(list(state.values()), "bfloat16")
    per_sync = len(updates) // args.syncs  # updates (buckets) per sync
    later = updates[per_sync:]
    print(json.dumps(rounded({"bench": "cuda_ipc_sync", **gpu_identity(),
                              "weights_mib_bf16": sent / 2**20, "bucket_megabytes": args.bucket_megabytes,
                              "keep_alive": not args.http10, "sync_s": sync_s, "first_sync_s": seconds[0],
                              "copy_floor_s": floor_s, "sync_over_floor": sync_s / floor_s,
                              "requests_per_sync": per_sync + 2, "http_round_trip_s": round_trip_s,
                              "receiver_read_s_per_sync": per_sync * median(r for r, _ in later),
                              "receiver_copy_s_per_sync": per_sync * median(c for _, c in later),
                              **sender_split}, 5)))


def sender_seconds(state, bucket_bytes: int, repeats: int = 5) -> dict[str, float]:
    """The sender's own work per sync, no engine: casting each bucket (until the GPU is done),
    then serializing its IPC handle (medians over repeats). Casts and serializations are timed in
    separate passes: a buffer whose handle no engine reads stays allocated (torch keeps shared
    blocks until the reader lets go), so a cast after one would time a fresh cudaMalloc."""
    import torch

    from miles_core.weight_sync.cuda_ipc import flatten_bucket, serialize_bucket
    from miles_core.weight_sync.transports import bucket_names

    buckets = [[(name, state[name]) for name in names] for names in bucket_names(state, bucket_bytes, torch.bfloat16)]
    cast, serialize = [], []
    for shared in [False] * repeats + [True] * repeats:
        seconds = 0.0
        for named in buckets:
            started = time.perf_counter()
            flat, entries = flatten_bucket(named, torch.bfloat16)
            torch.cuda.synchronize()
            if shared:
                started = time.perf_counter()
                serialize_bucket(flat, entries)
            seconds += time.perf_counter() - started
        (serialize if shared else cast).append(seconds)
    return {"sender_cast_s_per_sync": median(cast[1:]), "sender_serialize_s_per_sync": median(serialize[1:])}


def http_round_trip_seconds(client, repeats: int = 20) -> float:
    """Median time of one control request on one client: half of opening and closing a
    weight-update session, the two requests every sync makes besides its buckets."""
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        with client.weight_update_session():
            pass
        seconds.append((time.perf_counter() - started) / 2)
    return median(seconds[2:])


if __name__ == "__main__":
    main()
