"""Weights to a colocated SGLang engine over CUDA IPC (the `cuda_ipc` weight transport).

SGLang's `/update_weights_from_tensor` with `load_format="flattened_bucket"` takes, per engine
TP rank, one base64 string: a `MultiprocessingSerializer` (torch ForkingPickler) dump of
``{"flattened_tensor": uint8 tensor, "metadata": [entries with name, shape, dtype, start_idx,
end_idx, numel]}``. A CUDA tensor pickles to an IPC handle, not its bytes: the engine maps the
trainer's bucket and copies out of it, so a sync moves each weight once, on the GPU.

What SGLang accepts (read from its source, 0.5.23): it unpickles with an allow-list
(`SafeUnpickler`) that admits torch's tensor rebuild functions, `types.SimpleNamespace` and its
own metadata class, and it maps a CUDA device given as a GPU UUID to its own index (the trainer and
the engine see the GPU under different `CUDA_VISIBLE_DEVICES`). So entries here are
`SimpleNamespace`s (no SGLang import on the trainer) and the device goes as its UUID.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import io
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace

import torch
from torch.multiprocessing import reductions  # importing it registers torch's reducers with ForkingPickler

from miles_core.engines.sglang.client import SGLangClient
from miles_core.weight_sync.layout import checkpoint_layout
from miles_core.weight_sync.shared import flat_layout
from miles_core.weight_sync.transports import bucket_names

_DEVICE_ARG = 6  # torch's reduce_tensor(cuda tensor) args: (type, size, stride, offset, storage type, dtype, device, ...)


@dataclass(frozen=True)
class BucketLayout:
    """Where each tensor of a bucket goes in its buffer, and SGLang's metadata for it."""

    numel: int
    """Elements of the buffer (each tensor aligned as shared.flat_layout aligns it)."""
    places: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]
    """(shape, contiguous strides, offset in elements) of each tensor, in the bucket's order."""
    metadata: tuple[SimpleNamespace, ...]
    """SGLang's entry (name, shape, dtype, byte range) of each tensor; cached, so every sync of this
    layout pickles the same objects: read them, never change them."""


@functools.lru_cache(maxsize=1024)
def bucket_layout(shapes: tuple[tuple[str, tuple[int, ...]], ...], dtype: torch.dtype) -> BucketLayout:
    """The layout of a bucket of these (name, shape)s in dtype. Cached: a trainer sends the same
    buckets every sync, and building ~300 entries costs more host time than the copy itself."""
    entries, numel = flat_layout(dict(shapes))
    size = dtype.itemsize
    places = tuple((e.shape, torch.empty(e.shape, device="meta").stride(), e.offset) for e in entries)
    metadata = tuple(SimpleNamespace(name=e.name, shape=torch.Size(e.shape), dtype=dtype, start_idx=e.offset * size,
                                     end_idx=(e.offset + e.numel) * size, numel=e.numel * size) for e in entries)
    return BucketLayout(numel, places, metadata)


def flatten_bucket(named: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> tuple[torch.Tensor, list]:
    """One buffer on the tensors' device holding each tensor cast to dtype (one fused multi-tensor
    copy into views made by as_strided, the cheapest view on the host), as SGLang's uint8 bucket,
    and SGLang's metadata entry (byte offsets) for each."""
    layout = bucket_layout(tuple((name, tuple(tensor.shape)) for name, tensor in named), dtype)
    flat = torch.empty(layout.numel, dtype=dtype, device=named[0][1].device)
    torch._foreach_copy_([flat.as_strided(shape, strides, offset) for shape, strides, offset in layout.places],
                         [tensor for _, tensor in named])
    return flat.view(torch.uint8), list(layout.metadata)


def serialize_bucket(flat: torch.Tensor, entries: list) -> str:
    """The base64 payload SGLang deserializes for one TP rank. One payload per engine: SGLang
    reads each payload once, as torch's producer-side CUDA IPC reference counting expects."""
    stream = io.BytesIO()
    pickler = ForkingPickler(stream)
    pickler.dispatch_table[torch.Tensor] = _reduce_with_device_uuid
    pickler.dump({"flattened_tensor": flat, "metadata": entries})
    return base64.b64encode(stream.getvalue()).decode("ascii")


def _reduce_with_device_uuid(tensor: torch.Tensor):
    rebuild, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda:
        uuid = str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid)
        args = (*args[:_DEVICE_ARG], uuid, *args[_DEVICE_ARG + 1:])
    return rebuild, args


def send_weights_over_cuda_ipc(state: dict[str, torch.Tensor], urls: list[str], version: str, bucket_bytes: int,
                               dtype: torch.dtype, api_key: str | None = None) -> int:
    """Sender side (runs in the trainer, on the engines' GPU): per bucket, one buffer of the
    weights cast to dtype (the engines' own) and one `/update_weights_from_tensor` per engine, all
    in one weight-update session per engine. The buffer stays alive until every engine has
    answered, so no engine reads freed memory. Returns the bytes handed over per engine."""
    state = checkpoint_layout(state)  # SGLang's loaders skip fused MoE expert names without an error
    clients = [SGLangClient(url, api_key=api_key) for url in urls]
    sent = 0
    with contextlib.ExitStack() as sessions:
        for client in clients:
            sessions.enter_context(client.weight_update_session())
        buckets = bucket_names(state, bucket_bytes, dtype)
        for index, names in enumerate(buckets):
            named = [(name, state[name]) for name in names]
            flat, entries = flatten_bucket(named, dtype)
            if flat.is_cuda:  # the engine reads the buffer from its own process and stream
                torch.cuda.current_stream().synchronize()
            last = index == len(buckets) - 1  # one cache flush, after the last bucket (as broadcast does)
            for client in clients:
                client.update_weights_from_ipc_handles([serialize_bucket(flat, entries)], version, flush_cache=last)
            sent += flat.numel()
    return sent
