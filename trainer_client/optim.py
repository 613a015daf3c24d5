"""The optimizer side of a step: AdamW, a warmup + cosine learning-rate schedule, global-norm gradient clipping.

Schedule (the usual fine-tuning one): the learning rate rises linearly from ``lr / warmup_steps`` to ``lr``
over the first ``warmup_steps`` steps, then follows half a cosine from ``lr`` down to ``min_lr_ratio · lr`` at
the last step. Clipping scales every gradient by ``max_norm / ‖g‖`` when the global L2 norm ``‖g‖`` over all
parameters exceeds ``max_norm``; under FSDP the gradients are sharded DTensors, and the norm is reduced over
the shards (``clip_grad_norm_`` computes each shard's norm and all-reduces), so every rank clips by the same
factor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

__all__ = ["clip_gradients", "lr_factor", "warmup_cosine_schedule"]


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the base learning rate at optimizer step ``step`` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = total_steps - warmup_steps
    if decay_steps <= 1:
        return 1.0
    progress = min((step - warmup_steps) / (decay_steps - 1), 1.0)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine_schedule(
    optimizer: torch.optim.Optimizer, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float,
    first_step: int = 0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """The schedule of base learning rate ``lr``, positioned at optimizer step ``first_step``. A resumed run builds
    it at the restored step, so it follows its own schedule (``--steps``, ``--warmup-steps``, ``--lr``,
    ``--min-lr-ratio``) from there, whichever schedule the checkpoint was trained with: the schedule is a function
    of the step, and a checkpoint needs to keep only the step."""
    def factor(step: int) -> float:
        return lr_factor(step, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio)

    for group in optimizer.param_groups:
        group["initial_lr"] = lr  # what LambdaLR scales; a restored optimizer holds the saved run's
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=first_step - 1)


def clip_gradients(parameters: Iterable[torch.Tensor], *, max_norm: float) -> float:
    """Clip to ``max_norm`` (0: measure only) and return the global gradient norm before clipping."""
    grads = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(grads, max_norm=max_norm if max_norm > 0 else math.inf)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)
