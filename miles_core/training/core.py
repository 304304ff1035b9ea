"""What the loop calls on a trainer (`Trainer`), and the one RL step both backends share.

`RLTrainerCore` owns the step: score the old policy / reference / teacher / critic, advantages
and importance weights (miles_core.objectives), micro-batched updates with gradient
accumulation, metrics, optimizers and the reference refresh. A backend (FSDPTrainer,
MegatronTrainer) builds the models and fills in the hooks below: how to forward, how this
rank's micro-batches are chosen, how gradients are reduced and clipped, and how sums cross
ranks. Everything else about a step is written once, here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from miles_core import algorithms as algo
from miles_core import objectives
from miles_core.config import AlgorithmConfig, TrainingConfig
from miles_core.metrics import TRAIN_LOSS
from miles_core.net import init_custom_process_group, rendezvous_endpoint
from miles_core.training.batches import Batch, mixed_version_fraction, select_rows
from miles_core.training.data_parallel import sum_metrics_over_ranks, sum_over_ranks
from miles_core.types import Sample
from miles_core.weight_sync.shared import BufferHandle, SharedWeights


class Trainer(Protocol):
    """The trainer calls of the loop, the weight transports, checkpoints and the warm-up."""

    def train_step(self, samples: list[Sample]) -> dict[str, float]: ...
    def sft_step(self, samples: list[Sample]) -> float: ...
    def compute_logprobs(self, samples: list[Sample]) -> list[list[float]]: ...
    def hf_state_dict(self, to_cpu: bool | None = None) -> dict[str, torch.Tensor]: ...
    def weights_sha256(self) -> str: ...
    def export_hf(self, out_dir: str | Path) -> Path: ...
    def save_state(self, out_dir: str | Path, extra: dict[str, Any]) -> None: ...
    def load_state(self, ckpt_dir: str | Path) -> dict[str, Any]: ...
    def close(self) -> None: ...
    def share_weights(self, dtype: str) -> BufferHandle | None: ...
    def write_shared_weights(self) -> None: ...
    def unlink_shared_weights(self) -> None: ...


class RLTrainerCore:
    """The shared RL step. Subclasses set the attributes below in __init__ and define the hooks."""

    training: TrainingConfig
    algorithm: AlgorithmConfig
    group_size: int
    max_new_tokens: int
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    critic: torch.nn.Module | None
    critic_optimizer: torch.optim.Optimizer | None
    critic_scheduler: Any
    reference: torch.nn.Module | None
    teacher: torch.nn.Module | None
    step: int

    # ---- hooks ----------------------------------------------------------------------------------
    def _batch(self, samples: list[Sample]) -> Batch:
        """Padded tensors of the samples on the trainer's device."""
        raise NotImplementedError

    def _rl_batch(self, samples: list[Sample]) -> Batch:
        """_batch plus what an RL step needs beyond SFT (Megatron: the engines' routed experts)."""
        return self._batch(samples)

    def _token_logprobs(self, model, mb: Batch, with_entropy: bool = False):
        """(log p of each next token [B, T-1], entropy or None) of `model` on a micro-batch."""
        raise NotImplementedError

    def _values(self, mb: Batch) -> torch.Tensor:
        """The critic's value of each next-token position [B, T-1]."""
        raise NotImplementedError

    def _my_micro_batches(self, batch: Batch) -> Iterator[tuple[slice, Batch]]:
        """This data-parallel rank's (rows, micro-batch) pairs (miles_core.training.data_parallel)."""
        raise NotImplementedError

    def _dp_group(self):
        """The data-parallel process group (None: the default group)."""
        raise NotImplementedError

    def _sync_and_clip(self, *modules: torch.nn.Module) -> torch.Tensor:
        """Reduce the modules' gradients where the backend needs it, clip, return the global norm."""
        raise NotImplementedError

    def _critic_modules(self) -> tuple[torch.nn.Module, ...]:
        return (self.critic,)

    def _refresh_reference(self) -> None:
        """Copy the policy's current weights into the reference model."""
        raise NotImplementedError

    def _lazy_old_logprobs(self) -> bool:
        """Whether the update's own forward may provide the old log-probs (see objectives)."""
        return False

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    # ---- shared -----------------------------------------------------------------------------------
    def _optimizer(self, params, lr: float):
        t = self.training
        params = list(params)
        # One fused kernel per step on GPU instead of foreach's chain of multi-tensor launches:
        # 1-3% of a 0.6B step on an H100 (bench/megatron_mfu.py --foreach-adamw-row).
        fused = bool(params) and all(p.is_cuda for p in params)
        optimizer = torch.optim.AdamW(params, lr=lr, betas=tuple(t.adam_betas), weight_decay=t.weight_decay,
                                      fused=fused or None)
        warmup = t.lr_warmup_steps
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
        return optimizer, schedule

    @torch.no_grad()
    def _score(self, batch: Batch, with_old: bool = True) -> None:
        """Old-policy, reference, teacher log-probs and old values of every row: each rank
        scores its micro-batches, the sum over ranks fills in the rest."""
        scorers = {"old_logp": lambda mb: self._token_logprobs(self.model, mb)[0]} if with_old else {}
        if self.reference is not None:
            scorers["ref_logp"] = lambda mb: self._token_logprobs(self.reference, mb)[0]
        if self.teacher is not None:
            scorers["teacher_logp"] = lambda mb: self._token_logprobs(self.teacher, mb)[0]
        if self.critic is not None:
            scorers["old_values"] = self._values
        for key, scorer in scorers.items():
            out = torch.zeros_like(batch["mask"])
            for rows, mb in self._my_micro_batches(batch):
                out[rows] = scorer(mb)[: rows.stop - rows.start].to(out.dtype)
            batch[key] = sum_over_ranks(out, self._dp_group())

    @torch.no_grad()
    def compute_logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """Trainer log-probs of each sample's response tokens (for mismatch checks)."""
        batch = self._rl_batch(samples)
        self._score(batch)
        return [batch["old_logp"][row][batch["mask"][row] > 0].tolist() for row in range(len(samples))]

    def train_step(self, samples: list[Sample]) -> dict[str, float]:
        """Score, compute advantages over the whole batch, then policy/critic update(s)."""
        cfg, num_updates = self.algorithm, self.training.num_updates_per_step
        batch = self._rl_batch(samples)
        lazy_old = objectives.old_logp_from_update_forward(cfg, num_updates) and self._lazy_old_logprobs()
        self._score(batch, with_old=not lazy_old)
        if not lazy_old:
            objectives.anchor_old_logprobs(cfg, batch)
        objectives.compute_advantages(cfg, batch, self.group_size)
        weights = objectives.importance_weights(cfg, batch)
        batch["is_weights"] = weights if weights is not None else torch.ones_like(batch["mask"])
        self._update_logp: list[torch.Tensor] = []
        chunk = -(-len(samples) // num_updates)
        metrics: dict[str, float] = {}
        for start in range(0, len(samples), chunk):
            metrics |= self._update(select_rows(batch, slice(start, start + chunk)))
        if lazy_old:
            batch["old_logp"] = torch.cat(self._update_logp)
        metrics |= self._batch_metrics(batch)
        self.step += 1
        refresh = cfg.ref_refresh_interval_steps
        if refresh and self.reference is not None and self.step % refresh == 0:
            self._refresh_reference()
        metrics["train/lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    def _batch_metrics(self, batch: Batch) -> dict[str, float]:
        mask = batch["mask"]
        train_logp = batch.get("trainer_logp", batch["old_logp"])
        metrics = {k: float(v) for k, v in algo.mismatch_metrics(train_logp, batch["rollout_logp"], mask).items()}
        metrics["rollout/train_logprob_abs_diff"] = metrics["mismatch/logprob_abs_diff"]
        if "token_version" in batch:
            metrics["train/mixed_version_sample_frac"] = mixed_version_fraction(batch)
        metrics["train/advantage_abs_mean"] = float((batch["advantages"].abs() * mask).sum() / mask.sum().clamp(min=1))
        if self.teacher is not None:
            metrics["opd/reverse_kl"] = float(((train_logp - batch["teacher_logp"]) * mask).sum() / mask.sum())
        return metrics

    def _update(self, batch: Batch) -> dict[str, float]:
        train_policy = self.step >= self.algorithm.critic_warmup_steps
        totals = {"num_tokens": float(batch["mask"].sum()), "num_seqs": float(len(batch["tokens"]))}
        self.optimizer.zero_grad(set_to_none=True)
        if self.critic is not None:
            self.critic_optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for rows, mb in self._my_micro_batches(batch):
            loss, parts = self._loss(mb, totals) if train_policy else (torch.zeros(()), {})
            if self.critic is not None:
                share = (rows.stop - rows.start) / totals["num_seqs"]
                value_loss = algo.value_loss(self._values(mb), mb["old_values"], mb["returns"], mb["mask"],
                                             self.algorithm.value_clip) * share
                loss = loss + value_loss
                parts["train/value_loss"] = float(value_loss.detach())
            if loss.requires_grad:
                self._backward(loss)
            for key, value in parts.items():
                sums[key] = sums.get(key, 0.0) + value
        sums = sum_metrics_over_ranks(sums, self._dp_group())
        if train_policy:
            sums["train/grad_norm"] = float(self._sync_and_clip(self.model))
            self.optimizer.step()
        self.scheduler.step()
        if self.critic is not None:
            self._sync_and_clip(*self._critic_modules())
            self.critic_optimizer.step()
            self.critic_scheduler.step()
        sums.setdefault(TRAIN_LOSS, sums.get("train/value_loss", 0.0))
        return sums

    def _loss(self, mb: Batch, totals: dict[str, float]) -> tuple[torch.Tensor, dict]:
        cfg = self.algorithm
        logp, entropy = self._token_logprobs(self.model, mb, with_entropy=cfg.entropy_coef > 0)
        self._update_logp.append(logp.detach())
        if "old_logp" not in mb:  # one update per batch: the old policy is this forward's
            mb["old_logp"] = logp.detach()
        return objectives.policy_loss(cfg, logp, entropy, mb, totals, self.max_new_tokens)

    def sft_step(self, samples: list[Sample]) -> float:
        """One supervised step: agg(-log p) over the trainable response tokens."""
        batch = self._batch(samples)
        num_tokens = float(batch["mask"].sum())
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for _, mb in self._my_micro_batches(batch):
            loss = algo.sft_loss(self._token_logprobs(self.model, mb)[0], mb["mask"], num_tokens=num_tokens)
            self._backward(loss)
            total += float(loss.detach())
        self._sync_and_clip(self.model)
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return sum_metrics_over_ranks({"loss": total}, self._dp_group())["loss"]

    # ---- shared-memory weight sync (miles_core.weight_sync.transports.SharedMemoryTransport) -----------------
    _shared: SharedWeights | None = None

    def share_weights(self, dtype: str) -> BufferHandle | None:
        """Lay out a fresh buffer, holding the current weights in the engines' dtype, that
        engines on this GPU (or, training on CPU, this machine) map; its handle on rank 0,
        None on the others. A collective, like hf_state_dict."""
        weights = self._weights_to_share()
        self.unlink_shared_weights()
        self._shared = None
        if not weights or _rank() != 0:
            return None
        self._shared = SharedWeights.create(weights, getattr(torch, dtype))
        self._shared.write(weights)
        return self._shared.handle

    def _weights_to_share(self) -> dict[str, torch.Tensor]:
        """Hook: the weights under HF names, as cheaply as the backend can give them (views of
        the parameters where they are whole). A collective."""
        return self.hf_state_dict(to_cpu=False)

    def write_shared_weights(self) -> None:
        """Cast the current weights into the shared buffer. A collective."""
        weights = self._weights_to_share()
        if self._shared is not None:
            self._shared.write(weights)

    def unlink_shared_weights(self) -> None:
        """Remove a CPU buffer's /dev/shm file once every engine has mapped it: the mappings
        stay valid, and a killed trainer leaves nothing behind."""
        if self._shared is not None:
            self._shared.close()

    # ---- broadcast weight sync (sender side; see miles_core.weight_sync.transports.BroadcastTransport) -------
    broadcast_group: Any = None

    def broadcast_backend(self) -> str:
        return "nccl" if torch.cuda.is_available() else "gloo"

    def weight_broadcast_endpoint(self) -> tuple[str, int]:
        return rendezvous_endpoint()

    def open_weight_broadcast(self, address: str, port: int, world_size: int, group_name: str) -> None:
        """Rank 0 sends for the whole group (it gathers the weights of every rank first)."""
        if _rank() == 0:
            self.broadcast_group = init_custom_process_group(self.broadcast_backend(), f"tcp://{address}:{port}",
                                                             world_size, 0, group_name)

    def broadcast_weights(self, urls: list[str], group_name: str, version: str, bucket_bytes: int,
                          api_key: str | None = None, dtype: str | None = None, precision: str = "bf16") -> int:
        """Send the weights (cast to dtype, the engines' own, when given; block-FP8 linears with
        precision=fp8) to the engines; the bytes sent on rank 0, 0 elsewhere. A collective: every
        rank takes part in the gather."""
        from miles_core.weight_sync.transports import broadcast_to_engines

        weights = self.hf_state_dict()
        if _rank() != 0:
            return 0
        return broadcast_to_engines(weights, self.broadcast_group, urls, group_name, version, bucket_bytes,
                                    api_key, dtype=None if dtype is None else getattr(torch, dtype),
                                    fp8=precision == "fp8")

    def send_weights_over_cuda_ipc(self, urls: list[str], version: str, bucket_bytes: int, dtype: str,
                                   api_key: str | None = None) -> int:
        """Hand colocated SGLang engines CUDA IPC handles to the weights cast to dtype (see
        miles_core.weight_sync.cuda_ipc); the bytes per engine on rank 0, 0 elsewhere. A collective."""
        from miles_core.weight_sync.cuda_ipc import send_weights_over_cuda_ipc

        weights = self._weights_to_share()
        if _rank() != 0:
            return 0
        return send_weights_over_cuda_ipc(weights, urls, version, bucket_bytes, getattr(torch, dtype), api_key)

    def close_weight_broadcast(self) -> None:
        group, self.broadcast_group = self.broadcast_group, None
        if group is not None:
            torch.distributed.destroy_process_group(group)


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

