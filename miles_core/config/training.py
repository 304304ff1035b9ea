"""The trainer's sections: its backend (FSDP2 or Megatron-LM), their layouts, and the optimizer,
batch and resource settings (`training:` in a recipe)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from miles_core.config.base import Section
from miles_core.config.lora import LoRAConfig


class MegatronConfig(Section):
    """Megatron-LM layout and memory options (used when training.backend is megatron)."""

    tensor_parallel_size: int = Field(1, ge=1)
    """Tensor-parallel ranks per model replica (must divide the attention and key/value heads)."""
    pipeline_parallel_size: int = Field(1, ge=1)
    """Pipeline stages; only 1 is implemented (the trainer and the converter run one stage)."""
    context_parallel_size: int = Field(1, ge=1)
    """Context-parallel ranks; only 1 is implemented (it needs TransformerEngine attention)."""
    expert_parallel_size: int = Field(1, ge=1)
    """Expert-parallel ranks of MoE models (must divide the number of experts)."""
    recompute_activations: bool = False
    """Full activation recomputation, one layer per checkpoint: keeps only each layer's input
    alive and recomputes the rest in backward (~1/3 more compute, far less memory)."""
    logprob_chunk_tokens: int | None = Field(None, ge=1)
    """Tokens per chunk of the vocab-parallel log-prob pass. None: on CPU (eager), ~256 MB of fp32
    logits per chunk; on CUDA (compiled), under 2^31 logits per chunk, so its kernels index in int32."""
    fused_swiglu: bool = False
    """Megatron's fused SwiGLU (GPU only; ignored on CPU)."""
    routing_replay: bool = False
    """MoE routing replay (R3): the rollout engines return the experts each token was routed to
    (`return_routed_experts`) and the trainer's forward passes (old/reference log-probs and the
    update) use exactly those experts instead of recomputing top-k, so that train and rollout
    log-probs agree. Only for MoE models (the trainer refuses a dense one); SGLang engines also
    need rollout.engine.server_args.enable_return_routed_experts: true."""

    @model_validator(mode="after")
    def _implemented_layouts(self) -> MegatronConfig:
        if self.pipeline_parallel_size != 1:
            raise ValueError("pipeline parallelism is not implemented yet: set "
                             "training.megatron.pipeline_parallel_size=1")
        if self.context_parallel_size != 1:
            raise ValueError("context parallelism is not implemented yet (it needs TransformerEngine "
                             "attention): set training.megatron.context_parallel_size=1")
        return self


class FSDPConfig(Section):
    """FSDP2 compute and memory options (used when training.backend is fsdp2)."""

    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of forward and backward: bfloat16 gathers parameters and computes in bf16 (FSDP2's
    MixedPrecisionPolicy) while master weights, Adam states and the gradient reduction stay float32.
    Log-probs then carry bf16 rounding (rollout/train_logprob_abs_diff shows it)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward, keeping only its input: ~1/3 more
    compute, far less activation memory (the same gradients)."""


class TrainingConfig(Section):
    backend: Literal["fsdp2", "megatron"] = "fsdp2"
    """Training backend: torch FSDP2 (options in training.fsdp) or Megatron-LM (training.megatron)."""
    megatron: MegatronConfig = MegatronConfig()
    """Megatron-LM parallel layout and memory options; ignored by the fsdp2 backend."""
    fsdp: FSDPConfig = FSDPConfig()
    """FSDP2 mixed precision and activation checkpointing; ignored by the megatron backend."""
    lora: LoRAConfig | None = None
    """Low-rank adapters on a frozen base (FSDP2 backend only). `lora: {}` enables them with the
    defaults; absent, null (what a dumped config without LoRA holds) or enabled: false trains
    every weight. With rollout.engine=sglang the engines serve the adapter by name (enable_lora,
    max_lora_rank, lora_target_modules set in its server_args) and each sync loads it from disk."""
    num_steps: int = Field(40, ge=1)
    """RL steps (rollout -> train -> weight sync) in the run."""
    lr: float = Field(1e-3, gt=0)
    """Adam learning rate of the RL stage."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    grad_clip: float = Field(1.0, gt=0)
    """Max global gradient norm."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up steps (then constant)."""
    micro_batch_size: int = Field(256, ge=1)
    """Sequences per forward/backward; gradients accumulate across micro-batches."""
    num_updates_per_step: int = Field(1, ge=1)
    """Optimizer updates per RL step (mini-batches); >1 makes the ratio differ from 1."""
    num_threads: int = Field(2, ge=1)
    """torch intra-op threads of the trainer and engine processes on CPU."""
    fp8: bool = False
    """Train with FP8 matmuls (torchao float8 linears, dynamic per-tensor scaling) in the decoder
    layers' projections, master weights and optimizer states unchanged. FSDP2 backend on Hopper
    (or newer) GPUs with torchao installed; refused with megatron, and on CPU at start-up."""
    compile_decoder_layers: bool = False
    """torch.compile each decoder layer of the trained models (GPU only; ignored on CPU): fuses the
    norms, RoPE, SwiGLU and residual adds between the matmuls. The first step pays the compile."""
    cpus_per_trainer: float = Field(1.0, gt=0)
    """Ray CPUs reserved by the trainer, in all: a Megatron trainer group (tp * ep ranks) splits
    them evenly over its rank actors."""
    gpus_per_trainer: float = Field(0.0, ge=0)
    """Ray GPUs reserved by the trainer, in all: 0 on CPU, else one per rank (world_size)."""
    data_parallel_size: int | None = Field(None, ge=1)
    """Data-parallel ranks; each takes a deterministic share of every batch's micro-batches.
    FSDP2: Ray actors (one GPU each; gloo processes on CPU) that the parameters, gradients and
    Adam states are sharded over. Megatron: model replicas of tp * pp ranks each (a multiple of
    expert_parallel_size: the experts are split over ep of them). None: 1 for FSDP2,
    expert_parallel_size for Megatron."""

    @property
    def dp(self) -> int:
        """data_parallel_size with its default resolved."""
        default = self.megatron.expert_parallel_size if self.backend == "megatron" else 1
        return self.data_parallel_size or default

    @property
    def world_size(self) -> int:
        """Trainer ranks (Ray actors): dp for FSDP2, tp * pp * dp for Megatron (each holding
        1/ep of the experts)."""
        if self.backend == "megatron":
            return self.megatron.tensor_parallel_size * self.megatron.pipeline_parallel_size * self.dp
        return self.dp

    @property
    def lora_enabled(self) -> bool:
        return self.lora is not None and self.lora.enabled

    @model_validator(mode="after")
    def _lora_on_fsdp2(self) -> TrainingConfig:
        # megatron-core 0.16 has no LoRA of its own (Megatron-Bridge's PEFT is a separate package);
        # a second, hand-written LoRA on Megatron's parallel layers is not worth its upkeep.
        if self.lora_enabled and self.backend == "megatron":
            raise ValueError("training.lora is implemented for the fsdp2 backend only (megatron-core has no "
                             "LoRA of its own): set training.backend=fsdp2, or remove training.lora "
                             "(or set training.lora.enabled=false) to train all weights with Megatron")
        return self

    @model_validator(mode="after")
    def _data_parallel_fits(self) -> TrainingConfig:
        ep = self.megatron.expert_parallel_size
        if self.backend == "megatron" and self.dp % ep:
            raise ValueError(f"training.data_parallel_size={self.dp} must be a multiple of "
                             f"training.megatron.expert_parallel_size={ep} (the experts are split over ep of the "
                             f"data-parallel replicas): set data_parallel_size to {ep}, {2 * ep}, ...")
        return self

    @model_validator(mode="after")
    def _one_gpu_per_rank(self) -> TrainingConfig:
        ranks = self.world_size
        if ranks > 1 and self.gpus_per_trainer not in (0, ranks):
            # Each rank is its own process on its own device; NCCL cannot put two ranks on one GPU,
            # and a rank uses only one.
            layout = ("training.megatron tensor x pipeline x expert parallel" if self.backend == "megatron"
                      else "training.data_parallel_size")
            raise ValueError(f"{layout} = {ranks} runs {ranks} trainer ranks with one GPU each, but "
                             f"training.gpus_per_trainer={self.gpus_per_trainer:g}: set training.gpus_per_trainer={ranks} "
                             "(or 0 on CPU)")
        return self
