"""training.lora through the training driver on real Ray: the object-store sync carries only the
adapters (verified bit-exact against the trainer's merged weights), the engine's log-probs match
the trainer's, and a resumed run continues exactly."""

import json

from safetensors.torch import load_file

from miles_core.driver.session import run_training
from tests.integration.test_train_resume import spec_for

LORA = ("training.lora.rank=4", "training.lora.alpha=8", "training.lr=5e-3")


def test_lora_run_syncs_adapters_only_and_resumes_exactly(ray_local, tmp_path, warm_tiny):
    model = warm_tiny["warm"]
    straight = run_training(spec_for(tmp_path, model, tmp_path / "straight", 4, *LORA))
    # rollout.verify_weight_sync=true (spec_for): every sync compared the engines' merged weights
    # with the trainer's by sha256, so a sync that moved only adapters still left them identical
    initial = load_file(f"{model}/model.safetensors")
    full_bytes = sum(t.numel() * t.element_size() for t in initial.values())  # what a full sync carries
    adapter_bytes = {h["weights/sync_bytes"] for h in straight.history}
    assert len(adapter_bytes) == 1 and adapter_bytes.pop() * 4 < full_bytes
    assert all(h["rollout/train_logprob_abs_diff"] <= 1e-4 for h in straight.history)
    assert len({h["rollout/reward_mean"] for h in straight.history}) > 1

    first = run_training(spec_for(tmp_path, model, tmp_path / "resumed", 2, *LORA))
    assert first.steps == 2
    resumed = run_training(spec_for(tmp_path, model, tmp_path / "resumed", 4, *LORA))
    assert resumed.resumed_from_step == 2 and [h["step"] for h in resumed.history] == [3, 4]
    assert [h["rollout/reward_mean"] for h in resumed.history] == [h["rollout/reward_mean"]
                                                                  for h in straight.history[2:]]
    a = load_file(f"{straight.final_checkpoint_dir}/model.safetensors")
    b = load_file(f"{resumed.final_checkpoint_dir}/model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    # the frozen base is saved as loaded; only adapters moved
    base = {k.replace(".base_layer.", "."): v for k, v in a.items() if "lora_" not in k}
    assert base.keys() <= initial.keys() and all((v == initial[k]).all() for k, v in base.items())
    assert any("lora_B" in k and a[k].abs().sum() > 0 for k in a)
    state = json.loads(open(f"{resumed.final_checkpoint_dir}/trainer_state.json").read())
    assert state["step"] == 4
