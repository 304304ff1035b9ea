"""training.lora through `miles run`: the export is the merged model plus the adapters alone (PEFT's
layout), the after-eval scores the merged weights, and the registry says what it holds."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from miles_core.storage.checkpoint import step_dir_name
from miles_core.tracking.registry import WEIGHTS_TAG
from miles_core.types import LORA_ADAPTER_DIR

pytestmark = pytest.mark.e2e
STEPS = 4


def base_dir(adapter_dir: Path) -> Path:
    return Path(json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"])


def merged_by_peft(adapter_dir: Path) -> dict[str, torch.Tensor]:
    """The adapter folder applied to its base by peft itself and merged: what a user loading the
    registered adapter gets."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir(adapter_dir), torch_dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload().state_dict()


def test_lora_run_exports_merged_weights_with_its_adapter_and_registers_which(isolated):
    summary = isolated.miles_run(isolated.dir / "run", ["training.lora.rank=8", "training.lr=2e-3",
                                                        f"training.num_steps={STEPS}", "checkpoint.interval_steps=2"])
    assert summary["status"] == "completed" and summary["steps"] == STEPS

    adapter = Path(summary["hf_export_dir"]) / LORA_ADAPTER_DIR
    exported = load_file(adapter.parent / "model.safetensors")  # merged: plain HF names, no lora_ tensors
    by_peft, base = merged_by_peft(adapter), load_file(base_dir(adapter) / "model.safetensors")
    assert exported.keys() <= by_peft.keys() and not any("lora_" in name for name in exported)
    assert all(torch.allclose(exported[n], by_peft[n], atol=1e-6) for n in exported)
    assert any(not torch.equal(exported[n], base[n]) for n in exported if n in base)  # the adapters trained

    from mlflow.tracking import MlflowClient

    client = MlflowClient(summary["mlflow"]["tracking_uri"])
    version = client.get_model_version(summary["mlflow"]["model_name"], summary["model_version"])
    assert version.tags[WEIGHTS_TAG] == "merged_lora"
    assert (version.tags["lora_adapter_dir"], version.tags["lora_rank"]) == (LORA_ADAPTER_DIR, "8")
    registered = [a.path for a in client.list_artifacts(summary["mlflow"]["run_id"],
                                                        f"hf_export/{step_dir_name(STEPS)}/{LORA_ADAPTER_DIR}")]
    assert {Path(p).name for p in registered} == {"adapter_config.json", "adapter_model.safetensors"}
