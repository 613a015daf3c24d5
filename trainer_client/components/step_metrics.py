"""What the trainer measures per step: ``StepMetrics`` (what ``reporting`` writes: a JSON line of ``--metrics-out``,
the scalars of ``--report-to``'s trackers), each micro-batch's time and peak memory (``MicroBatchTimer``, for the
service's feedback), and the step's peak memory (``peak_memory``).

On CUDA a timing waits for the device (``torch.cuda.synchronize``) and a micro-batch's peak needs the allocator's
peak reset before it, so the per-micro-batch timer runs there only where a run reports it (``--feedback``); the
step's peak then is the largest of its micro-batches' peaks and what followed the last reset.
"""

from __future__ import annotations

import json
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from trainer_client.planning.source import MicroBatchTiming

__all__ = ["MicroBatchTimer", "StepMetrics", "peak_memory"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StepMetrics:
    """What one optimizer step measured. ``step`` is its number as everything a person reads counts it: 1-based,
    the optimizer steps done after it (TRL's ``global_step``, torchtitan's ``step``), the same in the logs, the
    ``--metrics-out`` line, the trackers, the ``step-<n>`` checkpoint folders and ``--steps`` (the last step is
    ``--steps``). It trained global batch ``step − 1``, the 0-based index the data and the plans are keyed by."""

    step: int
    loss: float
    tokens: int
    loss_tokens: int
    step_time_s: float
    tokens_per_s: float
    plan_source: str
    scheduler: str
    estimated_time_ms: float | None
    num_micro_batches: int
    micro_batch_time_s: float  # the slowest rank's time in its micro-batches: what the plan's estimate predicts
    num_padding_micro_batches: int  # zero-loss micro-batches run so that FSDP collectives match, all ranks
    plan_fallbacks: int
    lr: float
    grad_norm: float  # global gradient norm before clipping
    peak_memory_bytes: int | None
    memory_kind: str
    eval_loss: float | None = None  # the mean token loss of --eval-data after this step, where it was evaluated
    epoch: float | None = None  # records: epochs trained after this step (1.5: half of the second); synthetic: none

    def to_json(self) -> str:
        return json.dumps({name: getattr(self, name) for name in self.__slots__})


def peak_memory(device: torch.device) -> tuple[int | None, str]:
    """The peak memory so far and what it measures; on CUDA the allocator's peak, reset for the next step."""
    if device.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)
        return peak, "cuda_max_allocated"
    # ru_maxrss is in KiB on Linux: the process's peak resident set since it started.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "cpu_peak_rss"


class MicroBatchTimer:
    """This rank's time (and on CUDA peak memory) in each micro-batch it runs, for one step at a time."""

    def __init__(self, device: torch.device, *, dp_rank: int, enabled: bool) -> None:
        """``enabled``: time each micro-batch; on CUDA that waits for the device, so only a run that reports the
        timings should pay for it."""
        self.device = device
        self.dp_rank = dp_rank
        self.enabled = enabled
        self.timings: list[MicroBatchTiming] = []  # of the current step
        self._step_peak_bytes = 0  # CUDA: the largest micro-batch peak since the step's peak was last read

    def start_step(self) -> None:
        self.timings = []

    @contextmanager
    def micro_batch(self, index: int, *, is_padding: bool) -> Iterator[None]:
        """Time the micro-batch run inside; a padding micro-batch is run but not reported (the plan has none)."""
        on_cuda = self.enabled and self.device.type == "cuda"
        if on_cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        started = time.perf_counter()
        yield
        if not self.enabled or is_padding:
            return
        peak = None
        if on_cuda:
            torch.cuda.synchronize(self.device)
            peak = int(torch.cuda.max_memory_allocated(self.device))
            self._step_peak_bytes = max(self._step_peak_bytes, peak)
        self.timings.append(MicroBatchTiming(dp_rank=self.dp_rank, index=index, time_s=time.perf_counter() - started,
                                             peak_memory_bytes=peak))

    def step_peak_memory(self) -> tuple[int | None, str]:
        """The step's peak memory and its kind (``peak_memory``), counting the micro-batch peaks the resets hid."""
        peak, memory_kind = peak_memory(self.device)
        if peak is not None and self.device.type == "cuda":
            peak = max(peak, self._step_peak_bytes)
            self._step_peak_bytes = 0
        return peak, memory_kind
