"""``GET /samplers`` and ``GET /samplers/{name}``: the core's named length distributions, so that a browser (the
plan viewer) can plan a realistic batch without a copy of them."""

from __future__ import annotations

from typing import Annotated

import numpy as np
from fastapi import APIRouter, Query
from skrull_proto import SampledBatch, SamplersResponse

from scheduler_service.contract.wire import sampler_to_spec
from scheduler_service.core.errors import InvalidRequestError
from scheduler_service.core.samplers import DATASETS, sample_lengths
from scheduler_service.runtime.errors import RequestLimitError
from scheduler_service.web.deps import SettingsDep
from scheduler_service.web.problems import PROBLEM_RESPONSES

__all__ = ["router"]

router = APIRouter()


@router.get("/samplers", operation_id="listSamplers", response_model=SamplersResponse,
            summary="Named sequence-length samplers")
async def samplers() -> SamplersResponse:
    return SamplersResponse(samplers=[sampler_to_spec(name, distribution) for name, distribution in DATASETS.items()])


@router.get(
    "/samplers/{name}",
    operation_id="drawSamples",
    response_model=SampledBatch,
    responses={422: PROBLEM_RESPONSES[422]},
    summary="Draw a batch of sequence lengths from a sampler",
    description="Seeded: the same name, num_sequences, seed and max_length give the same lengths.",
)
async def draw(
    name: str,
    settings: SettingsDep,
    num_sequences: Annotated[int, Query(ge=1, description="How many lengths (capped by max_sequences).")] = 64,
    seed: Annotated[int, Query(ge=0, lt=2**63)] = 0,
    max_length: Annotated[int | None, Query(ge=1, description="Cut longer draws to this (default and cap: "
                                                              "the service's max_sequence_length).")] = None,
) -> SampledBatch:
    if name not in DATASETS:
        raise InvalidRequestError(f"unknown sampler {name!r}; known: {', '.join(DATASETS)}", field="name")
    if num_sequences > settings.max_sequences:
        raise RequestLimitError(f"num_sequences is {num_sequences}; at most {settings.max_sequences} are drawn",
                                field="num_sequences", limit=settings.max_sequences)
    cap = settings.max_sequence_length if max_length is None else min(max_length, settings.max_sequence_length)
    lengths = sample_lengths(name, num_sequences, np.random.default_rng(seed), max_length=cap)
    return SampledBatch(sampler=name, seed=seed, max_length=cap, sequence_lengths=lengths.tolist())
