"""Weights in one flat buffer that a trainer and colocated engines both map (the `shared_memory`
weight transport).

The trainer allocates the buffer once, in the engines' dtype, and hands out a handle: a CUDA IPC
handle when it trains on a GPU (engines on the same GPU map the same device memory, as
colocated SGLang does with `update_weights_from_tensor`), else a file in /dev/shm. A sync is
then two device-local copies and no serialization: the trainer casts its weights into the
buffer, each engine copies the buffer's views into its parameters.
"""

from __future__ import annotations

import contextlib
import math
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.multiprocessing.reductions import reduce_tensor

SHM_DIR = Path("/dev/shm")
ALIGN_ELEMENTS = 64  # every tensor starts on a 128-byte boundary (bf16): aligned vector copies


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    offset: int
    """In elements, from the start of the buffer."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class BufferHandle:
    """What an engine needs to map the buffer (crosses Ray as plain data)."""

    entries: tuple[Entry, ...]
    dtype: str
    numel: int
    shm_path: str | None = None
    """/dev/shm file of a CPU buffer."""
    cuda_ipc: tuple | None = None
    """(rebuild function, args) of torch's CUDA IPC reduction of a GPU buffer."""


def flat_layout(shapes: dict[str, tuple[int, ...]]) -> tuple[tuple[Entry, ...], int]:
    """Each named shape's place in one flat buffer (every tensor aligned to ALIGN_ELEMENTS), and
    the buffer's length in elements."""
    entries, offset = [], 0
    for name, shape in shapes.items():
        entries.append(Entry(name, tuple(shape), offset))
        offset += -(-math.prod(shape) // ALIGN_ELEMENTS) * ALIGN_ELEMENTS
    return tuple(entries), offset


class SharedWeights:
    """One side's mapping of the buffer: `views` are HF-named tensors over it."""

    def __init__(self, flat: torch.Tensor, handle: BufferHandle, owner: bool):
        self.flat, self.handle, self.owner = flat, handle, owner
        self.views = {e.name: flat[e.offset : e.offset + e.numel].view(e.shape) for e in handle.entries}

    @classmethod
    def create(cls, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> SharedWeights:
        """The trainer's side: a buffer on the weights' device, laid out for these names and shapes."""
        entries, numel = flat_layout({name: tuple(t.shape) for name, t in weights.items()})
        device = next(iter(weights.values())).device
        dtype_name = str(dtype).removeprefix("torch.")
        if device.type == "cuda":
            flat = torch.empty(numel, dtype=dtype, device=device)
            handle = BufferHandle(entries, dtype_name, numel, cuda_ipc=reduce_tensor(flat))
        else:
            path = _reserve_shm_file(numel * dtype.itemsize)
            flat = torch.from_file(str(path), shared=True, size=numel, dtype=dtype)
            handle = BufferHandle(entries, dtype_name, numel, shm_path=str(path))
        return cls(flat, handle, owner=True)

    @classmethod
    def open(cls, handle: BufferHandle) -> SharedWeights:
        """An engine's side: map the trainer's buffer (same GPU, or same machine for /dev/shm)."""
        if handle.cuda_ipc is not None:
            rebuild, args = handle.cuda_ipc
            try:
                flat = rebuild(*args)
            except RuntimeError as exc:
                raise RuntimeError("cannot map the trainer's CUDA weight buffer: rollout.weight_transport="
                                   "shared_memory needs every engine on the trainer's GPU (placement.layout="
                                   f"colocated, one GPU): {exc}") from exc
        else:
            path = Path(handle.shm_path or "")
            if path.parent != SHM_DIR or not path.name.startswith("miles-weights-") or not path.is_file():
                raise ValueError(f"no shared weight buffer at {path}: the trainer must run on this machine")
            flat = torch.from_file(str(path), shared=True, size=handle.numel, dtype=getattr(torch, handle.dtype))
        return cls(flat, handle, owner=False)

    def write(self, weights: dict[str, torch.Tensor]) -> None:
        """Cast-copy every named tensor into its view (one fused multi-tensor copy)."""
        if weights.keys() != self.views.keys():
            raise ValueError(f"weights changed names since the buffer was laid out: "
                             f"{sorted(weights.keys() ^ self.views.keys())[:5]}")
        names = list(self.views)
        torch._foreach_copy_([self.views[n] for n in names], [weights[n] for n in names])
        if self.flat.is_cuda:  # the engines read it from other processes' streams
            torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        if self.owner and self.handle.shm_path:
            with contextlib.suppress(FileNotFoundError):  # a mapping outlives its file
                os.remove(self.handle.shm_path)


def _reserve_shm_file(num_bytes: int) -> Path:
    """A new /dev/shm file with its pages allocated now: a tmpfs that fills up later would kill
    the trainer with SIGBUS in the middle of a write instead of failing here."""
    path = SHM_DIR / f"miles-weights-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, num_bytes)
    except OSError as exc:
        os.close(fd)
        path.unlink()
        raise RuntimeError(f"rollout.weight_transport=shared_memory needs {num_bytes / 2**30:.2f} GiB in {SHM_DIR} "
                           f"({exc.strerror}): enlarge it (docker --shm-size) or use weight_transport=broadcast") from None
    os.close(fd)
    return path

