"""Weight-sync transports: trainer (HF names) -> rollout engines, stamped with a version."""

from __future__ import annotations

import hashlib
import time
from typing import Any, Protocol

import ray
import torch


def weights_sha256(named_tensors: dict[str, torch.Tensor], names: list[str] | None = None) -> str:
    """Digest of the exact bytes of the named tensors (sorted by name): the equality check."""
    digest = hashlib.sha256()
    for name in sorted(names or named_tensors):
        tensor = named_tensors[name].detach().cpu().contiguous()
        digest.update(name.encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


class WeightTransport(Protocol):
    def push(self, trainer: Any, engines: list[Any], version: int) -> dict[str, float]: ...


class ObjectStoreTransport:
    """Full state dict through Ray's object store: one put, every engine reads it (zero-copy
    on the same node). The default for the embedded engine on CPU."""

    def __init__(self, verify: bool = False):
        self.verify = verify

    def push(self, trainer: Any, engines: list[Any], version: int) -> dict[str, float]:
        started = time.perf_counter()
        state_ref = trainer.hf_state_dict.remote()
        results = ray.get([e.update_weights_from_tensors.remote(state_ref, str(version)) for e in engines])
        failed = [r["message"] for r in results if not r["success"]]
        if failed:
            raise RuntimeError(f"weight sync to version {version} failed: {failed}")
        metrics = {"weights/sync_seconds": time.perf_counter() - started}
        if self.verify:
            expected = ray.get(trainer.weights_sha256.remote())
            got = ray.get([e.weights_sha256.remote() for e in engines])
            if any(g != expected for g in got):
                raise RuntimeError(f"engine weights differ from the trainer's after sync to version {version}")
        return metrics


TRANSPORTS = {"object_store": ObjectStoreTransport}
