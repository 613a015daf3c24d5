"""The plan viewer (``GET /``) and the samplers it draws batches from (``GET /samplers``).

The viewer is one static page shipped in the package (``static/``: HTML, CSS and vanilla JavaScript; no build
step, nothing from a CDN). It talks to the public API only — ``/models``, ``/samplers`` and ``/plan`` with
``breakdown`` — so it is also a living example of the contract. ``/samplers`` serves the core's named length
distributions, so a browser can plan a realistic batch without a copy of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import numpy as np
from fastapi import APIRouter, FastAPI, Query
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from skrull_proto import SampledBatch, SamplersResponse

from scheduler_service.api import SettingsDep
from scheduler_service.core.errors import InvalidRequestError
from scheduler_service.core.samplers import DATASETS, sample_lengths
from scheduler_service.problems import PROBLEM_RESPONSES, RequestLimitError
from scheduler_service.wire import sampler_to_spec

__all__ = ["STATIC_DIR", "install_viewer"]

STATIC_DIR = Path(__file__).resolve().parent / "static"

router = APIRouter()


@router.get("/", include_in_schema=False)
async def viewer_page() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html")


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


def install_viewer(app: FastAPI) -> None:
    """Add the page, its static files (``/static``) and the sampler routes to ``app``."""
    app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
