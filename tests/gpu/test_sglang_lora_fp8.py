"""LoRA adapters and block-FP8 weights on a REAL SGLang server (0.5.17) on a lent GPU (not run in CI).

- LoRA (issue 41): a server started with the args `training.lora` fills in (lora_server_args)
  loads a PEFT adapter folder through /load_lora_adapter (SGLangClient), serves requests naming it
  in `lora_path` with the log-probs of the merged weights, serves the base without it, and
  refuses it once unloaded.
- FP8 (issue 45): a server started from write_fp8_checkpoint's copy with `quantization: fp8`
  serves the block-FP8 weights (log-probs near the dequantized model's), and an FP8 checkpoint of
  new weights loads through /update_weights_from_disk.

    SGLANG_PYTHON=/tmp/sgl-python python3 -m pytest tests/gpu/test_sglang_lora_fp8.py -s
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_sglang_real import (  # its module stubs Ray where it is absent
    MEAN_LOGPROB_BOUND,
    PROMPTS,
    SERVER_ARGS,
    SGLANG_PYTHON,
    build_model,
    hf_model,
    mean_abs_diff,
    output_ids,
    sample,
    say,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
              pytest.mark.skipif(not SGLANG_PYTHON, reason="set SGLANG_PYTHON to an interpreter that has SGLang")]

LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 8, 16.0
# FP8 activations (per-token 1x128 groups in SGLang's block GEMM) add their rounding to the weights':
# the CPU stand-in measured 0.005-0.010 for the weights alone.
FP8_LOGPROB_BOUND = 0.05


def write_adapter(model_dir: Path, out: Path, seed: int) -> dict[str, torch.Tensor]:
    """A random adapter on every decoder linear in PEFT's layout (what training.lora's disk sync
    writes: miles_core.training.lora.save_adapter); returns the payload with B scaled by alpha/r."""
    from safetensors.torch import load_file, save_file

    from miles_core.weight_sync.lora import LORA_A, LORA_B, PEFT_PREFIX

    base = load_file(str(next(model_dir.glob("*.safetensors"))))
    g = torch.Generator().manual_seed(seed)
    tensors, payload = {}, {}
    for name, weight in base.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in LORA_MODULES:
            a = torch.randn(RANK, weight.shape[1], generator=g) * 0.05
            b = torch.randn(weight.shape[0], RANK, generator=g) * 0.05
            tensors[PEFT_PREFIX + module + LORA_A], tensors[PEFT_PREFIX + module + LORA_B] = a, b
            payload[module + LORA_A], payload[module + LORA_B] = a, b * (ALPHA / RANK)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0,
              "target_modules": LORA_MODULES, "bias": "none", "base_model_name_or_path": str(model_dir)}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return payload


def merged_model(model_dir: Path, payload: dict[str, torch.Tensor]):
    from miles_core.weight_sync.lora import merge_adapters

    model = hf_model(model_dir)
    state = {k: v for k, v in model.state_dict().items()}
    model.load_state_dict(state | merge_adapters(state, payload))
    return model


def launch(model_dir: Path, server_args: dict):
    from miles_core.config.rollout import SGLangEngineConfig
    from miles_core.engines.sglang.client import SGLangClient
    from miles_core.rollout.engine_group import launch_engine

    api_key = secrets.token_urlsafe(16)
    started = time.perf_counter()
    launcher = launch_engine(SGLangEngineConfig(server_args=server_args, python=SGLANG_PYTHON), str(model_dir),
                             "127.0.0.1", "bfloat16", 4, 1.0, api_key)
    say(f"healthy in {time.perf_counter() - started:.1f} s ({sorted(set(server_args) - set(SERVER_ARGS))})")
    return launcher, SGLangClient(launcher.url, api_key=api_key, timeout_seconds=300)


def test_lora_adapter_loads_serves_merged_logprobs_and_unloads(tmp_path):
    from miles_core.engines.sglang.args import lora_server_args

    model_dir = build_model(tmp_path / "v0", seed=0)
    payload = write_adapter(model_dir, tmp_path / "lora-v1", seed=1)
    args = lora_server_args({**SERVER_ARGS, "enable_memory_saver": False}, RANK, LORA_MODULES)
    launcher, client = launch(model_dir, args)
    try:
        started = time.perf_counter()
        client.load_lora_adapter("policy-v1", str(tmp_path / "lora-v1"))
        say(f"adapter loaded in {time.perf_counter() - started:.2f} s")
        seeds = list(range(16))
        adapted = sample(client, seeds, lora_path=["policy-v1"] * len(seeds))
        plain = sample(client, seeds)
        merged, base = merged_model(model_dir, payload), hf_model(model_dir)
        gaps = {"adapted_vs_merged": mean_abs_diff(merged, PROMPTS, adapted),
                "adapted_vs_base": mean_abs_diff(base, PROMPTS, adapted),
                "plain_vs_base": mean_abs_diff(base, PROMPTS, plain)}
        say(f"log-prob gaps {gaps}; outputs differ on {sum(a != b for a, b in zip(output_ids(adapted), output_ids(plain)))}/16")
        assert gaps["adapted_vs_merged"] < MEAN_LOGPROB_BOUND and gaps["plain_vs_base"] < MEAN_LOGPROB_BOUND
        assert gaps["adapted_vs_base"] > 3 * gaps["adapted_vs_merged"]
        client.unload_lora_adapter("policy-v1")
        with pytest.raises(Exception) as refused:
            sample(client, seeds[:2], lora_path=["policy-v1"] * 2)
        say(f"after unload: {str(refused.value)[:200]}")
    finally:
        launcher.stop()


def test_fp8_checkpoint_serves_block_fp8_and_updates_from_disk(tmp_path):
    from miles_core.weight_sync.fp8_checkpoint import write_fp8_checkpoint
    from miles_core.weight_sync.quantization import dequantize_block_fp8

    models = {v: build_model(tmp_path / v, seed=i) for i, v in enumerate(("v0", "v1"))}
    fp8 = {v: write_fp8_checkpoint(d, tmp_path / f"{v}-fp8") for v, d in models.items()}
    launcher, client = launch(fp8["v0"], {**SERVER_ARGS, "enable_memory_saver": False, "quantization": "fp8"})

    def dequantized(v: str):
        from safetensors.torch import load_file

        model = hf_model(models[v])
        q = load_file(str(next(fp8[v].glob("*.safetensors"))))
        state = model.state_dict()
        for name in [n for n in q if n.endswith(".weight_scale_inv")]:
            weight = name.removesuffix("_scale_inv")
            state[weight] = dequantize_block_fp8(q[weight], q[name]).to(state[weight].dtype)
        model.load_state_dict(state)
        return model

    try:
        seeds = list(range(16))
        served = sample(client, seeds)
        gaps = {"v0_vs_dequantized": mean_abs_diff(dequantized("v0"), PROMPTS, served),
                "v0_vs_bf16_source": mean_abs_diff(hf_model(models["v0"]), PROMPTS, served)}
        started = time.perf_counter()
        client.update_weights_from_disk(str(fp8["v1"]), weight_version="1")
        say(f"fp8 disk update in {time.perf_counter() - started:.2f} s")
        updated = sample(client, seeds)
        gaps["v1_vs_dequantized"] = mean_abs_diff(dequantized("v1"), PROMPTS, updated)
        gaps["v1_vs_old"] = mean_abs_diff(dequantized("v0"), PROMPTS, updated)
        say(f"fp8 log-prob gaps {gaps}")
        assert gaps["v0_vs_dequantized"] < FP8_LOGPROB_BOUND and gaps["v1_vs_dequantized"] < FP8_LOGPROB_BOUND
        assert gaps["v1_vs_old"] > 3 * gaps["v1_vs_dequantized"]
    finally:
        launcher.stop()
