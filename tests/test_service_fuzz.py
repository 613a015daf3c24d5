"""Contract fuzzing: schemathesis generates requests from the checked-in OpenAPI document (valid and invalid ones)
and sends them to the real app under uvicorn; no answer may be a 5xx, and every answer must match the document
(status code, content type, body schema). Examples are bounded and derandomized, so the run is deterministic."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from scheduler_service.export_schema import CONTRACT_DIR
from scheduler_service.runtime.settings import Settings
from scheduler_service.web.app import create_app
from tests.servers import uvicorn_in_thread

pytestmark = pytest.mark.slow

schema = schemathesis.openapi.from_path(CONTRACT_DIR / "openapi.json")

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]

# Small limits keep each generated plan cheap; cpsat gets a tiny time limit and a small pool that turns the
# excess into documented 429s rather than a queue.
FUZZ_SETTINGS = Settings(
    max_sequences=300, max_dp_size=64, max_cp_size=64, max_sequence_length=1 << 20, max_body_bytes=256 << 10,
    cpsat_workers=1, cpsat_queue=0, cpsat_max_sequences=12, cpsat_default_time_limit_s=0.05,
    cpsat_max_time_limit_s=0.05, cpsat_warmup=False, access_log=False,
)


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with uvicorn_in_thread(create_app(FUZZ_SETTINGS)) as port:
        yield f"http://127.0.0.1:{port}"


@schema.parametrize()
@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_api_conforms_to_its_contract(case: schemathesis.Case, base_url: str) -> None:
    case.call_and_validate(base_url=base_url, checks=CHECKS, timeout=30)
