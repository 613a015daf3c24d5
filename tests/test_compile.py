"""``--compile``: each decoder block under ``torch.compile`` trains as the eager trainer does (2 gloo ranks, CP 2, so
the compiled blocks sit around DACP attention and its collectives), and a machine that cannot compile is told so
before anything is built."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from trainer_client.config import TrainConfig
from trainer_client.distributed import ParallelDims, init_parallel, spawn_gloo
from trainer_client.models.loading import ModelLayout
from trainer_client.models.loss import CausalLMLoss
from trainer_client.models.model import build_model
from trainer_client.models.parallelize import (
    ActivationCheckpointing,
    Sharding,
    apply_compile,
    check_compile,
    check_cuda_graphs,
)
from trainer_client.trainer import Trainer

STEPS = 3


def _config(*, compile: bool) -> TrainConfig:
    # BucketSize 512 over CP 2: the longer sequences are sharded, the rest stay local, several micro-batches a step;
    # full checkpointing recomputes each compiled block in backward, collectives included.
    return TrainConfig(dp=1, cp=2, model="tiny", data="synthetic:lmsys", global_batch=8, steps=STEPS,
                       bucket_size=512, seed=0, progress=False, compile=compile,
                       activation_checkpointing=ActivationCheckpointing.FULL.value)


def _train_eager_and_compiled(out_dir: Path) -> None:
    # A forked rank keeps the suite's warnings-as-errors, and dynamo's tracing asks each tensor for .grad, which
    # warns of non-leaf tensors before dynamo's own filter can hide it (a torchrun rank never raises it).
    warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf Tensor",
                            category=UserWarning)
    parallel = init_parallel(ParallelDims.of(_config(compile=False)))
    for compiled in (False, True):
        trainer = Trainer(_config(compile=compiled), parallel)
        history = trainer.train()
        weights = {name: param.full_tensor() for name, param in trainer.module.lm.named_parameters()}
        if parallel.is_main:
            torch.save({"losses": [m.loss for m in history], "weights": weights,
                        "plans": [m.plan_source for m in history],
                        "graphs": counters["stats"]["unique_graphs"]}, out_dir / f"compiled-{compiled}.pt")
        trainer.close()
    dist.barrier()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, dict]:
    out_dir = tmp_path_factory.mktemp("compile")
    spawn_gloo(_train_eager_and_compiled, 2, out_dir)
    return {compiled: torch.load(out_dir / f"compiled-{compiled}.pt") for compiled in (False, True)}


@pytest.mark.slow
def test_compiled_blocks_train_with_the_eager_losses_and_weights(runs: dict[bool, dict]) -> None:
    eager, compiled = runs[False], runs[True]
    assert eager["graphs"] == 0 and compiled["graphs"] > 0  # dynamo compiled the blocks, not an eager fallback
    assert len(compiled["losses"]) == STEPS
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5)
    assert compiled["losses"][-1] != eager["losses"][0]  # the weights moved: the steps did train
    for name, weight in eager["weights"].items():
        # Adam divides by the gradients' root mean square: a float32 rounding apart in a tiny gradient moves a weight
        # by up to lr × a few 1e-3 after 3 steps.
        torch.testing.assert_close(compiled["weights"][name], weight, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_compiling_keeps_parameter_names_so_checkpoints_stay_interchangeable() -> None:
    module = CausalLMLoss(build_model("tiny", seed=0))
    names = [name for name, _ in module.named_parameters()]
    apply_compile(module)
    assert [name for name, _ in module.named_parameters()] == names
    assert all(hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in module.decoder_layers())


def test_the_layout_carries_the_compile_choice() -> None:
    layout = ModelLayout.on(torch.device("cpu"), dtype=None, sharding=Sharding.ZERO2,
                            activation_checkpointing=ActivationCheckpointing.NONE, compiled=True)
    assert layout.compiled
    assert not ModelLayout.on(torch.device("cpu"), dtype=None, sharding=Sharding.ZERO2,
                              activation_checkpointing=ActivationCheckpointing.NONE).compiled


def test_selective_checkpointing_is_refused_with_compile() -> None:
    with pytest.raises(ValueError, match=r"--compile with --activation-checkpointing selective is not supported"):
        TrainConfig(dp=1, cp=1, compile=True, activation_checkpointing=ActivationCheckpointing.SELECTIVE.value)


def test_a_cpu_without_a_cpp_compiler_is_refused_before_anything_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("trainer_client.models.parallelize.shutil.which", lambda name: None)
    with pytest.raises(ValueError, match=r"--compile on CPU needs a C\+\+ compiler"):
        check_compile(torch.device("cpu"))


def test_a_torch_without_dynamo_support_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("torch._dynamo.is_dynamo_supported", lambda: False)
    with pytest.raises(ValueError, match=r"--compile needs torch.compile, which torch .* does not support"):
        check_compile(torch.device("cpu"))


def test_a_gpu_too_old_for_triton_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (6, 1))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla P100")
    with pytest.raises(ValueError, match=r"compute capability 7.0 or more .* Tesla P100 has 6.x"):
        check_compile(torch.device("cuda", 0))


def test_the_trainer_checks_compile_before_building_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("trainer_client.models.parallelize.shutil.which", lambda name: None)
    monkeypatch.setattr("trainer_client.trainer.build_training_module",
                        lambda *args, **kwargs: pytest.fail("the model was built before --compile was checked"))
    cpu_rank = SimpleNamespace(device=torch.device("cpu"))  # no process group: nothing may get that far
    with pytest.raises(ValueError, match=r"C\+\+ compiler"):
        Trainer(TrainConfig(dp=1, cp=1, compile=True, progress=False), cpu_rank)  # type: ignore[arg-type]


@pytest.mark.parametrize(("device", "sharding", "cp", "why"), [
    ("cpu", Sharding.NONE, 1, r"--cuda-graphs needs a CUDA device"),
    ("cuda", Sharding.NONE, 2, r"--cuda-graphs needs --cp 1: with CP 2, sharded sequences run collectives"),
    ("cuda", Sharding.ZERO2, 1, r"--cuda-graphs needs --sharding none: zero2 gathers the parameters"),
])
def test_cuda_graphs_are_refused_where_a_captured_graph_cannot_run(device: str, sharding: Sharding, cp: int,
                                                                    why: str) -> None:
    with pytest.raises(ValueError, match=why):
        check_cuda_graphs(torch.device(device), sharding=sharding, cp_size=cp)


def test_the_trainer_checks_cuda_graphs_before_building_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("trainer_client.trainer.build_training_module",
                        lambda *args, **kwargs: pytest.fail("the model was built before --cuda-graphs was checked"))
    cpu_rank = SimpleNamespace(device=torch.device("cpu"))
    config = TrainConfig(dp=1, cp=1, cuda_graphs=True, sharding=Sharding.NONE, progress=False)
    with pytest.raises(ValueError, match=r"--cuda-graphs needs a CUDA device"):
        Trainer(config, cpu_rank)  # type: ignore[arg-type]


@pytest.mark.parametrize(("flags", "why"), [
    ({"token_buckets": 9}, r"--token-buckets is at most 8 \(BucketSize down to 1/128 of it\), got 9"),
    ({"cuda_graphs": True, "token_buckets": 0}, r"--cuda-graphs captures graphs per token bucket: give "
                                                r"--token-buckets 1 or more"),
    ({"fsdp_units": "model", "sharding": "zero3"}, r"--fsdp-units model is for --sharding zero2 .*, not zero3"),
])
def test_faster_path_flags_that_cannot_work_together_are_refused_by_name(flags: dict[str, object], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        TrainConfig(dp=1, cp=1, **flags)
