"""Export the wire contract's JSON Schemas and the service's OpenAPI document into ``proto/skrull_proto/``.

    python -m scheduler_service.export_schema           # rewrite the checked-in files
    python -m scheduler_service.export_schema --check   # exit 1 if they differ from the code

The files ship inside ``skrull_proto`` (package data), so a client in any
language can read the contract without running the service. A test runs the
``--check`` comparison, so the files cannot drift from the models.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import skrull_proto
from pydantic import BaseModel
from skrull_proto import (
    FeedbackRequest,
    FeedbackResponse,
    JobProfileRequest,
    ModelsResponse,
    PlanRequest,
    PlanResponse,
    Problem,
    ProfileDocument,
)
from skrull_proto.advise import AdviceDocument, AdviseRequest

__all__ = ["CONTRACT_DIR", "contract_documents", "main", "stale_documents"]

CONTRACT_DIR = Path(skrull_proto.__file__).resolve().parent

_SCHEMA_MODELS: dict[str, type[BaseModel]] = {
    "plan_request.schema.json": PlanRequest,
    "plan_response.schema.json": PlanResponse,
    "problem.schema.json": Problem,
    "models_response.schema.json": ModelsResponse,
    "feedback_request.schema.json": FeedbackRequest,
    "feedback_response.schema.json": FeedbackResponse,  # also the answer of PUT /jobs/{job_id}/profile
    "job_profile_request.schema.json": JobProfileRequest,
    "profile.schema.json": ProfileDocument,  # the profile file format
    "advise_request.schema.json": AdviseRequest,
    "advice.schema.json": AdviceDocument,  # the answer of POST /advise and skrull-advise --json
}


def _json_schema(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": model.__name__, **schema}


def _openapi() -> dict[str, Any]:
    # Imported here: the JSON Schemas need pydantic only, the OpenAPI document needs the app.
    from scheduler_service.runtime.settings import Settings
    from scheduler_service.web.app import create_app

    # The document does not depend on settings; defaults keep it independent of the environment.
    return create_app(Settings(warmup=False, cpsat_warmup=False)).openapi()


def _render(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2, ensure_ascii=False) + "\n"


def contract_documents() -> dict[str, str]:
    """File name (inside ``CONTRACT_DIR``) → its exact text."""
    documents = {name: _render(_json_schema(model)) for name, model in _SCHEMA_MODELS.items()}
    documents["openapi.json"] = _render(_openapi())
    return documents


def stale_documents(directory: Path = CONTRACT_DIR) -> list[str]:
    """Names of the files that are missing or differ from what the code exports."""
    stale = []
    for name, text in contract_documents().items():
        path = directory / name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            stale.append(name)
    return stale


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scheduler_service.export_schema",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when a file is stale")
    parser.add_argument("--dir", type=Path, default=CONTRACT_DIR, help="where the files live (default: the package)")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_documents(args.dir)
        for name in stale:
            print(f"stale: {args.dir / name}", file=sys.stderr)
        if stale:
            print("run: python -m scheduler_service.export_schema", file=sys.stderr)
        return 1 if stale else 0
    args.dir.mkdir(parents=True, exist_ok=True)
    for name, text in contract_documents().items():
        (args.dir / name).write_text(text, encoding="utf-8")
        print(f"wrote {args.dir / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
