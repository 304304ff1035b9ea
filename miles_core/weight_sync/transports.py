"""Weight-sync transports: trainer (HF names) -> rollout engines, stamped with a version.

Each transport pushes the trainer's full weights to a list of engine targets (actor, url)
and can verify the result by comparing a sha256 of the exact bytes on both sides.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Protocol

import torch

from miles_core.config.rollout import TransportConfig
from miles_core.engines.sglang.client import SGLangClient
from miles_core.metrics import SYNC_SECONDS
from miles_core.weight_sync.layout import checkpoint_layout

Target = tuple[Any, str]  # (engine actor handle, engine base URL)
# Transports that keep state per engine (a mapped buffer, a process group) compare targets as
# given: Ray actor handles are equal exactly when they name the same actor, so an engine
# restarted at its old URL (a new actor) counts as a new member, with no call to ask.


class WeightTransport(Protocol):
    def push(self, trainer: Any, targets: list[Target], version: int) -> dict[str, float]: ...


def _verify(trainer: Any, targets: list[Target], version: int) -> None:
    import ray

    expected = ray.get(trainer.weights_sha256.remote())
    got = ray.get([actor.weights_sha256.remote() for actor, _ in targets])
    if any(g != expected for g in got):
        raise RuntimeError(f"engine weights differ from the trainer's after the sync to version {version}")


def _check(results: list[dict], version: int) -> None:
    failed = [r.get("message") for r in results if not r.get("success")]
    if failed:
        raise RuntimeError(f"weight sync to version {version} failed: {failed}")


class ObjectStoreTransport:
    """Full state dict through Ray's object store: one put, every engine reads it (zero copy
    on the same node). The default for embedded engines on CPU. adapters_only (training.lora):
    only the LoRA adapters travel and each engine merges them into its base copy
    (miles_core.weight_sync.lora)."""

    def __init__(self, verify: bool = False, adapters_only: bool = False, **_: Any):
        self.verify, self.adapters_only = verify, adapters_only

    def push(self, trainer: Any, targets: list[Target], version: int) -> dict[str, float]:
        import ray

        started = time.perf_counter()
        # host memory: the object store is shared by processes
        state_ref = trainer.adapter_state_dict.remote() if self.adapters_only else trainer.hf_state_dict.remote(True)
        results = ray.get([actor.update_weights_from_tensors.remote(state_ref, str(version)) for actor, _ in targets])
        _check(results, version)
        if self.verify:
            _verify(trainer, targets, version)
        # bytes each engine received (what one engine's sync moves), as the engine counted them
        return {SYNC_SECONDS: time.perf_counter() - started,
                "weights/sync_bytes": float(max(r.get("received_bytes", 0) for r in results))}


class SharedMemoryTransport:
    """One buffer the trainer and colocated engines both map (miles_core.weight_sync.shared): CUDA
    IPC when they share a GPU, /dev/shm on CPU. A sync is a cast-copy into the buffer and a
    copy out of it per engine; nothing is serialized. The buffer is laid out again whenever the
    set of engine processes changes (a restarted engine, even at its old URL, maps the new one)."""

    def __init__(self, engine_dtype: str = "float32", verify: bool = False, **_: Any):
        self.engine_dtype, self.verify = engine_dtype, verify
        self.members: tuple[Target, ...] = ()

    def push(self, trainer: Any, targets: list[Target], version: int) -> dict[str, float]:
        import ray

        started = time.perf_counter()
        targets = tuple(targets)
        if targets != self.members:
            self.members = ()
            handle = ray.get(trainer.share_weights.remote(self.engine_dtype))
            try:
                _check(ray.get([actor.map_shared_weights.remote(handle) for actor, _ in targets]), version)
            finally:  # mapped or not, the file must not outlive this call (a killed trainer cannot remove it)
                ray.get(trainer.unlink_shared_weights.remote())
            self.members = targets
        else:
            ray.get(trainer.write_shared_weights.remote())
        written = time.perf_counter()
        _check(ray.get([actor.load_shared_weights.remote(str(version)) for actor, _ in targets]), version)
        done = time.perf_counter()
        if self.verify:
            _verify(trainer, targets, version)
        return {SYNC_SECONDS: done - started, "weights/shared_write_seconds": written - started,
                "weights/shared_load_seconds": done - written}


def adapter_name(version: int) -> str:
    """The name engines serve weight version `version`'s LoRA adapter under (requests' lora_path)."""
    return f"policy-v{version}"


class DiskTransport:
    """The trainer writes an HF safetensors directory; engines load it (`update_weights_from_disk`).
    Needs a filesystem both sides see; keeps only the newest version on disk.

    adapters_only (training.lora with SGLang engines): the trainer writes its adapter alone in
    PEFT's layout (`lora-v<version>/`), each engine loads it as `policy-v<version>`
    (/load_lora_adapter) and takes the version; then `on_adapter(name)` makes every request name
    it (Router.lora_path) and the names loaded before are unloaded (SGLang lets the requests
    already admitted with them finish first). The previous version's folder stays on disk: SGLang
    loads an unloaded adapter that a late request names again from its folder."""

    def __init__(self, sync_dir: str, verify: bool = False, api_key: str | None = None, adapters_only: bool = False,
                 on_adapter: Callable[[str], None] | None = None, **_: Any):
        self.sync_dir, self.verify, self.api_key = Path(sync_dir), verify, api_key
        self.adapters_only, self.on_adapter = adapters_only, on_adapter
        self.loaded: dict[Target, set[str]] = {}
        """The adapter names each engine holds (a restarted engine is a new target, holding none)."""

    def push(self, trainer: Any, targets: list[Target], version: int) -> dict[str, float]:
        import ray

        if self.adapters_only:
            return self._push_adapter(trainer, targets, version)
        started = time.perf_counter()
        out = self.sync_dir / f"v{version:06d}"
        ray.get(trainer.export_hf.remote(str(out)))
        with ThreadPoolExecutor(max_workers=len(targets)) as pool:
            _check(list(pool.map(lambda t: SGLangClient(t[1], api_key=self.api_key).update_weights_from_disk(
                str(out), str(version)), targets)), version)
        for old in self.sync_dir.glob("v*"):
            if old != out:
                shutil.rmtree(old, ignore_errors=True)
        if self.verify:
            _verify(trainer, targets, version)
        return {SYNC_SECONDS: time.perf_counter() - started}

    def _push_adapter(self, trainer: Any, targets: list[Target], version: int) -> dict[str, float]:
        import ray

        started, name = time.perf_counter(), adapter_name(version)
        out = self.sync_dir / f"lora-v{version:06d}"
        ray.get(trainer.export_adapter.remote(str(out)))
        self.loaded = {t: self.loaded.get(t, set()) for t in targets}  # engines replaced: forgotten

        def load(target: Target) -> None:
            client = SGLangClient(target[1], api_key=self.api_key)
            if name not in self.loaded[target]:  # a push again to the same version (after a restart)
                client.load_lora_adapter(name, str(out))
                self.loaded[target].add(name)
            client.update_weight_version(str(version))

        def unload(target: Target) -> None:
            for old in sorted(self.loaded[target] - {name}):
                SGLangClient(target[1], api_key=self.api_key).unload_lora_adapter(old)
                self.loaded[target].discard(old)

        with ThreadPoolExecutor(max_workers=len(targets)) as pool:
            list(pool.map(load, targets))
            if self.on_adapter is not None:
                self.on_adapter(name)
            list(pool.map(unload, targets))
        for old in sorted(self.sync_dir.glob("lora-v*"))[:-2]:
            shutil.rmtree(old, ignore_errors=True)
        return {"weights/sync_seconds": time.perf_counter() - started,
                "weights/sync_bytes": float(sum(f.stat().st_size for f in out.iterdir()))}


class BroadcastTransport:
    """torch.distributed broadcast from the trainer (rank 0) to every engine over a dedicated
    group (gloo on CPU, NCCL on GPU), in buckets; the group is rebuilt whenever the set of
    engines changes (e.g. after a restart). Each TP rank of an engine joins the group (SGLang
    joins at rank_offset + tp_rank), so engine i's offset is 1 + the ranks of engines before it."""

    def __init__(self, bucket_megabytes: int = 512, verify: bool = False, ranks_per_engine: int = 1,
                 api_key: str | None = None, engine_dtype: str | None = None, precision: str = "bf16", **_: Any):
        self.bucket_bytes, self.verify, self.ranks_per_engine = bucket_megabytes << 20, verify, ranks_per_engine
        self.api_key, self.engine_dtype, self.precision = api_key, engine_dtype, precision
        self.members: tuple[Target, ...] = ()
        self.generation = 0

    def _group_name(self) -> str:
        return f"miles-weights-{self.generation}"

    def _connect(self, trainer: Any, targets: tuple[Target, ...]) -> None:
        import ray

        if self.members:
            ray.get(trainer.close_weight_broadcast.remote())
            for target in self.members:
                if target in targets:  # the same engine process: it still holds the old group
                    SGLangClient(target[1], api_key=self.api_key).destroy_weights_update_group(self._group_name())
        urls = [url for _, url in targets]
        self.generation += 1
        address, port = ray.get(trainer.weight_broadcast_endpoint.remote())
        offsets, world = broadcast_rank_layout(len(urls), self.ranks_per_engine)
        backend = ray.get(trainer.broadcast_backend.remote())
        sender = trainer.open_weight_broadcast.remote(address, port, world, self._group_name())
        with ThreadPoolExecutor(max_workers=len(urls)) as pool:
            results = list(pool.map(lambda item: SGLangClient(item[1], api_key=self.api_key).init_weights_update_group(
                address, port, item[0], world, self._group_name(), backend), zip(offsets, urls)))
        ray.get(sender)
        _check(results, 0)
        self.members = targets

    def push(self, trainer: Any, targets: list[Target], version: int) -> dict[str, float]:
        import ray

        started = time.perf_counter()
        targets = tuple(targets)
        if targets != self.members:
            self._connect(trainer, targets)
        connected = time.perf_counter()
        urls = [url for _, url in targets]
        sent_bytes = ray.get(trainer.broadcast_weights.remote(urls, self._group_name(), str(version),
                                                             self.bucket_bytes, self.api_key, self.engine_dtype,
                                                             self.precision))
        done = time.perf_counter()
        if self.verify:
            _verify(trainer, targets, version)
        return {SYNC_SECONDS: done - started, "weights/broadcast_seconds": done - connected,
                "weights/broadcast_gbytes": sent_bytes / 1e9}


class CudaIpcTransport:
    """Colocated SGLang on the trainer's GPU: per bucket, the trainer casts its weights into one
    buffer and hands each engine a CUDA IPC handle to it (`/update_weights_from_tensor`, SGLang's
    flattened-bucket format; see miles_core.weight_sync.cuda_ipc). The bytes never leave the GPU."""

    def __init__(self, bucket_megabytes: int = 512, api_key: str | None = None, engine_dtype: str = "bfloat16",
                 **_: Any):
        self.bucket_bytes, self.api_key, self.engine_dtype = bucket_megabytes << 20, api_key, engine_dtype

    def push(self, trainer: Any, targets: list[Target], version: int) -> dict[str, float]:
        import ray

        started = time.perf_counter()
        sent_bytes = ray.get(trainer.send_weights_over_cuda_ipc.remote(
            [url for _, url in targets], str(version), self.bucket_bytes, self.engine_dtype, self.api_key))
        return {SYNC_SECONDS: time.perf_counter() - started, "weights/ipc_gbytes": sent_bytes / 1e9}


def broadcast_rank_layout(num_engines: int, ranks_per_engine: int) -> tuple[list[int], int]:
    """(rank_offset of each engine, world size): the trainer is rank 0, then every engine's ranks."""
    offsets = [1 + i * ranks_per_engine for i in range(num_engines)]
    return offsets, 1 + num_engines * ranks_per_engine


def make_transport(config: TransportConfig, sync_dir: str | Path, verify: bool, ranks_per_engine: int = 1,
                   api_key: str | None = None, engine_dtype: str = "float32", precision: str = "bf16",
                   adapters_only: bool = False, on_adapter: Callable[[str], None] | None = None) -> WeightTransport:
    """The transport that a `rollout.weight_transport` config names; disk syncs write under
    sync_dir, broadcast groups give each engine ranks_per_engine ranks, api_key is the
    engines' (EngineGroup.api_key), and a shared buffer holds weights in engine_dtype.
    precision=fp8 (rollout.precision): the broadcast sends block-FP8 linears (the only
    transport that does; config validation refuses the others). adapters_only
    (training.lora): the object store carries the adapters alone, and so does disk (to SGLang
    engines: /load_lora_adapter, then on_adapter(name) makes requests name it); the other
    transports carry the merged weights (full size)."""
    if config.kind == "object_store":
        return ObjectStoreTransport(verify=verify, adapters_only=adapters_only)
    if config.kind == "shared_memory":
        return SharedMemoryTransport(engine_dtype, verify=verify)
    if config.kind == "disk":
        return DiskTransport(str(sync_dir), verify=verify, api_key=api_key, adapters_only=adapters_only,
                             on_adapter=on_adapter)
    if config.kind == "broadcast":
        return BroadcastTransport(config.bucket_megabytes, verify=verify, ranks_per_engine=ranks_per_engine,
                                  api_key=api_key, engine_dtype=engine_dtype, precision=precision)
    if config.kind == "cuda_ipc":
        return CudaIpcTransport(config.bucket_megabytes, api_key=api_key, engine_dtype=engine_dtype)
    raise ValueError(f"unknown weight transport {config.kind!r}")


def bucket_names(state: dict[str, torch.Tensor], bucket_bytes: int, dtype: torch.dtype | None = None) -> list[list[str]]:
    """The names in order, cut into buckets of at most bucket_bytes (a bigger tensor is a bucket
    of its own), counting each tensor at dtype's size when given."""
    buckets, size = [[]], 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * (dtype.itemsize if dtype is not None else tensor.element_size())
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += nbytes
    return buckets


def broadcast_to_engines(state: dict[str, torch.Tensor], group, urls: list[str], group_name: str,
                         version: str, bucket_bytes: int, api_key: str | None = None,
                         dtype: torch.dtype | None = None, fp8: bool = False) -> int:
    """Sender side (runs in the trainer): per bucket, ask every engine to receive the named
    tensors, then broadcast them in that order, cast to dtype (the engines' own: bf16 engines
    receive half the bytes of fp32 master weights), all in one weight-update session per engine.
    Returns the bytes sent. MoE experts go in the checkpoint layout: SGLang's loaders skip fused
    expert names without an error. fp8: the decoder layers' linear weights go as float8_e4m3fn
    plus a float32 `weight_scale_inv` each (the block-FP8 engine's parameters), the rest in dtype."""
    state = checkpoint_layout(state)
    if fp8:
        from miles_core.weight_sync.quantization import quantize_named_tensors

        state = dict(quantize_named_tensors(state.items(), dtype=dtype or torch.bfloat16))
    elif dtype is not None:
        state = {name: tensor.to(dtype) for name, tensor in state.items()}
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    buckets = bucket_names(state, bucket_bytes)
    with ThreadPoolExecutor(max_workers=len(urls)) as pool, contextlib.ExitStack() as sessions:
        for url in urls:
            sessions.enter_context(SGLangClient(url, api_key=api_key).weight_update_session())
        for index, bucket in enumerate(buckets):
            dtypes = [str(state[n].dtype).removeprefix("torch.") for n in bucket]
            shapes = [list(state[n].shape) for n in bucket]
            # One cache flush, after the last bucket: SGLang fails an update whose flush it refuses
            # (requests still queued), after loading the tensors; between buckets nothing generates.
            flush = index == len(buckets) - 1
            requests = [pool.submit(SGLangClient(url, api_key=api_key).update_weights_from_distributed, bucket, dtypes,
                                    shapes, group_name, version, flush) for url in urls]
            tensors = [state[name].to(device) for name in bucket]
            works = [torch.distributed.broadcast(t, src=0, group=group, async_op=True) for t in tensors]
            _await_bucket(works, requests, group)
    return sum(t.numel() * t.element_size() for t in state.values())


def _await_bucket(works: list, requests: list[Future], group) -> None:
    """Waits for one bucket's broadcasts and every engine's answer. An engine that refuses the
    update answers at once and never joins the broadcast, which would hold the sender until the
    group's timeout: on the first refusal the group is aborted (it cannot be used again) and the
    engine's error raised."""
    done, _ = wait(requests, return_when=FIRST_EXCEPTION)
    refused = next((r.exception() for r in done if r.exception() is not None), None)
    if refused is not None:
        group.abort()
        raise refused
    for work in works:
        work.wait()
