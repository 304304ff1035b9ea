"""A trainer's state off the device between updates (placement.time_sharing).

Chosen over FSDP2's CPUOffloadPolicy: that policy keeps parameters on the host for good and
copies them to the GPU in every forward and backward, a cost paid per micro-batch for the whole
run; time-sharing needs the device memory back only while the engines generate, so the state
moves twice per step instead. Each tensor's storage is copied to a host buffer (pinned on CUDA,
so the copies run without a staging bounce and overlap) and then resized to zero bytes: the
tensor objects (parameters, their FSDP2 shards, optimizer states) stay the same Python objects,
so optimizer, FSDP2 hooks and compiled graphs keep their references, and onload resizes the
storage back and copies the bytes in, bit for bit. The host buffers are kept between steps
(pinning is slow), so after the first offload a step allocates nothing on the host.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def module_tensors(module: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None = None
                   ) -> Iterable[torch.Tensor]:
    """Parameters (their local shards), gradients and optimizer states of one model."""
    if module is not None:
        with torch.no_grad():
            for p in module.parameters():
                yield p.to_local() if isinstance(p, DTensor) else p
                if p.grad is not None:
                    yield p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    yield value.to_local() if isinstance(value, DTensor) else value


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class HostOffload:
    """Moves the storages of tensors on `device` to host memory and back."""

    def __init__(self, device: torch.device):
        self.device = device
        self.host: dict[int, torch.Tensor] = {}
        """Host buffer per storage (keyed by the storage's identity, stable across resizes)."""
        self.offloaded: list[tuple[torch.UntypedStorage, torch.Tensor]] = []

    @property
    def is_offloaded(self) -> bool:
        return bool(self.offloaded)

    def _storages(self, tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
        """Distinct resizable storages on the device (tied weights and shard views share one).
        A storage that cannot be resized (a CPU tensor mapped from a safetensors file) is
        already host memory and stays."""
        seen: dict[int, torch.UntypedStorage] = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if tensor.device.type == self.device.type and storage.nbytes() and storage.resizable():
                seen.setdefault(storage._cdata, storage)
        return list(seen.values())

    def offload(self, tensors: Iterable[torch.Tensor]) -> dict[str, float]:
        """Copy every storage out, then free it. Returns seconds and bytes moved."""
        if self.offloaded:
            return {"seconds": 0.0, "bytes": 0.0}
        started, pin = time.perf_counter(), self.device.type == "cuda"
        moved = []
        for storage in self._storages(tensors):
            host = self.host.get(storage._cdata)
            if host is None or host.numel() != storage.nbytes():
                host = self.host[storage._cdata] = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
            host.copy_(_bytes_view(storage), non_blocking=pin)
            moved.append((storage, host))
        if pin:  # the copies must land before the device memory is reused
            torch.cuda.current_stream().synchronize()
        for storage, _ in moved:
            storage.resize_(0)
        if pin:  # the caching allocator would keep the freed blocks from the engines' processes
            torch.cuda.empty_cache()
        self.offloaded = moved
        return {"seconds": time.perf_counter() - started, "bytes": float(sum(h.numel() for _, h in moved))}

    def onload(self) -> dict[str, float]:
        """Reallocate every offloaded storage and copy its bytes back."""
        started, pin = time.perf_counter(), self.device.type == "cuda"
        moved = sum(host.numel() for _, host in self.offloaded)
        for storage, host in self.offloaded:
            storage.resize_(host.numel())
            _bytes_view(storage).copy_(host, non_blocking=pin)
        if pin:
            torch.cuda.current_stream().synchronize()
        self.offloaded = []
        return {"seconds": time.perf_counter() - started, "bytes": float(moved)}
