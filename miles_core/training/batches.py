"""Samples to padded training tensors, shared by the FSDP2 and Megatron backends."""

from __future__ import annotations

import torch

from miles_core.types import Sample, token_versions

Batch = dict[str, torch.Tensor]


def pad_batch(samples: list[Sample], pad_id: int) -> Batch:
    """Right-padded tokens plus per-position tensors aligned with next-token targets.

    Position t of the [B, L-1] tensors is the prediction of token t+1; the mask is 1 where
    that token is a generated response token. `token_version` is the weight version that
    generated that token (-1 off the response), so mixed-version samples reach the trainer.
    """
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    tokens = torch.full((len(samples), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(samples), width - 1)
    rollout_logp = torch.zeros(len(samples), width - 1)
    version = torch.full((len(samples), width - 1), -1, dtype=torch.long)
    for row, s in enumerate(samples):
        seq = s.prompt_ids + s.response_ids
        tokens[row, : len(seq)] = torch.tensor(seq)
        start, end = len(s.prompt_ids) - 1, len(seq) - 1
        mask[row, start:end] = torch.tensor(s.loss_mask, dtype=mask.dtype) if s.loss_mask else 1.0
        if s.rollout_logprobs:
            rollout_logp[row, start:end] = torch.tensor(s.rollout_logprobs)
        version[row, start:end] = torch.tensor(token_versions(s), dtype=torch.long)
    attention = (torch.arange(width)[None, :] < torch.tensor(
        [len(s.prompt_ids) + len(s.response_ids) for s in samples])[:, None]).long()
    return {"tokens": tokens, "attention": attention, "mask": mask, "rollout_logp": rollout_logp,
            "token_version": version,
            "rewards": torch.tensor([s.reward for s in samples], dtype=torch.float32)}


def select_rows(batch: Batch, rows: slice) -> Batch:
    """The same rows of every tensor of the batch (a micro-batch or an update's chunk)."""
    return {k: v[rows] for k, v in batch.items()}


def mixed_version_fraction(batch: Batch) -> float:
    """Share of rows whose response tokens (token_version >= 0) span several weight versions."""
    versions = batch["token_version"]
    on = versions >= 0
    newest = torch.where(on, versions, versions.new_full((), -(2**62))).amax(dim=1)
    oldest = torch.where(on, versions, versions.new_full((), 2**62)).amin(dim=1)
    mixed = (newest > oldest) & on.any(dim=1)
    return float(mixed.float().mean()) if len(versions) else 0.0
