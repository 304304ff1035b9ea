"""Weight-sync transports (Ray is imported lazily: engines load this module on GPU hosts without Ray): trainer (HF names) -> rollout engines, stamped with a version.

Each transport pushes the trainer's full weights to a list of engine targets (actor, url)
and can verify the result by comparing a sha256 of the exact bytes on both sides.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import torch

Target = tuple[Any, str]  # (engine actor handle, engine base URL)


# MoE experts have two layouts under HF names: the checkpoint's one tensor per expert and
# projection (what save_pretrained writes and SGLang loads), and transformers 5 modules' fused
# `mlp.experts.gate_up_proj` [E, 2F, H] / `mlp.experts.down_proj` [E, H, F].
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def checkpoint_layout(named_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused expert tensors split into the checkpoint's per-expert ones (views); others as given."""
    out = {}
    for name, tensor in named_tensors.items():
        if (m := _FUSED.match(name)) is None:
            out[name] = tensor
            continue
        for expert, weight in enumerate(tensor):
            prefix = f"{m.group(1)}.{expert}."
            if m.group(2) == "down_proj":
                out[prefix + "down_proj.weight"] = weight
            else:
                out[prefix + "gate_proj.weight"], out[prefix + "up_proj.weight"] = weight.chunk(2)
    return out


def fused_layout(named_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors stacked into transformers 5's fused expert tensors; others as given."""
    out, experts = {}, {}
    for name, tensor in named_tensors.items():
        if (m := _PER_EXPERT.match(name)) is None:
            out[name] = tensor
        else:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = tensor
    for prefix, by_index in experts.items():
        order = [by_index[i] for i in sorted(by_index)]
        out[prefix + ".gate_up_proj"] = torch.stack([torch.cat([e["gate_proj"], e["up_proj"]]) for e in order])
        out[prefix + ".down_proj"] = torch.stack([e["down_proj"] for e in order])
    return out


def weights_sha256(named_tensors: dict[str, torch.Tensor], names: list[str] | None = None) -> str:
    """Digest of the exact bytes of the named tensors (sorted by name): the equality check.
    Taken in the checkpoint layout, so fused and per-expert MoE weights digest alike."""
    named_tensors = checkpoint_layout(named_tensors)
    digest = hashlib.sha256()
    for name in sorted(names or named_tensors):
        tensor = named_tensors[name].detach().cpu().contiguous()
        digest.update(name.encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


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
    on the same node). The default for embedded engines on CPU."""

    def __init__(self, verify: bool = False, **_: Any):
        self.verify = verify

    def push(self, trainer: Any, targets: list[Target], version: int) -> dict[str, float]:
        import ray

        started = time.perf_counter()
        state_ref = trainer.hf_state_dict.remote(True)  # host memory: the object store is shared by processes
        _check(ray.get([actor.update_weights_from_tensors.remote(state_ref, str(version)) for actor, _ in targets]),
               version)
        if self.verify:
            _verify(trainer, targets, version)
        return {"weights/sync_seconds": time.perf_counter() - started}


class DiskTransport:
    """The trainer writes an HF safetensors directory; engines load it (`update_weights_from_disk`).
    Needs a filesystem both sides see; keeps only the newest version on disk."""

    def __init__(self, sync_dir: str, verify: bool = False, **_: Any):
        self.sync_dir, self.verify = Path(sync_dir), verify

    def push(self, trainer: Any, targets: list[Target], version: int) -> dict[str, float]:
        import ray

        from miles_core.rollout.sglang_client import SGLangClient

        started = time.perf_counter()
        out = self.sync_dir / f"v{version:06d}"
        ray.get(trainer.export_hf.remote(str(out)))
        with ThreadPoolExecutor(max_workers=len(targets)) as pool:
            _check(list(pool.map(lambda t: SGLangClient(t[1]).update_weights_from_disk(str(out), str(version)),
                                 targets)), version)
        for old in self.sync_dir.glob("v*"):
            if old != out:
                shutil.rmtree(old, ignore_errors=True)
        if self.verify:
            _verify(trainer, targets, version)
        return {"weights/sync_seconds": time.perf_counter() - started}


class BroadcastTransport:
    """torch.distributed broadcast from the trainer (rank 0) to every engine (ranks 1..N) over
    a dedicated group (gloo on CPU, NCCL on GPU), in buckets; the group is rebuilt whenever
    the set of engines changes (e.g. after a restart)."""

    def __init__(self, bucket_megabytes: int = 512, verify: bool = False, **_: Any):
        self.bucket_bytes, self.verify = bucket_megabytes << 20, verify
        self.members: tuple[str, ...] = ()
        self.generation = 0

    def _group_name(self) -> str:
        return f"miles-weights-{self.generation}"

    def _connect(self, trainer: Any, urls: tuple[str, ...]) -> None:
        import ray

        from miles_core.rollout.sglang_client import SGLangClient

        if self.members:
            ray.get(trainer.close_weight_broadcast.remote())
            for url in self.members:
                if url in urls:
                    SGLangClient(url).destroy_weights_update_group(self._group_name())
        self.generation += 1
        address, port = ray.get(trainer.weight_broadcast_endpoint.remote())
        world, backend = len(urls) + 1, ray.get(trainer.broadcast_backend.remote())
        sender = trainer.open_weight_broadcast.remote(address, port, world, self._group_name())
        with ThreadPoolExecutor(max_workers=len(urls)) as pool:
            results = list(pool.map(lambda item: SGLangClient(item[1]).init_weights_update_group(
                address, port, item[0] + 1, world, self._group_name(), backend), enumerate(urls)))
        ray.get(sender)
        _check(results, 0)
        self.members = urls

    def push(self, trainer: Any, targets: list[Target], version: int) -> dict[str, float]:
        import ray

        started = time.perf_counter()
        urls = tuple(url for _, url in targets)
        if urls != self.members:
            self._connect(trainer, urls)
        connected = time.perf_counter()
        sent_bytes = ray.get(trainer.broadcast_weights.remote(list(urls), self._group_name(), str(version),
                                                             self.bucket_bytes))
        done = time.perf_counter()
        if self.verify:
            _verify(trainer, targets, version)
        return {"weights/sync_seconds": done - started, "weights/broadcast_seconds": done - connected,
                "weights/broadcast_gbytes": sent_bytes / 1e9}


def make_transport(kind: str, run_dir: str, bucket_megabytes: int, verify: bool) -> WeightTransport:
    if kind == "object_store":
        return ObjectStoreTransport(verify=verify)
    if kind == "disk":
        return DiskTransport(str(Path(run_dir) / "weight_sync"), verify=verify)
    if kind == "broadcast":
        return BroadcastTransport(bucket_megabytes, verify=verify)
    raise ValueError(f"unknown weight transport {kind!r}")


def broadcast_to_engines(state: dict[str, torch.Tensor], group, urls: list[str], group_name: str,
                         version: str, bucket_bytes: int) -> int:
    """Sender side (runs in the trainer): per bucket, ask every engine to receive the named
    tensors, then broadcast them in that order. Returns the bytes sent."""
    from miles_core.rollout.sglang_client import SGLangClient

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    names, buckets, size = list(state), [[]], 0
    for name in names:
        nbytes = state[name].numel() * state[name].element_size()
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += nbytes
    with ThreadPoolExecutor(max_workers=len(urls)) as pool:
        for bucket in buckets:
            meta = ([str(state[n].dtype).removeprefix("torch.") for n in bucket], [list(state[n].shape) for n in bucket])
            requests = [pool.submit(SGLangClient(url).update_weights_from_distributed, bucket, meta[0], meta[1],
                                    group_name, version) for url in urls]
            for name in bucket:
                torch.distributed.broadcast(state[name].to(device), src=0, group=group)
            _check([r.result() for r in requests], int(version))
    return sum(t.numel() * t.element_size() for t in state.values())
