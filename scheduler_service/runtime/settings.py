"""Service configuration: pydantic-settings read from ``SKRULL_*`` environment variables.

``get_settings()`` is cached and is the one place the app reads configuration
from; tests build ``Settings(...)`` directly and pass it to ``create_app``.
The ``serve`` command turns its flags into the same environment variables, so
every uvicorn worker process sees one configuration.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from functools import cache
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from scheduler_service.core.advise import AdviseLimits
from scheduler_service.core.plan import PlanLimits
from scheduler_service.core.planner import DEFAULT_CPSAT_TIME_LIMIT_S

__all__ = ["ENV_PREFIX", "MAX_DEFAULT_WORKERS", "Settings", "available_cores", "default_state_url",
           "default_workers", "get_settings"]

ENV_PREFIX = "SKRULL_"
# Each worker is an event loop and its own pools (about 75 MB plus 60-190 MB per pool process): past a few, a
# larger scheduler is better served by replicas.
MAX_DEFAULT_WORKERS = 4
_CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def available_cores() -> int:
    """Cores this process may keep busy: its CPU affinity, lowered by a cgroup v2 CPU quota (a container's CPU
    limit, which neither the affinity nor ``os.cpu_count()`` shows), whole cores only and at least one."""
    cores = len(os.sched_getaffinity(0))
    with contextlib.suppress(OSError, ValueError):  # no cgroup v2 file, or no quota ("max")
        quota_us, period_us = _CGROUP_CPU_MAX.read_text().split()
        cores = min(cores, max(1, int(quota_us) // int(period_us)))
    return cores


def default_workers() -> int:
    """One uvicorn worker per available core, at most ``MAX_DEFAULT_WORKERS``: a busy worker keeps one core busy
    planning on its event loop, and more workers than cores would only queue behind each other."""
    return min(available_cores(), MAX_DEFAULT_WORKERS)


def default_state_url() -> str:
    """A SQLite file in a per-user folder of the temporary directory: the one place the shipped containers may
    write, and a Kubernetes ``emptyDir`` there survives a restart of the service's container."""
    return f"sqlite://{Path(tempfile.gettempdir()) / f'skrull-{os.getuid()}' / 'jobs.sqlite3'}"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    # Server (used by `serve`; the app itself ignores them).
    host: str = Field(default="127.0.0.1", description="Interface uvicorn binds.")
    port: int = Field(default=8000, ge=0, le=65535, description="TCP port uvicorn binds (0: any free port).")
    workers: int = Field(default_factory=default_workers, ge=1, le=64, description="uvicorn worker processes; "
                         f"default one per available core, at most {MAX_DEFAULT_WORKERS} (the k8s manifests set 1).")
    log_level: Literal["debug", "info", "warning", "error"] = Field(default="info", description="Log level.")
    access_log: bool = Field(default=True, description="One JSON log line per request.")

    # Request limits: every one is reported in the 4xx that enforces it.
    max_body_bytes: int = Field(default=4 << 20, ge=1024, description="Largest request body accepted (else 413).")
    max_sequences: int = Field(default=65536, ge=1, description="Most sequences in one global batch.")
    max_sequence_length: int = Field(default=1 << 24, ge=1, description="Most tokens in one sequence.")
    max_dp_size: int = Field(default=4096, ge=1, description="Largest dp_size accepted.")
    max_cp_size: int = Field(default=1024, ge=1, description="Largest cp_size accepted.")
    max_search_budget: int = Field(default=1 << 16, ge=0, description="Largest search_budget a request may ask "
                                   "for (else 422).")

    # Plan quality: skrull's plan-level search budget (units of search work; a larger one never plans worse).
    search_budget: int | None = Field(default=None, ge=0, description="skrull's search budget when a request "
                                      "gives none (unset: the planner's default for the batch's size).")

    # Cost of a request, in cells (``cost``: micro-batches × cp_size local lists, plus sequences), estimated
    # from its shape before any work. Measured on 2 cores: 4-15 µs and about 3 bytes of answer per cell.
    max_plan_cells: int = Field(default=1 << 20, ge=1, description="Largest estimated plan accepted (else 422): "
                                "about 4-15 s of planning and a 3 MB answer on 2 cores.")
    max_answer_bytes: int = Field(default=8 << 20, ge=1024, description="Largest estimated /plan answer "
                                  "accepted (else 422); a breakdown adds about 180 bytes per cell.")
    max_advise_cells: int = Field(default=1 << 22, ge=1, description="Largest estimated /advise request "
                                  "accepted (else 422): every layout's plans of every sampled batch, in cells; "
                                  "the default is about a minute of work on 2 cores at worst.")
    max_advise_sample: int = Field(default=1 << 20, ge=1, description="Most sequences in an /advise sample "
                                   "(its lengths, or its histogram's counts summed).")
    max_feedback_cells: int = Field(default=1 << 18, ge=1, description="Largest /feedback report accepted, in "
                                    "lists and lengths (else 422).")
    # Small requests run on the event loop (cheapest, best p99: 256 sequences at DP 4 CP 8 is ~2.3k cells and
    # ~8 ms); everything above runs in the bounded heavy pool, so no request can stall /healthz.
    inline_max_cells: int = Field(default=4096, ge=0, description="Requests up to this many cells run on the "
                                  "event loop; larger ones in the heavy pool.")
    inline_max_search_budget: int = Field(default=1024, ge=0, description="Requests asking for a larger "
                                          "search_budget run in the heavy pool (a unit is 4-14 µs on 64-256 "
                                          "sequences on 2 cores).")
    heavy_workers: int = Field(default=1, ge=1, le=64, description="Processes planning heavy requests.")
    heavy_queue: int = Field(default=2, ge=0, description="Heavy requests allowed to wait for a busy pool "
                             "(else 429).")

    # Connections: uvicorn closes idle keep-alive connections; the header and body deadlines close a client
    # that starts a request and never finishes it (uvicorn alone waits forever for the rest of the headers).
    timeout_keep_alive_s: int = Field(default=5, ge=1, description="Idle keep-alive connections closed after.")
    header_timeout_s: float = Field(default=10.0, gt=0, description="A request's headers must arrive within "
                                    "this time of its first byte (else the connection is closed).")
    body_timeout_s: float = Field(default=30.0, gt=0, description="A request's body must arrive within this "
                                  "time (else 408).")

    # CP-SAT: a bounded process pool, so exact solves never block heuristic plans.
    cpsat_workers: int = Field(default=1, ge=1, le=64, description="Processes solving cpsat requests.")
    cpsat_queue: int = Field(default=1, ge=0, description="cpsat requests allowed to wait for a busy pool (else 429).")
    # CP-SAT's model grows with sequences² × DP ranks and building it is not bounded by the time limit:
    # measured on 2 cores with a 0.5 s limit, 40 sequences take ~1-2 s in all, 64 take 3-20 s, 120 take 16-34 s.
    cpsat_max_sequences: int = Field(default=48, ge=1, description="Most sequences a cpsat request may hold.")
    cpsat_default_time_limit_s: float = Field(default=DEFAULT_CPSAT_TIME_LIMIT_S, gt=0, description="Solver time "
                                              "limit when a request gives none (the core's default).")
    cpsat_max_time_limit_s: float = Field(default=10.0, gt=0, description="Cap on a request's time_limit_s.")
    cpsat_warmup: bool = Field(default=True, description="Start the pools at startup: CP-SAT imported, "
                                 "the heavy pool's planner warmed.")

    # Planner warm-up before /readyz says ready: the planning core's kernels compiled, or loaded from their cache.
    warmup: bool = Field(default=True, description="Compile the planner and plan a small batch at startup "
                         "before reporting ready.")
    jit_cache_dir: Path | None = Field(
        default=None, description="Folder of the planner's compiled kernels, read when the planning core is "
        "imported (serve passes it to its workers); unset: $XDG_CACHE_HOME/skrull/numba, or a folder under the "
        "temporary directory where that cannot be written. The container image ships it warm.")

    # Profiles measured by `python -m trainer_client.profile`, beside the shipped ones.
    profile_dir: Path | None = Field(
        default=None, description="Folder of profile JSON files, read at start-up (a bad file stops the start) "
        "and again by POST /profiles/reload or, in every worker, once the folder has changed.")

    # Feedback: per-job online refit of the profile from measured micro-batches (POST /feedback).
    feedback: bool = Field(default=True, description="Accept POST /feedback from trainers that opt in.")
    feedback_max_jobs: int = Field(default=256, ge=1, description="Jobs whose refit is kept; the least recently "
                                   "used is forgotten first.")
    feedback_window: int = Field(default=256, ge=2, le=65536, description="Observations each job's refit keeps.")
    feedback_memory_headroom: float = Field(default=0.9, gt=0, le=1, description="Fraction of the memory budget "
                                            "a job's plans may use before its bucket_size is lowered.")
    state_url: str = Field(default_factory=default_state_url, description="Where jobs' feedback state "
                           "is kept: a SQLite file path (or sqlite://PATH; default a file in the temporary "
                           "directory), or redis://… to share it between workers and replicas.")

    # Security: off for the sidecar on localhost; set it (from a Secret) for a shared Deployment.
    api_token: SecretStr | None = Field(default=None, min_length=1, description="Bearer token that POST "
                                        "/feedback and POST /profiles/reload require when set (off when unset).")

    @model_validator(mode="before")
    @classmethod
    def _default_time_limit_within_the_cap(cls, data: Any) -> Any:
        """Left unset, the default time limit is the core's, or the cap where that is lower: a lower cap alone
        must not stop the start."""
        if isinstance(data, dict) and "cpsat_default_time_limit_s" not in data and "cpsat_max_time_limit_s" in data:
            with contextlib.suppress(TypeError, ValueError):  # a bad cap is reported by its own field
                cap_s = float(data["cpsat_max_time_limit_s"])
                data = {**data, "cpsat_default_time_limit_s": min(DEFAULT_CPSAT_TIME_LIMIT_S, cap_s)}
        return data

    @model_validator(mode="after")
    def _time_limits_are_ordered(self) -> Settings:
        if self.cpsat_default_time_limit_s > self.cpsat_max_time_limit_s:
            raise ValueError(
                f"cpsat_default_time_limit_s {self.cpsat_default_time_limit_s} exceeds "
                f"cpsat_max_time_limit_s {self.cpsat_max_time_limit_s}"
            )
        return self

    @property
    def plan_limits(self) -> PlanLimits:
        return PlanLimits(
            max_sequences=self.max_sequences,
            max_sequence_length=self.max_sequence_length,
            max_dp_size=self.max_dp_size,
            max_cp_size=self.max_cp_size,
            max_search_budget=self.max_search_budget,
        )

    @property
    def advise_limits(self) -> AdviseLimits:
        return AdviseLimits(plan=self.plan_limits, max_sample_sequences=self.max_advise_sample)



@cache
def get_settings() -> Settings:
    """The process's settings, read once from the environment."""
    return Settings()
