"""What the service tests send: a tiny job's batch and its measured reports, and a measured profile document; and
the settings of a service under test."""

from __future__ import annotations

import copy
from typing import Any

from scheduler_service.core.models import MODEL_CATALOGUE
from scheduler_service.core.perf_model import PerformanceModel
from scheduler_service.core.profile import DEFAULT_PROFILE, builtin_profiles
from scheduler_service.runtime.settings import Settings

__all__ = ["LENGTHS", "measured_document", "report", "settings"]

# The batch of a job on the tiny model (dp 1, cp 2); ``report`` measures micro-batches of these lengths.
LENGTHS = [637, 208, 90, 138, 35, 1216, 326, 301, 270, 1742, 1014, 958, 344, 304, 347, 123]


def report(job_id: str = "job-1", *, scale: float = 1000.0, peak: float | None = None) -> dict[str, Any]:
    """Micro-batch times as if the machine were ``scale`` times slower than the default profile (the base of a job
    that names none) says; each micro-batch's slowest rank above its launch-bound floor, so every one refits."""
    perf = PerformanceModel(model=MODEL_CATALOGUE["tiny"], profile=builtin_profiles()[DEFAULT_PROFILE])
    micro_batches = []
    for local in ([[637, 90], [1216]], [[35, 138, 1014], [958]], [[344, 304], [347, 123, 270]], [[1742], [301]]):
        time_s = max(perf.compute_time_s(float(perf.flops_array(rank).sum())) for rank in local) * scale
        micro_batches.append({"local_lengths": local, "distributed_lengths": [], "time_ms": time_s * 1e3,
                              **({"peak_memory_bytes": peak} if peak is not None else {})})
    return {"job_id": job_id, "step": 3, "micro_batches": micro_batches}


def measured_document(name: str = "lab-tiny", model: str | None = "tiny", scale: float = 1.0) -> dict[str, Any]:
    document = copy.deepcopy(builtin_profiles()["h100-paper"].raw)
    document.update(name=name, model=model, description="made up for a test",
                    provenance={"date": "2025-03-04T05:06:07+00:00", "tool": "test"})
    document["compute"] = {"alpha_s_per_flop": 5e-11 * scale, "beta_s_per_layer": 5e-4,
                           "alpha_s_per_token": 2e-5, "alpha_s_per_sequence": 1e-4}
    return document


def settings(**overrides: Any) -> Settings:
    """A service for a test: no warm-ups (nothing to wait for) and no access log (quiet output)."""
    return Settings(cpsat_warmup=False, warmup=False, access_log=False, **overrides)
