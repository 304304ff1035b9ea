"""rollout.precision and training.fp8: what a recipe must set beside them (miles_core/config/precision.py)."""

import pytest

from miles_core.config import ConfigError, build_config

SGLANG = {"engine": {"kind": "sglang", "server_args": {"quantization": "fp8"}}, "gpus_per_engine": 1,
          "weight_transport": "broadcast", "precision": "fp8"}
TIS = ["algorithm.correction.kind=tis"]


def test_fp8_sglang_rollout_with_a_correction_validates():
    cfg = build_config({"rollout": SGLANG}, TIS)
    assert cfg.rollout.precision == "fp8" and cfg.rollout.engine.server_args["quantization"] == "fp8"
    # old_logprob_source=rollout corrects the mismatch itself (the ratio is against the engine's policy)
    build_config({"rollout": SGLANG}, ["algorithm.old_logprob_source=rollout"])


def test_fp8_rollout_without_a_correction_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"rollout.precision=fp8 .*algorithm.correction.kind=tis"):
        build_config({"rollout": SGLANG})


@pytest.mark.parametrize("server_args", [{}, {"quantization": "awq"}])
def test_fp8_rollout_needs_sglang_quantization_fp8(server_args):
    rollout = {**SGLANG, "engine": {"kind": "sglang", "server_args": server_args}}
    with pytest.raises(ConfigError, match="server_args.quantization=fp8"):
        build_config({"rollout": rollout}, TIS)


@pytest.mark.parametrize("quantization", ["fp8", "w8a8_fp8"])
def test_an_fp8_engine_under_bf16_precision_is_refused(quantization):
    rollout = {**SGLANG, "precision": "bf16", "engine": {"kind": "sglang", "server_args": {"quantization": quantization}}}
    with pytest.raises(ConfigError, match="set rollout.precision=fp8"):
        build_config({"rollout": rollout}, TIS)


def test_embedded_fp8_takes_full_weights_it_quantizes_itself():
    assert build_config({}, ["rollout.precision=fp8", *TIS]).rollout.weight_transport.kind == "object_store"
    with pytest.raises(ConfigError, match="rollout.weight_transport=object_store"):
        build_config({}, ["rollout.precision=fp8", "rollout.weight_transport=broadcast", *TIS])
    with pytest.raises(ConfigError, match="verify_weight_sync=false"):
        build_config({}, ["rollout.precision=fp8", "rollout.verify_weight_sync=true", *TIS])
    with pytest.raises(ConfigError, match="cannot merge LoRA adapters into FP8"):
        build_config({}, ["rollout.precision=fp8", "training.lora.rank=4", *TIS])
    with pytest.raises(ConfigError, match="rollout.precision"):
        build_config({}, ["rollout.precision=fp16"])


def test_training_fp8_is_fsdp2_on_gpus_only():
    with pytest.raises(ConfigError, match="megatron backend has no FP8 path"):
        build_config({}, ["training.fp8=true", "training.backend=megatron", "training.gpus_per_trainer=1"])
    with pytest.raises(ConfigError, match="only GPUs"):
        build_config({}, ["training.fp8=true"])
    assert build_config({}, ["training.fp8=true", "training.gpus_per_trainer=1"]).training.fp8
    with pytest.raises(ConfigError, match="training.fp8 with training.lora is not supported"):
        build_config({}, ["training.fp8=true", "training.gpus_per_trainer=1", "training.lora.rank=4"])


@pytest.mark.parametrize("transport", ["disk", "cuda_ipc"])
def test_fp8_weights_travel_by_broadcast_only(transport):
    extra = (["training.gpus_per_trainer=0.5", "rollout.gpus_per_engine=0.5", "placement.layout=colocated"]
             if transport == "cuda_ipc" else [])
    with pytest.raises(ConfigError, match="set rollout.weight_transport=broadcast"):
        build_config({"rollout": {**SGLANG, "weight_transport": transport}}, [*TIS, *extra])


def test_fp8_refuses_dedicated_eval_engines():
    with pytest.raises(ConfigError, match="eval.periodic_engines=rollout"):
        build_config({"rollout": SGLANG}, [*TIS, "eval.interval_steps=5", "eval.periodic_engines=dedicated"])
