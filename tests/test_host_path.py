"""What a layer costs the host (issue 44): no identity slices, no mask search, the micro-batch's attention handle
passed over by FSDP's walks, FSDP's settings given only when they change, one FSDP unit under zero2 with the losses
of one per layer, and a compiled layer of local sequences as one forward and one backward graph, whatever the
length."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.fsdp import FSDPModule
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

from scheduler_service.core.plan import MicroBatch
from tests.torch_releases import flash_operator_on_cpu
from trainer_client.dacp.kernels import AttentionBackend
from trainer_client.dacp.packing import pack_micro_batch
from trainer_client.data import Sample
from trainer_client.distributed import ParallelDims, init_parallel, spawn_gloo
from trainer_client.models.loading import ModelLayout, build_training_module
from trainer_client.models.loss import CausalLMLoss, run_micro_batch
from trainer_client.models.model import DACP_ATTENTION, build_model, model_config, model_inputs, register_dacp_attention
from trainer_client.models.parallelize import (
    ActivationCheckpointing,
    FsdpUnits,
    Sharding,
    apply_compile,
    prepare_micro_batch,
)


def _local_pack(lengths: tuple[int, ...], seed: int = 0):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    samples = [Sample(input_ids=(ids := rng.integers(0, 1024, size=n, dtype=np.int64)), labels=ids) for n in lengths]
    return pack_micro_batch(samples, MicroBatch(local=(tuple(range(len(lengths))),), distributed=()), cp_size=1,
                            cp_rank=0)


def _copies_per_layer(attn_implementation: str) -> float:
    """The select and slice backwards (each a memset and a copy on a GPU) a decoder layer adds to one micro-batch
    of local sequences (the difference between 4 layers and 1, over 3): with DACP on the GPU's attention path
    (torch's flash operator, with a CPU kernel here), or stock transformers with SDPA on the same packed row."""
    register_dacp_attention()
    counts = []
    for num_layers in (1, 4):
        config = model_config("tiny")
        config.num_hidden_layers = num_layers
        config.layer_types = config.layer_types[:1] * num_layers
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
        pack = _local_pack((40, 7, 129))
        with flash_operator_on_cpu(), profile(activities=[ProfilerActivity.CPU]) as trace:
            if attn_implementation == DACP_ATTENTION:
                module = CausalLMLoss(model, compute_dtype=torch.float32)
                run_micro_batch(module, pack, num_loss_tokens=pack.num_loss_tokens,
                                attention_backend=AttentionBackend.TORCH_VARLEN.value)
            else:
                model(input_ids=pack.input_ids_T[None], position_ids=pack.position_ids_T[None],
                      labels=pack.input_ids_T[None], use_cache=False).loss.backward()
        counts.append(sum(event.name in ("aten::select_backward", "aten::slice_backward")
                          for event in trace.events()))
    return (counts[1] - counts[0]) / 3


def test_a_layer_of_local_sequences_slices_and_selects_no_more_than_transformers() -> None:
    # query[0] and q[:num_local] each cost one per layer before; what is left is RoPE's rotate_half, transformers'
    assert _copies_per_layer(DACP_ATTENTION) == _copies_per_layer("sdpa")


def test_the_model_builds_no_mask_and_searches_no_packed_sequences() -> None:
    # transformers looks for packed sequences in position_ids (a host sync) when a mask function is registered
    model = build_model("tiny", seed=0)
    failing = mock.Mock(side_effect=AssertionError("transformers searched the positions for packed sequences"))
    with mock.patch("transformers.masking_utils.find_packed_sequence_indices", failing), torch.no_grad():
        model(**model_inputs(_local_pack((40, 7)), "sdpa"))
    failing.assert_not_called()


def _graphs_per_layer(trace) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    events = [event.name for event in trace.events()]
    return events.count("CompiledFunction"), events.count("CompiledFunctionBackward")


@pytest.mark.slow
# dynamo's tracing asks each tensor for .grad, which warns of non-leaf tensors before its own filter can hide it
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning")
def test_a_compiled_layer_of_local_sequences_is_one_graph_forward_and_one_backward_for_every_length() -> None:
    # torch's flash operator (with a CPU kernel here) is the GPU's local attention: Dynamo traces it
    module = CausalLMLoss(build_model("tiny", seed=0), compute_dtype=torch.float32)
    apply_compile(module)
    num_layers = len(module.decoder_layers())
    with flash_operator_on_cpu():
        graphs = []
        for seed, lengths in enumerate([(40, 7, 129), (64,), (5, 5, 5, 90, 33), (200, 1)]):
            pack = _local_pack(lengths, seed)
            with profile(activities=[ProfilerActivity.CPU]) as trace:
                run_micro_batch(module, pack, num_loss_tokens=pack.num_loss_tokens,
                                attention_backend=AttentionBackend.TORCH_VARLEN.value)
            graphs.append(_graphs_per_layer(trace))
            if seed == 0:
                unique_after_first = counters["stats"]["unique_graphs"]
    assert graphs == [(num_layers, num_layers)] * 4  # one forward and one backward graph per layer
    assert counters["stats"]["unique_graphs"] == unique_after_first  # no recompile over four lengths


def _train_units(out_dir: Path) -> None:
    parallel = init_parallel(ParallelDims(dp_size=1, cp_size=1))
    packs = [_local_pack((40, 7, 129), seed) for seed in range(3)]
    for units in FsdpUnits:
        layout = ModelLayout(sharding=Sharding.ZERO2, activation_checkpointing=ActivationCheckpointing.NONE,
                             param_dtype=torch.float32, fsdp_units=units)
        module = build_training_module("tiny", parallel=parallel, layout=layout, seed=0)
        sharded = sum(isinstance(unit, FSDPModule) for unit in module.modules())
        losses = []
        with mock.patch.object(FSDPModule, "set_requires_gradient_sync", autospec=True,
                               side_effect=FSDPModule.set_requires_gradient_sync) as setter:
            for index, pack in enumerate(packs):
                prepare_micro_batch(module, sharding=layout.sharding, is_last=index == len(packs) - 1)
                losses.append(run_micro_batch(module, pack, num_loss_tokens=pack.num_loss_tokens,
                                              attention_backend="sdpa").item())
        grads = {name: param.grad.full_tensor() for name, param in module.named_parameters()}
        torch.save({"units": sharded, "losses": losses, "grads": grads, "setter_calls": setter.call_count},
                   out_dir / f"{units}.pt")
    dist.barrier()


@pytest.fixture(scope="module")
def units_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out_dir = tmp_path_factory.mktemp("units")
    spawn_gloo(_train_units, 1, out_dir)
    return {units.value: torch.load(out_dir / f"{units}.pt") for units in FsdpUnits}


def test_one_fsdp_unit_trains_with_the_losses_and_gradients_of_one_per_layer(units_runs: dict[str, dict]) -> None:
    per_layer, whole = units_runs["layer"], units_runs["model"]
    assert whole["units"] == 1 < per_layer["units"]
    assert whole["losses"] == per_layer["losses"]
    for name, grad in per_layer["grads"].items():
        torch.testing.assert_close(whole["grads"][name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_fsdp_is_told_of_the_last_micro_batch_only_when_that_changes(units_runs: dict[str, dict]) -> None:
    # three micro-batches: "not last" given once, "last" once, to each unit alone (FSDP's own setter walks the model)
    for run in units_runs.values():
        assert run["setter_calls"] == 2 * run["units"]
