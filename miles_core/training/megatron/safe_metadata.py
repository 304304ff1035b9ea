"""torch_dist metadata without arbitrary unpickling, and checkpoints that hold only tensors.

torch.distributed.checkpoint's FileSystemReader reads a checkpoint's `.metadata` with plain
`pickle.load`, so whoever can write the object store could run code on resume. Inside
`restricted_metadata_loading()` that load goes through an unpickler that builds only what DCP
metadata holds (its dataclasses, torch.Size, dtypes, layouts, paths) and refuses anything else.

Harmless classes are not enough: metadata may declare any item (even one the model expects as a
tensor) as a bytes item, and DCP's load planner hands those bytes to
`torch.load(weights_only=False)`. Our checkpoints hold tensors only (tensor reads use
`weights_only=True`), so metadata with any other storage type is refused as it is read, before
a load is planned.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from miles_core.storage.checkpoint import UnsafeCheckpointError

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
        raise UnsafeCheckpointError(f"torch_dist metadata refers to {module}.{name}, which checkpoint metadata "
                                    "never holds: refusing to load it (is the store trusted?)")


def check_tensors_only(metadata: Any, where: str = "torch_dist metadata") -> Any:
    """metadata itself when it is DCP Metadata whose every item is stored as a tensor, else
    UnsafeCheckpointError naming the first item that is not."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    if type(metadata) is not Metadata:
        raise UnsafeCheckpointError(f"{where} is a {type(metadata).__name__}, not DCP Metadata: refusing to load "
                                    "it; restore the checkpoint from a trusted copy")
    for fqn, item in metadata.state_dict_metadata.items():
        if type(item) is not TensorStorageMetadata:
            raise UnsafeCheckpointError(
                f"{where} declares item {fqn!r} as {type(item).__name__}; checkpoints written here hold only "
                "tensors, and DCP would unpickle those bytes (which can run code): refusing to load it. "
                "Restore the checkpoint from a trusted copy or write it again")
    return metadata


def read_metadata(directory: str | Path) -> Any:
    """A torch_dist directory's metadata, read restricted and checked to hold only tensors."""
    path = Path(directory) / ".metadata"
    with path.open("rb") as fh:
        return check_tensors_only(MetadataUnpickler(fh).load(), where=str(path))


class _RestrictedPickle:
    """Stands in for the `pickle` module inside torch's filesystem reader: load is restricted,
    everything else is pickle's."""

    @staticmethod
    def load(file: Any) -> Any:
        return check_tensors_only(MetadataUnpickler(file).load())

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
