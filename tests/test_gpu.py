"""On a CUDA device: the varlen kernels against the SDPA reference in bf16, and an FSDP2 bf16 training step.

Marked ``gpu``; they run where torch sees a CUDA device and are skipped elsewhere (the flash-attn kernel only where
flash-attn is installed).
Tolerances are bf16's: 8 mantissa bits, so a sum over a few hundred keys agrees to about 1e-2.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist

from trainer_client.config import TrainConfig
from trainer_client.dacp.kernels import AttentionBackend, _flash_attn_varlen_func, varlen_causal_attn_func
from trainer_client.distributed import ParallelDims, free_port, init_parallel
from trainer_client.trainer import Trainer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BF16_TOLERANCE = {"rtol": 2e-2, "atol": 2e-2}


def _kernels() -> list[AttentionBackend]:
    kernels = [AttentionBackend.TORCH_VARLEN]
    if _flash_attn_varlen_func() is not None:
        kernels.append(AttentionBackend.FLASH_ATTN)
    return kernels


@pytest.mark.parametrize("backend", _kernels() if torch.cuda.is_available() else [])
def test_varlen_kernel_matches_sdpa_forward_and_backward_in_bf16(backend: AttentionBackend) -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    lengths_q, lengths_k = [37, 256, 1], [37, 300, 64]  # queries aligned bottom-right on longer key prefixes
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")

    def inputs() -> list[torch.Tensor]:
        shapes = [(sum(lengths_q), 8, 64), (sum(lengths_k), 2, 64), (sum(lengths_k), 2, 64)]
        return [torch.randn(s, device="cuda", generator=generator, dtype=torch.bfloat16).requires_grad_()
                for s in shapes]

    q, k, v = inputs()
    grad_out = torch.randn_like(q)
    results = {}
    for name in (backend, AttentionBackend.SDPA):
        tensors = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = varlen_causal_attn_func(*tensors, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                      softmax_scale=1 / math.sqrt(64), backend=name)
        out.backward(grad_out)
        results[name] = [out.detach(), *(t.grad for t in tensors)]
    for got, want in zip(results[backend], results[AttentionBackend.SDPA], strict=True):
        torch.testing.assert_close(got.float(), want.float(), **BF16_TOLERANCE)


def test_fsdp2_bf16_step_on_one_gpu() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="1", RANK="0",
                      LOCAL_RANK="0")
    # A shipped profile: the step is under test, not a measurement (on CUDA the default, auto, measures first).
    config = TrainConfig(dp=1, cp=1, model="small", global_batch=4, steps=3, bucket_size=4096, progress=False,
                         sharding="zero2", activation_checkpointing="selective", profile="h100-paper")
    parallel = init_parallel(ParallelDims.of(config))
    try:
        trainer = Trainer(config, parallel)
        history = trainer.train()
        trainer.close()
        assert all(math.isfinite(m.loss) and math.isfinite(m.grad_norm) for m in history)
        assert {p.dtype for p in trainer.module.parameters()} == {torch.float32}  # fp32 master weights
        assert trainer.autocast_dtype is None  # FSDP's MixedPrecisionPolicy computes in bf16
        assert history[-1].peak_memory_bytes is not None and history[-1].memory_kind == "cuda_max_allocated"
    finally:
        dist.destroy_process_group()
