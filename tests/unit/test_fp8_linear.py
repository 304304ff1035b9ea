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


def _scaled_weights(model_dir, factor: float) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {name: tensor * factor for name, tensor in model.state_dict().items()}


def _check_loaded(engine, sent: dict[str, torch.Tensor]) -> None:
    """Every FP8 layer holds exactly the block quantization of what was sent; the rest as sent."""
    modules = dict(engine.model.named_modules())
    for name, tensor in sent.items():
        owner = modules.get(name.removesuffix(".weight"))
        if isinstance(owner, Fp8BlockLinear):
            q, scale_inv = quantize_block_fp8(tensor)
            assert torch.equal(owner.weight.view(torch.uint8), q.view(torch.uint8)), name
            assert torch.equal(owner.weight_scale_inv, scale_inv), name
        elif name in engine.model.state_dict():
            assert torch.equal(engine.model.state_dict()[name], tensor), name


def test_an_fp8_engine_quantizes_every_weight_it_is_sent(tiny_model_dir):
    from miles_core.engines.embedded.engine import EmbeddedEngine

    engine = EmbeddedEngine(str(tiny_model_dir), num_threads=1, quantization="fp8")
    assert len(engine.fp8.modules) == 7 * engine.model.config.num_hidden_layers  # q k v o gate up down
    sent = _scaled_weights(tiny_model_dir, 1.5)
    assert engine.update_weights_from_tensors(sent, "1")["success"]
    _check_loaded(engine, sent)
    engine.release_memory(["weights"])  # the FP8 buffers are freed too, and refilled by the next update
    assert all(t.untyped_storage().nbytes() == 0 for t in engine.fp8.tensors())
    engine.resume_memory(["weights"])
    assert engine.update_weights_from_tensors(sent, "2")["success"]
    _check_loaded(engine, sent)


def test_the_http_engine_quantizes_loads_and_serves_fp8_logprobs(tiny_model_dir):
    """--quantization fp8 (SGLang's flag) reaches the engine; its loads quantize (a plain cast into
    float8 would drop the scales); its log-probs are the FP8 model's, near but not equal to fp32's."""
    from miles_core.engines.embedded.engine import EmbeddedEngine
    from miles_core.engines.embedded.http_server import serve

    sent = _scaled_weights(tiny_model_dir, 0.9)
    reference = EmbeddedEngine(str(tiny_model_dir), num_threads=1)
    assert reference.update_weights_from_tensors(sent, "1")["success"]
    with serve(tiny_model_dir, num_threads=1, server_args={"quantization": "fp8"}) as handle:
        assert handle.update_weights_from_tensors(sent, "1")["success"]
        engine = handle.service.engine
        _check_loaded(engine, sent)
        prompts = [[5, 6, 7, 8], [9, 10, 11]]
        params = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True}
        outs = engine.generate(prompts, params, seed=0)
    gaps = []
    with torch.no_grad():
        for prompt, out in zip(prompts, outs):
            ids = torch.tensor([prompt + out["output_ids"]])
            logp = reference.model(ids).logits.float().log_softmax(-1)[0, len(prompt) - 1:-1]
            ref = logp.gather(-1, torch.tensor(out["output_ids"])[:, None])[:, 0]
            got = torch.tensor([entry[0] for entry in out["meta_info"]["output_token_logprobs"]])
            gaps.append((ref - got).abs().mean().item())
    assert 1e-4 < sum(gaps) / len(gaps) < 0.05  # measured: 0.005-0.010 on the tiny model


def test_the_embedded_engine_refuses_a_quantization_it_cannot_serve(tiny_model_dir):
    import pytest

    from miles_core.engines.embedded.engine import EmbeddedEngine

    with pytest.raises(ValueError, match="serves block FP8"):
        EmbeddedEngine(str(tiny_model_dir), num_threads=1, quantization="awq")


def test_the_fp8_gemm_is_used_only_where_its_probe_matches_the_reference(monkeypatch, caplog):
    """A GPU whose torch._scaled_mm refuses the block form, or gets it wrong, dequantizes instead,
    and says so; one that matches the reference takes the GEMM."""
    from miles_core.engines.embedded import fp8_linear
    from miles_core.weight_sync.quantization import emulated_fp8_linear

    probe = fp8_linear._block_fp8_gemm_works.__wrapped__
    cpu = torch.device("cpu")

    def refused(*args):
        raise RuntimeError("Invalid scaling configuration")

    cases = [(refused, False), (lambda x, q, s: emulated_fp8_linear(x, q, s) * 1.1, False),
             (lambda x, q, s: emulated_fp8_linear(x.float(), q, s).to(x.dtype), True)]
    for gemm, usable in cases:
        monkeypatch.setattr(fp8_linear, "scaled_mm_block_fp8", gemm)
        caplog.clear()
        assert probe(cpu) is usable
        assert ("dequantize to bf16" in caplog.text) is not usable
