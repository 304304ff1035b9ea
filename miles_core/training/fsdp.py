"""The FSDP2 training backend: an HF causal LM sharded with `fully_shard`, AdamW, and
checkpoints in safetensors + JSON (no pickle anywhere on the load path)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

from miles_core import objectives
from miles_core.config import AlgorithmConfig, TrainingConfig
from miles_core.config.training import FSDPConfig
from miles_core.net import free_port
from miles_core.training import lora, state_io
from miles_core.training.batches import pad_batch
from miles_core.training.core import RLTrainerCore
from miles_core.training.data_parallel import rank_micro_batches
from miles_core.training.logprobs import next_token_logprobs
from miles_core.training.offload import HostOffload, module_tensors
from miles_core.types import LORA_ADAPTER_DIR, Sample
from miles_core.weight_sync.layout import checkpoint_layout, weights_sha256


def _resident(method):
    """Runs a method with the trainer's state on the device (see FSDPTrainer.resident)."""
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        with self.resident():
            return method(self, *args, **kwargs)

    return wrapped


def _peak_gib() -> float | None:
    """This process's peak allocated GPU memory since the last reset (None on CPU)."""
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def ensure_process_group() -> bool:
    """Join the launcher's group (torchrun / the trainer group sets WORLD_SIZE) or make a private
    world-size-1 group; NCCL for CUDA tensors, gloo for CPU ones. Returns True when this call
    created the group."""
    if dist.is_initialized():
        return False
    backend = "cuda:nccl,cpu:gloo" if torch.cuda.is_available() else "gloo"
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    return True


def trainer_device() -> torch.device:
    """The GPU Ray gave this actor (it sees only its own, as device 0), else the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _shard(model: torch.nn.Module, options: FSDPConfig, compile_layers: bool = False,
           fp8: bool = False) -> torch.nn.Module:
    """fully_shard each decoder layer and the root over all data-parallel ranks, computing in
    options.compute_dtype (fp32 master weights and gradient reduction); compile_layers:
    torch.compile each decoder layer first (GPU only); fp8: torchao float8 linears first
    (training.fp8; refuses on a device without FP8 matmuls)."""
    if fp8:  # before fully_shard, which must see the Float8Linear modules it shards
        from miles_core.training.float8 import convert_float8_linears

        convert_float8_linears(model, trainer_device())
    if options.activation_checkpointing:  # non-reentrant: what FSDP2's per-layer hooks support
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compile_layers and torch.cuda.is_available():
        compile_decoder_layers(model)
    policy = {} if options.compute_dtype == "float32" else {"mp_policy": MixedPrecisionPolicy(
        param_dtype=getattr(torch, options.compute_dtype), reduce_dtype=torch.float32)}
    for layer in model.model.layers:
        fully_shard(layer, **policy)
    fully_shard(model, **policy)
    return model


def _right_padded(attention: torch.Tensor | None) -> bool:
    """True when every row's mask is ones then zeros (what pad_batch makes): the causal mask
    alone is then exact for every real token, so attention can run without an explicit mask
    (SDPA's flash kernel, no [B, 1, L, L] mask)."""
    if attention is None:
        return True
    return bool((attention[:, 1:] <= attention[:, :-1]).all()) and bool((attention[:, 0] > 0).all())


def causal_lm_logprobs(model, tokens: torch.Tensor, attention: torch.Tensor | None, temperature: float = 1.0,
                       with_entropy: bool = False):
    """log p(tokens[:, t+1] | ..t) [B, L-1] (and entropy, or None) of an HF causal LM.

    The logits stay in the model's dtype: one fused pass reduces them to per-token log-sum-exp
    (miles_core.training.logprobs, no vocab split; torch.compile'd on CUDA) instead of
    log_softmax over an fp32 copy. The same numbers as log_softmax(logits / T).
    """
    mask = None if _right_padded(attention) else attention
    logits = model(input_ids=tokens, attention_mask=mask, use_cache=False).logits
    return next_token_logprobs(logits, tokens, temperature, logits.shape[-1], with_entropy)


def compile_decoder_layers(model: torch.nn.Module, layers=None) -> int:
    """torch.compile each decoder layer's forward (before fully_shard: FSDP2's hooks stay
    eager, around the compiled forward; state-dict names are unchanged). Returns the count."""
    import torch._dynamo

    layers = list(model.model.layers if layers is None else layers)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 8 * len(layers) + 8)
    for layer in layers:
        layer.forward = torch.compile(layer.forward)
    return len(layers)


class FSDPTrainer(RLTrainerCore):
    """Owns the policy (and critic/reference/teacher when the objective needs them), their
    optimizers and schedulers; speaks HF parameter names. The RL step is RLTrainerCore's."""

    def __init__(self, model_dir: str, training: TrainingConfig, algorithm: AlgorithmConfig,
                 temperature: float = 1.0, max_new_tokens: int = 8, seed: int = 0, group_size: int = 1,
                 teacher_dir: str | None = None):
        torch.set_num_threads(training.num_threads)
        torch.manual_seed(seed)
        self.owns_process_group = ensure_process_group()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = trainer_device()
        self.training, self.algorithm, self.group_size = training, algorithm, group_size
        self.temperature, self.max_new_tokens = temperature, max_new_tokens
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model_dir = model_dir
        self.lora = training.lora if training.lora_enabled else None
        policy = self._load(AutoModelForCausalLM, model_dir)
        if self.lora is not None:  # adapters before sharding: FSDP2 shards A and B with their layer
            policy = lora.inject(policy, self.lora)
        self.model = _shard(policy, training.fsdp, training.compile_decoder_layers, training.fp8).train()
        self.tied = bool(self.model.config.tie_word_embeddings)
        # Frozen parameters get no optimizer state (with LoRA: only the adapters do).
        self.optimizer, self.scheduler = self._optimizer(
            [p for p in self.model.parameters() if p.requires_grad], training.lr)
        self.critic = self.critic_optimizer = self.critic_scheduler = None
        if algorithm.uses_critic:
            # classifier_dropout: transformers' token-classification head adds dropout 0.1 by default,
            # which would make old values (and the value clip around them) random
            config = AutoConfig.from_pretrained(model_dir, num_labels=1)
            config.classifier_dropout = 0.0
            self.critic = _shard(self._load(AutoModelForTokenClassification, model_dir, config=config),
                                 training.fsdp, training.compile_decoder_layers).train()
            self.critic_optimizer, self.critic_scheduler = self._optimizer(self.critic.parameters(), algorithm.critic_lr)
        self.reference = self._frozen(model_dir) if objectives.needs_reference(algorithm) else None
        self.teacher = self._frozen(teacher_dir) if algorithm.effective_opd_coef > 0 else None
        self.step = 0
        self.host_offload = HostOffload(self.device)

    # ---- time-sharing (placement.time_sharing) ------------------------------------------------
    def _device_tensors(self):
        for _, model, optimizer, _ in self._modules():
            yield from module_tensors(model, optimizer)
        yield from module_tensors(self.reference)
        yield from module_tensors(self.teacher)

    def offload(self) -> dict[str, float]:
        """Parameters, gradients and optimizer states (reference and teacher too) leave the
        device until onload: the engines get its memory while they generate."""
        peak = _peak_gib()  # the update's peak, before the offload frees it
        moved = self.host_offload.offload(self._device_tensors())
        return {"time/offload_seconds": moved["seconds"], "time_sharing/offloaded_gib": moved["bytes"] / 2**30,
                **({"memory/train_peak_gib": peak} if peak is not None else {})}

    def onload(self) -> dict[str, float]:
        """Everything offload moved is back on the device, bit for bit."""
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        moved = self.host_offload.onload()
        return {"time/onload_seconds": moved["seconds"]}

    @contextlib.contextmanager
    def resident(self):
        """For the calls that read the state outside an update (checkpoints, exports): on the
        device for the call, back off it after when it was offloaded."""
        was_offloaded = self.host_offload.is_offloaded
        self.host_offload.onload()
        try:
            yield
        finally:
            if was_offloaded:
                self.host_offload.offload(self._device_tensors())

    def _load(self, model_class, model_dir: str, **kwargs) -> torch.nn.Module:
        return model_class.from_pretrained(model_dir, dtype=torch.float32, **kwargs).to(self.device)

    def _frozen(self, model_dir: str | None) -> torch.nn.Module:
        if model_dir is None:
            raise ValueError("a teacher model directory is required for distillation")
        return self._load(AutoModelForCausalLM, model_dir).eval().requires_grad_(False)

    def close(self) -> None:
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()

    # ---- RLTrainerCore hooks ----------------------------------------------------------------
    def _batch(self, samples: list[Sample]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device) for k, v in pad_batch(samples, self.tokenizer.pad_token_id).items()}

    def _my_micro_batches(self, batch: dict[str, torch.Tensor]):
        """This rank's (rows, micro-batch) pairs; with several ranks all run as many, of one
        shape, since every FSDP2 forward gathers parameters from all of them."""
        return rank_micro_batches(batch, self.training.micro_batch_size, self.rank, self.world,
                                  equal_shapes=self.world > 1)

    def _dp_group(self):
        return None  # every rank of the default group is a data-parallel rank

    def _sync_and_clip(self, *modules: torch.nn.Module) -> torch.Tensor:
        """FSDP2 reduced the gradients in backward; the norm of DTensor gradients is global."""
        params = [p for m in modules for p in m.parameters()]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.training.grad_clip)
        return grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm

    def _refresh_reference(self) -> None:
        self.reference.load_state_dict(self._full_weights(), strict=False)

    def _lazy_old_logprobs(self) -> bool:
        return self.world == 1  # with several ranks, one rank's update forward sees only its rows

    def _backward(self, loss: torch.Tensor) -> None:
        """Each rank's loss is normalised by the global batch's counts, so the true gradient is
        the sum over ranks; FSDP2 averages (gloo has no pre-scaled sum), hence the factor."""
        (loss * self.world if self.world > 1 else loss).backward()

    def _token_logprobs(self, model, batch: dict[str, torch.Tensor], with_entropy: bool = False):
        return causal_lm_logprobs(model, batch["tokens"], batch["attention"], self.temperature, with_entropy)

    def _values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # The value at position t scores the state that predicts token t+1 (next-token layout).
        return self.critic(input_ids=batch["tokens"], attention_mask=batch["attention"]).logits[:, :-1, 0].float()

    # ---- weights out ------------------------------------------------------------------------
    def _full_weights(self) -> dict[str, torch.Tensor]:
        """On every rank (the reference refresh needs them everywhere)."""
        state = state_io.full_weights(self.model, to_cpu=False)
        return state if self.lora is None else lora.merged_weights(state, self.lora)

    @_resident
    def hf_state_dict(self, to_cpu: bool | None = None) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights under Hugging Face names (tied head dropped); on the GPU
        unless to_cpu (default: only when training on CPU). A collective: with to_cpu only
        rank 0 receives them (the others get an empty dict)."""
        to_cpu = not torch.cuda.is_available() if to_cpu is None else to_cpu
        state = state_io.full_weights(self.model, drop_tied_head=self.tied, to_cpu=to_cpu)
        return state if self.lora is None else lora.merged_weights(state, self.lora)

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The adapter sync's payload (miles_core.weight_sync.lora) on the CPU; {} without LoRA. A
        collective when sharded."""
        return {} if self.lora is None else lora.adapter_payload(self.model, self.lora)

    @_resident
    def export_adapter(self, out_dir: str | Path) -> Path:
        """The LoRA adapter alone, in PEFT's layout (export_hf's `adapter/`): what the adapter sync
        to SGLang engines loads (/load_lora_adapter). A collective when sharded; rank 0 writes."""
        if self.lora is None:
            raise ValueError("export_adapter needs training.lora (the trainer trains no adapter)")
        adapter = lora.adapter_params(self.model)
        if self.rank == 0:
            lora.save_adapter(Path(out_dir), adapter, self.lora, self.model_dir)
        return Path(out_dir)

    @_resident
    def weights_sha256(self) -> str:
        return weights_sha256(self.hf_state_dict(to_cpu=True))

    def _weights_to_share(self) -> dict[str, torch.Tensor]:
        """On one rank each parameter's local shard is the whole tensor: views, no gather, no
        copy (the state-dict API costs tens of ms per sync on a 0.6B model)."""
        if self.world > 1 or self.lora is not None:  # LoRA: merged weights under HF names
            return self.hf_state_dict(to_cpu=False)
        return {name: (p.to_local() if isinstance(p, DTensor) else p).detach()
                for name, p in self.model.named_parameters()}

    @_resident
    def export_hf(self, out_dir: str | Path) -> Path:
        """Save a standalone HF directory (config, safetensors weights, tokenizer). With LoRA the
        weights are merged (what eval, the registry and SGLang load) and LORA_ADAPTER_DIR holds the
        adapters alone in PEFT's layout."""
        out_dir = Path(out_dir)
        state = self.hf_state_dict(to_cpu=True)  # a collective; rank 0 writes
        if self.lora is not None:
            adapter = lora.adapter_params(self.model)  # a collective too
            if self.rank == 0:
                lora.save_adapter(out_dir / LORA_ADAPTER_DIR, adapter, self.lora, self.model_dir)
        if self.rank != 0:
            return out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        self.model.config.save_pretrained(out_dir)
        if getattr(self.model, "generation_config", None) is not None:
            self.model.generation_config.save_pretrained(out_dir)
        # The checkpoint layout (per-expert MoE tensors) is what SGLang and save_pretrained read;
        # split experts are views of one tensor, which safetensors refuses to save as such.
        weights = {k: v if k in state else v.clone() for k, v in checkpoint_layout(state).items()}
        save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        self.tokenizer.save_pretrained(out_dir)
        return out_dir

    # ---- checkpoints ----------------------------------------------------------------------------
    def _modules(self):
        yield "policy", self.model, self.optimizer, self.scheduler
        if self.critic is not None:
            yield "critic", self.critic, self.critic_optimizer, self.critic_scheduler

    @_resident
    def save_state(self, out_dir: str | Path, extra: dict[str, Any]) -> None:
        """Policy (+critic) weights, optimizers, schedulers, reference and RNG in out_dir. Every
        rank takes part in gathering the shards; rank 0 writes (the ranks' replicas agree)."""
        out_dir = Path(out_dir)
        meta: dict[str, Any] = {"modules": {}}
        for name, model, optimizer, scheduler in self._modules():
            meta["modules"][name] = state_io.save_module(out_dir, name, model, optimizer, scheduler, self.tied,
                                                         write=self.rank == 0)
        if self.rank != 0:
            return
        if self.reference is not None and self.algorithm.ref_refresh_interval_steps:
            save_file({k: v.contiguous() for k, v in self.reference.state_dict().items()},
                      str(out_dir / "reference.safetensors"))
        rng_tensors, meta["python_rng"] = state_io.rng_state()
        save_file(rng_tensors, str(out_dir / "rng.safetensors"))
        meta["trainer_step"] = self.step
        (out_dir / "trainer_state.json").write_text(json.dumps({**meta, **extra}, indent=1))

    @_resident
    def load_state(self, ckpt_dir: str | Path) -> dict[str, Any]:
        """Restore everything save_state wrote; returns the `extra` dict given at save time."""
        ckpt_dir = Path(ckpt_dir)
        meta = json.loads((ckpt_dir / "trainer_state.json").read_text())
        modules = meta.pop("modules")
        for name, model, optimizer, scheduler in self._modules():
            state_io.load_module(ckpt_dir, name, model, optimizer, scheduler, modules[name],
                                 self.tied and name == "policy")
        if (ckpt_dir / "reference.safetensors").is_file() and self.reference is not None:
            self.reference.load_state_dict(load_file(str(ckpt_dir / "reference.safetensors")))
        state_io.set_rng_state(load_file(str(ckpt_dir / "rng.safetensors")), meta.pop("python_rng"))
        self.step = int(meta.pop("trainer_step"))
        return meta


# The weight pushes a restarted engine triggers mid-rollout (trainer offloaded) read the state too.
for _name in ("share_weights", "write_shared_weights", "broadcast_weights", "send_weights_over_cuda_ipc"):
    setattr(FSDPTrainer, _name, _resident(getattr(RLTrainerCore, _name)))
