"""Checks that the rollout and training precisions (rollout.precision, training.fp8) fit the
rest of a recipe. Kept apart from schema.py, which holds the sections themselves."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles_core.config.schema import RunConfig

# SGLang --quantization values (QUANTIZATION_CHOICES in sglang/srt/server_args.py) that make the
# engine compute in FP8: with rollout.precision=bf16 they would sample from an FP8 policy that no
# correction accounts for.
FP8_SERVER_QUANTIZATIONS = ("fp8", "w8a8_fp8", "modelopt_fp8", "mxfp8")


def check_precision(cfg: RunConfig) -> None:
    """ValueError naming the first precision setting the recipe cannot run, and the fix."""
    _fp8_rollout_is_corrected(cfg)
    _engine_agrees(cfg)
    _fp8_training_fits(cfg)


def _fp8_rollout_is_corrected(cfg: RunConfig) -> None:
    """FP8 rollouts sample from a quantized copy of the policy: without a correction the trainer
    would treat them as on-policy, and the mismatch biases every gradient."""
    a = cfg.algorithm
    if (cfg.rollout.precision == "fp8" and a.name != "sft" and a.correction.kind == "none"
            and a.old_logprob_source == "trainer"):
        raise ValueError("rollout.precision=fp8 samples from a quantized policy, off-policy for the bf16 trainer: "
                         "set algorithm.correction.kind=tis (or icepop/mis) or algorithm.old_logprob_source=rollout "
                         "(or rollout.precision=bf16)")


def _engine_agrees(cfg: RunConfig) -> None:
    r = cfg.rollout
    if r.engine.kind == "embedded":
        if r.precision == "fp8":
            _embedded_fp8_fits(cfg)
        return
    quantization = r.engine.server_args.get("quantization")
    if r.precision == "fp8" and quantization != "fp8":
        raise ValueError(f"rollout.precision=fp8 sends block-FP8 weights (weight + weight_scale_inv), which SGLang "
                         f"loads only into fp8 linears: set rollout.engine.server_args.quantization=fp8 "
                         f"(it is {quantization!r})")
    if r.precision == "fp8":
        _fp8_weights_can_travel(cfg)
    if r.precision == "bf16" and quantization in FP8_SERVER_QUANTIZATIONS:
        raise ValueError(f"rollout.engine.server_args.quantization={quantization} makes the engine generate in FP8 "
                         "while rollout.precision=bf16 says its samples are on-policy: set rollout.precision=fp8 "
                         "(with an algorithm.correction) or remove the quantization server arg")


def _embedded_fp8_fits(cfg: RunConfig) -> None:
    """The embedded engine quantizes what it is sent (engines/embedded/fp8_linear.Fp8Weights): full
    weights through the object store or the shared buffer. Not built or checked: a block-FP8
    broadcast into it, LoRA adapters merged into FP8 weights, and a checksum of FP8 weights
    against the trainer's."""
    r = cfg.rollout
    if r.weight_transport.kind not in ("object_store", "shared_memory"):
        raise ValueError(f"rollout.precision=fp8 with the embedded engine quantizes the weights it is sent through "
                         f"the object store or the shared buffer, not {r.weight_transport.kind}: set "
                         "rollout.weight_transport=object_store (or shared_memory where trainer and engine share a GPU)")
    if r.verify_weight_sync:
        raise ValueError("rollout.verify_weight_sync compares the engine's weights with the trainer's, which FP8 "
                         "quantization changes by design: set rollout.verify_weight_sync=false")
    if cfg.training.lora_enabled:
        raise ValueError("rollout.precision=fp8 with the embedded engine cannot merge LoRA adapters into FP8 weights: "
                         "set rollout.precision=bf16 or drop training.lora")


def _fp8_training_fits(cfg: RunConfig) -> None:
    t = cfg.training
    if not t.fp8:
        return
    if t.backend != "fsdp2":
        raise ValueError("training.fp8 converts the FSDP2 trainer's linears to torchao float8 linears; the megatron "
                         "backend has no FP8 path here (Transformer Engine FP8 is not wired in): set "
                         "training.backend=fsdp2 or training.fp8=false")
    if t.gpus_per_trainer <= 0:
        raise ValueError("training.fp8 needs FP8 matmuls, which only GPUs (Hopper or newer) have: set "
                         "training.gpus_per_trainer >= 1 or training.fp8=false")
    if t.lora_enabled:  # torchao would convert the frozen base inside peft's LoRA layers: never run
        raise ValueError("training.fp8 with training.lora is not supported (FP8 base layers under LoRA adapters have "
                         "not been built or checked): set training.fp8=false or drop training.lora")


def _fp8_weights_can_travel(cfg: RunConfig) -> None:
    """Only the broadcast quantizes (miles_core.weight_sync.transports.broadcast_to_engines): a disk sync writes a
    bf16 checkpoint and the CUDA IPC buckets hold one dtype, which block-FP8 engines cannot load."""
    transport = cfg.rollout.weight_transport.kind
    if transport != "broadcast":
        raise ValueError(f"rollout.precision=fp8 sends block-FP8 weights over the broadcast transport only (not "
                         f"{transport}, which carries bf16): set rollout.weight_transport=broadcast")
    if cfg.eval.mode == "local_engine" and cfg.eval.interval_steps and cfg.eval.periodic_engines == "dedicated":
        raise ValueError("rollout.precision=fp8: dedicated eval engines load weights from a bf16 disk sync, which "
                         "block-FP8 engines cannot take: set eval.periodic_engines=rollout")
