"""Fp8BlockLinear (miles_core/engines/embedded/fp8_linear.py): the emulated FP8-weight forward against the bf16/fp32
reference, layer by layer and for the whole tiny model's log-probs."""

import torch
from transformers import AutoModelForCausalLM

from miles_core.engines.embedded.fp8_linear import Fp8BlockLinear, swap_to_fp8_linears
from miles_core.weight_sync.quantization import dequantize_block_fp8, quantize_block_fp8


def test_layer_matches_the_dequantized_reference_and_tracks_the_original():
    torch.manual_seed(0)
    linear = torch.nn.Linear(200, 130)
    fp8 = Fp8BlockLinear.from_linear(linear)
    assert fp8.weight.dtype == torch.float8_e4m3fn and fp8.weight_scale_inv.shape == (2, 2)
    x = torch.randn(3, 200)
    reference = x @ dequantize_block_fp8(fp8.weight, fp8.weight_scale_inv).T + linear.bias
    assert torch.allclose(fp8(x), reference, atol=1e-6)
    assert ((fp8(x) - linear(x)).norm() / linear(x).norm()).item() < 0.05
    assert not list(fp8.parameters())  # nothing an optimizer could step


def test_load_quantized_replaces_the_weight_in_place():
    linear = torch.nn.Linear(16, 8, bias=False)
    fp8 = Fp8BlockLinear.from_linear(linear)
    q, scale_inv = quantize_block_fp8(torch.full((8, 16), 2.0))
    fp8.load_quantized(q, scale_inv)
    assert torch.allclose(fp8(torch.ones(1, 16)), torch.full((1, 8), 32.0))


def test_tiny_model_with_fp8_linears_stays_close_in_log_probs(tiny_model_dir):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        before = torch.log_softmax(model(ids).logits, -1)
        swapped = swap_to_fp8_linears(model)
        after = torch.log_softmax(model(ids).logits, -1)
    assert len(swapped) == 7 * model.config.num_hidden_layers
    assert not any(name.startswith("lm_head") for name in swapped)
    gap = (after - before).abs()
    # FP8 weights are a different policy (the reason fp8 rollouts need a correction), but close.
    assert 0 < gap.mean().item() < 0.05, gap.mean().item()
