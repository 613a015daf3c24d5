"""Host cost per decoder layer (``make bench-host``): what the trainer's own code costs the CPU that dispatches a
GPU's kernels, against plain transformers in the same run.

A model of Qwen2.5-0.5B's structure (24 layers, 14 query and 2 K/V heads, Q/K/V biases, tied LM head) at
negligible compute (hidden size 64, head dim 4, 16 tokens in 4 sequences), so that what is timed is the host's
work: Python, the dispatcher, autograd, FSDP2's hooks. One gloo process, ``zero2``, no activation checkpointing,
float32. Each figure is per layer: the difference between the model with 24 layers and with 4, over 20.

* ``transformers`` — plain ``Qwen2ForCausalLM`` with ``attn_implementation="sdpa"``, no FSDP, the packed row
  given as ``position_ids`` restarting per sequence, its own loss: the reference.
* ``skrull eager`` — the trainer's module (``loading.build_training_module``: the chunked loss, FSDP2 ``zero2``)
  running one micro-batch as the trainer runs it (``prepare_micro_batch``, ``run_micro_batch``), DACP attention
  on the GPU's path (``torch_varlen``).
* ``skrull eager, one FSDP unit`` — the same with ``--fsdp-units model``: FSDP2's hooks once per micro-batch.
* ``skrull compiled`` and ``skrull compiled, one FSDP unit`` — both with ``--compile`` (each decoder layer's
  forward under ``torch.compile``).

The GPU's attention path cannot run on a CPU, so torch's flash attention operator and its backward
(``aten::_flash_attention_forward``, ``torch_compat``) get a CPU kernel here that only allocates their outputs:
roughly what a kernel launch costs the host. The reference's SDPA computes for real, on 16 tokens.

Measured per variant, over one micro-batch's forward and backward: host time (the thread's CPU time, the minimum of
``--repeats`` runs), aten operators called (the profiler's outermost ``aten::`` events), Python function calls
(``sys.setprofile``'s call events), and compiled graphs run (the profiler's ``CompiledFunction`` and
``CompiledFunctionBackward`` events of AOTAutograd). Prints a table, and ``--out`` writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from transformers import Qwen2Config, Qwen2ForCausalLM

from trainer_client.config_choices import FsdpUnits
from trainer_client.dacp.kernels import AttentionBackend
from trainer_client.distributed import ParallelDims, init_parallel, spawn_ranks
from trainer_client.models.loading import ModelLayout, build_training_module
from trainer_client.models.loss import run_micro_batch
from trainer_client.models.parallelize import ActivationCheckpointing, Sharding, prepare_micro_batch
from trainer_client.profiler.measure import local_pack

__all__ = ["HostCost", "counted", "host_us", "main"]

LAYER_COUNTS = (4, 24)
SEQUENCE_LENGTHS = (5, 4, 4, 3)  # 16 tokens in 4 sequences
VARIANTS = {  # name: (compiled, FSDP units)
    "skrull eager": (False, FsdpUnits.LAYER),
    "skrull eager, one FSDP unit": (False, FsdpUnits.MODEL),
    "skrull compiled": (True, FsdpUnits.LAYER),
    "skrull compiled, one FSDP unit": (True, FsdpUnits.MODEL),
}


def host_config(num_layers: int) -> Qwen2Config:
    """Qwen2.5-0.5B's structure at negligible compute."""
    return Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers, num_attention_heads=14,
                       num_key_value_heads=2, head_dim=4, vocab_size=256, tie_word_embeddings=True,
                       max_position_embeddings=4096, use_sliding_window=False, attention_dropout=0.0, pad_token_id=0)


@dataclass(frozen=True, kw_only=True, slots=True)
class HostCost:
    """One micro-batch's forward and backward, on the host."""

    host_us: float
    aten_ops: int
    python_calls: int
    compiled_graphs: int


@contextmanager
def _python_calls() -> Iterator[list[int]]:
    count = [0]

    def tracer(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            count[0] += 1

    sys.setprofile(tracer)
    try:
        yield count
    finally:
        sys.setprofile(None)


def _profiled(run: Callable[[], object]) -> tuple[int, int]:
    """(aten operators called, compiled graphs run) in one ``run``: the profiler's ``aten::`` events not inside
    another (an operator's own sub-calls are its implementation), and AOTAutograd's forward and backward events.
    A ``TorchDispatchMode`` would count operators too, but compiled code does not run under one."""
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        run()
    events = trace.events()

    def inside_an_operator(event: Any) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return True
            parent = parent.cpu_parent
        return False

    operators = sum(event.name.startswith("aten::") and not inside_an_operator(event) for event in events)
    graphs = sum(event.name in ("CompiledFunction", "CompiledFunctionBackward") for event in events)
    return operators, graphs


def host_us(runs: dict[str, Callable[[], object]], *, rounds: int, repeats: int) -> dict[str, float]:
    """Each run's host time: its thread's CPU time, the minimum over ``rounds`` rounds of ``repeats`` runs, the
    runs taking turns within each round, so that what else the machine does slows every variant alike."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for name, run in runs.items():
            for _ in range(repeats):
                started = time.thread_time_ns()
                run()
                best[name] = min(best[name], (time.thread_time_ns() - started) / 1e3)
    return best


def counted(run: Callable[[], object], host: float) -> HostCost:
    """``run``'s operators, Python calls and compiled graphs, beside its measured host time."""
    aten_ops, compiled_graphs = _profiled(run)
    with _python_calls() as calls:
        run()
    return HostCost(host_us=host, aten_ops=aten_ops, python_calls=calls[0], compiled_graphs=compiled_graphs)


_HOST_KERNELS: list[torch.library.Library] = []  # kept alive: a Library's kernels go with it


def _varlen_allocation_only() -> None:
    """A CPU kernel for torch's flash attention operator and its backward (``torch_compat``) that allocates their
    outputs and computes nothing: what launching the GPU kernel costs the host, on a machine without one."""

    def forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cum_seq_q: torch.Tensor | None,
                cum_seq_k: torch.Tensor | None, max_q: int, max_k: int, dropout_p: float, is_causal: bool,
                return_debug_mask: bool, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        return (torch.empty_like(query), query.new_empty((query.shape[1], query.shape[0]), dtype=torch.float),
                torch.empty(2, dtype=torch.uint64), torch.empty((), dtype=torch.uint64), query.new_empty(0))

    def backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)

    library = torch.library.Library("aten", "IMPL")
    library.impl("_flash_attention_forward", forward, "CPU")
    library.impl("_flash_attention_backward", backward, "CPU")
    _HOST_KERNELS.append(library)


def _transformers_run(num_layers: int) -> Callable[[], object]:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(host_config(num_layers)).train()
    model.config._attn_implementation = "sdpa"
    input_ids = torch.randint(0, 256, (1, sum(SEQUENCE_LENGTHS)))
    position_ids = torch.cat([torch.arange(length) for length in SEQUENCE_LENGTHS]).unsqueeze(0)

    def run() -> None:  # gradients accumulate, as in a step's micro-batches
        model(input_ids=input_ids, position_ids=position_ids, labels=input_ids, use_cache=False).loss.backward()

    return run


def _skrull_run(num_layers: int, *, compiled: bool, fsdp_units: FsdpUnits, folder: Path,
                parallel: Any) -> Callable[[], object]:
    torch.manual_seed(0)
    Qwen2ForCausalLM(host_config(num_layers)).save_pretrained(folder)
    layout = ModelLayout(sharding=Sharding.ZERO2, activation_checkpointing=ActivationCheckpointing.NONE,
                         param_dtype=torch.float32, compiled=compiled, fsdp_units=fsdp_units)
    module = build_training_module(str(folder), parallel=parallel, layout=layout, seed=0)
    pack = local_pack(SEQUENCE_LENGTHS, vocab_size=256, device=parallel.device, seed=0)

    def run() -> None:  # gradients accumulate, as in a step's micro-batches
        prepare_micro_batch(module, sharding=layout.sharding, is_last=False)
        run_micro_batch(module, pack, num_loss_tokens=pack.num_loss_tokens,
                        attention_backend=AttentionBackend.TORCH_VARLEN.value)

    return run


def _rank_main(rounds: int, repeats: int, out_path: Path) -> None:
    torch.set_num_threads(1)
    parallel = init_parallel(ParallelDims(dp_size=1, cp_size=1), device_type="cpu")
    _varlen_allocation_only()
    runs: dict[tuple[str, int], Callable[[], object]] = {}
    with tempfile.TemporaryDirectory(prefix="skrull-bench-host-") as work:
        for num_layers in LAYER_COUNTS:
            runs["transformers", num_layers] = _transformers_run(num_layers)
            for number, (variant, (compiled, fsdp_units)) in enumerate(VARIANTS.items()):
                runs[variant, num_layers] = _skrull_run(num_layers, compiled=compiled, fsdp_units=fsdp_units,
                                                        folder=Path(work) / f"{number}-{num_layers}",
                                                        parallel=parallel)
        for run in runs.values():  # warm-up: first calls, compilation
            for _ in range(3):
                run()
        host = host_us({f"{variant}/{layers}": run for (variant, layers), run in runs.items()}, rounds=rounds,
                       repeats=repeats)
        costs: dict[str, dict[str, dict[str, float]]] = {}
        for (variant, layers), run in runs.items():
            costs.setdefault(variant, {})[str(layers)] = asdict(counted(run, host[f"{variant}/{layers}"]))
    out_path.write_text(json.dumps(costs))
    dist.barrier()


def per_layer(costs: dict[str, dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Each variant's figures per layer: (24 layers − 4 layers) / 20."""
    few, many = (str(count) for count in LAYER_COUNTS)
    span = LAYER_COUNTS[1] - LAYER_COUNTS[0]
    return {variant: {name: (by_layers[many][name] - by_layers[few][name]) / span for name in by_layers[many]}
            for variant, by_layers in costs.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="rounds in which the variants take turns")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per variant and round (the minimum of "
                        "all is kept)")
    parser.add_argument("--out", type=Path, help="also write the figures as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="skrull-bench-host-") as work:
        out_path = Path(work) / "costs.json"
        spawn_ranks(_rank_main, 1, args.rounds, args.repeats, out_path)
        costs = json.loads(out_path.read_text())
    layers = per_layer(costs)
    reference = layers["transformers"]
    print(f"## Host cost per decoder layer (torch {torch.__version__}, one CPU thread; 24 − 4 layers over 20)\n")
    print("| variant | host µs | / transformers | aten ops | Python calls | compiled graphs |")
    print("|---|---|---|---|---|---|")
    for variant, figures in layers.items():
        print(f"| {variant} | {figures['host_us']:.0f} | {figures['host_us'] / reference['host_us']:.2f} | "
              f"{figures['aten_ops']:.0f} | {figures['python_calls']:.0f} | {figures['compiled_graphs']:.1f} |")
    if args.out:
        args.out.write_text(json.dumps({"per_layer": layers, "by_layer_count": costs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
