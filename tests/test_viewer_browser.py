"""The plan viewer in a real browser: headless Chromium (Debian's ``chromium`` and ``chromium-driver``) driven by
Selenium against the service under uvicorn. Skipped, saying why, where Chromium or its driver is absent (CI).

What a user does: load the page, give a batch (a CSV file here), plan it with two schedulers, and read the chart
and numbers — which must be what ``/plan`` answers; give a bad batch and see the service's problem beside it.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                       reason="needs Chromium and its driver (Debian: apt-get install chromium chromium-driver)"),
]

LENGTHS = [812, 30311, 97, 4096, 1500, 256, 65000, 733, 12000, 2500, 31000, 640]
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
        assert cell(page, "micro-batches", scheduler) == str(len(micro_batches))
        gantt = page.find_element(By.CSS_SELECTOR, f'svg.gantt[data-scheduler="{scheduler}"]')
        assert len(gantt.find_elements(By.CSS_SELECTOR, "rect.mb")) == len(micro_batches)
        drawn_ms: dict[str, float] = {}
        for bar in gantt.find_elements(By.CSS_SELECTOR, "rect.seg"):
            part = str(bar.get_attribute("data-part"))
            drawn_ms[part] = drawn_ms.get(part, 0.0) + float(str(bar.get_attribute("data-ms")))
        ranks = [rank for mb in micro_batches for rank in mb["cp_ranks"]]
        planned_ms = {"local": sum(r["local_ms"] for r in ranks),
                      "distributed": sum(r["distributed_ms"] for r in ranks),
                      "sharded": sum(r["sharded_ms"] for r in ranks),
                      "overhead": sum(r["fixed_ms"] + r["exposed_comm_ms"] for r in ranks)}
        assert drawn_ms == pytest.approx({part: ms for part, ms in planned_ms.items() if ms > 0})
        memory = page.find_element(By.CSS_SELECTOR, f'svg.memory[data-scheduler="{scheduler}"]')
        tokens = [float(str(bar.get_attribute("data-tokens"))) for bar in memory.find_elements(By.CSS_SELECTOR, "rect")]
        assert tokens == [r["tokens"] for r in ranks]


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
    too_long.send_keys("812, 200000")  # more than bucket_size 20000 × cp_size 4 tokens
    plan_and_wait(page)
    problem = httpx.post(f"http://127.0.0.1:{live_port}/plan", json={
        "sequence_lengths": [812, 200000], "scheduler": "skrull", **SETUP}).json()
    [error] = problem["errors"]
    assert error["field"] == "sequence_lengths[1]" and "80000" in error["message"]
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
