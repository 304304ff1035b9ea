"""The shared weight buffer: another process maps what the trainer wrote, sees each later write,
keeps its mapping after the file is unlinked; bad handles and renamed weights fail clearly."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from miles_core.training.megatron.launch import run_spawned
from miles_core.weight_sync.shared import ALIGN_ELEMENTS, SharedWeights


def _weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(7, 5, generator=gen), "norm.weight": torch.randn(3, generator=gen),
            "mlp.weight": torch.randn(4, 6, generator=gen)}


def _read_in_another_process(rank: int, world_size: int, handle) -> dict[str, torch.Tensor]:
    return {name: view.clone() for name, view in SharedWeights.open(handle).views.items()}


def test_another_process_maps_the_weights_cast_to_the_engine_dtype():
    weights = _weights(0)
    shared = SharedWeights.create(weights, torch.bfloat16)
    try:
        assert all(e.offset % ALIGN_ELEMENTS == 0 for e in shared.handle.entries)
        shared.write(weights)
        seen = run_spawned(_read_in_another_process, 1, shared.handle)
        assert seen.keys() == weights.keys()
        for name, tensor in weights.items():
            assert seen[name].dtype == torch.bfloat16
            assert torch.equal(seen[name], tensor.to(torch.bfloat16)), name
    finally:
        shared.close()


def test_a_mapping_sees_later_writes_and_outlives_the_file():
    shared = SharedWeights.create(_weights(0), torch.float32)
    engine = SharedWeights.open(shared.handle)
    shared.close()  # what the transport does once every engine has mapped the buffer
    newer = _weights(1)
    shared.write(newer)
    assert all(torch.equal(engine.views[n], newer[n]) for n in newer)
    with pytest.raises(ValueError, match="no shared weight buffer"):
        SharedWeights.open(shared.handle)


def test_a_handle_outside_dev_shm_is_refused(tmp_path):
    shared = SharedWeights.create(_weights(0), torch.float32)
    try:
        elsewhere = tmp_path / "miles-weights-x"
        elsewhere.write_bytes(b"\0" * 4 * shared.handle.numel)
        with pytest.raises(ValueError, match="no shared weight buffer"):
            SharedWeights.open(replace(shared.handle, shm_path=str(elsewhere)))
    finally:
        shared.close()


def test_weights_renamed_after_the_layout_fail_clearly():
    shared = SharedWeights.create(_weights(0), torch.float32)
    try:
        renamed = _weights(0)
        renamed["mlp.proj"] = renamed.pop("mlp.weight")
        with pytest.raises(ValueError, match="changed names"):
            shared.write(renamed)
    finally:
        shared.close()


def test_a_trainer_shares_its_current_weights_after_each_step(tiny_model_dir):
    from miles_core.config import AlgorithmConfig, TrainingConfig
    from miles_core.training.fsdp import FSDPTrainer
    from tests.support import random_samples

    trainer = FSDPTrainer(str(tiny_model_dir), TrainingConfig(num_threads=1, lr=1e-2), AlgorithmConfig(), group_size=2)
    try:
        engine = SharedWeights.open(trainer.share_weights("float32"))
        trainer.unlink_shared_weights()
        for seed in (1, 2):
            trainer.train_step(random_samples(4, seed=seed))
            trainer.write_shared_weights()
            expected = trainer.hf_state_dict(to_cpu=True)
            assert engine.views.keys() == expected.keys()
            assert all(torch.equal(engine.views[n], expected[n]) for n in expected)
    finally:
        trainer.close()


def test_a_full_dev_shm_fails_before_anything_is_written(monkeypatch, tmp_path):
    import errno
    import os

    from miles_core.weight_sync import shared as shared_weights

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    # A folder of its own for /dev/shm: a run beside this one may be making buffers there.
    monkeypatch.setattr(shared_weights, "SHM_DIR", tmp_path)
    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(RuntimeError, match=rf"needs 0.00 GiB in {tmp_path} .*--shm-size"):
        SharedWeights.create(_weights(0), torch.float32)
    assert not list(tmp_path.iterdir())
