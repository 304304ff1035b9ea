"""placement.time_sharing's trainer side: FSDPTrainer.offload frees the device storage of its
parameters, gradients and optimizer states, and onload brings them back bit for bit (on CPU the
device is the CPU: the storages are freed and restored all the same)."""

import torch

from miles_core.config import build_config
from miles_core.training.fsdp import FSDPTrainer
from miles_core.types import Sample


def _samples() -> list[Sample]:
    return [Sample(i, [2, 10, 11, 3], [12, 1], "x", rollout_logprobs=[-1.0, -1.0], reward=float(i % 2))
            for i in range(4)]


def test_offload_frees_every_state_and_onload_restores_it_bit_for_bit(tmp_path, tiny_model_dir):
    cfg = build_config({}, ["algorithm.name=ppo", "training.num_threads=1"])  # ppo: a critic and its optimizer too
    trainer = FSDPTrainer(str(tiny_model_dir), cfg.training, cfg.algorithm, group_size=2)
    twin = FSDPTrainer(str(tiny_model_dir), cfg.training, cfg.algorithm, group_size=2)
    trainer.train_step(_samples())
    twin.train_step(_samples())
    tensors = list(trainer._device_tensors())
    assert any(t.numel() for t in tensors if t.ndim == 1) and len(trainer.optimizer.state) > 0
    before = [t.clone() for t in tensors]

    metrics = trainer.offload()
    assert metrics["time/offload_seconds"] >= 0 and metrics["time_sharing/offloaded_gib"] > 0
    held = [tuple(t.shape) for t in tensors if t.untyped_storage().nbytes()]
    assert not held, f"every parameter, optimizer state and critic tensor leaves the device; held: {held[:3]}"
    trainer.save_state(tmp_path / "ckpt", {"step": 1})  # a checkpoint while offloaded onloads for itself
    assert trainer.host_offload.is_offloaded

    assert trainer.onload()["time/onload_seconds"] >= 0
    for was, now in zip(before, tensors):
        assert now.untyped_storage().nbytes() > 0 and torch.equal(was, now)
    # the next update after an offload/onload round trip equals one without it
    trainer.offload()
    trainer.onload()
    trainer.train_step(_samples())
    twin.train_step(_samples())
    assert trainer.weights_sha256() == twin.weights_sha256()
    trainer.close()
    twin.close()
