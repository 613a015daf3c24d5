"""The optimizer side of a step: AdamW, a learning-rate schedule chosen by name, global-norm gradient clipping.

Schedules (``--lr-scheduler``, ``LRSchedulerName``): each multiplies ``--lr`` by a factor of the optimizer step
``s`` (0-based) of a run of ``T`` steps (``--steps``), ``W`` of them warmup (``--warmup-steps``), ``m`` the
``--min-lr-ratio``:

* ``warmup_cosine``, the default and this trainer's own: ``(s + 1) / W`` while ``s < W`` (``lr / W`` at step 0,
  ``lr`` at step ``W − 1``), then half a cosine from ``lr`` at step ``W`` to ``m · lr`` at the last step, ``T − 1``:
  ``m + (1 − m) · (1 + cos(π · (s − W) / (T − W − 1))) / 2``; a run with one step after warmup keeps ``lr``.
* transformers' schedules of the same names (``transformers.get_scheduler``), after their warmup: ``linear``
  (``(T − s) / (T − W)``, down to 0 at step ``T``), ``cosine`` (``(1 + cos(π · (s − W) / (T − W))) / 2``),
  ``cosine_with_min_lr`` (that cosine scaled into ``[m, 1]``), ``constant_with_warmup`` (1) and
  ``warmup_stable_decay`` (1, then a cosine towards ``m`` over the last ``D = max(1, ⌈(T − W) / 5⌉)`` steps,
  ``wsd_decay_steps``: a cooldown of a fifth of the steps after warmup matches a cosine schedule's final loss,
  Hägele et al. 2024, arXiv:2405.18392). transformers' decays reach their end (0 or ``m``) at step ``T``, one past
  the last. ``--min-lr-ratio`` is ``m`` of ``warmup_cosine``, ``cosine_with_min_lr`` and ``warmup_stable_decay``
  (``LRSchedulerName.reads_min_lr_ratio``); the others do not read it, and ``TrainConfig`` refuses it given with
  one of them.

Every schedule warms up as the default does, ``(s + 1) / W`` (``warmup_stable_decay`` from ``m`` to 1 so:
``m + (1 − m) · (s + 1) / W``), so that no step trains at LR 0 and step ``W``, the first after warmup, trains at
``lr``. transformers' own warmup gives step ``s`` the factor ``s / W``, a step behind, and so trains step 0 at LR 0
(one warmup step: the run's first step learns nothing); torchtitan warms up by ``(s + 1) / W`` for that reason.
``lr_factors`` takes transformers' factor of step ``s + 1`` during the warmup (``_warmup_a_step_ahead``) and its
own from ``W`` on, so the decays end where transformers' end.

No schedule of transformers reproduces the default, so it stays this module's (``warmup_cosine_factor``).
``cosine_with_min_lr`` differs in its decay: its cosine divides by ``T − W``, not ``T − W − 1``, so it reaches
``m`` at step ``T``, one past the last (10 steps, ``W`` 2, ``m`` 0.1: 0.5, 1, 1, 0.966, …, 0.134 against the
default's 0.5, 1, 1, 0.955, …, 0.1). With ``W = 0`` and ``num_training_steps = T − 1`` it equals the default bit
for bit. transformers' ``cosine_warmup_with_min_lr`` has the default's warmup and ends at ``m`` on the last step,
but its cosine starts a step earlier (``(s − W + 1) / (T − W)``): the default holds ``lr`` for steps ``W − 1``
and ``W``, it for one.

A schedule is a function of the step alone, so a resumed run builds it at the restored step (``lr_schedule``'s
``first_step``) and follows its own flags from there; a checkpoint keeps only the step.

Clipping scales every gradient by ``max_norm / ‖g‖`` when the global L2 norm ``‖g‖`` over all parameters exceeds
``max_norm``; under FSDP the gradients are sharded DTensors, and the norm is reduced over the shards
(``clip_grad_norm_`` computes each shard's norm and all-reduces), so every rank clips by the same factor.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from trainer_client.config_choices import LRSchedulerName

__all__ = ["LRSchedulerName", "build_optimizer", "clip_gradients", "lr_factors", "lr_schedule", "warmup_cosine_factor",
           "wsd_decay_steps"]


def build_optimizer(parameters: Iterable[torch.Tensor], *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW (torch's, its default betas and epsilon) over the trained ``parameters``: under LoRA the adapters
    alone, under FSDP each rank's shards, so every rank keeps the optimizer states of what it holds."""
    return torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay)


def warmup_cosine_factor(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """The default schedule's multiplier of the base learning rate at optimizer step ``step`` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = total_steps - warmup_steps
    if decay_steps <= 1:
        return 1.0
    progress = min((step - warmup_steps) / (decay_steps - 1), 1.0)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def wsd_decay_steps(*, warmup_steps: int, total_steps: int) -> int:
    """``warmup_stable_decay``'s decay: a fifth of the steps after warmup, rounded up, at least one."""
    return max(1, math.ceil((total_steps - warmup_steps) / 5))


def lr_factors(
    scheduler: LRSchedulerName, *, warmup_steps: int, total_steps: int, min_lr_ratio: float,
) -> Callable[[int], float]:
    """The multiplier of the base learning rate as a function of the optimizer step (0-based); every step's is
    above 0 (module docstring, the warmup)."""
    if scheduler is LRSchedulerName.WARMUP_COSINE:
        return functools.partial(warmup_cosine_factor, warmup_steps=warmup_steps, total_steps=total_steps,
                                 min_lr_ratio=min_lr_ratio)
    specific: dict[str, float | int] | None = None
    if scheduler is LRSchedulerName.COSINE_WITH_MIN_LR:
        specific = {"min_lr_rate": min_lr_ratio}
    elif scheduler is LRSchedulerName.WARMUP_STABLE_DECAY:
        specific = {"min_lr_ratio": min_lr_ratio,
                    "num_decay_steps": wsd_decay_steps(warmup_steps=warmup_steps, total_steps=total_steps)}
    from transformers import SchedulerType, get_scheduler

    # get_scheduler builds a LambdaLR at step 0 on the optimizer it is given (a LambdaLR is positioned only when it
    # is made): it gets a stand-in, and only its function of the step is kept, for lr_schedule to position.
    stand_in = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    built = get_scheduler(SchedulerType(scheduler.value), stand_in, num_warmup_steps=warmup_steps,
                          num_training_steps=total_steps, scheduler_specific_kwargs=specific)
    assert isinstance(built, LambdaLR)  # every schedule LRSchedulerName names is one
    return functools.partial(_warmup_a_step_ahead, built.lr_lambdas[0], warmup_steps)


def _warmup_a_step_ahead(factor: Callable[[int], float], warmup_steps: int, step: int) -> float:
    """transformers' ``factor``, its warmup a step ahead: step ``s < W`` trains at its factor of ``s + 1``, so the
    first step is not at LR 0 and the last warmup step is at the peak, as the default's warmup."""
    return factor(step + 1 if step < warmup_steps else step)


def lr_schedule(
    optimizer: torch.optim.Optimizer, *, scheduler: LRSchedulerName, lr: float, warmup_steps: int,
    total_steps: int, min_lr_ratio: float, first_step: int = 0,
) -> LambdaLR:
    """Schedule ``scheduler`` of base learning rate ``lr``, positioned at optimizer step ``first_step``. A resumed run
    builds it at the restored step, so it follows its own schedule (``--lr-scheduler``, ``--steps``,
    ``--warmup-steps``, ``--lr``, ``--min-lr-ratio``) from there, whichever schedule the checkpoint was trained
    with."""
    factors = lr_factors(scheduler, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio)
    for group in optimizer.param_groups:
        group["initial_lr"] = lr  # what LambdaLR scales; a restored optimizer holds the saved run's
    return LambdaLR(optimizer, factors, last_epoch=first_step - 1)


def clip_gradients(parameters: Iterable[torch.Tensor], *, max_norm: float) -> float:
    """Clip to ``max_norm`` (0: measure only) and return the global gradient norm before clipping."""
    grads = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(grads, max_norm=max_norm if max_norm > 0 else math.inf)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)
