"""Block-wise FP8 quantization (miles_core/weight_sync/quantization.py) against hand-written references and
the layout SGLang's fp8 loader registers.

SGLang facts these tests pin (sgl-project/sglang, python/sglang/srt/layers/quantization/):
- fp8.py, Fp8LinearMethod.create_fp8_weight_: an fp8-serialized checkpoint's `weight` is
  torch.float8_e4m3fn [out, in]; with weight_block_size [block_n, block_k] it registers
  `weight_scale_inv` as float32 [(out + block_n - 1) // block_n, (in + block_k - 1) // block_k].
- fp8_utils.py, block_quant_dequant: dequantized = q.float() * scale repeated over the block,
  so weight_scale_inv multiplies (amax / 448), it does not divide.
- fp8.py, Fp8Config.get_quant_method: only LinearBase (and FusedMoE) layers get Fp8 methods;
  embeddings and lm_head are other classes and stay unquantized.
"""

import math

import pytest
import torch

from miles_core.weight_sync.quantization import (
    FP8_MAX,
    dequantize_block_fp8,
    dequantize_channel_fp8,
    emulated_fp8_linear,
    fp8_quantization_config,
    is_quantized_weight,
    quantize_block_fp8,
    quantize_channel_fp8,
    quantize_named_tensors,
    quantize_token_groups_fp8,
)


def _reference_scales(w: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Loop-by-block amax / 448: the obvious (slow) definition the vectorised code must match."""
    rows, cols = math.ceil(w.shape[0] / block), math.ceil(w.shape[1] / block)
    out = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            out[i, j] = w[i * block:(i + 1) * block, j * block:(j + 1) * block].abs().max() / 448.0
    return out


def test_constructed_matrix_gets_exact_block_scales():
    # 256x256 = four blocks, each filled with one magnitude so the scale is known by hand.
    w = torch.zeros(256, 256)
    w[:128, :128] = 448.0   # scale 1: exactly representable, q = 448
    w[:128, 128:] = -2.0    # scale 2/448
    w[128:, :128] = 0.0     # an all-zero block: q is all zero whatever its (floored) scale
    w[128:, 128:] = 0.5
    w[200, 200] = 7.0       # the amax of the last block: 7/448 = 1/64
    q, scale_inv = quantize_block_fp8(w)
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (2, 2)
    assert scale_inv[0, 0].item() == 1.0
    assert scale_inv[0, 1].item() == pytest.approx(2.0 / 448.0, rel=1e-7)
    assert scale_inv[1, 1].item() == 1.0 / 64.0
    assert torch.all(q[128:, :128].float() == 0)
    assert q[0, 0].float().item() == 448.0 and q[200, 200].float().item() == 448.0
    assert q[0, 200].float().item() == -448.0
    # 0.5 / (1/64) = 32: exact in e4m3, so the round trip is exact there.
    assert torch.equal(dequantize_block_fp8(q, scale_inv), w)


def test_random_round_trip_within_e4m3_rounding():
    torch.manual_seed(0)
    w = torch.randn(256, 384) * torch.logspace(-3, 1, 384)  # columns of very different magnitudes
    q, scale_inv = quantize_block_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert torch.allclose(scale_inv, _reference_scales(w), rtol=1e-6, atol=0)
    back = dequantize_block_fp8(q, scale_inv)
    # e4m3 has 3 mantissa bits: a normal value rounds within 2^-4 of itself; below the smallest
    # normal (2^-6) the spacing is 2^-9, so the absolute error is at most 2^-10 times the scale.
    per_element_scale = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)
    bound = w.abs() / 16 + per_element_scale * 2.0 ** -10
    assert torch.all((back - w).abs() <= bound * (1 + 1e-6))
    assert (back - w).abs().max() > 0  # it did quantize


@pytest.mark.parametrize("shape", [(1, 1), (130, 7), (129, 257), (384, 128)])
def test_non_multiple_of_128_shapes(shape):
    torch.manual_seed(1)
    w = torch.randn(*shape, dtype=torch.bfloat16)
    q, scale_inv = quantize_block_fp8(w)
    assert q.shape == shape and q.is_contiguous()
    assert scale_inv.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    assert torch.allclose(scale_inv, _reference_scales(w.float()), rtol=1e-6, atol=0)
    # every block's largest element reaches +-448 (the padding did not count towards amax)
    assert q.float().abs().max().item() == FP8_MAX


def test_dequantize_refuses_a_scale_of_the_wrong_shape():
    q, scale_inv = quantize_block_fp8(torch.randn(130, 7))
    with pytest.raises(ValueError, match=r"expected \(2, 1\)"):
        dequantize_block_fp8(q, scale_inv[:1])


def test_per_channel_round_trip():
    w = torch.tensor([[1.0, -4.0, 2.0], [0.0, 0.0, 0.0], [0.25, 0.5, -0.125]])
    q, scale_inv = quantize_channel_fp8(w)
    assert scale_inv.shape == (3, 1)
    assert scale_inv[0, 0].item() == pytest.approx(4.0 / 448.0) and scale_inv[2, 0].item() == pytest.approx(0.5 / 448)
    assert torch.allclose(dequantize_channel_fp8(q, scale_inv), w, rtol=1 / 16, atol=0)


def test_which_names_are_quantized():
    assert is_quantized_weight("model.layers.0.self_attn.q_proj.weight")
    assert is_quantized_weight("model.layers.11.mlp.down_proj.weight")
    assert is_quantized_weight("model.layers.3.mlp.experts.7.gate_proj.weight")
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_norm.weight",
                 "model.layers.0.self_attn.q_proj.bias", "model.layers.0.mlp.gate.weight"):
        assert not is_quantized_weight(name), name


def test_payload_names_dtypes_and_shapes_match_sglang_block_fp8_params():
    state = {
        "model.embed_tokens.weight": torch.randn(100, 64, dtype=torch.float32),
        "model.layers.0.input_layernorm.weight": torch.ones(64),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(64),
        "model.layers.0.mlp.up_proj.weight": torch.randn(200, 64),
        "lm_head.weight": torch.randn(100, 64),
    }
    out = list(quantize_named_tensors(state.items()))
    names = [n for n, _ in out]
    # each scale right after its weight, so a bucket never separates the two
    assert names == ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                     "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight_scale_inv",
                     "model.layers.0.self_attn.q_proj.bias", "model.layers.0.mlp.up_proj.weight",
                     "model.layers.0.mlp.up_proj.weight_scale_inv", "lm_head.weight"]
    got = dict(out)
    assert got["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert got["model.layers.0.mlp.up_proj.weight"].shape == (200, 64)
    assert got["model.layers.0.mlp.up_proj.weight_scale_inv"].dtype == torch.float32
    assert got["model.layers.0.mlp.up_proj.weight_scale_inv"].shape == (2, 1)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.input_layernorm.weight",
                 "model.layers.0.self_attn.q_proj.bias"):
        assert got[name].dtype == torch.bfloat16, name


def test_quantization_config_is_what_fp8config_reads():
    cfg = fp8_quantization_config()
    assert cfg["quant_method"] == "fp8" and cfg["weight_block_size"] == [128, 128]
    assert cfg["activation_scheme"] == "dynamic"  # Fp8Config refuses block quant otherwise


def test_emulated_fp8_linear_tracks_the_bf16_reference():
    torch.manual_seed(2)
    w, x = torch.randn(192, 160) * 0.05, torch.randn(4, 160)
    q, scale_inv = quantize_block_fp8(w)
    y = emulated_fp8_linear(x, q, scale_inv)
    reference = x @ w.T
    assert torch.equal(y, x @ dequantize_block_fp8(q, scale_inv).T)
    assert (y - reference).norm() / reference.norm() < 0.05


def test_fp8_engine_checkpoint_from_the_tiny_model(tiny_model_dir, tmp_path):
    import json

    from safetensors.torch import load_file

    from miles_core.weight_sync.fp8_checkpoint import write_fp8_checkpoint

    out = write_fp8_checkpoint(tiny_model_dir, tmp_path / "fp8")
    config = json.loads((out / "config.json").read_text())
    # Fp8Config.from_config: quant_method containing "fp8" -> is_checkpoint_fp8_serialized; block size set
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    before = {}
    for shard in tiny_model_dir.glob("*.safetensors"):
        before.update(load_file(str(shard)))
    after = {}
    for shard in out.glob("*.safetensors"):
        after.update(load_file(str(shard)))
    q_name = "model.layers.0.self_attn.q_proj.weight"
    assert after[q_name].dtype == torch.float8_e4m3fn
    scale = after["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    assert torch.allclose(dequantize_block_fp8(after[q_name], scale), before[q_name].float(), rtol=1 / 16, atol=1e-3)
    assert after["model.embed_tokens.weight"].dtype == before["model.embed_tokens.weight"].dtype  # kept as is
    assert set(after) - set(before) == {n[:-len("weight")] + "weight_scale_inv" for n in before if is_quantized_weight(n)}
    assert (out / "tokenizer_config.json").exists() and not (tmp_path / "fp8.partial").exists()


def test_sglang_block_shape_rules():
    from miles_core.memory import KNOWN_HF_CONFIGS
    from miles_core.weight_sync.fp8_checkpoint import block_shape_problems

    qwen3_4b = KNOWN_HF_CONFIGS["Qwen/Qwen3-4B"]  # q 4096, k/v 1024, MLP 9728 = 76 * 128
    assert block_shape_problems(qwen3_4b, 1) == [] and block_shape_problems(qwen3_4b, 4) == []  # 2432 = 19 * 128
    # tp=8: MLP 1216 rows (and down_proj columns) per rank = 9.5 blocks; tp=16: k/v 64 rows per rank
    assert [p.split()[0] for p in block_shape_problems(qwen3_4b, 8)] == ["gate_proj", "up_proj", "down_proj"]
    assert any(p.startswith("k_proj rows per tp rank 64") for p in block_shape_problems(qwen3_4b, 16))
    tiny = {"hidden_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256}
    assert [p.split()[0] for p in block_shape_problems(tiny, 1)] == ["q_proj", "k_proj", "v_proj"]
    moe = {**KNOWN_HF_CONFIGS["Qwen/Qwen3-30B-A3B"]}  # experts 768 wide = 6 * 128
    assert block_shape_problems(moe, 2) == [] and block_shape_problems(moe, 4)  # 192 per rank


def test_fp8_rollout_engines_start_from_the_converted_copy(tmp_path):
    from miles_core.config import TinyModelConfig, build_config
    from miles_core.driver.run import _engine_model_dir
    from miles_core.tiny import build_tiny_model

    # 4 heads of 32 and 4 kv heads: q, k, v 128 rows each, MLP 256: whole 128-row blocks
    model_dir = build_tiny_model(TinyModelConfig(hidden_size=128, num_key_value_heads=4), tmp_path / "model")
    assert _engine_model_dir(build_config({}), str(model_dir), tmp_path) == str(model_dir)
    tiny_model_dir = model_dir
    cfg = build_config({"rollout": {"engine": {"kind": "sglang", "server_args": {"quantization": "fp8"}},
                                    "gpus_per_engine": 1, "weight_transport": "broadcast", "precision": "fp8"}},
                       ["algorithm.correction.kind=tis"])
    engine_dir = _engine_model_dir(cfg, str(tiny_model_dir), tmp_path)
    assert engine_dir == str(tmp_path / "engine_fp8_model")
    assert "quantization_config" in (tmp_path / "engine_fp8_model" / "config.json").read_text()
    with pytest.raises(ValueError, match="does not fit: q_proj rows per tp rank 96"):
        _engine_model_dir(cfg, str(build_tiny_model(TinyModelConfig(), tmp_path / "small")), tmp_path)


def test_activations_quantize_per_token_in_groups_of_128():
    """The activation side of a block-FP8 GEMM: each 1x128 slice of a row has its own scale, so
    one large activation leaves the rest of its row (and other rows) at full FP8 resolution."""
    x = torch.randn(3, 256)
    x[0, 5] = 1000.0
    q, scale_inv = quantize_token_groups_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (3, 2)
    expected = x.abs().view(3, 2, 128).amax(-1) / FP8_MAX
    torch.testing.assert_close(scale_inv, expected)
    back = q.float().view(3, 2, 128) * scale_inv[..., None]
    torch.testing.assert_close(back.view(3, 256)[:, 128:], x[:, 128:], rtol=0.07, atol=1e-3)
    torch.testing.assert_close(back.view(3, 256)[1:], x[1:], rtol=0.07, atol=1e-3)
    with pytest.raises(ValueError, match="multiple of 128"):
        quantize_token_groups_fp8(torch.randn(2, 100))
