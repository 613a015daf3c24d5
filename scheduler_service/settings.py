"""Service configuration: pydantic-settings read from ``SKRULL_*`` environment variables.

``get_settings()`` is cached and is the one place the app reads configuration
from; tests build ``Settings(...)`` directly and pass it to ``create_app``.
The ``serve`` command turns its flags into the same environment variables, so
every uvicorn worker process sees one configuration.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from scheduler_service.core.plan import PlanLimits

__all__ = ["ENV_PREFIX", "Settings", "get_settings"]

ENV_PREFIX = "SKRULL_"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    # Server (used by `serve`; the app itself ignores them).
    host: str = Field(default="127.0.0.1", description="Interface uvicorn binds.")
    port: int = Field(default=8000, ge=0, le=65535, description="TCP port uvicorn binds (0: any free port).")
    workers: int = Field(default=1, ge=1, le=64, description="uvicorn worker processes (one is the k8s pattern).")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    access_log: bool = Field(default=True, description="One JSON log line per request.")

    # Request limits: every one is reported in the 4xx that enforces it.
    max_body_bytes: int = Field(default=4 << 20, ge=1024, description="Largest request body accepted (else 413).")
    max_sequences: int = Field(default=65536, ge=1, description="Most sequences in one global batch.")
    max_sequence_length: int = Field(default=1 << 24, ge=1, description="Most tokens in one sequence.")
    max_dp_size: int = Field(default=4096, ge=1)
    max_cp_size: int = Field(default=1024, ge=1)

    # Heuristic planning: small batches plan on the event loop (cheapest, best p99), larger ones in a thread
    # so that one huge batch does not stall /healthz and every other request behind it.
    # Measured: ~8 ms for 256 sequences (DP 4, CP 8) inline, ~40 ms for 1024.
    inline_max_sequences: int = Field(
        default=1024, ge=0, description="Batches up to this many sequences are planned inline; larger in a thread."
    )

    # CP-SAT: a bounded process pool, so exact solves never block heuristic plans.
    cpsat_workers: int = Field(default=1, ge=1, le=64, description="Processes solving cpsat requests.")
    cpsat_queue: int = Field(default=1, ge=0, description="cpsat requests allowed to wait for a busy pool (else 429).")
    # CP-SAT's model grows with sequences² × DP ranks and building it is not bounded by the time limit:
    # measured on 2 cores with a 0.5 s limit, 40 sequences take ~1-2 s in all, 64 take 3-20 s, 120 take 16-34 s.
    cpsat_max_sequences: int = Field(default=48, ge=1, description="Most sequences a cpsat request may hold.")
    cpsat_default_time_limit_s: float = Field(default=2.0, gt=0, description="Solver time limit when none is given.")
    cpsat_max_time_limit_s: float = Field(default=10.0, gt=0, description="Cap on a request's time_limit_s.")
    cpsat_warmup: bool = Field(default=True, description="Start the pool and import CP-SAT at startup.")

    # Planner warm-up before /readyz says ready.
    warmup: bool = Field(default=True, description="Plan a small batch at startup before reporting ready.")

    # Profiles measured by `python -m trainer_client.profile`, beside the shipped ones.
    profile_dir: Path | None = Field(
        default=None, description="Folder of profile JSON files, read at start-up (a bad file stops the start) "
        "and again by POST /profiles/reload or when a request names a profile not loaded yet.")

    # Feedback: per-job online refit of the profile from measured micro-batches (POST /feedback).
    feedback: bool = Field(default=True, description="Accept POST /feedback from trainers that opt in.")
    feedback_max_jobs: int = Field(default=256, ge=1, description="Jobs whose refit is kept; the least recently "
                                   "used is forgotten first.")
    feedback_window: int = Field(default=256, ge=2, le=65536, description="Observations each job's refit keeps.")
    feedback_memory_headroom: float = Field(default=0.9, gt=0, le=1, description="Fraction of the memory budget "
                                            "a job's plans may use before its bucket_size is lowered.")

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
        )

    @property
    def cpsat_capacity(self) -> int:
        """cpsat requests admitted at once: solving plus waiting."""
        return self.cpsat_workers + self.cpsat_queue


@cache
def get_settings() -> Settings:
    """The process's settings, read once from the environment."""
    return Settings()
