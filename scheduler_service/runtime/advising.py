"""``POST /advise`` without HTTP: the wire request to the core's ``LayoutProblem`` (``contract.advice``), bounded
before any work, and the advice as the document the CLI writes.

The sample is bounded twice before anything is planned: its size from the request's shape (a histogram's counts
are summed before any length is expanded), then the whole work (``core.advise.advise_cost``: layouts × batches ×
cells of each plan) against ``max_advise_cells``. Either refusal is a 422 naming the field and the limit.
"""

from __future__ import annotations

import json

from skrull_proto.advise import AdviceDocument
from skrull_proto.advise import AdviseRequest as AdviseRequestModel

from scheduler_service.contract.advice import TrainerSources, advice_document, layout_problem
from scheduler_service.core.advise import AdviseLimits, LayoutProblem, advise, advise_cost
from scheduler_service.core.profile import Profile
from scheduler_service.runtime.errors import RequestLimitError

__all__ = ["advice_json", "advise_in_worker", "check_sample_size", "core_problem"]


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


def core_problem(request: AdviseRequestModel, *, limits: AdviseLimits, max_cells: int,
                 extra_profiles: dict[str, Profile] | None = None) -> LayoutProblem:
    """The core's problem, validated (which names the offending field), refused over the service's limits."""
    check_sample_size(request, limits)
    problem = layout_problem(request, limits=limits, extra_profiles=extra_profiles)
    cost = advise_cost(problem)
    if cost.cells > max_cells:
        raise RequestLimitError(
            f"pricing {cost.num_layouts} layouts on {problem.num_batches} batches of about {cost.sequences_per_batch} "
            f"sequences is estimated at {cost.cells} cells; the service advises on at most {max_cells}: ask for "
            "fewer num_batches, a smaller global batch, or fewer cp_sizes and shardings",
            field="num_batches", limit=max_cells)
    return problem


def advice_json(problem: LayoutProblem) -> bytes:
    """The advice for ``problem`` as the document ``AdviceDocument`` describes, validated by it and in its field
    order. The service has no ``--data`` and names models and profiles by name (``TrainerSources()``)."""
    document = advice_document(advise(problem), TrainerSources())
    return json.dumps(AdviceDocument.model_validate(document).model_dump(mode="json")).encode()


def advise_in_worker(request_json: bytes, limits: AdviseLimits, max_cells: int,
                     extra_profiles: dict[str, Profile]) -> bytes:
    """``advice_json`` in a pool process, from the request's JSON (validated again there, cheaply)."""
    request = AdviseRequestModel.model_validate_json(request_json)
    return advice_json(core_problem(request, limits=limits, max_cells=max_cells, extra_profiles=extra_profiles))
