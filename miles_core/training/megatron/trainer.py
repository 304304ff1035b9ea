"""The Megatron-LM training backend: the FSDPTrainer interface on a megatron-core GPTModel.

SPMD: with tp * dp > 1 every rank constructs the trainer with the same arguments and every
method is called on every rank (each returns the same result, except full weights: rank 0
only). Micro-batches are dealt to data-parallel ranks round-robin; gradients are summed over
the data-parallel group (dp = ep: expert parallel ranks replicate the dense weights).

Optimizer: plain ``torch.optim.AdamW`` (fused on GPU) over this rank's (TP-sharded) parameters,
on CPU and GPU alike (megatron's DistributedOptimizer needs its DDP grad buffers; not used here). Its
moments are checkpointed as torch_dist with the parameters' sharding (see state.py), so a
checkpoint saved at one TP size resumes at another.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoTokenizer

from miles_core import objectives
from miles_core.config import AlgorithmConfig, TrainingConfig
from miles_core.training import state_io
from miles_core.training.batches import pad_batch
from miles_core.training.core import RLTrainerCore
from miles_core.training.data_parallel import rank_micro_batches
from miles_core.training.logprobs import next_token_logprobs
from miles_core.training.megatron import mapping, state
from miles_core.training.megatron.convert import (
    TORCH_DIST,
    load_hf_weights,
    load_model_checkpoint,
    verify_manifest,
)
from miles_core.training.megatron.grad_norm import clip_grad_norm, is_expert_parallel
from miles_core.training.megatron.model import (
    build_gpt_model,
    causal_positions,
    family_of,
    forward_logits,
    init_parallel,
    model_shape,
    shutdown_parallel,
)
from miles_core.training.megatron.routing_replay import replayed_routing, routing_targets
from miles_core.types import Sample
from miles_core.weight_sync.layout import weights_sha256


@dataclass
class MegatronOptions:
    """Parallel layout and memory options, normally read from `training.megatron`."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    recompute: bool = False
    logprob_chunk_tokens: int | None = None
    fused_swiglu: bool = False
    routing_replay: bool = False
    compile_layers: bool = False

    @classmethod
    def from_training(cls, training: TrainingConfig) -> MegatronOptions:
        # The config validated the layout already (pp = cp = 1); cp has no option here.
        m = training.megatron
        return cls(tp=m.tensor_parallel_size, pp=m.pipeline_parallel_size, ep=m.expert_parallel_size,
                   recompute=m.recompute_activations, logprob_chunk_tokens=m.logprob_chunk_tokens,
                   fused_swiglu=m.fused_swiglu, routing_replay=m.routing_replay,
                   compile_layers=training.compile_decoder_layers)


def _require_experts(model_dir: str) -> None:
    """Routing replay on a dense model would silently do nothing: refuse it before any setup."""
    hf_config = AutoConfig.from_pretrained(model_dir)
    if model_shape(hf_config).num_experts is None:
        raise ValueError(f"training.megatron.routing_replay needs an MoE model (Qwen3-MoE), but {model_dir} is "
                         f"{family_of(hf_config)} without experts: set training.megatron.routing_replay=false")


class ValueHead(torch.nn.Module):
    """Final RMSNorm + Linear(hidden, 1) on the critic's last hidden states (TP-replicated)."""

    def __init__(self, hidden: int, eps: float, std: float):
        super().__init__()
        self.norm = torch.nn.RMSNorm(hidden, eps=eps)
        self.score = torch.nn.Linear(hidden, 1)
        torch.nn.init.normal_(self.score.weight, std=std)
        torch.nn.init.zeros_(self.score.bias)

    def named_tensors(self) -> dict[str, torch.Tensor]:
        return {f"value_head.{k}": v for k, v in self.state_dict(keep_vars=True).items()}


class MegatronTrainer(RLTrainerCore):
    """Policy (+critic / reference / teacher) as megatron GPTModels; speaks HF names outside."""

    def __init__(self, model_dir: str, training: TrainingConfig, algorithm: AlgorithmConfig,
                 temperature: float = 1.0, max_new_tokens: int = 8, seed: int = 0, group_size: int = 1,
                 teacher_dir: str | None = None, megatron_ckpt: str | None = None,
                 megatron: MegatronOptions | dict | None = None):
        """megatron_ckpt: a converted torch_dist directory to start from (else HF weights of
        model_dir); megatron: parallel options overriding `training.megatron`."""
        torch.set_num_threads(training.num_threads)
        torch.manual_seed(seed)
        if isinstance(megatron, dict):
            megatron = MegatronOptions(**megatron)
        self.opts = megatron or MegatronOptions.from_training(training)
        if self.opts.routing_replay:
            _require_experts(model_dir)
        if self.opts.pp != 1:
            raise NotImplementedError("MegatronTrainer runs pipeline size 1 only (training.megatron.pp=1)")
        self.owns_process_group = init_parallel(self.opts.tp, self.opts.pp, self.opts.ep, seed)
        from megatron.core import parallel_state as ps

        self.ps = ps
        self.tp, self.tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.training, self.algorithm, self.group_size = training, algorithm, group_size
        self.temperature, self.max_new_tokens = temperature, max_new_tokens
        self.model_dir = model_dir
        self.hf_config = AutoConfig.from_pretrained(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.shape = model_shape(self.hf_config, self.tp)
        self.tied = self.shape.tied
        if self.opts.ep > 1 and (self.shape.num_experts or 0) % self.opts.ep:
            raise ValueError(f"training.megatron.expert_parallel_size={self.opts.ep} needs an MoE model whose "
                             f"experts split evenly over it; {model_dir} has {self.shape.num_experts or 'no'} experts")
        # fp32 parameters and Adam state (as FSDPTrainer); bf16 autocast for the matmuls on GPU
        self.dtype = torch.float32
        hf_weights = None if megatron_ckpt else load_hf_weights(model_dir)
        # policy and reference replay the engine's experts; critic and teacher route freely
        self.model = self._build(self.hf_config, hf_weights, megatron_ckpt, replay=True).train()
        self.optimizer, self.scheduler = self._optimizer(self.model.parameters(), training.lr)
        self.critic = self.value_head = self.critic_optimizer = self.critic_scheduler = None
        if algorithm.uses_critic:
            self._build_critic(hf_weights, megatron_ckpt, seed)
        self.reference = self._frozen(model_dir, hf_weights, megatron_ckpt, replay=True) \
            if objectives.needs_reference(algorithm) else None
        if algorithm.effective_opd_coef > 0 and teacher_dir is None:
            raise ValueError("a teacher model directory is required for distillation")
        self.teacher = self._frozen(teacher_dir) if algorithm.effective_opd_coef > 0 else None
        self.step = 0

    # ---- construction -------------------------------------------------------------------------
    def _build(self, hf_config, hf_weights, megatron_ckpt: str | None, post_process: bool = True,
               replay: bool = False):
        # post_process=False: the critic trunk (its final norm and head are the ValueHead)
        model = build_gpt_model(hf_config, self.tp, self.dtype, self.opts.ep, recompute=self.opts.recompute,
                                post_process=post_process, fused_swiglu=self.opts.fused_swiglu,
                                compile_layers=self.opts.compile_layers, routing_replay=replay and self.opts.routing_replay)
        if megatron_ckpt is not None:
            verify_manifest(megatron_ckpt)
            load_model_checkpoint(model, Path(megatron_ckpt) / TORCH_DIST)
        else:
            shape = model_shape(hf_config, self.tp)
            weights = mapping.hf_to_megatron_rank(hf_weights, shape, self.tp, self.tp_rank, self.opts.ep,
                                                  self.ps.get_expert_model_parallel_rank())
            own = model.state_dict()
            weights = {k: v for k, v in weights.items() if k in own}
            missing, unexpected = model.load_state_dict(weights, strict=False)
            missing = [k for k in missing if not k.endswith("_extra_state")]
            if missing or unexpected:
                raise RuntimeError(f"weights do not fit the model: missing={missing[:5]} unexpected={unexpected[:5]}")
        return model

    def _build_critic(self, hf_weights, megatron_ckpt, seed: int) -> None:
        self.critic = self._build(self.hf_config, hf_weights, megatron_ckpt, post_process=False).train()
        torch.manual_seed(seed + 1)  # same on every TP rank: the head is replicated
        self.value_head = ValueHead(self.shape.hidden_size, self.hf_config.rms_norm_eps,
                                    getattr(self.hf_config, "initializer_range", 0.02))
        weights = hf_weights if hf_weights is not None else {}
        if "model.norm.weight" in weights:
            self.value_head.norm.weight.data.copy_(weights["model.norm.weight"])
        self.value_head.to(next(self.critic.parameters()).device, self.dtype)
        params = list(self.critic.parameters()) + list(self.value_head.parameters())
        self.critic_optimizer, self.critic_scheduler = self._optimizer(params, self.algorithm.critic_lr)

    def _frozen(self, model_dir: str, hf_weights=None, megatron_ckpt: str | None = None, replay: bool = False):
        hf_config = self.hf_config if model_dir == self.model_dir else AutoConfig.from_pretrained(model_dir)
        if hf_weights is None and megatron_ckpt is None:
            hf_weights = load_hf_weights(model_dir)
        return self._build(hf_config, hf_weights, megatron_ckpt, replay=replay).eval().requires_grad_(False)

    def close(self) -> None:
        shutdown_parallel(self.owns_process_group)

    # ---- forward pieces -------------------------------------------------------------------------
    def _device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        device = next(self.model.parameters()).device
        return {k: v.to(device) for k, v in batch.items()}

    def _batch(self, samples: list[Sample]) -> dict[str, torch.Tensor]:
        return self._device(pad_batch(samples, self.tokenizer.pad_token_id))

    def _rl_batch(self, samples: list[Sample]) -> dict[str, torch.Tensor]:
        """pad_batch on the device, plus the engine's experts when routing replay is on (kept on
        CPU: one micro-batch's layers at a time go to the device, see routing_replay.py)."""
        batch = self._batch(samples)
        if self.opts.routing_replay:
            batch["routed_experts"] = routing_targets(samples, batch["tokens"].shape[1], self.shape.num_layers,
                                                      self.hf_config.num_experts_per_tok, self.shape.num_experts)
        return batch

    def _token_logprobs(self, model, mb: dict[str, torch.Tensor], with_entropy: bool = False, vocab_size=None):
        tokens = mb["tokens"]
        # with recompute the backward re-runs the routers, which must replay the same experts
        backward_follows = self.opts.recompute and torch.is_grad_enabled() and model.training
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=torch.cuda.is_available()), \
                replayed_routing(getattr(model, "router_replays", None), mb.get("routed_experts"), tokens.device,
                                 backward_follows):
            logits = forward_logits(model, tokens)
        return next_token_logprobs(logits, tokens, self.temperature, vocab_size or self.shape.vocab_size,
                                   with_entropy, self.opts.logprob_chunk_tokens,
                                   self.ps.get_tensor_model_parallel_group())

    def _values(self, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        tokens = mb["tokens"]
        hidden = self.critic(input_ids=tokens, position_ids=causal_positions(tokens), attention_mask=None)
        values = self.value_head.score(self.value_head.norm(hidden)).squeeze(-1).transpose(0, 1)  # [b, s]
        return values[:, :-1].float()

    def _my_micro_batches(self, batch: dict[str, torch.Tensor]) -> Iterator[tuple[slice, dict[str, torch.Tensor]]]:
        """This data-parallel rank's micro-batches. With expert parallelism every forward
        exchanges tokens between the EP ranks, so every rank runs as many, all of one shape."""
        return rank_micro_batches(batch, self.training.micro_batch_size, self.dp_rank, self.dp,
                                  equal_shapes=self.opts.ep > 1)

    def _dp_group(self):
        return self.ps.get_data_parallel_group()

    # ---- RLTrainerCore hooks: gradients and metrics across ranks -----------------------------------
    def _sync_and_clip(self, *modules: torch.nn.Module) -> torch.Tensor:
        """Sum gradients over DP (an expert's over the expert-DP ranks that hold the same
        experts); over TP for the q/k norms (each TP rank only sees its own heads, as megatron's
        finalize_model_grads does); then clip the global norm."""
        named = [(n, p) for m in modules for n, p in m.named_parameters() if p.requires_grad]
        dense_group, expert_group = self.ps.get_data_parallel_group(), self.ps.get_expert_data_parallel_group()
        for name, p in named:
            group = expert_group if is_expert_parallel(p) else dense_group
            if dist.get_world_size(group) > 1:
                if p.grad is None:  # unused here (e.g. an expert no token chose); DP peers may disagree
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=group)
            if p.grad is not None and self.tp > 1 and ("q_layernorm" in name or "k_layernorm" in name):
                dist.all_reduce(p.grad, group=self.ps.get_tensor_model_parallel_group())
        return clip_grad_norm([p for _, p in named], self.training.grad_clip)

    def _critic_modules(self) -> tuple[torch.nn.Module, ...]:
        return self.critic, self.value_head

    def _refresh_reference(self) -> None:
        self.reference.load_state_dict(self.model.state_dict())

    # ---- weights out ----------------------------------------------------------------------------
    @staticmethod
    def _gather(tensor: torch.Tensor, group) -> list[torch.Tensor] | None:
        """Every group rank's tensor, on the group's first rank (on CPU); None on the others."""
        first = dist.get_group_rank(group, dist.get_rank()) == 0
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))] if first else None
        dist.gather(tensor.contiguous(), parts, group=group, group_dst=0)
        return [p.cpu() for p in parts] if first else None

    def _full_megatron(self, model) -> dict[str, torch.Tensor]:
        """This model's whole Megatron state dict, on global rank 0 (partial on the others): TP
        shards joined, and with expert parallelism every rank's local experts renumbered to
        their global index. Only rank 0 ever holds a full copy (8 copies of a 30B model would
        not fit in one node's host memory)."""
        ps, full = self.ps, {}
        for name, tensor in model.state_dict().items():
            if name.endswith("_extra_state"):
                continue
            tensor = tensor.detach()
            expert = self.opts.ep > 1 and mapping.local_expert_index(name) is not None
            tp_group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
            if mapping.parallel_kind(name) != "replicated" and dist.get_world_size(tp_group) > 1:
                parts = self._gather(tensor, tp_group)
                if parts is None:  # sent to this TP group's first rank; so were its EP peers'
                    continue
                tensor = mapping.unshard(name, parts)
            if not expert:
                full[name] = tensor.cpu()
                continue
            parts = self._gather(tensor, ps.get_expert_model_parallel_group())
            num_local = self.shape.num_experts // self.opts.ep
            for ep_rank, part in enumerate(parts or []):
                full[mapping.renumber_expert(name, ep_rank * num_local)] = part
        return full

    def hf_state_dict(self, to_cpu: bool | None = None) -> dict[str, torch.Tensor]:
        """Full weights under Hugging Face names, on CPU (tied lm_head dropped), on rank 0 (the
        rank whose result a TrainerGroup returns); {} on the other ranks. Collective.
        to_cpu is accepted for the FSDPTrainer signature (the object-store transport passes it);
        the result is on CPU either way.

        MoE experts come one tensor per expert, the checkpoint layout SGLang loads (the embedded
        engine fuses them for its transformers 5 modules)."""
        full = self._full_megatron(self.model)
        return mapping.megatron_to_hf(full, model_shape(self.hf_config, self.tp)) if dist.get_rank() == 0 else {}

    def weights_sha256(self) -> str:
        return weights_sha256(self.hf_state_dict())

    def export_hf(self, out_dir: str | Path) -> Path:
        """Save a standalone HF directory (config, safetensors weights, tokenizer). Collective."""
        out_dir = Path(out_dir)
        weights = self.hf_state_dict()
        if dist.get_rank() == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            self.hf_config.save_pretrained(out_dir)
            self.tokenizer.save_pretrained(out_dir)
            source_gen = Path(self.model_dir) / "generation_config.json"
            if source_gen.is_file():
                (out_dir / "generation_config.json").write_text(source_gen.read_text())
            save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        dist.barrier()
        return out_dir

    # ---- checkpoints -----------------------------------------------------------------------------
    def _modules(self):
        yield "policy", self.model, self.optimizer, self.scheduler, None
        if self.critic is not None:
            yield "critic", self.critic, self.critic_optimizer, self.critic_scheduler, self.value_head.named_tensors()

    def save_state(self, out_dir: str | Path, extra: dict[str, Any]) -> None:
        """Policy (+critic) weights and optimizers as torch_dist, schedulers/RNG/extra as JSON."""
        out_dir = Path(out_dir)
        meta: dict[str, Any] = {"modules": {}, "layout": {"tp": self.tp, "ep": self.opts.ep, "dp": self.dp}}
        for name, model, optimizer, scheduler, tensors in self._modules():
            sub = TORCH_DIST if name == "policy" else f"{name}_{TORCH_DIST}"
            schedule = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
            meta["modules"][name] = {**state.save(out_dir / sub, model, optimizer, tensors), "scheduler": schedule}
        if self.reference is not None and self.algorithm.ref_refresh_interval_steps:
            state.save(out_dir / f"reference_{TORCH_DIST}", self.reference, None)
        if dist.get_rank() == 0:
            rng_tensors, meta["python_rng"] = state_io.rng_state()
            save_file(rng_tensors, str(out_dir / "rng.safetensors"))
            meta["trainer_step"] = self.step
            (out_dir / "trainer_state.json").write_text(json.dumps({**meta, **extra}, indent=1))
        dist.barrier()

    def load_state(self, ckpt_dir: str | Path) -> dict[str, Any]:
        """Restore everything save_state wrote (at any TP size); returns the `extra` dict."""
        ckpt_dir = Path(ckpt_dir)
        meta = json.loads((ckpt_dir / "trainer_state.json").read_text())
        modules = meta.pop("modules")
        meta.pop("layout", None)
        for name, model, optimizer, scheduler, tensors in self._modules():
            sub = TORCH_DIST if name == "policy" else f"{name}_{TORCH_DIST}"
            state.load(ckpt_dir / sub, model, optimizer, modules[name], tensors)
            scheduler.load_state_dict({**modules[name]["scheduler"], "lr_lambdas": [None]})
        if (ckpt_dir / f"reference_{TORCH_DIST}").is_dir() and self.reference is not None:
            state.load(ckpt_dir / f"reference_{TORCH_DIST}", self.reference, None, None)
        state_io.set_rng_state(load_file(str(ckpt_dir / "rng.safetensors")), meta.pop("python_rng"))
        self.step = int(meta.pop("trainer_step"))
        return meta

