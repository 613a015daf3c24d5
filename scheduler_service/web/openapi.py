"""The service's OpenAPI document: FastAPI's, completed with what the routes declare by hand."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from skrull_proto import FeedbackRequest, JobProfileRequest, PlanRequest, Problem
from skrull_proto.advise import AdviseRequest

__all__ = ["JSON", "json_request_body", "openapi_document"]

JSON = "application/json"


def json_request_body(schema: str) -> dict[str, Any]:
    """OpenAPI of a body the route parses itself (``runtime.parsing``), so that the service decides where it is
    parsed."""
    return {"requestBody": {"content": {JSON: {"schema": {"$ref": f"#/components/schemas/{schema}"}}},
                            "required": True}}


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document plus the schemas the routes refer to by hand: PlanRequest, FeedbackRequest,
    JobProfileRequest and AdviseRequest (POST /plan, /feedback, PUT /jobs/{job_id}/profile and POST /advise parse
    their own bodies) and Problem (the problem+json responses); the bearer token marked optional where it is asked
    for (``auth``). Built once per app."""
    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version=app.version, description=app.description,
                               routes=app.routes)
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for model in (PlanRequest, FeedbackRequest, JobProfileRequest, AdviseRequest, Problem):
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        document["components"]["schemas"] = dict(sorted(schemas.items()))
        for item in document["paths"].values():  # the bearer token is optional: off unless SKRULL_API_TOKEN is set
            for operation in item.values():
                if "security" in operation:
                    operation["security"].append({})
        app.openapi_schema = document
    return app.openapi_schema
