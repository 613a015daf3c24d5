"""The single-device reference DACP attention is tested against (shape legend: T tokens, H query heads, G K/V
heads, D head dimension)."""

from __future__ import annotations

import math

import torch


def reference_attention(q_THD: torch.Tensor, k_TGD: torch.Tensor, v_TGD: torch.Tensor) -> torch.Tensor:
    """Textbook causal softmax attention of one sequence, GQA by repeating K/V heads."""
    groups = q_THD.shape[1] // k_TGD.shape[1]
    k_THD, v_THD = k_TGD.repeat_interleave(groups, dim=1), v_TGD.repeat_interleave(groups, dim=1)
    scores_HTT = torch.einsum("thd,shd->hts", q_THD, k_THD) / math.sqrt(q_THD.shape[-1])
    causal_TT = torch.ones(q_THD.shape[0], q_THD.shape[0], dtype=torch.bool).tril()
    weights_HTT = scores_HTT.masked_fill(~causal_TT, float("-inf")).softmax(dim=-1)
    return torch.einsum("hts,shd->thd", weights_HTT, v_THD)
