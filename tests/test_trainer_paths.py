"""The trainer's faster paths train as its eager path with one FSDP unit per layer does (fp32, gloo): one FSDP unit
for the whole model, compiled blocks, and rows padded to token buckets, at CP 1 and CP 2, with LoRA and without."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from trainer_client.config import TrainConfig
from trainer_client.distributed import ParallelDims, init_parallel, spawn_gloo
from trainer_client.trainer import Trainer

STEPS = 2
LAYOUTS = {"dp2-cp1": (2, 1), "dp1-cp2": (1, 2)}
# The eager trainer's losses before the faster paths (d26bd73), these runs' configurations, torch 2.13.0+cpu.
LOSSES_BEFORE = {
    ("dp2-cp1", False): [6.94456573786939, 6.944500886292017],
    ("dp2-cp1", True): [6.94456573786939, 6.944673220850841],
    ("dp1-cp2", False): [6.947361221437263, 6.94716380821646],
    ("dp1-cp2", True): [6.947361221437263, 6.947423260121726],
}
PATHS = {  # name: the flags that differ from the reference
    "eager": {"fsdp_units": "layer"},  # the reference: the eager trainer as it was
    "one_unit": {"fsdp_units": "model"},
    "compiled": {"fsdp_units": "model", "compile": True},
    "bucketed": {"fsdp_units": "model", "token_buckets": 3},
}


def _config(dp: int, cp: int, lora: bool, **flags: object) -> TrainConfig:
    # BucketSize 512: at CP 2 the longer sequences are sharded, the rest stay local, several micro-batches a step
    return TrainConfig(dp=dp, cp=cp, model="tiny", data="synthetic:lmsys", global_batch=8, steps=STEPS,
                       bucket_size=512, seed=0, progress=False, lora_rank=4 if lora else None, **flags)


def _train_every_path(out_dir: Path, dp: int, cp: int) -> None:
    # dynamo's tracing asks each tensor for .grad, which warns of non-leaf tensors before its filter can hide it
    warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf Tensor",
                            category=UserWarning)
    parallel = init_parallel(ParallelDims.of(_config(dp, cp, False)))
    for lora in (False, True):
        for name, flags in PATHS.items():
            trainer = Trainer(_config(dp, cp, lora, **flags), parallel)
            history = trainer.train()
            if parallel.is_main:
                torch.save({"losses": [m.loss for m in history]}, out_dir / f"{name}-lora{lora}.pt")
            trainer.close()
    dist.barrier()


@pytest.fixture(scope="module", params=list(LAYOUTS))
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    dp, cp = LAYOUTS[request.param]
    out_dir = tmp_path_factory.mktemp(f"paths-{request.param}")
    spawn_gloo(_train_every_path, dp * cp, out_dir, dp, cp)
    return {"layout": request.param, **{path.stem: torch.load(path)["losses"] for path in out_dir.glob("*.pt")}}


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
def test_the_eager_path_trains_with_the_losses_it_had_before_the_faster_paths(runs: dict[str, Any], lora: bool) -> None:
    assert runs[f"eager-lora{lora}"] == pytest.approx(LOSSES_BEFORE[runs["layout"], lora], rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("path", [name for name in PATHS if name != "eager"])
def test_every_path_trains_with_the_eager_losses(runs: dict[str, Any], path: str, lora: bool) -> None:
    reference, got = runs[f"eager-lora{lora}"], runs[f"{path}-lora{lora}"]
    assert len(got) == STEPS and got[-1] != got[0]  # it trained
    assert got == pytest.approx(reference, rel=1e-6)
