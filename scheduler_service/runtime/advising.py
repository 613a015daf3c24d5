"""``POST /advise`` without HTTP: the wire request to the core's ``AdviseRequest``, bounded before any work, and
the advice as the JSON document the CLI writes.

The sample is bounded twice before anything is planned: its size from the request's shape (a histogram's counts
are summed before any length is expanded), then the whole work (``core.advise.advise_cost``: layouts × batches ×
cells of each plan) against ``max_advise_cells``. Either refusal is a 422 naming the field and the limit.
"""

from __future__ import annotations

import json

import numpy as np
from skrull_proto.advise import AdviceDocument
from skrull_proto.advise import AdviseRequest as AdviseRequestModel

from scheduler_service.core.advise import AdviseLimits, AdviseRequest, GlobalBatch, advise, advise_cost
from scheduler_service.core.memory import ActivationCheckpointing, Sharding
from scheduler_service.core.models import ModelShape, resolve_model
from scheduler_service.core.profile import Profile, resolve_profile
from scheduler_service.runtime.errors import RequestLimitError

__all__ = ["DEFAULT_GLOBAL_BATCH", "advice_json", "advise_in_worker", "check_sample_size", "core_request"]

DEFAULT_GLOBAL_BATCH = 64  # sequences per step when a request names neither a batch nor a token budget


def check_sample_size(request: AdviseRequestModel, limits: AdviseLimits) -> None:
    """Refuse a sample over the limit from its shape, before any length is expanded."""
    if request.sequence_lengths is not None:
        field, num_sequences = "sequence_lengths", len(request.sequence_lengths)
    else:
        assert request.histogram is not None
        field, num_sequences = "histogram", sum(bar.count for bar in request.histogram)
    if num_sequences > limits.max_sample_sequences:
        raise RequestLimitError(f"{field} holds {num_sequences} sequences; at most {limits.max_sample_sequences} are "
                                "accepted: send a smaller sample or a histogram of it", field=field,
                                limit=limits.max_sample_sequences)


def core_request(request: AdviseRequestModel, *, limits: AdviseLimits, max_cells: int,
                 extra_profiles: dict[str, Profile] | None = None) -> AdviseRequest:
    """The core's request, validated (which names the offending field), refused over the service's limits."""
    check_sample_size(request, limits)
    if request.sequence_lengths is not None:
        lengths = np.asarray(request.sequence_lengths, dtype=np.int64)
    else:
        assert request.histogram is not None
        lengths = np.repeat(np.asarray([bar.length for bar in request.histogram], dtype=np.int64),
                            [bar.count for bar in request.histogram])
    model = request.model if isinstance(request.model, str) else ModelShape(**request.model.model_dump())
    global_batch = (GlobalBatch(num_tokens=request.tokens_per_step) if request.tokens_per_step is not None
                    else GlobalBatch(num_sequences=request.global_batch or DEFAULT_GLOBAL_BATCH))
    core = AdviseRequest(
        sequence_lengths=lengths, model=resolve_model(model), profile=resolve_profile(request.profile, extra_profiles),
        num_gpus=request.gpus, gpus_per_node=request.gpus_per_node, global_batch=global_batch,
        shardings=tuple(Sharding(mode.value) for mode in request.shardings or Sharding),
        activation_checkpointing=tuple(ActivationCheckpointing(mode.value)
                                       for mode in request.activation_checkpointing or ()),
        cp_sizes=tuple(request.cp_sizes or ()), num_batches=request.num_batches, seed=request.seed,
        compute_bytes=2 if request.dtype == "bfloat16" else 4, limits=limits,
    )
    cost = advise_cost(core)
    if cost.cells > max_cells:
        raise RequestLimitError(
            f"pricing {cost.num_layouts} layouts on {core.num_batches} batches of about {cost.sequences_per_batch} "
            f"sequences is estimated at {cost.cells} cells; the service advises on at most {max_cells}: ask for "
            "fewer num_batches, a smaller global batch, or fewer cp_sizes and shardings",
            field="num_batches", limit=max_cells)
    return core


def advice_json(request: AdviseRequest) -> bytes:
    """The advice for ``request`` as the document ``AdviceDocument`` describes."""
    document = advise(request).to_json()
    return json.dumps(AdviceDocument.model_validate(document).model_dump(mode="json")).encode()


def advise_in_worker(request_json: bytes, limits: AdviseLimits, max_cells: int,
                     extra_profiles: dict[str, Profile]) -> bytes:
    """``advice_json`` in a pool process, from the request's JSON (validated again there, cheaply)."""
    request = AdviseRequestModel.model_validate_json(request_json)
    return advice_json(core_request(request, limits=limits, max_cells=max_cells, extra_profiles=extra_profiles))
