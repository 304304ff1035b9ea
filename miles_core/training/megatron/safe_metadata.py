"""torch_dist metadata without arbitrary unpickling.

torch.distributed.checkpoint's FileSystemReader reads a checkpoint's `.metadata` with plain
`pickle.load`, so whoever can write the object store could run code on resume. Inside
`restricted_metadata_loading()` that load goes through an unpickler that builds only what DCP
metadata holds (its dataclasses, torch.Size, dtypes, layouts, paths) and refuses anything else.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

# Modules whose own classes (dataclasses and enums) DCP metadata is made of; megatron's save
# also records its SavePlan (planner module).
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")
_ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"),
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("pathlib", "PosixPath"),
            ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module in _DCP_MODULES or module == "torch":
            found = super().find_class(module, name)  # a getattr on a module already imported
            if module == "torch":
                if isinstance(found, torch.dtype):
                    return found  # torch.float32 and the other dtypes
            elif isinstance(found, type) and found.__module__ == module:
                return found  # a class defined there, not one it imports
        raise pickle.UnpicklingError(f"torch_dist metadata refers to {module}.{name}, which checkpoint metadata "
                                     "never holds: refusing to load it (is the store trusted?)")


class _RestrictedPickle:
    """Stands in for the `pickle` module inside torch's filesystem reader: load is restricted,
    everything else is pickle's."""

    @staticmethod
    def load(file: Any) -> Any:
        return MetadataUnpickler(file).load()

    def __getattr__(self, name: str) -> Any:
        return getattr(pickle, name)


@contextmanager
def restricted_metadata_loading() -> Iterator[None]:
    from torch.distributed.checkpoint import filesystem

    original, filesystem.pickle = filesystem.pickle, _RestrictedPickle()
    try:
        yield
    finally:
        filesystem.pickle = original
