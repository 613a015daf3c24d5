"""The plan viewer in a real browser: headless Chromium (Debian's ``chromium`` and ``chromium-driver``) driven by
Selenium against the service under uvicorn. Skipped, saying why, where Chromium or its driver is absent (CI).

What a user does: load the page, give a batch (a CSV file here), plan it with two schedulers, and read the chart
and numbers — which must be what ``/plan`` answers, a micro-batch that spans DP replicas drawn as one block across
their rows; give a bad batch and see the service's problem beside it. In
the advise view: give a sample and a GPU count, read the ranked layouts — which must be what ``/advise`` answers —,
open one layout's plan with one click, and see the service's problems beside the advise form's fields.
"""

from __future__ import annotations

import shutil
import struct
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import Select, WebDriverWait

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                       reason="needs Chromium and its driver (Debian: apt-get install chromium chromium-driver)"),
]

LENGTHS = [812, 30311, 97, 4096, 1500, 256, 65000, 733, 12000, 2500, 31000, 640]
# 120000 tokens: more than one CP group holds (bucket_size 20000 × cp_size 4), so every plan spans DP replicas 0 and 1
SPANNING_LENGTHS = [100, 200, 120000, 3000, 700, 30000, 5000]
SETUP = {"dp_size": 2, "cp_size": 4, "bucket_size": 20000, "model": "qwen2.5-0.5b", "breakdown": True}
WAIT_S = 30


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    options = Options()
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1200,1600"):
        options.add_argument(argument)
    options.binary_location = str(CHROMIUM)
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))  # no driver download
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def page(browser: WebDriver, live_port: int) -> WebDriver:
    browser.get(f"http://127.0.0.1:{live_port}/")
    WebDriverWait(browser, WAIT_S).until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready"))
    assert not browser.find_element(By.CSS_SELECTOR, '.field[data-field="request"] .problem').text
    for name, value in (("dp", SETUP["dp_size"]), ("cp", SETUP["cp_size"]), ("bucket", SETUP["bucket_size"])):
        field = browser.find_element(By.ID, name)
        field.clear()
        field.send_keys(str(value))
    return browser


def plan_and_wait(page: WebDriver) -> None:
    page.find_element(By.ID, "plan").click()
    WebDriverWait(page, WAIT_S).until(lambda d: d.find_element(By.ID, "plan").is_enabled()
                                      and d.find_element(By.ID, "status").text.startswith("planned"))


def cell(page: WebDriver, metric: str, scheduler: str) -> str:
    return page.find_element(By.CSS_SELECTOR, f'td[data-metric="{metric}"][data-scheduler="{scheduler}"]').text


def assert_bars_add_up(bars: list[WebElement], ranks: list[dict[str, float]]) -> None:
    """The drawn breakdown bars, summed per part, are the parts of ``ranks`` that /plan answered (those above 0)."""
    drawn_ms: dict[str, float] = {}
    for bar in bars:
        part = str(bar.get_attribute("data-part"))
        drawn_ms[part] = drawn_ms.get(part, 0.0) + float(str(bar.get_attribute("data-ms")))
    planned_ms = {"local": sum(r["local_ms"] for r in ranks),
                  "distributed": sum(r["distributed_ms"] for r in ranks),
                  "sharded": sum(r["sharded_ms"] for r in ranks),
                  "overhead": sum(r["fixed_ms"] + r.get("launch_bound_ms", 0.0) + r["exposed_comm_ms"]
                                  for r in ranks)}
    assert drawn_ms == pytest.approx({part: ms for part, ms in planned_ms.items() if ms > 0})


def test_viewer_plans_an_uploaded_batch_and_draws_what_plan_answers(
    page: WebDriver, live_port: int, tmp_path: Path
) -> None:
    upload = tmp_path / "batch.csv"
    upload.write_text("id,num_tokens\n" + "".join(f"{i},{n}\n" for i, n in enumerate(LENGTHS)))
    page.find_element(By.ID, "file").send_keys(str(upload))
    WebDriverWait(page, WAIT_S).until(lambda d: d.find_element(By.ID, "lengths").get_attribute("value")
                                      == ", ".join(map(str, LENGTHS)))
    plan_and_wait(page)
    assert page.find_element(By.ID, "status").text == "planned 2 of 2"  # skrull and deepspeed, the defaults
    for scheduler in ("skrull", "deepspeed"):
        expected = httpx.post(f"http://127.0.0.1:{live_port}/plan",
                              json={"sequence_lengths": LENGTHS, "scheduler": scheduler, **SETUP}).json()
        assert cell(page, "iteration", scheduler) == f"{expected['estimated_iteration_time_ms']:.2f}"
        assert cell(page, "speedup", scheduler) == f"{expected['speedup_vs_deepspeed']:.2f}×"
        within = 100 * (expected["estimated_iteration_time_ms"] / expected["lower_bound_ms"] - 1)
        assert cell(page, "bound", scheduler) == f"{within:.1f} %"
        micro_batches = [mb for dp in expected["dp_ranks"] for mb in dp["micro_batches"]]
        spanning = expected.get("spanning", [])  # skrull spans DP replicas where it finds that faster
        assert cell(page, "micro-batches", scheduler) == str(len(micro_batches) + len(spanning))
        gantt = page.find_element(By.CSS_SELECTOR, f'svg.gantt[data-scheduler="{scheduler}"]')
        assert len(gantt.find_elements(By.CSS_SELECTOR, "rect.mb")) == len(micro_batches)
        assert len(gantt.find_elements(By.CSS_SELECTOR, "rect.span")) == len(spanning)
        # as the ranks run them: the spanning micro-batches' world ranks first, then each DP rank's own
        ranks = [rank for span in spanning for rank in span["ranks"]] + [rank for mb in micro_batches
                                                                         for rank in mb["cp_ranks"]]
        assert_bars_add_up(gantt.find_elements(By.CSS_SELECTOR, "rect.seg"), ranks)
        memory = page.find_element(By.CSS_SELECTOR, f'svg.memory[data-scheduler="{scheduler}"]')
        tokens = [float(str(bar.get_attribute("data-tokens"))) for bar in memory.find_elements(By.CSS_SELECTOR, "rect")]
        assert tokens == [r["tokens"] for r in ranks]


def test_viewer_draws_a_spanning_micro_batch_as_one_block_across_the_dp_rows_it_spans(
    page: WebDriver, live_port: int
) -> None:
    lengths = page.find_element(By.ID, "lengths")
    lengths.clear()
    lengths.send_keys(", ".join(map(str, SPANNING_LENGTHS)))
    plan_and_wait(page)
    assert page.find_element(By.ID, "status").text == "planned 2 of 2"
    assert "spanning micro-batch" in page.find_element(By.ID, "legend").text
    for scheduler in ("skrull", "deepspeed"):
        expected = httpx.post(f"http://127.0.0.1:{live_port}/plan",
                              json={"sequence_lengths": SPANNING_LENGTHS, "scheduler": scheduler, **SETUP}).json()
        [span] = expected["spanning"]
        assert span["dp_ranks"] == [0, 1]
        own = [mb for dp in expected["dp_ranks"] for mb in dp["micro_batches"]]
        assert cell(page, "micro-batches", scheduler) == str(len(own) + 1)
        assert cell(page, "iteration", scheduler) == f"{expected['estimated_iteration_time_ms']:.2f}"

        gantt = page.find_element(By.CSS_SELECTOR, f'svg.gantt[data-scheduler="{scheduler}"]')
        [block] = gantt.find_elements(By.CSS_SELECTOR, "rect.span")
        assert block.get_attribute("data-dp-ranks") == "0,1"
        assert gantt.find_element(By.CSS_SELECTOR, 'text.span-label[data-span="0"]').text == "spans DP 0-1"
        # one block over every CP row of DP 0 and of DP 1 (8 rows), not one per replica
        top, bottom = block.rect["y"], block.rect["y"] + block.rect["height"]
        rows = gantt.find_elements(By.CSS_SELECTOR, "text.row-label")
        assert len(rows) == 8 and all(top < row.rect["y"] + row.rect["height"] / 2 < bottom for row in rows)
        # first on the timeline: it starts at 0 and each replica's own micro-batches (if any) start where it ends
        assert float(str(block.get_attribute("data-start-ms"))) == 0.0
        block_end = block.rect["x"] + block.rect["width"]
        assert block.rect["width"] > 0
        for dp_rank, dp in enumerate(expected["dp_ranks"]):
            firsts = gantt.find_elements(By.CSS_SELECTOR, f'rect.mb[data-dp="{dp_rank}"][data-mb="0"]')
            assert len(firsts) == (len(dp["micro_batches"]) > 0)
            assert all(first.rect["x"] == pytest.approx(block_end, abs=1.0) for first in firsts)
        # its breakdown: each world rank's parts on its own row inside the block, adding up to what /plan answers
        bars = gantt.find_elements(By.CSS_SELECTOR, 'rect.seg[data-span="0"]')
        assert all(top <= bar.rect["y"] and bar.rect["y"] + bar.rect["height"] <= bottom for bar in bars)
        assert len({bar.rect["y"] for bar in bars}) == len(span["ranks"]) == 8  # every rank holds a share
        ranks = span["ranks"]
        assert_bars_add_up(bars, ranks)

        memory = page.find_element(By.CSS_SELECTOR, f'svg.memory[data-scheduler="{scheduler}"]')
        spanned = memory.find_elements(By.CSS_SELECTOR, 'rect.mem.span[data-span="0"]')
        assert [float(str(bar.get_attribute("data-tokens"))) for bar in spanned] == [r["tokens"] for r in ranks]
        assert "DP 0-1" in [label.text for label in memory.find_elements(By.CSS_SELECTOR, "text.dp-label")]

    # a plan without spanning micro-batches (deepspeed's of a batch one CP group holds): no block, label or entry
    lengths.clear()
    lengths.send_keys(", ".join(map(str, LENGTHS)))
    page.find_element(By.CSS_SELECTOR, '#schedulers input[value="skrull"]').click()
    plan_and_wait(page)
    assert page.find_element(By.ID, "status").text == "planned 1 of 1"
    plain = httpx.post(f"http://127.0.0.1:{live_port}/plan",
                       json={"sequence_lengths": LENGTHS, "scheduler": "deepspeed", **SETUP}).json()
    assert "spanning" not in plain
    assert page.find_elements(By.CSS_SELECTOR, "svg.gantt rect.mb")
    assert not page.find_elements(By.CSS_SELECTOR, "rect.span, text.span-label, rect.mem.span")
    assert "spanning" not in page.find_element(By.ID, "legend").text


def _schemes_text(micro_batch: dict) -> str:
    """What the viewer says of a micro-batch's collectives that do not all-gather K/V (viewer.js, ``schemesOf``)."""
    def name(scheme: str, ulysses_degree: int | None) -> str:
        return f"2D (Ulysses over {ulysses_degree})" if scheme == "2d" else "Ulysses"

    parts = []
    if micro_batch["distributed"] and "distributed_scheme" in micro_batch:
        scheme = name(micro_batch["distributed_scheme"], micro_batch.get("distributed_ulysses_degree"))
        parts.append(f"whole group {scheme}")
    for group in micro_batch.get("sharded", []):
        if "scheme" in group:
            ranks = group["cp_ranks"]
            parts.append(f"ranks {ranks[0]}-{ranks[-1]} {name(group['scheme'], group.get('ulysses_degree'))}")
    return ", ".join(parts)


def test_viewer_names_each_micro_batchs_collective_schemes(browser: WebDriver, live_port: int) -> None:
    """A long-heavy batch of a model without GQA, where the plan gives a block of two CP ranks Ulysses: the band of
    each micro-batch says which of its collectives are not all-gather-KV, as /plan answers."""
    lengths = [60000, 500, 700, 30000, 900, 12000, 300, 45000]
    browser.get(f"http://127.0.0.1:{live_port}/?lengths={','.join(map(str, lengths))}&model=llama-2-7b&dp=1&cp=4"
                "&bucket=40000&schedulers=skrull&plan=1")
    WebDriverWait(browser, WAIT_S).until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready"))
    assert browser.find_element(By.ID, "status").text == "planned 1 of 1"
    expected = httpx.post(f"http://127.0.0.1:{live_port}/plan", json={
        "sequence_lengths": lengths, "dp_size": 1, "cp_size": 4, "bucket_size": 40000, "model": "llama-2-7b"}).json()
    micro_batches = expected["dp_ranks"][0]["micro_batches"]
    texts = [_schemes_text(mb) for mb in micro_batches]
    assert any("Ulysses" in text for text in texts)  # the precondition: a scheme to show
    bands = browser.find_elements(By.CSS_SELECTOR, 'svg.gantt[data-scheduler="skrull"] rect.mb[data-dp="0"]')
    assert [band.get_attribute("data-schemes") for band in bands] == texts


def test_viewer_shows_the_services_problem_beside_the_bad_field(page: WebDriver, live_port: int) -> None:
    lengths = page.find_element(By.ID, "lengths")
    lengths.clear()
    lengths.send_keys("812, -5, 97")
    dp = page.find_element(By.ID, "dp")
    dp.clear()
    dp.send_keys("0")
    plan_and_wait(page)
    problem = httpx.post(f"http://127.0.0.1:{live_port}/plan", json={
        "sequence_lengths": [812, -5, 97], "scheduler": "skrull", **SETUP, "dp_size": 0}).json()
    expected = {error["field"]: f"{error['field']}: {error['message']}" for error in problem["errors"]}
    assert set(expected) == {"sequence_lengths[1]", "dp_size"}
    for box, field in (("sequence_lengths", "sequence_lengths[1]"), ("dp_size", "dp_size")):
        assert page.find_element(By.CSS_SELECTOR, f'.field[data-field="{box}"] .problem').text == expected[field]
    assert page.find_element(By.ID, "results").get_attribute("hidden") is not None
    dp.clear()
    dp.send_keys(str(SETUP["dp_size"]))
    too_long = page.find_element(By.ID, "lengths")
    too_long.clear()
    too_long.send_keys("812, 200000")  # more than the world holds: bucket_size 20000 × cp_size 4 × dp_size 2 tokens
    plan_and_wait(page)
    problem = httpx.post(f"http://127.0.0.1:{live_port}/plan", json={
        "sequence_lengths": [812, 200000], "scheduler": "skrull", **SETUP}).json()
    [error] = problem["errors"]
    assert error["field"] == "sequence_lengths[1]" and "160000" in error["message"]
    shown = page.find_element(By.CSS_SELECTOR, '.field[data-field="sequence_lengths"] .problem').text
    assert shown == f"sequence_lengths[1]: {error['message']}"


def test_viewer_draws_a_batch_from_a_sampler_and_shows_its_problems(page: WebDriver, live_port: int) -> None:
    count = page.find_element(By.ID, "num-sequences")
    count.clear()
    count.send_keys("20")
    page.find_element(By.ID, "draw").click()
    drawn = httpx.get(f"http://127.0.0.1:{live_port}/samplers/lmsys", params={"num_sequences": 20}).json()
    expected = ", ".join(map(str, drawn["sequence_lengths"]))
    WebDriverWait(page, WAIT_S).until(lambda d: d.find_element(By.ID, "lengths").get_attribute("value") == expected)
    count.clear()
    count.send_keys("0")
    page.find_element(By.ID, "draw").click()
    problem = page.find_element(By.CSS_SELECTOR, '.field[data-field="sampler"] .problem')
    WebDriverWait(page, WAIT_S).until(lambda _: problem.text)
    assert "num_sequences: Input should be greater than or equal to 1" in problem.text


def test_a_link_fills_the_form_and_plans_at_once(browser: WebDriver, live_port: int) -> None:
    browser.get(f"http://127.0.0.1:{live_port}/?sampler=docmix&num_sequences=16&seed=3&dp=1&cp=2"
                "&schedulers=skrull_binary&plan=1")
    WebDriverWait(browser, WAIT_S).until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready"))
    assert browser.find_element(By.ID, "status").text == "planned 1 of 1"
    drawn = httpx.get(f"http://127.0.0.1:{live_port}/samplers/docmix", params={"num_sequences": 16, "seed": 3}).json()
    expected = httpx.post(f"http://127.0.0.1:{live_port}/plan", json={
        "sequence_lengths": drawn["sequence_lengths"], "dp_size": 1, "cp_size": 2, "scheduler": "skrull_binary"}).json()
    assert cell(browser, "iteration", "skrull_binary") == f"{expected['estimated_iteration_time_ms']:.2f}"


# ---- the advise view -----------------------------------------------------------------------------------------

ADVISE = {"model": "qwen2.5-7b", "gpus": 32, "gpus_per_node": 8, "global_batch": 32, "seed": 0}
SAMPLE = {"num_sequences": 300, "seed": 0}  # synthetic:chatqa2


@pytest.fixture
def advise_page(browser: WebDriver, live_port: int) -> WebDriver:
    browser.get(f"http://127.0.0.1:{live_port}/")
    WebDriverWait(browser, WAIT_S).until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready"))
    browser.find_element(By.ID, "tab-advise").click()
    assert browser.find_element(By.ID, "advise-form").is_displayed()
    assert not browser.find_element(By.ID, "plan-form").is_displayed()
    Select(browser.find_element(By.ID, "advise-model")).select_by_value(str(ADVISE["model"]))
    for name, value in (("sample", "synthetic:chatqa2"), ("sample-size", SAMPLE["num_sequences"]),
                        ("advise-seed", ADVISE["seed"]), ("gpus", ADVISE["gpus"]),
                        ("gpus-per-node", ADVISE["gpus_per_node"]), ("global-batch", ADVISE["global_batch"])):
        type_into(browser, name, value)
    return browser


def type_into(page: WebDriver, field_id: str, value: object) -> None:
    field = page.find_element(By.ID, field_id)
    field.clear()
    field.send_keys(str(value))


def advise_and_wait(page: WebDriver) -> None:
    page.find_element(By.ID, "advise").click()
    WebDriverWait(page, WAIT_S).until(lambda d: d.find_element(By.ID, "advise").is_enabled()
                                      and d.find_element(By.ID, "advise-status").text.startswith(("ranked", "no")))


def advise_problem(page: WebDriver, box: str) -> str:
    return page.find_element(By.CSS_SELECTOR, f'#advise-form .field[data-field="{box}"] .problem').text


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_advise_view_ranks_what_advise_answers_and_opens_a_layouts_plan_in_one_click(
    advise_page: WebDriver, live_port: int, tmp_path: Path
) -> None:
    page, service = advise_page, f"http://127.0.0.1:{live_port}"
    advise_and_wait(page)
    sample = httpx.get(f"{service}/samplers/chatqa2", params=SAMPLE).json()["sequence_lengths"]
    profile = httpx.get(f"{service}/models").json()["default_profile"]
    advice = httpx.post(f"{service}/advise", json={"sequence_lengths": sample, "profile": profile, **ADVISE},
                        timeout=WAIT_S).json()
    layouts = advice["layouts"]
    assert len(layouts) >= 2 and any(layout["spans_nodes"] for layout in layouts)
    assert page.find_element(By.ID, "advise-status").text == f"ranked {len(layouts)} layouts; " \
                                                             f"{len(advice['excluded'])} excluded"
    assert page.find_element(By.ID, "why").text == advice["why"]
    rows = page.find_elements(By.CSS_SELECTOR, "#layouts tr.layout")
    assert [row.get_attribute("data-rank") for row in rows] == [str(layout["rank"]) for layout in layouts]
    for row, layout in zip(rows, layouts, strict=True):
        def shown(metric: str, row: WebElement = row) -> str:
            return row.find_element(By.CSS_SELECTOR, f'td[data-metric="{metric}"]').text

        assert shown("layout").startswith(f"dp {layout['dp_size']} × cp {layout['cp_size']}")
        assert ("nodes" in shown("layout")) == layout["spans_nodes"]
        assert shown("throughput") == f"{layout['tokens_per_s_per_gpu']:,.0f}"
        static_cp = layout["tokens_per_s_per_gpu"] / layout["speedup_vs_static_cp"]
        assert shown("static-throughput") == f"{static_cp:,.0f}"
        assert shown("speedup") == f"{layout['speedup_vs_static_cp']:.2f}×"
        assert shown("step-time") == f"{layout['predicted_step_time_ms']:.1f}"
        command = page.find_element(By.CSS_SELECTOR, f'#layouts tr.command[data-rank="{layout["rank"]}"] code')
        assert command.text == layout["trainer_command"]
    copy = page.find_element(By.CSS_SELECTOR, '#layouts tr.command[data-rank="1"] button.copy')
    copy.click()  # to the clipboard where the browser allows it, else the command is selected for the user
    WebDriverWait(page, WAIT_S).until(lambda _: copy.text in ("Copied", "Selected: copy it"))
    chart_rows = page.find_elements(By.CSS_SELECTOR, "svg.advice-chart g.layout-row")
    assert len(chart_rows) == len(layouts)
    first_bar = chart_rows[0].find_element(By.CSS_SELECTOR, "text.skrull-value").text
    assert first_bar.startswith(f"{layouts[0]['tokens_per_s_per_gpu']:,.0f}")
    reasons = [cell.text for cell in page.find_elements(By.CSS_SELECTOR, '#excluded td[data-metric="reason"]')]
    assert len(reasons) == len(advice["excluded"])
    assert all(excluded["reason"] in shown for shown, excluded in zip(reasons, advice["excluded"], strict=True))
    screenshot = tmp_path / "advise.png"
    assert page.save_screenshot(str(screenshot))
    assert png_size(screenshot)[0] >= 1000 and screenshot.stat().st_size > 50_000  # drawn, not a blank page

    # one click on a layout that spans nodes and has several DP ranks plans a batch of the sample on it
    layout = next(layout for layout in layouts if layout["spans_nodes"] and layout["dp_size"] > 1)
    rank = layout["rank"]
    page.find_element(By.CSS_SELECTOR, f'#layouts tr.layout[data-rank="{rank}"] button.open-plan').click()
    WebDriverWait(page, WAIT_S).until(lambda d: d.find_element(By.ID, "plan").is_enabled()
                                      and d.find_element(By.ID, "status").text.startswith("planned"))
    assert page.find_element(By.ID, "plan-form").is_displayed()
    assert not page.find_element(By.ID, "advice").is_displayed()
    assert page.find_element(By.ID, "status").text == "planned 1 of 1"
    assert page.find_element(By.ID, "plan-origin").text.startswith(f"Layout {rank} of the advice")
    setup = {"dp_size": layout["dp_size"], "cp_size": layout["cp_size"], "bucket_size": layout["bucket_size"],
             "gpus_per_node": advice["gpus_per_node"]}  # so blocks across nodes are priced as the advice did
    for field_id, value in (("dp", setup["dp_size"]), ("cp", setup["cp_size"]), ("bucket", setup["bucket_size"]),
                            ("plan-gpus-per-node", setup["gpus_per_node"]), ("model", advice["model"]),
                            ("profile", advice["profile"])):
        assert page.find_element(By.ID, field_id).get_attribute("value") == str(value)
    batch = [int(token) for token in str(page.find_element(By.ID, "lengths").get_attribute("value")).split(", ")]
    assert len(batch) == ADVISE["global_batch"] and not Counter(batch) - Counter(sample)  # drawn from the sample
    planned = {"sequence_lengths": batch, "model": advice["model"], "profile": advice["profile"], **setup}
    expected = httpx.post(f"{service}/plan", json={**planned, "scheduler": "skrull"}).json()
    assert cell(page, "iteration", "skrull") == f"{expected['estimated_iteration_time_ms']:.2f}"
    labels = page.find_elements(By.CSS_SELECTOR, 'svg.gantt[data-scheduler="skrull"] text.row-label')
    assert len(labels) == layout["dp_size"] * layout["cp_size"]

    # the advice is still there, and the same layout opens the same batch again
    page.find_element(By.ID, "tab-advise").click()
    assert page.find_element(By.ID, "advice").is_displayed()
    page.find_element(By.CSS_SELECTOR, f'svg.advice-chart g.layout-row[data-rank="{rank}"]').click()
    WebDriverWait(page, WAIT_S).until(lambda d: d.find_element(By.ID, "plan-form").is_displayed()
                                      and d.find_element(By.ID, "status").text == "planned 1 of 1")
    assert page.find_element(By.ID, "lengths").get_attribute("value") == ", ".join(map(str, batch))


def test_advise_view_shows_the_services_problems_beside_the_bad_fields(advise_page: WebDriver, live_port: int) -> None:
    page, service = advise_page, f"http://127.0.0.1:{live_port}"
    profile = httpx.get(f"{service}/models").json()["default_profile"]
    type_into(page, "sample", "812, -5, 97")
    type_into(page, "gpus", "0")
    advise_and_wait(page)
    assert page.find_element(By.ID, "advise-status").text == "no advice"
    assert not page.find_element(By.ID, "advice").is_displayed()
    problem = httpx.post(f"{service}/advise", json={"sequence_lengths": [812, -5, 97], "profile": profile,
                                                     **ADVISE, "gpus": 0}).json()
    expected = {error["field"]: f"{error['field']}: {error['message']}" for error in problem["errors"]}
    assert set(expected) == {"sequence_lengths[1]", "gpus"}
    assert advise_problem(page, "sample") == expected["sequence_lengths[1]"]
    assert advise_problem(page, "gpus") == expected["gpus"]

    type_into(page, "gpus", "8")
    type_into(page, "sample", "5000000, 6000000")  # longer than any layout of 8 GPUs holds, every one
    advise_and_wait(page)
    problem = httpx.post(f"{service}/advise", json={"sequence_lengths": [5000000, 6000000], "profile": profile,
                                                     **ADVISE, "gpus": 8}, timeout=WAIT_S).json()
    [error] = problem["errors"]
    assert error["field"] == "sequence_lengths" and "no layout of 8 GPUs holds any sequence" in error["message"]
    assert advise_problem(page, "sample") == f"sequence_lengths: {error['message']}"
    assert not advise_problem(page, "gpus")

    type_into(page, "sample", "synthetic:imagenet")
    advise_and_wait(page)
    assert advise_problem(page, "sample").startswith("name: unknown sampler 'imagenet'; known: wikipedia")


def test_an_advise_link_fills_the_form_and_advises_at_once(browser: WebDriver, live_port: int) -> None:
    browser.get(f"http://127.0.0.1:{live_port}/?view=advise&sample=synthetic:docmix&sample_size=100&seed=2"
                "&model=qwen2.5-1.5b&gpus=8&global_batch=16&advise=1")
    WebDriverWait(browser, WAIT_S).until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready"))
    assert browser.find_element(By.ID, "advise-view").is_displayed()
    assert browser.find_element(By.ID, "advise-status").text.startswith("ranked")
    service = f"http://127.0.0.1:{live_port}"
    sample = httpx.get(f"{service}/samplers/docmix", params={"num_sequences": 100, "seed": 2}).json()
    advice = httpx.post(f"{service}/advise", json={"sequence_lengths": sample["sequence_lengths"], "seed": 2,
                                                    "model": "qwen2.5-1.5b", "gpus": 8, "global_batch": 16}).json()
    first = browser.find_element(By.CSS_SELECTOR, '#layouts tr.layout[data-rank="1"] td[data-metric="throughput"]')
    assert first.text == f"{advice['layouts'][0]['tokens_per_s_per_gpu']:,.0f}"
