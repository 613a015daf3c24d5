"""Prometheus metrics of the scheduling service: the HTTP requests, and the runtime's ``ServiceEvents``.

Each app owns a ``CollectorRegistry`` (tests build many apps in one process).
With several uvicorn workers set ``PROMETHEUS_MULTIPROC_DIR`` (an empty,
writable folder) so ``/metrics`` aggregates every worker's samples; without it
each worker reports only its own.

    skrull_http_requests_total{method,route,status}           every request; 499: the client hung up first
    skrull_http_request_duration_seconds{method,route}        its latency
    skrull_plan_requests_total{scheduler,status}              POST /plan by scheduler and HTTP status
    skrull_plan_request_duration_seconds{scheduler,status}    its latency, end to end
    skrull_plan_solve_seconds{scheduler}                      the scheduler's own solve time
    skrull_plan_speedup_vs_deepspeed{scheduler}               estimated speedup of each plan
    skrull_sequences_planned_total{scheduler}                 sequences in successful plans
    skrull_sequences_placed_total{scheduler,placement}        the same by placement: local (whole on one CP rank),
                                                              distributed (whole CP group), sharded (hybrid group)
    skrull_sharded_group_degree{scheduler}                    CP ranks of each hybrid DACP group planned
    skrull_cpsat_in_flight                                    cpsat requests solving or waiting
    skrull_cpsat_rejected_total                               cpsat requests answered 429
    skrull_cpsat_status_total{status}                         CP-SAT result status
    skrull_heavy_in_flight                                    heavy requests (plans, reports) working or waiting
    skrull_heavy_rejected_total                               heavy requests answered 429
    skrull_feedback_micro_batches_total                       measured micro-batches accepted by POST /feedback
    skrull_feedback_jobs                                      jobs whose refit the service keeps
    skrull_feedback_bucket_lowered_total                      plans whose bucket_size feedback lowered (memory)
    skrull_job_store_errors_total{operation}                  failed job-store calls: get, keep, register, replace, open
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client import multiprocess as prometheus_multiprocess
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from scheduler_service.runtime.work import PlanSummary

__all__ = ["CONTENT_TYPE_LATEST", "ServiceMetrics"]

# Latencies of a sidecar that answers in about a millisecond, up to multi-second CP-SAT solves.
# The *_created series double the exposition for no use on a dashboard.
disable_created_metrics()

_LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_SPEEDUP_BUCKETS = (0.5, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0)
# A group's size divides cp_size (at most max_cp_size, 1024 by default): powers of two, plus 3 and 6.
_GROUP_DEGREE_BUCKETS = (2, 3, 4, 6, 8, 16, 32, 64, 128, 256, 512)


class ServiceMetrics:
    """The service's metrics; the runtime reports to them as its ``ServiceEvents``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.http_requests = Counter(
            "skrull_http_requests", "HTTP requests by route and status.", ["method", "route", "status"], registry=r
        )
        self.http_duration = Histogram(
            "skrull_http_request_duration_seconds", "HTTP request latency.", ["method", "route"],
            buckets=_LATENCY_BUCKETS_S, registry=r,
        )
        self.plan_requests = Counter(
            "skrull_plan_requests", "POST /plan requests by scheduler and HTTP status.", ["scheduler", "status"],
            registry=r,
        )
        self.plan_duration = Histogram(
            "skrull_plan_request_duration_seconds", "POST /plan latency, end to end in the app.",
            ["scheduler", "status"], buckets=_LATENCY_BUCKETS_S, registry=r,
        )
        self.solve_time = Histogram(
            "skrull_plan_solve_seconds", "Scheduler solve time per plan.", ["scheduler"],
            buckets=_LATENCY_BUCKETS_S, registry=r,
        )
        self.speedup = Histogram(
            "skrull_plan_speedup_vs_deepspeed", "Estimated speedup of each plan over the deepspeed baseline.",
            ["scheduler"], buckets=_SPEEDUP_BUCKETS, registry=r,
        )
        self.sequences_planned = Counter(
            "skrull_sequences_planned", "Sequences in successfully planned batches.", ["scheduler"], registry=r
        )
        self.sequences_placed = Counter(
            "skrull_sequences_placed", "Sequences in successfully planned batches, by placement: local, "
            "distributed (the whole CP group) or sharded (a hybrid DACP group).", ["scheduler", "placement"],
            registry=r,
        )
        self.group_degree = Histogram(
            "skrull_sharded_group_degree", "CP ranks of each hybrid DACP group in a successful plan.", ["scheduler"],
            buckets=_GROUP_DEGREE_BUCKETS, registry=r,
        )
        self.cpsat_in_flight = Gauge(
            "skrull_cpsat_in_flight", "cpsat requests solving or waiting for the pool.", registry=r,
            multiprocess_mode="livesum",
        )
        self.cpsat_rejected = Counter(
            "skrull_cpsat_rejected", "cpsat requests answered 429 because the pool was full.", registry=r
        )
        self.cpsat_status = Counter("skrull_cpsat_status", "CP-SAT result status.", ["status"], registry=r)
        self.heavy_in_flight = Gauge(
            "skrull_heavy_in_flight", "Heavy requests (plans, feedback reports) working or waiting for the pool.",
            registry=r, multiprocess_mode="livesum",
        )
        self.heavy_rejected = Counter(
            "skrull_heavy_rejected", "Heavy requests answered 429 because the pool was full.", registry=r
        )
        self.feedback_micro_batches = Counter(
            "skrull_feedback_micro_batches", "Measured micro-batches accepted by POST /feedback.", registry=r
        )
        # Every worker sets the shared job store's count: the latest is the answer, a sum would count it per worker.
        self.feedback_jobs = Gauge("skrull_feedback_jobs", "Jobs whose refit profile the service keeps.",
                                   registry=r, multiprocess_mode="mostrecent")
        self.feedback_bucket_lowered = Counter(
            "skrull_feedback_bucket_lowered", "Plans whose bucket_size a job's memory feedback lowered.", registry=r
        )
        self.job_store_errors = Counter(
            "skrull_job_store_errors", "Job-store calls that failed (the store unreachable, corrupt, full or "
            "read-only), by operation: get, keep, register, replace, open.", ["operation"], registry=r,
        )
        self._pool_in_flight = {"cpsat": self.cpsat_in_flight, "heavy": self.heavy_in_flight}
        self._pool_rejected = {"cpsat": self.cpsat_rejected, "heavy": self.heavy_rejected}

    def observe_request(
        self, *, method: str, route: str, status: int, duration_s: float, scheduler: str | None
    ) -> None:
        status_label = str(status)
        self.http_requests.labels(method, route, status_label).inc()
        self.http_duration.labels(method, route).observe(duration_s)
        if scheduler is not None:
            self.plan_requests.labels(scheduler, status_label).inc()
            self.plan_duration.labels(scheduler, status_label).observe(duration_s)

    # -- ServiceEvents

    def plan_made(self, summary: PlanSummary, *, num_sequences: int) -> None:
        scheduler = summary.scheduler
        self.solve_time.labels(scheduler).observe(summary.solve_time_s)
        self.speedup.labels(scheduler).observe(summary.speedup)
        self.sequences_planned.labels(scheduler).inc(num_sequences)
        for placement, count in summary.placements.items():
            self.sequences_placed.labels(scheduler, placement.value).inc(count)
        for degree in summary.group_degrees:
            self.group_degree.labels(scheduler).observe(degree)
        if summary.solver_status is not None:
            self.cpsat_status.labels(summary.solver_status).inc()
        if summary.bucket_lowered:
            self.feedback_bucket_lowered.inc()

    def pool_admitted(self, pool: str) -> None:
        self._pool_in_flight[pool].inc()

    def pool_released(self, pool: str) -> None:
        self._pool_in_flight[pool].dec()

    def pool_refused(self, pool: str) -> None:
        self._pool_rejected[pool].inc()

    def feedback_adopted(self, num_micro_batches: int) -> None:
        self.feedback_micro_batches.inc(num_micro_batches)

    def jobs_kept(self, num_jobs: int) -> None:
        self.feedback_jobs.set(num_jobs)

    def job_store_failed(self, operation: str) -> None:
        self.job_store_errors.labels(operation).inc()

    def exposition(self) -> bytes:
        """The text exposition format; aggregated over workers in multiprocess mode."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            registry = CollectorRegistry()
            prometheus_multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)
