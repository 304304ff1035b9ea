"""The global gradient norm of a megatron model over its TP and EP shards, and clipping to it."""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_expert_parallel(param: torch.Tensor) -> bool:
    """An expert weight split over expert-parallel ranks (megatron marks them allreduce=False)."""
    return not getattr(param, "allreduce", True)


def _squared_norm(grads: list[torch.Tensor], group, device) -> torch.Tensor:
    total = torch.stack([n.float() for n in torch._foreach_norm(grads)]).pow(2).sum() if grads else \
        torch.zeros((), device=device)
    dist.all_reduce(total, group=group)
    return total


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """Global L2 grad norm over TP (sharded tensors counted once per shard, replicated ones once)
    and EP (each rank's experts are its own), and clip to max_norm. Gradients must already be
    summed over data parallel ranks."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.zeros(())
    own = [p for p in params if param_is_not_tensor_parallel_duplicate(p)]
    dense = [p.grad.detach() for p in own if not is_expert_parallel(p)]
    experts = [p.grad.detach() for p in own if is_expert_parallel(p)]
    device = params[0].grad.device
    total = _squared_norm(dense, ps.get_model_parallel_group(), device)
    if ps.get_expert_model_parallel_world_size() > 1:  # every rank joins, with or without experts here
        total = total + _squared_norm(experts, ps.get_expert_tensor_model_pipeline_parallel_group(), device)
    norm = total.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_([p.grad.detach() for p in params], scale)
    return norm
