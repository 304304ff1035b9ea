"""torch_dist metadata is read without arbitrary unpickling: real DCP metadata loads, a pickle
that would run code is refused."""

import io
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from miles_core.training.megatron.safe_metadata import MetadataUnpickler, restricted_metadata_loading


class RunsCode:
    def __reduce__(self):
        return (os.system, ("touch /tmp/miles-pwned",))


def test_dcp_metadata_loads_and_code_does_not_run(tmp_path):
    dcp.save({"w": torch.zeros(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)}, checkpoint_id=str(tmp_path / "ok"))
    metadata = MetadataUnpickler(io.BytesIO((tmp_path / "ok" / ".metadata").read_bytes())).load()
    assert metadata.state_dict_metadata["w"].size == torch.Size([3, 4])
    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        MetadataUnpickler(io.BytesIO(pickle.dumps(RunsCode()))).load()


def test_a_checkpoint_whose_metadata_runs_code_is_refused(tmp_path):
    state = {"w": torch.zeros(3, 4)}
    dcp.save(state, checkpoint_id=str(tmp_path))
    (tmp_path / ".metadata").write_bytes(pickle.dumps(RunsCode()))
    with restricted_metadata_loading(), pytest.raises(CheckpointException, match="refers to posix.system"):
        dcp.load(state, checkpoint_id=str(tmp_path))
    assert not os.path.exists("/tmp/miles-pwned")
    dcp.save(state, checkpoint_id=str(tmp_path / "fine"))
    with restricted_metadata_loading():
        dcp.load(state, checkpoint_id=str(tmp_path / "fine"))
