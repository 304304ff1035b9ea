"""The weight transport's cross-section rules: what `auto` resolves to for a placement, and
whether the chosen transport can reach the engines. Kept apart from schema.py, which holds the
sections themselves."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles_core.config.schema import RunConfig


def choose_transport(cfg: RunConfig) -> tuple[str, str]:
    """(transport kind, why) for `rollout.weight_transport: auto`. On a GPU the object store would
    copy every weight through host memory (7-10 s a sync on a 0.6B model, against 13.5 ms for
    shared_memory), so it is chosen only where no GPU is placed."""
    r, t = cfg.rollout, cfg.training
    real_sglang = r.engine.kind == "sglang" and r.engine.is_sglang
    if r.engine.kind == "sglang" and t.lora_enabled:
        return "disk", "training.lora: SGLang loads each adapter version from a folder (/load_lora_adapter)"
    on_gpus = t.gpus_per_trainer > 0 and r.gpus_per_engine > 0
    if (on_gpus and cfg.placement.layout == "colocated" and t.world_size == 1
            and t.gpus_per_trainer + r.num_engines * r.gpus_per_engine <= 1):
        kind = "cuda_ipc" if real_sglang else "shared_memory"
        return kind, "trainer and engines share one GPU: the weights never leave it"
    if r.engine.kind == "sglang":
        if any(int(r.engine.server_args.get(arg) or 1) > 1 for arg in ("dp_size", "pp_size")):
            return "disk", "SGLang takes no weight-update group under dp_size or pp_size > 1"
        return "broadcast", "SGLang engines in processes of their own: a broadcast from the trainer"
    if on_gpus:
        return "broadcast", "trainer and engines on different GPUs: an NCCL broadcast from the trainer"
    return "object_store", "no GPU placed: Ray's object store (shared memory on one node)"


def resolve_auto_transport(cfg: RunConfig) -> None:
    """Resolves `rollout.weight_transport: auto` to the fastest transport the placement allows."""
    r = cfg.rollout
    if r.weight_transport.kind != "auto":
        return
    r.weight_transport = {"kind": choose_transport(cfg)[0]}


def check_transport(cfg: RunConfig) -> None:
    """ValueError naming the first way the weight transport cannot reach the engines, and the fix."""
    r = cfg.rollout
    transport = r.weight_transport.kind
    if r.engine.kind == "sglang" and transport in ("object_store", "shared_memory"):
        raise ValueError(f"SGLang engines run in their own process, which the {transport} "
                         "transport cannot reach: set rollout.weight_transport=broadcast (or disk)")
    if transport == "cuda_ipc" and not (r.engine.kind == "sglang" and r.engine.is_sglang):
        raise ValueError("rollout.weight_transport=cuda_ipc hands CUDA IPC handles to SGLang's "
                         "/update_weights_from_tensor: use it with rollout.engine=sglang (embedded engines on "
                         "the trainer's device: rollout.weight_transport=shared_memory)")
    if transport in ("shared_memory", "cuda_ipc"):
        _on_one_device(cfg, transport)
    # A fraction of a GPU beside the trainer: the weights come by CUDA IPC, or from disk (LoRA
    # adapters go that way); both ran against SGLang 0.5.17 sharing one H100 with the trainer.
    if (r.engine.kind == "sglang" and r.engine.is_sglang and r.gpus_per_engine < 1
            and transport not in ("cuda_ipc", "disk")):
        raise ValueError("the sglang engine needs a GPU: set rollout.gpus_per_engine >= 1 (a fraction of one "
                         "only beside the trainer on its GPU, with rollout.weight_transport=cuda_ipc or disk)")
    t = cfg.training
    if transport == "broadcast" and t.gpus_per_trainer > 0 and r.gpus_per_engine > 0 and (
            t.gpus_per_trainer / t.world_size < 1 or r.gpus_per_engine < 1):
        raise ValueError("rollout.weight_transport=broadcast needs the trainer's ranks and the engines on GPUs of "
                         "their own: NCCL refuses two ranks of one group on one GPU ('Duplicate GPU detected'), "
                         "and a fraction of a GPU may share it. Use rollout.weight_transport=auto (shared_memory or "
                         "cuda_ipc on one GPU) or whole GPUs (training.gpus_per_trainer, rollout.gpus_per_engine)")
    if r.engine.kind == "sglang" and transport == "broadcast":
        for arg in ("dp_size", "pp_size"):  # a broadcast group gives each engine tp_size ranks
            if int(r.engine.server_args.get(arg) or 1) > 1:
                raise ValueError(f"SGLang joins a weight-update group with tp_size ranks per engine and refuses "
                                 f"one under {arg} > 1: set rollout.engine.server_args.{arg}=1 (more engines: "
                                 f"rollout.num_engines), or rollout.weight_transport=disk")
    if r.engine.kind == "sglang" and r.verify_weight_sync:
        raise ValueError("rollout.verify_weight_sync compares a sha256 of the engine's weights, which SGLang "
                         "does not serve: set rollout.verify_weight_sync=false for engine sglang")


def _on_one_device(cfg: RunConfig, transport: str) -> None:
    """shared_memory maps one buffer, cuda_ipc one GPU allocation: the trainer (one rank) and
    every engine must sit on one device (cuda_ipc: one GPU)."""
    r, t = cfg.rollout, cfg.training
    if transport == "cuda_ipc" and (t.gpus_per_trainer <= 0 or r.gpus_per_engine <= 0):
        raise ValueError("rollout.weight_transport=cuda_ipc shares GPU memory: give the trainer and the engines "
                         "one GPU to share (e.g. training.gpus_per_trainer=0.5, rollout.gpus_per_engine=0.5), or "
                         "use broadcast")
    if (t.gpus_per_trainer > 0) != (r.gpus_per_engine > 0):
        raise ValueError(f"rollout.weight_transport={transport} maps one buffer on one device: give the "
                         "trainer and the engines GPUs (training.gpus_per_trainer, rollout.gpus_per_engine) "
                         "or neither")
    if cfg.placement.layout != "colocated":
        raise ValueError(f"rollout.weight_transport={transport} needs the trainer and the engines on one "
                         "machine: set placement.layout=colocated (or use broadcast)")
    if r.gpus_per_engine > 0 and (t.world_size > 1 or t.gpus_per_trainer + r.num_engines * r.gpus_per_engine > 1):
        raise ValueError(f"rollout.weight_transport={transport} on GPUs needs the trainer (one rank) and the "
                         "engines on one GPU: placement.layout=colocated and training.gpus_per_trainer + "
                         "rollout.num_engines * rollout.gpus_per_engine <= 1; use broadcast otherwise")
