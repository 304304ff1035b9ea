"""training.fp8 on the CPU: which linears would be converted, and that the trainer refuses (with
the fix) instead of training in a precision the CPU cannot compute. The conversion itself runs on
a GPU with torchao (not part of the CPU suite)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles_core.config.training import FSDPConfig
from miles_core.training.float8 import convert_float8_linears, float8_filter
from miles_core.training.fsdp import _shard


def test_only_decoder_layer_projections_with_16_multiple_dims_are_converted():
    layer = torch.nn.Linear(64, 32)
    assert float8_filter(layer, "model.layers.0.self_attn.q_proj")
    assert float8_filter(layer, "model.layers.11.mlp.down_proj")
    assert not float8_filter(layer, "lm_head")
    assert not float8_filter(layer, "score")  # a critic's value head
    assert not float8_filter(torch.nn.Linear(64, 8), "model.layers.0.self_attn.k_proj")  # 8 % 16 != 0
    assert not float8_filter(torch.nn.LayerNorm(64), "model.layers.0.input_layernorm")


def test_the_tiny_model_has_convertible_projections(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    names = [n for n, m in model.named_modules() if float8_filter(m, n)]
    layers = model.config.num_hidden_layers
    assert len(names) == 7 * layers and not any(n.startswith("lm_head") for n in names)


def test_cpu_refuses_fp8_training_with_the_fix(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(NotImplementedError, match="set training.fp8=false"):
        convert_float8_linears(model, torch.device("cpu"))
    with pytest.raises(NotImplementedError, match="training.fp8"):  # the trainer's path, before any sharding
        _shard(model, FSDPConfig(), fp8=True)
