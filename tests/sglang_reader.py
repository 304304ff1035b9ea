"""Reading a cuda_ipc payload as SGLang does (python/sglang/srt/utils/common.py SafeUnpickler,
patch_torch.py, weight_sync/tensor_bucket.py), for the tests and bench/cuda_ipc_sync.py.

What SGLang admits when it unpickles a payload: 0.5.16 allows module prefixes (builtins.,
collections., copyreg., types., torch., multiprocessing.reduction., multiprocessing.resource_sharer.,
...); 0.5.23 allows exact (module, name) pairs. The pairs below are the ones of 0.5.23's list a
payload may need; a payload that needs any other global would be refused by 0.5.23.
"""

from __future__ import annotations

import base64
import io
import pickle

import torch

SGLANG_0_5_16_PREFIXES = ("builtins.", "collections.", "copyreg.", "functools.", "types.", "torch.",
                          "multiprocessing.reduction.", "multiprocessing.resource_sharer.")
SGLANG_0_5_23_GLOBALS = {
    ("builtins", "dict"), ("builtins", "list"), ("builtins", "tuple"), ("collections", "OrderedDict"),
    ("copyreg", "__newobj__"), ("types", "SimpleNamespace"),
    ("multiprocessing.resource_sharer", "DupFd"),
    ("torch", "Size"), ("torch", "Tensor"), ("torch", "device"), ("torch", "dtype"),
    ("torch", "bfloat16"), ("torch", "float16"), ("torch", "float32"), ("torch", "uint8"),
    ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"), ("torch", "UntypedStorage"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
}


class SGLangUnpickler(pickle.Unpickler):
    """Admits only what both SGLang versions admit; records what the payload asked for."""

    def __init__(self, data: bytes):
        super().__init__(io.BytesIO(data))
        self.globals: set[tuple[str, str]] = set()

    def find_class(self, module: str, name: str):
        self.globals.add((module, name))
        if (module, name) not in SGLANG_0_5_23_GLOBALS or not (module + ".").startswith(SGLANG_0_5_16_PREFIXES):
            raise pickle.UnpicklingError(f"SGLang refuses the global {module}.{name}")
        return super().find_class(module, name)


def read_as_sglang(payload: str) -> list[tuple[str, torch.Tensor]]:
    """What SGLang's flattened-bucket loader does with one rank's payload."""
    bucket = SGLangUnpickler(base64.b64decode(payload, validate=True)).load()
    flat = bucket["flattened_tensor"]
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    return [(m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)) for m in bucket["metadata"]]


def map_device_uuids() -> None:
    """SGLang's receiver patch (sglang/srt/utils/patch_torch.py): a CUDA tensor's device may come
    as a GPU UUID, which names the same GPU under any CUDA_VISIBLE_DEVICES."""
    from torch.multiprocessing import reductions

    original = reductions.rebuild_cuda_tensor

    def rebuild(*args):
        device = args[6]
        if isinstance(device, str):
            device = next(i for i in range(torch.cuda.device_count())
                          if str(torch.cuda.get_device_properties(i).uuid) == device)
        return original(*args[:6], device, *args[7:])

    reductions.rebuild_cuda_tensor = rebuild
