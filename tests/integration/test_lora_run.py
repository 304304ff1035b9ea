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


def test_lora_run_on_sglang_engines_loads_adapters_by_name(ray_local, tmp_path, warm_tiny):
    """rollout.engine=sglang (the embedded server standing in for sglang.launch_server): each sync
    writes the adapter in PEFT layout, every engine loads it as policy-v<version> and the requests
    name it (lora_path); the engine's log-probs match the trainer's only if they did, since the
    engine's base weights never change."""
    from miles_core.config import build_config
    from miles_core.driver.session import TrainSpec

    cfg = build_config({}, [
        "rollout.engine={kind: sglang, server_module: miles_core.engines.embedded.http_server, "
        "server_args: {skip_server_warmup: true}}",
        "rollout.gpus_per_engine=0", "rollout.cpus_per_engine=0.5", "training.cpus_per_trainer=1",
        "training.num_threads=1", "training.num_steps=3", "checkpoint.interval_steps=3",
        "rollout.num_prompts_per_step=8", "rollout.num_samples_per_prompt=4", "rollout.request_timeout_seconds=60",
        *LORA])
    assert cfg.rollout.weight_transport.kind == "disk" and cfg.rollout.engine.server_args["enable_lora"]
    model = warm_tiny["warm"]
    result = run_training(TrainSpec(config=cfg, model_dir=str(model), train_path=str(warm_tiny["train"]),
                                    run_dir=str(tmp_path / "run")))
    initial = load_file(f"{model}/model.safetensors")
    full_bytes = sum(t.numel() * t.element_size() for t in initial.values())
    sync_bytes = [h["weights/sync_bytes"] for h in result.history]
    assert all(0 < b * 4 < full_bytes for b in sync_bytes), (sync_bytes, full_bytes)
    print(f"adapter sync {sync_bytes[0]:.0f} B vs full weights {full_bytes} B")
    assert [h["rollout/weight_version"] for h in result.history] == [0.0, 1.0, 2.0]
    assert all(h["rollout/train_logprob_abs_diff"] <= 1e-4 for h in result.history)
    # the adapters moved: a rollout on the base weights would not have matched the trainer
    final = load_file(f"{result.final_checkpoint_dir}/model.safetensors")
    assert any("lora_B" in k and final[k].abs().sum() > 0 for k in final)
    # the newest two versions' folders stay (SGLang reloads an unloaded adapter from its folder)
    kept = sorted(p.name for p in (tmp_path / "run" / "weight_sync").glob("lora-v*"))
    assert kept == ["lora-v000002", "lora-v000003"]
