"""The one-GPU recipe's task on CPU, at the tiny model's size: the built-in column-addition
task through the flow's stages (generate, SFT warm-up on the worked solutions, GRPO steps with
DAPO's reward), as configs/gpu-single.yaml runs it on a GPU."""

import re

from miles_core.config import load_config
from miles_core.driver.session import TrainSpec, run_training
from miles_core.engines.embedded.engine import EmbeddedEngine
from miles_core.evaluation.core import HELDOUT, evaluate_all
from miles_core.storage import artifacts
from tests.conftest import REPO

# configs/gpu-single.yaml shrunk to the CPU: the tiny model, 3-digit problems (~47-token answers)
CPU_SIZE = ["model.dtype=float32", "training.fsdp.compute_dtype=float32", "training.gpus_per_trainer=0",
            "rollout.gpus_per_engine=0", "rollout.cpus_per_engine=1", "training.cpus_per_trainer=1",
            "data.builtin.digits=3", "data.builtin.num_train=2000", "data.builtin.num_eval=20",
            "rollout.max_new_tokens=64", "eval.max_new_tokens=64", "rollout.num_prompts_per_step=8",
            "rollout.num_samples_per_prompt=4", "training.micro_batch_size=32", "training.num_threads=1",
            "warmup.target_pass_at_1=null", "warmup.sft_steps=60", "warmup.lr=3e-3", "training.num_steps=2",
            "eval.interval_steps=0", "checkpoint.interval_steps=2"]


def test_column_addition_recipe_warms_up_on_worked_solutions_and_trains(ray_local_3cpus, tmp_path):
    cfg = load_config(REPO / "configs/gpu-single.yaml", [*CPU_SIZE, f"storage.work_dir={tmp_path}",
                                                          "model.tiny.hidden_size=96", "model.tiny.num_layers=4",
                                                          "model.tiny.num_attention_heads=4",
                                                          "model.tiny.num_key_value_heads=2",
                                                          "model.tiny.intermediate_size=256"])
    model, data = artifacts.prepare_model(cfg), artifacts.prepare_data(cfg)
    warm = artifacts.warm_up(cfg, model, data)
    assert warm.sft_steps == 60
    # the warm-up trained on the scratchpads, not the bare labels: the model now writes them
    engine = EmbeddedEngine(warm.model_dir, num_threads=1, device="cpu")
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "123+456="}],
                                                  add_generation_prompt=True, tokenize=True)
    prompt = list(prompt if isinstance(prompt, list) else prompt["input_ids"])
    out = engine.generate([prompt], [{"max_new_tokens": 64, "temperature": 0.0}])[0]
    assert re.match(r"1: \d\+\d\+\d=\d+\n2: ", out["text"]), out["text"]
    result = run_training(TrainSpec(config=cfg, model_dir=warm.model_dir, train_path=data.train_path,
                                    run_dir=str(tmp_path / "run")))
    assert result.steps == 2
    first = result.history[0]
    assert first["rollout/response_len_mean"] > 25  # worked answers, not a bare number
    assert -1.0 <= first["rollout/reward_mean"] <= 1.0  # DAPO's +1/-1
    assert 0.0 <= evaluate_all(cfg, result.hf_export_dir, data.eval_path)[HELDOUT].pass_at_1 <= 1.0
