"""The FSDP2 training backend: an HF causal LM sharded with `fully_shard`, AdamW, and
checkpoints in safetensors + JSON (no pickle anywhere on the load path)."""

from __future__ import annotations

import json
import os
import random
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles_core import algorithms as algo
from miles_core.config import AlgorithmConfig, TrainingConfig
from miles_core.data import Sample
from miles_core.weights import weights_sha256

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ensure_process_group() -> bool:
    """Join the launcher's group (torchrun / Ray sets WORLD_SIZE) or make a private
    world-size-1 gloo group. Returns True when this call created the group."""
    if dist.is_initialized():
        return False
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    return True


def pad_batch(samples: list[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded tokens plus per-position tensors aligned with next-token targets.

    Position t of the [B, L-1] tensors is the prediction of token t+1; the mask is 1 where
    that token is a generated response token.
    """
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    tokens = torch.full((len(samples), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(samples), width - 1)
    rollout_logp = torch.zeros(len(samples), width - 1)
    for row, s in enumerate(samples):
        seq = s.prompt_ids + s.response_ids
        tokens[row, : len(seq)] = torch.tensor(seq)
        start, end = len(s.prompt_ids) - 1, len(seq) - 1
        mask[row, start:end] = 1.0
        if s.rollout_logprobs:
            rollout_logp[row, start:end] = torch.tensor(s.rollout_logprobs)
    attention = (torch.arange(width)[None, :] < torch.tensor(
        [len(s.prompt_ids) + len(s.response_ids) for s in samples])[:, None]).long()
    advantages = torch.tensor([s.advantage for s in samples])[:, None].expand(-1, width - 1)
    return {"tokens": tokens, "attention": attention, "mask": mask,
            "rollout_logp": rollout_logp, "advantages": advantages.contiguous()}


class FSDPTrainer:
    """Owns the policy, its optimizer and scheduler; speaks HF parameter names."""

    def __init__(self, model_dir: str, training: TrainingConfig, algorithm: AlgorithmConfig,
                 temperature: float = 1.0, max_new_tokens: int = 8, seed: int = 0):
        torch.set_num_threads(training.num_threads)
        torch.manual_seed(seed)
        self.owns_process_group = ensure_process_group()
        self.training, self.algorithm = training, algorithm
        self.temperature, self.max_new_tokens = temperature, max_new_tokens
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.tied = bool(self.model.config.tie_word_embeddings)
        for layer in self.model.model.layers:
            fully_shard(layer)
        fully_shard(self.model)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=training.lr,
                                           betas=tuple(training.adam_betas), weight_decay=training.weight_decay)
        warmup = training.lr_warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)
        self.reference = None
        if algorithm.kl_loss_coef > 0:
            self.reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.step = 0

    def close(self) -> None:
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()

    # ---- forward pieces -------------------------------------------------------------------
    def _token_logprobs(self, model, batch: dict[str, torch.Tensor], with_entropy: bool = False):
        logits = model(input_ids=batch["tokens"], attention_mask=batch["attention"]).logits[:, :-1]
        logits = logits.float() / self.temperature
        logp = torch.log_softmax(logits, dim=-1).gather(-1, batch["tokens"][:, 1:, None]).squeeze(-1)
        return logp, (algo.entropy_from_logits(logits) if with_entropy else None)

    def _micro_batches(self, samples: list[Sample]) -> list[dict[str, torch.Tensor]]:
        size = self.training.micro_batch_size
        return [pad_batch(samples[i : i + size], self.tokenizer.pad_token_id) for i in range(0, len(samples), size)]

    @torch.no_grad()
    def compute_logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """Trainer log-probs of each sample's response tokens (for mismatch checks)."""
        out = []
        for mb in self._micro_batches(samples):
            logp, _ = self._token_logprobs(self.model, mb)
            for row in range(logp.shape[0]):
                out.append(logp[row][mb["mask"][row] > 0].tolist())
        return out[: len(samples)]

    # ---- one RL step ----------------------------------------------------------------------
    def train_step(self, samples: list[Sample]) -> dict[str, float]:
        """Policy-gradient update(s) on one rollout batch; returns scalar metrics."""
        num_updates = self.training.num_updates_per_step
        chunk = -(-len(samples) // num_updates)
        metrics: dict[str, float] = {}
        for update in range(num_updates):
            part = samples[update * chunk : (update + 1) * chunk]
            if part:
                metrics = self._update(part, first=(update == 0), metrics=metrics)
        self.step += 1
        metrics["train/lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    def _update(self, samples: list[Sample], first: bool, metrics: dict[str, float]) -> dict[str, float]:
        batches = self._micro_batches(samples)
        with torch.no_grad():
            for mb in batches:
                mb["old_logp"], _ = self._token_logprobs(self.model, mb)
                if self.reference is not None:
                    mb["ref_logp"], _ = self._token_logprobs(self.reference, mb)
        totals = {"num_tokens": sum(float(mb["mask"].sum()) for mb in batches), "num_seqs": float(len(samples))}
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for mb in batches:
            loss, parts = self._loss(mb, totals)
            loss.backward()
            for key, value in parts.items():
                sums[key] = sums.get(key, 0.0) + value
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.training.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        sums["train/grad_norm"] = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        if first:  # mismatch metrics are defined against the rollout, i.e. before any update
            metrics.update({k: v for k, v in sums.items()})
        else:
            metrics.update({k: v for k, v in sums.items() if not k.startswith("rollout/")})
        return metrics

    def _loss(self, mb: dict[str, torch.Tensor], totals: dict[str, float]) -> tuple[torch.Tensor, dict]:
        cfg, mask = self.algorithm, mb["mask"]
        want_entropy = cfg.entropy_coef > 0
        logp, entropy = self._token_logprobs(self.model, mb, with_entropy=want_entropy)
        token_loss, clipped, ratio = algo.clipped_policy_loss(
            logp, mb["old_logp"], mb["advantages"], cfg.eps_clip_low, cfg.eps_clip_high)

        def agg(values: torch.Tensor) -> torch.Tensor:  # micro-batch share of the global mean
            return algo.aggregate(values, mask, cfg.loss_aggregation, self.max_new_tokens,
                                  num_tokens=totals["num_tokens"], num_seqs=totals["num_seqs"])

        loss = agg(token_loss)
        parts = {"train/pg_loss": float(loss), "train/clip_frac": float(agg(clipped)),
                 "train/ppo_kl": float(agg(mb["old_logp"] - logp.detach()))}
        if entropy is not None:
            ent = agg(entropy)
            loss = loss - cfg.entropy_coef * ent
            parts["train/entropy"] = float(ent)
        if self.reference is not None:
            kl = agg(algo.kl_estimate(logp, mb["ref_logp"], cfg.kl_estimator))
            loss = loss + cfg.kl_loss_coef * kl
            parts["train/kl_loss"] = float(kl)
        diff = (mb["old_logp"] - mb["rollout_logp"]).abs()
        parts["rollout/train_logprob_abs_diff"] = float(agg(diff))
        parts["train/loss"] = float(loss)
        return loss, parts

    def sft_step(self, samples: list[Sample]) -> float:
        """One supervised step: -mean log p(response tokens)."""
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        batches = self._micro_batches(samples)
        num_tokens = sum(float(mb["mask"].sum()) for mb in batches)
        for mb in batches:
            logp, _ = self._token_logprobs(self.model, mb)
            loss = -(logp * mb["mask"]).sum() / num_tokens
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.training.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return total

    # ---- weights out ------------------------------------------------------------------------
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights under Hugging Face names, on CPU."""
        state = get_model_state_dict(self.model, options=FULL)
        if self.tied:
            state.pop("lm_head.weight", None)
        return {k: v.contiguous() for k, v in state.items()}

    def weights_sha256(self) -> str:
        return weights_sha256(self.hf_state_dict())

    def export_hf(self, out_dir: str | Path) -> Path:
        """Save a standalone HF directory (config, safetensors weights, tokenizer)."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        self.model.config.save_pretrained(out_dir)
        if getattr(self.model, "generation_config", None) is not None:
            self.model.generation_config.save_pretrained(out_dir)
        save_file(self.hf_state_dict(), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        self.tokenizer.save_pretrained(out_dir)
        return out_dir

    # ---- checkpoints ----------------------------------------------------------------------------
    def save_state(self, out_dir: str | Path, extra: dict[str, Any]) -> None:
        """Model, optimizer, scheduler and RNG state as safetensors + JSON files in out_dir."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file(self.hf_state_dict(), str(out_dir / "model.safetensors"))
        optim = get_optimizer_state_dict(self.model, self.optimizer, options=FULL)
        tensors = {f"{fqn}::{key}": value.detach().cpu().contiguous()
                   for fqn, entry in optim["state"].items() for key, value in entry.items()}
        tensors["__rng__::torch"] = torch.get_rng_state()
        save_file(tensors, str(out_dir / "optimizer.safetensors"))
        meta = {
            "param_groups": optim["param_groups"],
            "scheduler": {k: v for k, v in self.scheduler.state_dict().items() if k != "lr_lambdas"},
            "python_rng": _encode_python_rng(random.getstate()),
            "trainer_step": self.step,
            **extra,
        }
        (out_dir / "trainer_state.json").write_text(json.dumps(meta, indent=1))

    def load_state(self, ckpt_dir: str | Path) -> dict[str, Any]:
        """Restore everything save_state wrote; returns the `extra` dict given at save time."""
        ckpt_dir = Path(ckpt_dir)
        weights = load_file(str(ckpt_dir / "model.safetensors"))
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        if self.tied:
            weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
        set_model_state_dict(self.model, weights, options=StateDictOptions(full_state_dict=True))
        flat = load_file(str(ckpt_dir / "optimizer.safetensors"))
        meta = json.loads((ckpt_dir / "trainer_state.json").read_text())
        torch.set_rng_state(flat.pop("__rng__::torch"))
        state: dict[str, dict[str, torch.Tensor]] = {}
        for name, value in flat.items():
            fqn, _, key = name.rpartition("::")
            state.setdefault(fqn, {})[key] = value
        set_optimizer_state_dict(self.model, self.optimizer,
                                 {"state": state, "param_groups": meta.pop("param_groups")},
                                 options=StateDictOptions(full_state_dict=True))
        self.scheduler.load_state_dict({**meta.pop("scheduler"), "lr_lambdas": [None]})
        random.setstate(_decode_python_rng(meta.pop("python_rng")))
        self.step = int(meta.pop("trainer_step"))
        return meta


def _encode_python_rng(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _decode_python_rng(state: list) -> tuple:
    version, internal, gauss = state
    return version, tuple(internal), gauss
