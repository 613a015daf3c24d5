"""The plan viewer's server side: the page and its files are served from the package, its two views (plan and
advise) each show every problem beside a field of their own form and read only what the contract holds, the
per-CP-rank breakdown the plan view draws is the simulator's and is opt-in (per world rank for a micro-batch that
spans DP replicas), and the samplers it draws batches from are seeded and bounded.

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
from pydantic import BaseModel
from skrull_proto import (
    CPRankEstimateModel,
    DPRankPlanModel,
    MicroBatchModel,
    PlanRequest,
    PlanResponse,
    SchedulerName,
    SpanningMicroBatchModel,
)
from skrull_proto.advise import AdviceDocument, AdviseRequest, ExcludedLayoutModel, RankedLayoutModel

from scheduler_service.contract.wire import request_to_problem
from scheduler_service.core.planner import make_plan
from scheduler_service.core.samplers import DATASETS, sample_lengths
from scheduler_service.runtime.settings import Settings
from scheduler_service.web.app import create_app
from scheduler_service.web.routes.viewer import STATIC_DIR

REQUEST = {"sequence_lengths": [812, 30311, 97, 4096, 1500, 256, 65000, 733, 12000, 2500, 31000, 640],
           "dp_size": 2, "cp_size": 4, "bucket_size": 20000}
# sequence 2 (120000 tokens) is longer than one CP group holds (bucket_size 20000 × cp_size 4): every plan runs it in a
# micro-batch over both DP replicas
SPANNING_REQUEST = {"sequence_lengths": [100, 200, 120000, 3000, 700, 30000, 5000], "dp_size": 2, "cp_size": 4,
                    "bucket_size": 20000}


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


class _Forms(HTMLParser):
    """Each form's boxes (its ``.field`` elements, by ``data-field``), and every element id of the page."""

    def __init__(self) -> None:
        super().__init__()
        self.boxes: dict[str, set[str]] = {}
        self.ids: set[str] = set()
        self._form: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if values.get("id"):
            self.ids.add(values["id"] or "")
        if tag == "form":
            self._form = values["id"]
            self.boxes[self._form or ""] = set()
        if self._form is not None and values.get("data-field"):
            self.boxes[self._form].add(values["data-field"] or "")

    def handle_endtag(self, tag: str) -> None:
        if tag == "form":
            self._form = None


def _module_imports(script: str) -> list[str]:
    """The static files an ES module imports (``import … from "./common.js"``)."""
    return re.findall(r'^import [^;]*? from "\./([\w-]+\.js)";', script, re.MULTILINE)


def _field_boxes(script: str) -> dict[str, str]:
    """A view's ``FIELD_BOXES``: a problem's field → the box of its form that shows it."""
    found = re.search(r"^const FIELD_BOXES = \{(.*?)\};", script, re.MULTILINE | re.DOTALL)
    assert found is not None
    return dict(re.findall(r'(\w+): "(\w+)"', found.group(1)))


def test_root_serves_the_viewer_page_whose_assets_all_come_from_the_service(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    parser = _Assets()
    parser.feed(page.text)
    assert sorted(parser.urls) == ["/static/viewer.css", "/static/viewer.js"]
    loaded, pending = set(), list(parser.urls)
    while pending:  # the page's files, then the modules its script imports, and theirs
        url = pending.pop()
        loaded.add(url)
        asset = client.get(url)
        assert asset.status_code == 200 and asset.content == (STATIC_DIR / url.removeprefix("/static/")).read_bytes()
        if url.endswith(".js"):  # a browser runs a module only when it is served as JavaScript
            assert asset.headers["content-type"].split(";")[0] in ("text/javascript", "application/javascript")
            pending += [f"/static/{name}" for name in _module_imports(asset.text) if f"/static/{name}" not in loaded]
    assert loaded == {f"/static/{path.name}" for path in STATIC_DIR.iterdir() if path.name != "index.html"}


def test_viewer_scripts_talk_only_to_the_public_api() -> None:
    scripts = "\n".join(path.read_text() for path in sorted(STATIC_DIR.glob("*.js")))
    urls = set(re.findall(r'call\("(?:GET|POST)", [`"](/[a-z]+)', scripts))
    assert urls == {"/models", "/samplers", "/plan", "/advise"}
    assert "http://" not in scripts.replace('"http://www.w3.org/2000/svg"', "") and "https://" not in scripts


def test_static_files_ship_in_the_wheel() -> None:
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert "static/*" in pyproject["tool"]["setuptools"]["package-data"]["scheduler_service.web"]
    assert {path.name for path in STATIC_DIR.iterdir()} == {"index.html", "viewer.js", "advise.js", "common.js",
                                                            "viewer.css"}


def test_page_has_a_plan_view_and_an_advise_view_each_with_its_own_form() -> None:
    forms = _Forms()
    forms.feed((STATIC_DIR / "index.html").read_text())
    assert {"tab-plan", "plan-view", "tab-advise", "advise-view", "advice", "layouts", "excluded"} <= forms.ids
    assert set(forms.boxes) == {"plan-form", "advise-form"}
    for form, script in (("plan-form", "viewer.js"), ("advise-form", "advise.js")):
        boxes = _field_boxes((STATIC_DIR / script).read_text())
        # every problem lands in a box of the form it came from; anything else in that form's "request" box
        assert set(boxes.values()) | {"request"} <= forms.boxes[form], form
    advise_boxes = _field_boxes((STATIC_DIR / "advise.js").read_text())
    # each field the advise form sends, and the sampler's query of a synthetic draw, shows its problem beside it
    sent = {"sequence_lengths", "model", "profile", "gpus", "gpus_per_node", "global_batch", "seed"}
    assert sent <= set(advise_boxes) and sent <= set(AdviseRequest.model_fields)
    assert {"name", "num_sequences"} <= set(advise_boxes)


def test_advise_view_reads_only_fields_the_advice_document_has() -> None:
    script = (STATIC_DIR / "advise.js").read_text()
    confidence = RankedLayoutModel.model_fields["confidence"].annotation
    assert confidence is not None and issubclass(confidence, BaseModel)
    readers = {"advice": AdviceDocument, "layout": RankedLayoutModel, "l": RankedLayoutModel,
               "excluded": ExcludedLayoutModel, "confidence": confidence}
    for name, model in readers.items():
        read = set(re.findall(rf"(?<![.\w]){name}\.(\w+)", script))  # `layout.x`, not `advice.layout.x`
        assert read and read <= set(model.model_fields), (name, read - set(model.model_fields))


def test_plan_view_reads_only_fields_the_plan_response_has() -> None:
    script = (STATIC_DIR / "viewer.js").read_text()
    readers = {"plan": PlanResponse, "dp": DPRankPlanModel, "mb": MicroBatchModel, "span": SpanningMicroBatchModel,
               "rank": CPRankEstimateModel}
    for name, model in readers.items():
        read = set(re.findall(rf"(?<![.\w]){name}\.(\w+)", script))  # `span.ranks`, not `plan.spanning.ranks`
        assert read and read <= set(model.model_fields), (name, read - set(model.model_fields))
    assert {"spanning", "dp_ranks"} <= set(re.findall(r"(?<![.\w])plan\.(\w+)", script))
    parts = re.search(r"^const PARTS = \[(.*?)\];", script, re.MULTILINE | re.DOTALL)
    assert parts is not None
    part_fields = set(re.findall(r'"(\w+_ms)"', parts.group(1)))
    assert part_fields and part_fields <= set(CPRankEstimateModel.model_fields)


@pytest.mark.parametrize("request_body", [REQUEST, SPANNING_REQUEST], ids=["within-groups", "spanning"])
def test_plan_breakdown_is_opt_in_so_earlier_clients_see_the_same_response(
    client: TestClient, request_body: dict[str, object]
) -> None:
    plain = client.post("/plan", json=request_body).json()
    detailed = client.post("/plan", json={**request_body, "breakdown": True}).json()
    assert all("cp_ranks" not in mb for dp in plain["dp_ranks"] for mb in dp["micro_batches"])
    assert all("ranks" not in span for span in plain.get("spanning", []))
    for dp in detailed["dp_ranks"]:
        for mb in dp["micro_batches"]:
            del mb["cp_ranks"]
    for span in detailed.get("spanning", []):
        del span["ranks"]
    assert {**detailed, "solve_time_ms": 0} == {**plain, "solve_time_ms": 0}


@pytest.mark.parametrize("scheduler", ["skrull", "deepspeed"])
def test_spanning_breakdown_is_one_estimate_per_world_rank_of_the_block_and_sets_its_time(
    client: TestClient, scheduler: str
) -> None:
    """What the plan view draws of a spanning micro-batch: one row per world rank of its block (DP-major, so the
    rows of its DP replicas in order), the block as long as its slowest rank, its replicas' times after it."""
    response = PlanResponse.model_validate(client.post("/plan", json={**SPANNING_REQUEST, "scheduler": scheduler,
                                                                      "breakdown": True}).json())
    [span] = response.spanning
    cp_size = SPANNING_REQUEST["cp_size"]
    assert span.dp_ranks == [0, 1] and len(span.ranks) == len(span.local) == len(span.dp_ranks) * cp_size
    assert span.estimated_time_ms == pytest.approx(max(rank.time_ms for rank in span.ranks), abs=1e-5)
    for rank in span.ranks:
        parts_ms = (rank.local_ms + rank.distributed_ms + rank.sharded_ms + rank.fixed_ms + rank.exposed_comm_ms
                    + rank.launch_bound_ms)
        assert parts_ms == pytest.approx(rank.time_ms, abs=1e-5) and rank.tokens <= response.bucket_size
    for dp in response.dp_ranks:  # each replica runs the block first, then its own micro-batches
        own_ms = sum(mb.estimated_time_ms for mb in dp.micro_batches)
        assert dp.estimated_time_ms == pytest.approx(span.estimated_time_ms + own_ms, abs=1e-3)


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
                parts_ms = (rank.local_ms + rank.distributed_ms + rank.sharded_ms + rank.fixed_ms + rank.exposed_comm_ms
                            + rank.launch_bound_ms)
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
