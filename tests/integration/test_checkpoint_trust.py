"""A checkpoint from the object store cannot run code when loaded: torch_dist metadata that
declares a tensor as a bytes item (whose bytes DCP would `torch.load(weights_only=False)`) is
refused before anything is read. Needs the `megatron` extra."""

from __future__ import annotations

import io
import os
import pickle
import re

import pytest

pytest.importorskip("megatron.core")

from miles_core.config import TinyModelConfig
from miles_core.storage.checkpoint import UnsafeCheckpointError
from miles_core.tiny import build_tiny_model

TARGET = "decoder.final_layernorm.weight"


class _MakesMarker:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _declare_bytes_item(torch_dist_dir, fqn: str, payload: bytes) -> None:
    """Rewrite `.metadata` (with pickle, as an attacker would) so `fqn` is a bytes item whose
    bytes are `payload`; only classes the restricted unpickler admits are used."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    with open(torch_dist_dir / ".metadata", "rb") as fh:
        metadata = pickle.load(fh)
    assert fqn in metadata.state_dict_metadata
    declared = BytesStorageMetadata()
    declared.size = metadata.state_dict_metadata[fqn].size  # passes megatron's global-shape check
    metadata.state_dict_metadata[fqn] = declared
    metadata.storage_data = {k: v for k, v in metadata.storage_data.items() if k.fqn != fqn}
    (torch_dist_dir / "__payload.distcp").write_bytes(payload)
    metadata.storage_data[MetadataIndex(fqn)] = _StorageInfo("__payload.distcp", 0, len(payload))
    with open(torch_dist_dir / ".metadata", "wb") as fh:
        pickle.dump(metadata, fh)


def test_a_bytes_item_in_torch_dist_metadata_is_refused_without_running_it(tmp_path):
    import torch

    from miles_core.training.megatron.convert import (
        TORCH_DIST,
        convert_hf_to_torch_dist,
        export_torch_dist_to_hf,
        write_manifest,
    )

    hf = build_tiny_model(TinyModelConfig(), tmp_path / "hf")
    ckpt = tmp_path / "ckpt"
    convert_hf_to_torch_dist(hf, ckpt, tp=1)
    marker = tmp_path / "payload-ran"
    buffer = io.BytesIO()
    torch.save(_MakesMarker(str(marker)), buffer)
    _declare_bytes_item(ckpt / TORCH_DIST, TARGET, buffer.getvalue())
    (ckpt / "MANIFEST.json").unlink()
    write_manifest(ckpt, format="megatron_torch_dist")  # whoever writes the store rewrites this too

    try:
        with pytest.raises(UnsafeCheckpointError, match=rf"item '{re.escape(TARGET)}' as BytesStorageMetadata"):
            export_torch_dist_to_hf(ckpt, None, tmp_path / "export")
    finally:  # on code that unpickles the item, the payload has run by the time the load fails
        assert not marker.exists(), "the checkpoint's pickle payload ran"

