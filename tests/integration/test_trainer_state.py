"""FSDPTrainer checkpoints round-trip every module it owns (policy and critic)."""

import torch

from miles_core.config import build_config
from miles_core.training.fsdp import FSDPTrainer
from miles_core.types import Sample


def test_ppo_critic_state_round_trips(tmp_path, tiny_model_dir):
    cfg = build_config({}, ["algorithm.name=ppo", "training.num_threads=1"])
    trainer = FSDPTrainer(str(tiny_model_dir), cfg.training, cfg.algorithm, group_size=2)
    samples = [Sample(i, [2, 10, 11, 3], [12, 1], "x", rollout_logprobs=[-1.0, -1.0], reward=float(i % 2))
               for i in range(4)]
    trainer.train_step(samples)
    trainer.save_state(tmp_path / "ckpt", {"step": 1})
    restored = FSDPTrainer(str(tiny_model_dir), cfg.training, cfg.algorithm, group_size=2)
    assert restored.load_state(tmp_path / "ckpt") == {"step": 1}
    for a, b in zip(trainer.critic.state_dict().values(), restored.critic.state_dict().values()):
        assert torch.equal(a.full_tensor() if hasattr(a, "full_tensor") else a,
                           b.full_tensor() if hasattr(b, "full_tensor") else b)
    assert restored.weights_sha256() == trainer.weights_sha256()
    # optimizers and schedulers came back too: one more identical step stays identical
    trainer.train_step(samples)
    restored.train_step(samples)
    assert restored.weights_sha256() == trainer.weights_sha256()
    trainer.close()
    restored.close()
