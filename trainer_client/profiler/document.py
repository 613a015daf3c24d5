"""The profile document: what the sweeps measured (``sweeps.Measurements``), fitted and written as a
``skrull_proto.ProfileDocument``, section by section, each checked by the format's model as it is built.

Every fit sits beside the points it was fitted to and a ``source`` saying how they were measured: ``compute``
(the extended fit of eq. 14 and the paper's two-coefficient fit, per-case points), ``memory`` (activation bytes
per token, static bytes counted tensor by tensor), ``communication`` (latency tables over all ranks and over
every hybrid group size; those of groups that span nodes under ``communication.inter_node``) and
``provenance`` (hardware, software, model shape, date, command, options). With the shard-size effect measured,
``compute.shard_effect`` holds its rows beside the model's prediction and the attention efficiency derived from
them (``scheduler_service.core.shard_effect``), written as ``compute.attention_efficiency`` only where it is well
determined; ``compute.shard_effect_note`` says which, and why.

Sections are validated from mappings because, beside their typed members, they carry the free-form extras
the format allows (``source``, ``fit``, ``points``). The file is the document's JSON (``document_json``): the
members that were set, in the format's order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from skrull_proto import PROFILE_SCHEMA_VERSION, ProfileDocument
from skrull_proto.profile_document import (
    ActivationBytesPerToken,
    AttentionEfficiency,
    CommunicationSection,
    ComputeSection,
    HardwareSection,
    MemorySection,
    StaticBytesPerParameter,
)

from scheduler_service.core.fitting import ComputeFit, fit_compute, fit_memory
from scheduler_service.core.memory import static_bytes_per_parameter
from scheduler_service.core.models import ModelShape
from scheduler_service.core.perf_model import PerformanceModel
from scheduler_service.core.profile import parse_profile
from scheduler_service.core.shard_effect import derive_attention_efficiency, derive_shard_cost, shard_effect_rows
from trainer_client.profiler.sweeps import Measurements, ProfileOptions, compute_points, shard_runs

__all__ = ["LinkTables", "build_document", "compute_form", "compute_section", "document_json", "rebase_compute",
           "refit_compute", "split_by_node", "with_shard_effect"]

TOOL = "python -m trainer_client.profile"


def document_json(document: ProfileDocument) -> dict[str, Any]:
    """The document as its file holds it: the members that were set (none left to its defaults)."""
    return document.model_dump(mode="json", exclude_unset=True)


def build_document(options: ProfileOptions, measured: Measurements, *, command: str) -> ProfileDocument:
    """The profile of ``measured``, named ``options.name`` (default: DEVICE-MODEL); ``command`` is recorded in the
    provenance. It loads where it is used: the format's model checks each section, the core the ranges."""
    shape = measured.shape
    document = ProfileDocument(
        schema_version=PROFILE_SCHEMA_VERSION,
        name=options.name or f"{measured.device_type}-{shape.name}",
        description=f"{shape.name} measured on {measured.device_name} ({measured.device_type}, "
                    f"{measured.threads_per_rank} threads per rank, {measured.world_size} rank(s), "
                    f"{measured.dtype_name}, {measured.attention_backend} attention"
                    f"{', blocks compiled' if options.compile else ''}) by {TOOL} on "
                    f"{measured.measured_at[:10]}. Holds for this model only.",
        model=shape.name,
        hardware=_hardware_section(options, measured),
        compute=_compute_section(options, measured),
        memory=_memory_section(options, measured),
        communication=_communication_section(measured),
        provenance={
            "tool": TOOL,
            "command": command,
            "date": measured.measured_at,
            "hardware": measured.hardware,
            "software": measured.software,
            "model": asdict(shape),
            "world_size": measured.world_size,
            "local_world_size": measured.local_world_size,
            "dtype": measured.dtype_name,
            "attention_backend": measured.attention_backend,
            "options": {key: value for key, value in asdict(options).items() if key != "progress"},
        },
    )
    if measured.shards:
        document = with_shard_effect(document, shape, measured.shards, options)
    parse_profile(document_json(document))  # the core's ranges (the format's shape is checked as built)
    return document


def _hardware_section(options: ProfileOptions, measured: Measurements) -> HardwareSection:
    return HardwareSection.model_validate({
        "device": measured.device_name,
        "device_memory_bytes": options.memory_budget_bytes or measured.device_memory_bytes,
        "source": "--memory-budget-bytes" if options.memory_budget_bytes else
                  ("torch.cuda.get_device_properties().total_memory" if measured.device_type == "cuda"
                   else "physical host memory (sysconf); CPU ranks share it"),
    })


def _fit_summary(fit: ComputeFit) -> dict[str, float]:
    return {"alpha_s_per_flop": fit.alpha_s_per_flop, "alpha_s_per_token": fit.alpha_s_per_token,
            "alpha_s_per_sequence": fit.alpha_s_per_sequence, "beta_s_per_layer": fit.beta_s_per_layer,
            "floor_s_per_layer": fit.floor_s_per_layer, "median_relative_error": fit.median_relative_error,
            "max_relative_error": fit.max_relative_error}


def compute_form(extended: ComputeFit, launch_bound: ComputeFit | None) -> ComputeFit:
    """The fit a profile keeps: the launch-bound form where it was fitted and fits better (a lower median relative
    error), else the additive one."""
    if launch_bound is not None and launch_bound.median_relative_error < extended.median_relative_error:
        return launch_bound
    return extended


def _compute_section(options: ProfileOptions, measured: Measurements) -> ComputeSection:
    return compute_section(measured.compute_points, num_layers=measured.shape.num_layers,
                           on_gpu=measured.device_type == "cuda",
                           timing=f"median of {options.repeats} timed runs after {options.warmup} warm-up each")


def compute_section(points: Sequence[Mapping[str, Any]], *, num_layers: int, on_gpu: bool,
                    timing: str) -> ComputeSection:
    """The compute section of ``points`` (the sweep's, as the document holds them): the extended fit (per-token and
    per-sequence terms) as the coefficients; on a GPU, where the host's dispatch overlaps the device's work, also
    the launch-bound form ``max(floor, ...)``, kept where it fits better; eq. 14 alone beside them."""
    fit_points = compute_points(points)
    extended = fit_compute(fit_points, num_layers=num_layers, extended=True)
    launch_bound = fit_compute(fit_points, num_layers=num_layers, extended=True, floor=True) if on_gpu else None
    paper = fit_compute(fit_points, num_layers=num_layers, extended=False)
    kept = compute_form(extended, launch_bound)
    form = "launch_bound" if kept is launch_bound else "extended"  # which of fit's entries the coefficients are
    fits: dict[str, Any] = {"extended": _fit_summary(extended), "paper_eq14": _fit_summary(paper), "form": form}
    if launch_bound is not None:
        fits["launch_bound"] = _fit_summary(launch_bound)
    return ComputeSection.model_validate({
        "alpha_s_per_flop": kept.alpha_s_per_flop,
        "alpha_s_per_token": kept.alpha_s_per_token,
        "alpha_s_per_sequence": kept.alpha_s_per_sequence,
        "beta_s_per_layer": kept.beta_s_per_layer,
        "floor_s_per_layer": kept.floor_s_per_layer,
        "fit": fits,
        "points": list(points),
        "source": f"least squares on relative error (non-negative) over {len(fit_points)} micro-batches "
                  f"(forward + backward, trainer code path), {timing}; FLOPs per eq. 13. The coefficients are "
                  f"fit.{form}'s: "
                  + ("on a GPU the host dispatches kernels while the device runs earlier ones, so a micro-batch "
                     "takes max(floor_s_per_layer·layers, the device time) (fit.launch_bound; the floor is "
                     "2·min·max/(min + max) of the floor-bound points' times, the smallest worst error over them, "
                     "as the host's dispatch time jitters), kept where its median error is below the additive "
                     "fit's (fit.extended). " if on_gpu else
                     "on a CPU one process both dispatches and computes, so the costs add (fit.extended). ")
                  + "paper_eq14 is the two-coefficient fit alpha·FLOPs + beta for comparison.",
    })


def _memory_section(options: ProfileOptions, measured: Measurements) -> MemorySection:
    """Activations fitted per token; static memory per parameter as the profiled sharding keeps it (the trainer
    derives its BucketSize with its own mode's, ``scheduler_service.core.memory.training_profile``)."""
    memory = fit_memory(measured.memory_points)
    static = static_bytes_per_parameter(measured.sharding, compute_bytes=measured.param_dtype.itemsize)
    return MemorySection.model_validate({
        "activation_bytes_per_token": ActivationBytesPerToken(fixed=memory.bytes_per_token, per_layer_hidden=0.0,
                                                              per_vocab=0.0),
        "beta_bytes": memory.beta_bytes,
        "reserved_bytes": measured.reserved_bytes,
        "static_bytes_per_parameter": StaticBytesPerParameter(replicated=static.replicated, sharded=static.sharded),
        "sharding": measured.sharding.value,
        "activation_checkpointing": options.activation_checkpointing,
        "fit": {"max_relative_error": memory.max_relative_error},
        "points": [[tokens, activations] for tokens, activations in measured.memory_points],
        "peaks": [[tokens, peak] for tokens, peak in measured.memory_peaks],
        "static_bytes_counted": measured.static_bytes_counted,
        "static_bytes": measured.static_bytes,
        "source": ("points: activation bytes, each of peaks (every byte alive at the peak of a step's last "
                   "micro-batch "
                   + ("(torch.cuda.max_memory_allocated)" if measured.device_type == "cuda" else
                      "(the tensors alive before it: the model's, the optimizer's and every other Python reaches; "
                      "and the peak of those made during it, torch.distributed._tools.mem_tracker.MemTracker)")
                   + f", after one before it, with activation checkpointing {options.activation_checkpointing}, the "
                     f"model laid out by FSDP2 --sharding {measured.sharding} over {measured.world_size} rank(s) in "
                     f"{measured.dtype_name}; largest over the ranks) less static_bytes_counted, the static bytes "
                     "the memory model counts for that layout (static_bytes_per_parameter × parameters, its "
                     "sharded part over the ranks); static per parameter: that layout's "
                     "(scheduler_service.core.memory; the trainer "
                     "derives its BucketSize with its own mode's). static_bytes: rank 0's weights, gradients and "
                     "AdamW states (its shards) counted per tensor. reserved: device memory no tensor holds (CUDA "
                     "context, communicator buffers, allocator slack: mem_get_info minus allocated) once the model "
                     "was built and warm, with the allocator's cache emptied, before the sweeps; 0 on CPU."),
    })


def refit_compute(document: Mapping[str, Any], *, name: str, command: str, date: str) -> dict[str, Any]:
    """``document`` (a profile file's JSON, as the profiler of any earlier version wrote it) with its compute
    coefficients fitted again from its own points by this version (``compute_section``), renamed ``name``. What the
    shard-size effect measured stays as it was; the provenance keeps the measurement's and records the refit
    (``command``, ``date``, the fit it replaced)."""
    provenance = document.get("provenance", {})
    compute = document["compute"]
    options = provenance.get("options", {})
    timing = f"as measured on {str(provenance.get('date', 'an unrecorded date'))[:10]}"
    if {"repeats", "warmup"} <= options.keys():
        timing = f"median of {options['repeats']} timed runs after {options['warmup']} warm-up each, {timing}"
    section = compute_section(compute["points"], num_layers=provenance["model"]["num_layers"],
                              on_gpu="gpu" in provenance.get("hardware", {}), timing=timing)
    refit = section.model_dump(mode="json", exclude_unset=True)
    shard_effect = {key: value for key, value in compute.items()
                    if key.startswith(("shard_effect", "attention_"))
                    or key in ("alpha_s_per_shard", "alpha_s_per_ulysses_shard")}
    for derived in ("shard_cost", "ulysses_shard_cost", "attention_efficiency"):
        if derived in compute.get("fit", {}):
            refit["fit"][derived] = compute["fit"][derived]
    record = {"tool": TOOL, "command": command, "date": date, "from": document.get("name"),
              "replaced_fit": compute.get("fit")}
    return {**document, "name": name, "compute": {**refit, **shard_effect},
            "provenance": {**provenance, "refits": [*provenance.get("refits", []), record]}}


def rebase_compute(base: Mapping[str, Any], measured: Mapping[str, Any], *, name: str, command: str,
                   date: str) -> dict[str, Any]:
    """``base`` (a profile document) computing at the rates ``measured`` (a measured profile's document) found:
    the measured compute section (coefficients, fits, points) in place of the base's, the base's hardware, memory
    and communication kept, renamed ``name``. For a device that computes as the measured one does where the base
    describes the rest: an H100 and an H200 share the GH100's compute and differ in memory.

    What one process could not measure stays the base's: the attention efficiency per query length (the measured
    profile has none unless its sweep sharded sequences over ranks). The result names the base's model (none:
    every model) and carries no ``provenance``, since nothing measured it as a whole (a GPU run's machine check
    reads provenance); ``derivation`` records the base, the measurement the compute came from and ``command``."""
    compute = dict(measured["compute"])
    if "attention_efficiency" not in compute and "attention_efficiency" in base["compute"]:
        compute["attention_efficiency"] = base["compute"]["attention_efficiency"]
    origin = measured.get("provenance", {})
    device = measured.get("hardware", {}).get("device")
    compute["source"] = (f"measured as profile {measured.get('name')} ({measured.get('model')} on {device}, "
                         f"{str(origin.get('date', 'an unrecorded date'))[:10]}): "
                         f"{measured['compute'].get('source', '')}")
    derivation = {"tool": TOOL, "command": command, "date": date, "base": base.get("name"),
                  "compute_from": {"name": measured.get("name"), "model": measured.get("model"), "device": device,
                                   "date": origin.get("date"), "command": origin.get("command"),
                                   "software": origin.get("software")}}
    rebased = {key: value for key, value in base.items() if key != "provenance"}
    return {**rebased, "name": name,
            "description": f"{base.get('hardware', {}).get('device')} computing at the rates profile "
                           f"{measured.get('name')} measured ({measured.get('model')} on {device}; compute.source), "
                           f"with the hardware, memory and communication of profile {base.get('name')} (each "
                           "section's source).",
            "compute": compute, "derivation": derivation}


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkTables:
    """The collective tables of one kind of link (within a node, or across nodes) as the profile holds them."""

    tables: dict[str, list[list[float]]]  # collective -> [[bytes, seconds], ...] over world_size ranks
    world_size: int | None
    tables_by_group_size: dict[str, dict[str, list[list[float]]]]


def split_by_node(tables: dict[str, list[list[float]]], group_tables: dict[str, dict[str, list[list[float]]]], *,
                  world_size: int, local_world_size: int) -> tuple[LinkTables, LinkTables]:
    """(within a node, across nodes) of what the sweeps measured. Ranks fill nodes in order and blocks are
    aligned, so the world and every block larger than a node cross nodes; the blocks of one node, measured all
    at once, are the intra-node tables. On one node everything is intra-node and nothing inter-node."""
    if local_world_size >= world_size:
        return (LinkTables(tables=tables, world_size=world_size, tables_by_group_size=group_tables),
                LinkTables(tables={}, world_size=None, tables_by_group_size={}))
    node_tables = group_tables.get(str(local_world_size), {})
    within = LinkTables(tables=node_tables, world_size=local_world_size if node_tables else None,
                        tables_by_group_size={size: by_size for size, by_size in group_tables.items()
                                              if int(size) < local_world_size})
    across = LinkTables(tables=tables, world_size=world_size,
                        tables_by_group_size={size: by_size for size, by_size in group_tables.items()
                                              if int(size) > local_world_size})
    return within, across


def _communication_section(measured: Measurements) -> CommunicationSection:
    """The latency tables within a node and across nodes (none in one process: plans with CP > 1 then count
    communication within a node as free; none across nodes on one node: such plans are refused)."""
    method = ("collective latency vs bytes moved in all (median over repetitions of the ranks' mean time from "
              "launch to the end of wait, each rank first computing for collective_lead_s: what a static-CP "
              "micro-batch computes before each collective)")
    blocks = ("all_gather and reduce_scatter of the same sizes over every aligned block of s ranks at once "
              "(dist.new_group per block), slowest block")
    within, across = split_by_node(measured.tables, measured.group_tables, world_size=measured.world_size,
                                   local_world_size=measured.local_world_size)
    num_nodes = measured.world_size // measured.local_world_size
    if measured.world_size == 1:
        within_note = ("none: measured in one process; plans with cp_size > 1 count communication as free until "
                       "this is re-run under torchrun")
    elif num_nodes == 1:
        within_note = f"measured over {measured.world_size} ranks ({measured.process_group_backend})"
    else:
        within_note = (f"measured over the {measured.local_world_size} ranks of each of the {num_nodes} nodes at "
                       f"once ({measured.process_group_backend}), slowest node")
    if across.tables:
        across_note = (f"{method}: measured over {measured.world_size} ranks on {num_nodes} nodes of "
                       f"{measured.local_world_size} ({measured.process_group_backend})"
                       + (f"; tables_by_group_size: {blocks}, for s in {', '.join(across.tables_by_group_size)}."
                          if across.tables_by_group_size else "."))
    else:
        across_note = (f"none: measured on one node (LOCAL_WORLD_SIZE {measured.local_world_size} = WORLD_SIZE "
                       f"{measured.world_size}); plans whose CP blocks span nodes are refused until this is re-run "
                       f"under torchrun across nodes")
    inter_node: dict[str, Any] = {"tables": across.tables, "tables_by_group_size": across.tables_by_group_size,
                                  "source": across_note}
    if across.tables:
        inter_node |= {"world_size": measured.world_size, "num_nodes": num_nodes}
    return CommunicationSection.model_validate({
        "kv_bytes_per_element": measured.kv_bytes_per_element,
        "tables": within.tables,
        "tables_by_group_size": within.tables_by_group_size,
        "fit": "relative",
        "world_size": within.world_size,
        "inter_node": inter_node,
        "source": f"{method}: {within_note}."
                  + (f" tables_by_group_size: {blocks}, for s in {', '.join(within.tables_by_group_size)}."
                     if within.tables_by_group_size else ""),
    })


def with_shard_effect(document: ProfileDocument, shape: ModelShape, shards: Sequence[Mapping[str, Any]],
                      options: ProfileOptions) -> ProfileDocument:
    """``document`` with the shard-effect rows of ``shards`` (``compute.shard_effect``) and their note, the cost of
    a shard (``compute.alpha_s_per_shard``, derived in ``compute.fit.shard_cost``), the efficiency's derivation
    (``compute.fit.attention_efficiency``) and, where the rows determine it, the curve
    (``compute.attention_efficiency``). ``document`` has neither: the rows are read first against the model without
    a shard cost, for that cost, then with it and at efficiency 1, for the efficiency."""
    unpriced = PerformanceModel(model=shape, profile=parse_profile(document_json(document)))
    # a Ulysses row whose all-to-all the profile cannot price (a group across nodes without inter-node
    # all-to-all tables) says nothing the model can read
    shards = [shard for shard in shards if unpriced.scheme_comm(shard["degree"], shard.get("ulysses_degree", 1))
              is not None]
    cost = derive_shard_cost(unpriced, shards)
    ulysses_cost = derive_shard_cost(unpriced, shards, ulysses=True)
    document = document.model_copy(update={"compute": document.compute.model_copy(
        update={"alpha_s_per_shard": cost.alpha_s_per_shard,
                "alpha_s_per_ulysses_shard": ulysses_cost.alpha_s_per_shard})})
    perf = PerformanceModel(model=shape, profile=parse_profile(document_json(document)))
    rows = shard_effect_rows(perf, shards)
    fit = derive_attention_efficiency(perf, rows)
    degrees = sorted({row["degree"] for row in rows})
    note = (f"one sequence of each of {list(options.shard_sizes)} tokens run whole on every rank at once (whole_s: "
            f"mean over ranks; the median of {options.repeats} timed runs after {options.warmup} warm-up) vs as "
            f"zigzag shards over every aligned block of d ranks at once, d in {degrees} (shard_s: slowest rank; "
            f"the mean of {shard_runs(options)} timed runs, as its collectives' tables). predicted_*: this profile's "
            f"model with attention efficiency 1 (a rank holding only its shard: nothing hides the collectives, "
            f"whose cost is the table measured for d). ")
    compute = document.compute
    fits = (compute.model_extra or {}).get("fit", {})
    update: dict[str, Any] = {
        "fit": {**fits, "shard_cost": cost.to_json(), "ulysses_shard_cost": ulysses_cost.to_json(),
                "attention_efficiency": fit.to_json()},
        "shard_effect": rows,
        "shard_effect_note": note + (f"Rows with ulysses_degree: the same sequence sharded by Ulysses (all-to-all over "
                                     f"heads), for its own cost alone. alpha_s_per_shard: {cost.result}; "
                                     f"alpha_s_per_ulysses_shard: {ulysses_cost.result}; attention_efficiency: "
                                     f"{fit.result}; candidates and verdicts in compute.fit."),
    }
    if fit.points:
        update["attention_efficiency"] = AttentionEfficiency.model_validate({
            "points": list(fit.points),
            "source": f"derived from compute.shard_effect: per query length, the efficiency that makes the model's "
                      f"time equal the measured time, median per length, relative to the longest query measured "
                      f"({fit.reference_query_tokens:g} tokens); candidates in compute.fit.attention_efficiency.",
        })
    return document.model_copy(update={
        "compute": ComputeSection.model_validate({**compute.model_dump(exclude_unset=True), **update})})
