"""MoE expert layouts under HF names: the checkpoint's per-expert tensors and transformers 5's
fused module tensors convert exactly, and digest alike (so weight-sync verification compares a
trainer and an engine that hold different layouts)."""

import torch

from miles_core.weight_sync.layout import checkpoint_layout, fused_layout, weights_sha256


def _fused() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"model.layers.0.mlp.experts.gate_up_proj": torch.randn(3, 8, 5, generator=g),  # E=3, 2F=8, H=5
            "model.layers.0.mlp.experts.down_proj": torch.randn(3, 5, 4, generator=g),
            "model.layers.0.mlp.gate.weight": torch.randn(3, 5, generator=g)}


def test_fused_and_checkpoint_layouts_round_trip_and_digest_alike():
    fused = _fused()
    per_expert = checkpoint_layout(fused)
    assert torch.equal(per_expert["model.layers.0.mlp.experts.2.gate_proj.weight"],
                       fused["model.layers.0.mlp.experts.gate_up_proj"][2, :4])
    assert torch.equal(per_expert["model.layers.0.mlp.experts.1.up_proj.weight"],
                       fused["model.layers.0.mlp.experts.gate_up_proj"][1, 4:])
    assert len(per_expert) == 3 * 3 + 1
    back = fused_layout(per_expert)
    assert back.keys() == fused.keys() and all(torch.equal(back[k], v) for k, v in fused.items())
    assert weights_sha256(fused) == weights_sha256(per_expert)
    per_expert["model.layers.0.mlp.experts.0.down_proj.weight"] = per_expert[
        "model.layers.0.mlp.experts.0.down_proj.weight"] + 1e-3
    assert weights_sha256(fused) != weights_sha256(per_expert)


def test_checkpoint_names_are_views_into_the_fused_parameters():
    fused = _fused()
    view = checkpoint_layout(fused)["model.layers.0.mlp.experts.1.up_proj.weight"]
    view.copy_(torch.zeros_like(view))  # what the HTTP engine's partial weight update does
    assert fused["model.layers.0.mlp.experts.gate_up_proj"][1, 4:].abs().sum() == 0
    assert fused["model.layers.0.mlp.experts.gate_up_proj"][1, :4].abs().sum() > 0
