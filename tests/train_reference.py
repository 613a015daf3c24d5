"""The single-process training step the distributed trainer's steps are tested against (shape legend: T tokens of
one sequence, V vocabulary)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer_client.data import IGNORE_INDEX, GlobalBatch
from trainer_client.models.model import build_model


def unscheduled_step(batch: GlobalBatch) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, stock transformers SDPA attention, one sequence at a time: the loss and every gradient."""
    model = build_model("tiny", attn_implementation="sdpa", seed=0)
    total = torch.zeros(())
    for sample in batch.samples:
        logits_TV = model(input_ids=torch.from_numpy(sample.input_ids)[None], use_cache=False).logits[0]
        total = total + F.cross_entropy(logits_TV, torch.from_numpy(sample.targets), ignore_index=IGNORE_INDEX,
                                        reduction="sum")
    loss = total / batch.num_loss_tokens
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}
