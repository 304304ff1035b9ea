"""training.lora: low-rank adapters (LoRA) on a frozen base, trained by the FSDP2 backend via peft."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from miles_core.config.base import Section

# The linear layers of the decoder blocks of Llama/Qwen-style models (what "all-linear" means here:
# peft's own "all-linear" also excludes the output head, which we never adapt either).
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAConfig(Section):
    """Train rank-`rank` adapters B @ A on the target linear layers while the base weights stay frozen;
    the layer computes W x + (alpha / rank) B A x. Present in a recipe = enabled (unless enabled: false).
    It applies to the RL steps; the SFT warm-up (warmup.*) trains every weight."""

    enabled: bool = True
    """false keeps the section in the recipe but trains every weight (full fine-tuning)."""
    rank: int = Field(8, ge=1, le=1024)
    """Rank r of each adapter pair (A is r x in_features, B is out_features x r)."""
    alpha: float = Field(16.0, gt=0)
    """Scale numerator: the adapter's output is multiplied by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input while training. Non-zero makes the trainer's log-probs
    random, so they no longer match the engine's (keep 0 for on-policy RL)."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Names (last path component, e.g. q_proj, v_proj) of the linear layers to adapt, or
    "all-linear": every linear layer of the decoder blocks (attention and MLP projections)."""

    @field_validator("target_modules")
    @classmethod
    def _names(cls, value):
        if isinstance(value, list):
            if not value:
                raise ValueError('name at least one module (e.g. [q_proj, v_proj]) or use "all-linear"')
            bad = [n for n in value if not n or "." in n or n == "lm_head"]
            if bad:
                raise ValueError(f"{bad}: give last name components of decoder linear layers "
                                 f"(one of {', '.join(ALL_LINEAR)}), not paths or lm_head")
        return value

    @property
    def modules(self) -> list[str]:
        """target_modules with "all-linear" resolved."""
        return list(ALL_LINEAR) if self.target_modules == "all-linear" else list(self.target_modules)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def check_lora_engines(cfg) -> None:
    """training.lora with rollout.engine=sglang: the engines are launched to serve adapters
    (miles_core.engines.sglang.args.lora_server_args fills in or checks enable_lora, max_lora_rank
    and lora_target_modules) and each sync loads the adapter alone from a folder on the disk the
    trainer and engines share (/load_lora_adapter), so the transport must be disk."""
    from miles_core.engines.sglang.args import lora_server_args

    r, t = cfg.rollout, cfg.training
    if not t.lora_enabled or r.engine.kind != "sglang":
        return
    if r.weight_transport.kind != "disk":
        raise ValueError(f"training.lora with rollout.engine=sglang syncs the adapter alone, which SGLang loads from "
                         f"a folder (/load_lora_adapter): set rollout.weight_transport=disk (or auto), not "
                         f"{r.weight_transport.kind}")
    if cfg.placement.time_sharing:
        raise ValueError("placement.time_sharing releases the engines' weights every step, and the adapter sync to "
                         "SGLang loads the adapter alone, never the base: set placement.time_sharing=false, or "
                         "rollout.engine=embedded")
    r.engine.server_args = lora_server_args(r.engine.server_args, t.lora.rank, t.lora.modules)
