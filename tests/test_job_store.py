"""The job store: jobs' feedback state kept as explicit JSON in SQLite (always) or Redis (against a real
``redis-server``; skipped where none is installed), bounded as the in-memory store was, never losing a
refit to a concurrent one, and failing call by call (not for good) when its file breaks. Its document is
read and written by a pydantic ``TypeAdapter``, and records the hand-written codec before it wrote read back."""

from __future__ import annotations

import dataclasses
import json
import math
import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from scheduler_service.core import feedback
from scheduler_service.core.feedback import JobFeedback, MicroBatchMeasurement
from scheduler_service.core.models import MODEL_CATALOGUE
from scheduler_service.core.profile import builtin_profiles, parse_profile
from scheduler_service.runtime.errors import JobStoreUnavailableError, ServiceUnavailableError
from scheduler_service.runtime.job_store import (
    JobStore,
    RedisJobStore,
    SQLiteJobStore,
    decode_job,
    encode_job,
    open_job_store,
)
from scheduler_service.web.metrics import ServiceMetrics
from tests.job_store_backends import corrupted
from tests.service_inputs import measured_document

StoreFactory = Callable[..., JobStore]

# A record as the first, hand-written codec wrote it (a registered base, refit from two reports: both windows, the
# memory fit and a BucketSize cap), before the TypeAdapter replaced that codec.
FORMAT_1_RECORD = Path(__file__).with_name("job_record_format1.json")


def new_job(job_id: str = "job-1", *, cp_size: int = 2) -> JobFeedback:
    return feedback.start_job(job_id, base=builtin_profiles()["h100-paper"], model=MODEL_CATALOGUE["tiny"],
                              dp_size=1, cp_size=cp_size)


def registered_job(job_id: str = "job-1", *, scale: float = 1.0) -> JobFeedback:
    """A job whose trainer registered a profile it measured (PUT /jobs/{job_id}/profile) as its base."""
    base = parse_profile(measured_document(name="trainer-tiny", scale=scale))
    return feedback.start_job(job_id, base=base, model=MODEL_CATALOGUE["tiny"], dp_size=1, cp_size=2,
                              base_registered=True)


def refit(job: JobFeedback, *, num_reports: int = 3) -> JobFeedback:
    """The job after reports with times and peaks that move its compute scale and cap its BucketSize."""
    for step in range(num_reports):
        measurements = [MicroBatchMeasurement(local_lengths=((600 + 50 * i + step, 90), (1200 - 40 * i,)),
                                              distributed_lengths=(), time_s=0.02 * (1 + i / 4),
                                              peak_memory_bytes=7e10 + 1e9 * i) for i in range(4)]
        job = feedback.observe(job, measurements)
    return job


@pytest.fixture(params=["sqlite", "redis"])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreFactory]:
    """Opens stores on one backend and one place, as separate workers (or a restarted one) would."""
    url = str(tmp_path / "jobs.sqlite3") if request.param == "sqlite" else request.getfixturevalue("redis_url")
    opened: list[JobStore] = []

    def factory(max_jobs: int = 8) -> JobStore:
        opened.append(open_job_store(url, max_jobs=max_jobs, events=ServiceMetrics()))
        return opened[-1]

    yield factory
    for store in opened:
        store.close()


def test_a_refit_job_survives_encoding_exactly() -> None:
    job = refit(new_job())
    assert job.bucket_cap is not None and job.memory_window and job.compute_window  # every part is exercised
    assert decode_job(encode_job(job)) == job


def test_a_record_of_the_hand_written_codec_reads_back_and_is_written_as_the_same_document() -> None:
    text = FORMAT_1_RECORD.read_text()
    job = decode_job(text)
    assert job is not None and job.base_registered and job.bucket_cap is not None
    assert job.memory_slope is not None and job.compute_window and job.memory_window
    # The same JSON value; the text may differ in how a float is spelled (5e-05 or 0.00005).
    assert json.loads(encode_job(job)) == json.loads(text)


@pytest.mark.parametrize("damage", ["'{'", "json_set(document, '$.model', 'tiny')", "json_remove(document, '$.base')",
                                    "json_set(document, '$.profile', json('[]'))"])
def test_a_damaged_document_reads_as_no_job(tmp_path: Path, damage: str) -> None:
    store = SQLiteJobStore(tmp_path / "jobs.sqlite3", max_jobs=8, events=ServiceMetrics())
    store.keep(new_job())
    with sqlite3.connect(tmp_path / "jobs.sqlite3") as db:
        db.execute(f"UPDATE jobs SET document = {damage}, revision = 'other'")
    assert store.get("job-1") is None
    assert store.state == "ok"  # the store works; one record was lost


def test_a_document_of_another_format_reads_as_no_job(tmp_path: Path) -> None:
    store = SQLiteJobStore(tmp_path / "jobs.sqlite3", max_jobs=8, events=ServiceMetrics())
    store.keep(new_job())
    with sqlite3.connect(tmp_path / "jobs.sqlite3") as db:
        db.execute("UPDATE jobs SET document = json_set(document, '$.format', 99), revision = 'other'")
    assert store.get("job-1") is None
    store.close()


def test_urls_pick_the_store() -> None:
    with pytest.raises(ValueError, match="postgres://"):
        open_job_store("postgres://db/skrull", max_jobs=1, events=ServiceMetrics())


def test_sqlite_store_runs_in_wal_mode(tmp_path: Path) -> None:
    store = open_job_store(f"sqlite://{tmp_path}/state/jobs.sqlite3", max_jobs=8, events=ServiceMetrics())
    assert isinstance(store, SQLiteJobStore)
    store.keep(new_job())
    with sqlite3.connect(tmp_path / "state" / "jobs.sqlite3") as db:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    store.close()


def test_keeps_a_job_and_its_refit_across_a_reopen(open_store: StoreFactory) -> None:
    store = open_store()
    job = new_job()
    assert store.get("job-1") is None
    assert store.keep(job) == 1
    stored = store.get("job-1")
    assert stored is not None and stored.job == job
    refitted = refit(job)
    assert store.replace(stored, refitted)
    reopened = open_store().get("job-1")  # a restarted process, or another worker
    assert reopened is not None and reopened.job == refitted


def test_keeping_the_same_job_again_keeps_its_refit_and_another_shape_restarts_it(open_store: StoreFactory) -> None:
    store = open_store()
    job = new_job()
    store.keep(job)
    stored = store.get("job-1")
    assert stored is not None
    refitted = refit(job)
    store.replace(stored, refitted)
    store.keep(job)  # the next plan of the same job: the refit stays
    assert (kept := store.get("job-1")) is not None and kept.job == refitted
    store.keep(new_job(cp_size=4))  # a plan with other sizes: a fresh job
    assert (kept := store.get("job-1")) is not None and kept.job == new_job(cp_size=4)


def test_a_registered_base_survives_a_reopen_as_registered(open_store: StoreFactory) -> None:
    store = open_store()
    job = refit(registered_job())
    store.keep(job)
    reopened = open_store().get("job-1")
    assert reopened is not None and reopened.job == job and reopened.job.base_registered


def test_a_record_written_before_registered_bases_reads_as_a_shared_base(tmp_path: Path) -> None:
    store = SQLiteJobStore(tmp_path / "jobs.sqlite3", max_jobs=8, events=ServiceMetrics())
    store.keep(new_job())
    with sqlite3.connect(tmp_path / "jobs.sqlite3") as db:
        db.execute("UPDATE jobs SET document = json_remove(document, '$.base_registered'), revision = 'other'")
    stored = store.get("job-1")
    assert stored is not None and stored.job == new_job()
    store.close()


def test_registering_rewrites_a_job_that_keeping_would_leave_as_it_is(open_store: StoreFactory) -> None:
    store = open_store()
    store.keep(registered_job())
    slower = registered_job(scale=10.0)  # the same name, model and sizes: the same job_key, other numbers
    store.keep(slower)
    assert (kept := store.get("job-1")) is not None and kept.job == registered_job()
    assert store.register(slower) == 1
    assert (kept := open_store().get("job-1")) is not None and kept.job == slower


def test_a_refit_from_an_outdated_revision_is_refused(open_store: StoreFactory) -> None:
    first, second = open_store(), open_store()
    first.keep(new_job())
    seen_by_first, seen_by_second = first.get("job-1"), second.get("job-1")
    assert seen_by_first is not None and seen_by_second is not None
    assert second.replace(seen_by_second, refit(seen_by_second.job, num_reports=1))
    assert not first.replace(seen_by_first, refit(seen_by_first.job, num_reports=2))
    now = first.get("job-1")  # first sees second's write, not its own stale one
    assert now is not None and now.job == refit(new_job(), num_reports=1)


def test_forgets_the_least_recently_used_job_beyond_the_bound(open_store: StoreFactory) -> None:
    store = open_store(max_jobs=2)
    assert [store.keep(new_job(job_id)) for job_id in ("a", "b")] == [1, 2]
    stored = store.get("a")
    assert stored is not None
    store.replace(stored, refit(stored.job, num_reports=1))  # an adopted refit uses "a": "b" is now the oldest
    assert store.keep(new_job("c")) == 2
    assert store.get("b") is None
    assert store.get("a") is not None and store.get("c") is not None
    store.keep(new_job("a"))
    store.keep(new_job("d"))
    assert store.get("c") is None


def test_concurrent_refits_of_one_job_from_two_workers_lose_no_report(open_store: StoreFactory) -> None:
    """Each of two workers (own connection, two threads each) adopts 15 reports by compare-and-set, refitting
    again on the newer state whenever another got in first: every report counts."""
    workers = [open_store(), open_store()]
    workers[0].keep(new_job())
    num_reports = 15

    def send_reports(store: JobStore) -> None:
        for _ in range(num_reports):
            while True:
                stored = store.get("job-1")
                assert stored is not None
                updated = dataclasses.replace(stored.job, num_observations=stored.job.num_observations + 1)
                if store.replace(stored, updated):
                    break

    threads = [threading.Thread(target=send_reports, args=(store,)) for store in workers for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    final = open_store().get("job-1")
    assert final is not None and final.job.num_observations == 4 * num_reports


def test_an_unreachable_redis_stops_the_start() -> None:
    with pytest.raises(ServiceUnavailableError, match="the job store is unavailable"):
        RedisJobStore("redis://127.0.0.1:1/0", max_jobs=1, events=ServiceMetrics())


def test_a_corrupt_sqlite_file_fails_each_call_and_is_read_again_once_restored(tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite3"
    metrics = ServiceMetrics()
    store = SQLiteJobStore(path, max_jobs=8, events=metrics)
    store.keep(new_job())
    stored = store.get("job-1")
    assert stored is not None
    refitted = refit(stored.job)
    assert store.replace(stored, refitted)
    with corrupted(path):
        with pytest.raises(JobStoreUnavailableError, match="file is not a database") as failure:
            store.get("job-1")
        assert failure.value.operation == "get"
        with pytest.raises(JobStoreUnavailableError, match="file is not a database"):
            store.keep(new_job("job-2"))
        assert store.state == "unavailable: file is not a database"
    kept = store.get("job-1")  # the same store object: no restart
    assert kept is not None and kept.job == refitted
    assert store.state == "ok"
    assert [metrics.registry.get_sample_value("skrull_job_store_errors_total", {"operation": operation})
            for operation in ("get", "keep")] == [1, 1]
    store.close()


@pytest.mark.parametrize("field", ["compute_scale", "memory_slope"])
def test_a_job_with_a_value_json_cannot_hold_is_refused_not_stored_as_null(field: str) -> None:
    job = dataclasses.replace(new_job(), **{field: math.nan})
    with pytest.raises(ValueError, match="not JSON compliant"):
        encode_job(job)
