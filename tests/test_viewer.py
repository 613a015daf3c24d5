"""The plan viewer's server side: the page and its files are served from the package, the per-CP-rank breakdown it
draws is the simulator's and is opt-in, and the samplers it draws batches from are seeded and bounded.

The page itself runs in a real browser in ``test_viewer_browser.py``.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from skrull_proto import PlanRequest, PlanResponse, SchedulerName

from scheduler_service.core.planner import make_plan
from scheduler_service.core.samplers import DATASETS, sample_lengths
from scheduler_service.runtime.settings import Settings
from scheduler_service.runtime.wire import request_to_problem
from scheduler_service.web.app import create_app
from scheduler_service.web.routes.viewer import STATIC_DIR

REQUEST = {"sequence_lengths": [812, 30311, 97, 4096, 1500, 256, 65000, 733, 12000, 2500, 31000, 640],
           "dp_size": 2, "cp_size": 4, "bucket_size": 20000}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(Settings(cpsat_warmup=False, access_log=False, max_sequences=1000))) as client:
        yield client


class _Assets(HTMLParser):
    """Every URL the page loads by itself (scripts, stylesheets, images)."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if tag in ("script", "img") and values.get("src"):
            self.urls.append(values["src"] or "")
        if tag == "link" and values.get("href"):
            self.urls.append(values["href"] or "")


def test_root_serves_the_viewer_page_whose_assets_all_come_from_the_service(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    parser = _Assets()
    parser.feed(page.text)
    assert sorted(parser.urls) == ["/static/viewer.css", "/static/viewer.js"]
    for url in parser.urls:
        asset = client.get(url)
        assert asset.status_code == 200 and asset.content == (STATIC_DIR / url.removeprefix("/static/")).read_bytes()


def test_viewer_script_talks_only_to_the_public_api() -> None:
    script = (STATIC_DIR / "viewer.js").read_text()
    urls = set(re.findall(r'call\("(?:GET|POST)", [`"](/[a-z]+)', script))
    assert urls == {"/models", "/samplers", "/plan"}
    assert "http://" not in script.replace('"http://www.w3.org/2000/svg"', "") and "https://" not in script


def test_static_files_ship_in_the_wheel() -> None:
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert "static/*" in pyproject["tool"]["setuptools"]["package-data"]["scheduler_service.web"]
    assert {path.name for path in STATIC_DIR.iterdir()} == {"index.html", "viewer.js", "viewer.css"}


def test_plan_breakdown_is_opt_in_so_earlier_clients_see_the_same_response(client: TestClient) -> None:
    plain = client.post("/plan", json=REQUEST).json()
    detailed = client.post("/plan", json={**REQUEST, "breakdown": True}).json()
    assert all("cp_ranks" not in mb for dp in plain["dp_ranks"] for mb in dp["micro_batches"])
    for dp in detailed["dp_ranks"]:
        for mb in dp["micro_batches"]:
            del mb["cp_ranks"]
    assert {**detailed, "solve_time_ms": 0} == {**plain, "solve_time_ms": 0}


@pytest.mark.parametrize("scheduler", ["skrull", "skrull_binary", "deepspeed"])
def test_plan_breakdown_is_the_simulators_and_its_parts_add_up(client: TestClient, scheduler: str) -> None:
    request = {**REQUEST, "scheduler": scheduler, "breakdown": True}
    response = PlanResponse.model_validate(client.post("/plan", json=request).json())
    result = make_plan(request_to_problem(PlanRequest.model_validate(request)), SchedulerName(scheduler))
    for dp, dp_estimate in zip(response.dp_ranks, result.estimate.dp_ranks, strict=True):
        for mb, mb_estimate in zip(dp.micro_batches, dp_estimate.micro_batches, strict=True):
            assert len(mb.cp_ranks) == REQUEST["cp_size"]
            assert mb.estimated_time_ms == pytest.approx(max(rank.time_ms for rank in mb.cp_ranks), abs=1e-5)
            for rank, expected in zip(mb.cp_ranks, mb_estimate.cp_ranks, strict=True):
                parts_ms = rank.local_ms + rank.distributed_ms + rank.sharded_ms + rank.fixed_ms + rank.exposed_comm_ms
                assert parts_ms == pytest.approx(rank.time_ms, abs=1e-5)
                assert rank.time_ms == pytest.approx(expected.time_s * 1e3, abs=1e-5)
                assert rank.tokens == pytest.approx(expected.tokens) and rank.tokens <= response.bucket_size
                assert 0 <= rank.exposed_comm_ms <= rank.comm_ms + 1e-9


def test_samplers_lists_the_cores_distributions(client: TestClient) -> None:
    listed = client.get("/samplers").json()["samplers"]
    assert [sampler["name"] for sampler in listed] == list(DATASETS)
    assert {s["name"]: s["longest"] for s in listed} == {name: d.longest for name, d in DATASETS.items()}


def test_sampler_draws_are_seeded_and_the_cores(client: TestClient) -> None:
    first = client.get("/samplers/chatqa2", params={"num_sequences": 50, "seed": 7}).json()
    again = client.get("/samplers/chatqa2", params={"num_sequences": 50, "seed": 7}).json()
    other = client.get("/samplers/chatqa2", params={"num_sequences": 50, "seed": 8}).json()
    assert first == again and first["sequence_lengths"] != other["sequence_lengths"]
    expected = sample_lengths("chatqa2", 50, np.random.default_rng(7), max_length=first["max_length"])
    assert first["sequence_lengths"] == expected.tolist()
    capped = client.get("/samplers/lmsys", params={"num_sequences": 500, "max_length": 2048}).json()
    assert max(capped["sequence_lengths"]) <= 2048 == capped["max_length"]


@pytest.mark.parametrize(("path", "params", "field", "fragment"), [
    ("/samplers/imagenet", {}, "name", "unknown sampler 'imagenet'; known: wikipedia"),
    ("/samplers/lmsys", {"num_sequences": 1001}, "num_sequences", "at most 1000"),
    ("/samplers/lmsys", {"num_sequences": 0}, "query.num_sequences", "greater than or equal to 1"),
    ("/samplers/lmsys", {"seed": "x"}, "query.seed", "valid integer"),
])
def test_sampler_rejects_bad_queries_with_a_problem_naming_the_field(
    client: TestClient, path: str, params: dict[str, str | int], field: str, fragment: str
) -> None:
    response = client.get(path, params=params)
    assert response.status_code == 422
    assert response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert problem["field"] == field and fragment in problem["detail"]
