"""The per-GPU memory estimate against hand calculations (miles_core/memory.py docstring)."""

import pytest

from miles_core.config import load_config
from miles_core.memory import (
    GIB,
    KNOWN_HF_CONFIGS,
    Layout,
    ModelDims,
    describe_estimate,
    estimate,
    estimate_for_config,
    parameter_counts,
)
from tests.conftest import REPO

# 2 layers, h=64, 4 query heads and 2 kv heads of 16, MLP 128, vocabulary 100, tied embeddings.
DENSE = ModelDims(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                  vocab_size=100, tied_embeddings=True)
# 1 MoE layer, h=32, 2 query heads / 1 kv head of 16, 4 experts of width 8, top-2, untied, vocab 64.
MOE = ModelDims(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64,
                vocab_size=64, tied_embeddings=False, num_experts=4, experts_per_token=2, moe_intermediate_size=8)
TP2 = Layout(tp=2, vocab_multiple=128)


def test_dense_parameter_counts_by_hand():
    # per layer: q,k,v 64*(4+2*2)*16 = 8192, o 4*16*64 = 4096, norms 2*64 + q/k norms 2*16 = 160,
    # MLP 3*64*128 = 24576 -> 37024; x2 layers + embedding 100*64 + final norm 64 = 80512.
    # tp=2: (8192+4096+24576)/2 + 160 = 18592 per layer, vocabulary padded to 256 rows -> 256*64/2,
    # + final norm: 2*18592 + 8192 + 64 = 45440.
    assert parameter_counts(DENSE, TP2) == (80512, 45440)
    assert parameter_counts(DENSE, Layout()) == (80512, 80512)  # HF layout: no padding, no sharding


def test_moe_parameter_counts_by_hand():
    # attention 32*4*16 + 2*16*32 = 3072, norms 64 + 32 = 96, router 32*4 = 128, experts 4*3*32*8 = 3072,
    # untied vocabulary 2*64*32 = 4096, final norm 32 -> 10496; ep=2 halves the experts: 8960.
    assert parameter_counts(MOE, Layout(ep=2)) == (10496, 8960)


def test_dense_bytes_by_hand():
    est = estimate(DENSE, TP2, micro_batch=2, seq_tokens=10, element_bytes=2)
    assert (est.weights_bytes, est.grads_bytes, est.optimizer_bytes) == (45440 * 4, 45440 * 4, 45440 * 8)
    # per token and layer: 4*64 + ((4+2*2)*16 + 4*16)/2 + 3*128/2 = 256 + 96 + 192 = 544;
    # logits and their gradient 2*256/2 = 256; 20 tokens at 2 B: (2*544 + 256) * 20 * 2
    assert est.activation_bytes == (2 * 544 + 256) * 20 * 2
    recomputed = estimate(DENSE, Layout(tp=2, recompute=True, vocab_multiple=128), 2, 10, 2)
    assert recomputed.activation_bytes == (2 * 64 + 544 + 256) * 20 * 2  # layer inputs + one layer
    assert est.total_bytes == 45440 * 16 + est.activation_bytes


def test_moe_activations_and_extra_models_by_hand():
    est = estimate(MOE, Layout(ep=2), micro_batch=1, seq_tokens=4, element_bytes=4, trainable_models=2,
                   frozen_models=1)
    # 4*32 + (4*16 + 2*16) + top-2 copies of (32 + 3*8) = 128 + 96 + 112 = 336; logits 2*64
    assert est.activation_bytes == 2 * (336 + 128) * 4 * 4
    assert est.weights_bytes == 2 * 8960 * 4 and est.optimizer_bytes == 2 * 8960 * 8
    assert est.frozen_bytes == 8960 * 4


def test_public_model_sizes():
    assert parameter_counts(ModelDims.from_hf_config(KNOWN_HF_CONFIGS["Qwen/Qwen3-4B"]), Layout())[0] == 4_022_468_096
    moe = ModelDims.from_hf_config(KNOWN_HF_CONFIGS["Qwen/Qwen3-30B-A3B"])
    assert parameter_counts(moe, Layout())[0] == 30_532_122_624


def test_quick_start_recipe_fits_one_80gb_gpu():
    cfg = load_config(REPO / "configs/qwen3-4b-grpo-dapo.yaml")
    est = estimate_for_config(cfg)
    # 4.02 B parameters * 16 B + recomputed activations of 1 x 9216 tokens
    assert est.params_per_gpu == 4_022_468_096
    assert 60 * GIB < est.total_bytes < 72 * GIB, est.total_bytes / GIB
    rows = dict(describe_estimate(cfg))
    assert rows["total per trainer GPU"].startswith(f"{est.total_bytes / GIB:.2f} GiB")


def test_unknown_shape_is_reported_not_guessed():
    from miles_core.config import build_config

    rows = describe_estimate(build_config({"model": {"source": "hf://someone/unknown-model@abc"}}))
    assert rows[0][0] == "estimate" and "unknown" in rows[0][1]


@pytest.mark.parametrize("layout", [Layout(), TP2])
def test_builtin_model_estimate_matches_its_shape(layout, tiny_model_dir):
    import json

    from miles_core.config import RunConfig
    from miles_core.memory import model_dims

    from_builtin = model_dims(RunConfig().model)
    from_dir = ModelDims.from_hf_config(json.loads((tiny_model_dir / "config.json").read_text()))
    assert parameter_counts(from_builtin, layout) == parameter_counts(from_dir, layout)


def test_engine_weight_bytes_fp8_by_hand():
    from miles_core.memory import engine_weight_bytes

    # DENSE per layer: q 64x64, k 32x64, v 32x64, o 64x64, gate/up 128x64, down 64x128 = 36864 FP8
    # elements in 7 single-block matrices (7 float32 scales); x2 layers: 73728 B + 14 * 4 B. The other
    # 80512 - 73728 = 6784 elements (embedding, norms) stay bf16: 13568 B.
    assert engine_weight_bytes(DENSE, "bf16") == 2 * 80512
    assert engine_weight_bytes(DENSE, "fp8") == 73728 + 56 + 13568


def test_plan_rows_show_each_sides_precision_and_the_fp8_saving():
    from miles_core.memory import engine_weight_bytes, model_dims, precision_rows

    cfg = load_config(REPO / "configs/qwen3-4b-grpo-dapo.yaml",
                      ["rollout.precision=fp8", "rollout.engine.server_args.quantization=fp8",
                       "algorithm.correction.kind=tis", "rollout.weight_transport=broadcast"])
    rows = dict(precision_rows(cfg))
    assert rows["precision"].startswith("rollout fp8; training bf16 autocast")
    dims = model_dims(cfg.model)
    saved = engine_weight_bytes(dims, "bf16") - engine_weight_bytes(dims, "fp8")
    assert 3 * GIB < saved < 4 * GIB  # ~3.6 B projection elements at 1 B instead of 2
    assert f"{saved / GIB:.2f} GiB less than bf16" in rows["engine weights"]
    bf16_rows = dict(precision_rows(load_config(REPO / "configs/qwen3-4b-grpo-dapo.yaml")))
    assert "less than" not in bf16_rows["engine weights"]


def test_lora_counts_adapters_trainable_and_the_base_frozen(tiny_model_dir):
    from miles_core.config import RunConfig, build_config
    from miles_core.config.lora import ALL_LINEAR, LoRAConfig
    from miles_core.memory import lora_parameter_count, model_dims, with_lora

    # per layer, r (in + out): q 4*(64+64) = 512, k and v 4*(64+32) = 384 each, o 512,
    # gate and up 4*(64+128) = 768 each, down 768 -> 4096; two layers -> 8192
    assert lora_parameter_count(DENSE, list(ALL_LINEAR), 4) == 8192
    assert lora_parameter_count(DENSE, ["q_proj", "v_proj"], 4) == 2 * (512 + 384)
    full = estimate(DENSE, Layout(), 1, 8)
    est = with_lora(full, 8192, fsdp=2)
    assert (est.weights_bytes, est.grads_bytes, est.optimizer_bytes) == (4096 * 4, 4096 * 4, 4096 * 8)
    assert est.frozen_bytes == full.weights_bytes  # the whole base, frozen
    # the count is what peft really adds to the built-in model
    import torch
    from transformers import AutoModelForCausalLM

    from miles_core.training.lora import inject, trainable_counts

    model = inject(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), LoRAConfig(rank=4))
    assert trainable_counts(model)[0] == lora_parameter_count(model_dims(RunConfig().model), list(ALL_LINEAR), 4)
    cfg = build_config({}, ["training.lora.rank=4"])
    assert estimate_for_config(cfg).optimizer_bytes < estimate_for_config(RunConfig()).optimizer_bytes / 10
    assert any("LoRA base" in what for what, _ in describe_estimate(cfg))
