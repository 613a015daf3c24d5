"""Stress benchmark: the probes and small plans while heavy valid requests keep the heavy pool saturated.

    python -m benchmarks.stress                    # 30 s, 4 heavy clients, default settings
    python -m benchmarks.stress --seconds 10 --heavy-clients 8 --env SKRULL_HEAVY_WORKERS=2

Starts ``python -m scheduler_service serve`` on a free loopback port (default
settings plus any ``--env``). ``--heavy-clients`` threads send heavy but valid
plans back to back (``--heavy-sequences`` sequences that each fill a
micro-batch of ``cp_size`` 1024 with ``bucket_size`` 1: the shape that held the
event loop for seconds before issue 14), each retrying a 429 after its
Retry-After, as a well-behaved client does; more clients than the pool admits
keep it full. Beside them one client probes ``GET /healthz`` and one sends
small plans (256 sequences, DP 4, CP 8, as ``benchmarks.load``), each every
20 ms. It reports the probes' and small plans' latency percentiles, the heavy
plans answered and refused, and the peak resident memory of the server
process and of its whole process tree (the pools included), sampled every
50 ms (the tree is listed again every second).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
from skrull_proto import PlanRequest

from benchmarks.load import free_port, process_tree, start_server, wait_ready
from scheduler_service.core.samplers import sample_lengths

__all__ = ["main"]

_PROBE_INTERVAL_S = 0.02
_RSS_INTERVAL_S = 0.05
_TREE_INTERVAL_S = 1.0


@dataclass(kw_only=True)
class _Samples:
    healthz_s: list[float] = field(default_factory=list)
    healthz_errors: int = 0
    small_s: list[float] = field(default_factory=list)
    small_errors: int = 0
    heavy_ok: int = 0
    heavy_busy: int = 0
    heavy_other: int = 0
    peak_server_rss_bytes: int = 0
    peak_tree_rss_bytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True, kw_only=True)
class StressReport:
    seconds: float
    heavy_clients: int
    heavy_sequences: int
    heavy_ok: int
    heavy_busy_429: int
    heavy_other: int
    healthz_count: int
    healthz_errors: int
    healthz_p50_ms: float
    healthz_p99_ms: float
    healthz_max_ms: float
    small_plan_count: int
    small_plan_errors: int
    small_plan_p50_ms: float
    small_plan_p99_ms: float
    peak_server_rss_mb: float
    peak_tree_rss_mb: float
    server_env: dict[str, str]


def _rss_bytes(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # ended meanwhile
        return 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _heavy_client(base_url: str, body: bytes, samples: _Samples, stop: threading.Event) -> None:
    with httpx.Client(base_url=base_url, timeout=600) as client:
        while not stop.is_set():
            response = client.post("/plan", content=body, headers={"content-type": "application/json"})
            if stop.is_set():
                return  # answered while the server shuts down: not part of the run
            with samples.lock:
                if response.status_code == 200:
                    samples.heavy_ok += 1
                elif response.status_code == 429:
                    samples.heavy_busy += 1
                else:
                    samples.heavy_other += 1
            if response.status_code == 429:
                stop.wait(float(response.headers["retry-after"]))


def _prober(base_url: str, samples: _Samples, stop: threading.Event, small_body: bytes | None) -> None:
    """GET /healthz (or POST a small plan) every 20 ms; latency from sending to the whole answer."""
    with httpx.Client(base_url=base_url, timeout=600) as client:
        while not stop.wait(_PROBE_INTERVAL_S):
            started = time.perf_counter()
            if small_body is None:
                ok = client.get("/healthz").status_code == 200
            else:
                ok = client.post("/plan", content=small_body,
                                 headers={"content-type": "application/json"}).status_code == 200
            elapsed_s = time.perf_counter() - started
            with samples.lock:
                if small_body is None:
                    samples.healthz_s.append(elapsed_s)
                    samples.healthz_errors += not ok
                else:
                    samples.small_s.append(elapsed_s)
                    samples.small_errors += not ok


def _memory_sampler(pid: int, samples: _Samples, stop: threading.Event) -> None:
    tree, listed_at = process_tree(pid), time.monotonic()
    while not stop.wait(_RSS_INTERVAL_S):
        if time.monotonic() - listed_at > _TREE_INTERVAL_S:  # listing /proc costs the probes' process CPU
            tree, listed_at = process_tree(pid), time.monotonic()
        tree_bytes = sum(_rss_bytes(process_id) for process_id in tree)
        samples.peak_server_rss_bytes = max(samples.peak_server_rss_bytes, _rss_bytes(pid))
        samples.peak_tree_rss_bytes = max(samples.peak_tree_rss_bytes, tree_bytes)


def _ms(samples_s: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples_s), q) * 1e3) if samples_s else float("nan")


def run(args: argparse.Namespace) -> StressReport:
    heavy = PlanRequest(sequence_lengths=[1000] * args.heavy_sequences, dp_size=1, cp_size=1024, bucket_size=1)
    lengths = sample_lengths("lmsys", 256, np.random.default_rng(0), max_length=128 * 1024)
    small = PlanRequest(sequence_lengths=[int(n) for n in lengths], dp_size=4, cp_size=8)
    env_overrides = dict(item.split("=", 1) for item in args.env)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    server = start_server(port, env_overrides)
    samples = _Samples()
    stop = threading.Event()
    try:
        wait_ready(base_url, server)
        threads = [
            *(threading.Thread(target=_heavy_client, args=(base_url, heavy.model_dump_json().encode(), samples,
                                                           stop)) for _ in range(args.heavy_clients)),
            threading.Thread(target=_prober, args=(base_url, samples, stop, None)),
            threading.Thread(target=_prober, args=(base_url, samples, stop, small.model_dump_json().encode())),
            threading.Thread(target=_memory_sampler, args=(server.pid, samples, stop)),
        ]
        for thread in threads:
            thread.start()
        time.sleep(args.seconds)
        stop.set()
        for thread in threads:
            thread.join()
    finally:
        stop.set()
        server.terminate()
        server.wait(timeout=60)
    return StressReport(
        seconds=args.seconds, heavy_clients=args.heavy_clients, heavy_sequences=args.heavy_sequences,
        heavy_ok=samples.heavy_ok, heavy_busy_429=samples.heavy_busy, heavy_other=samples.heavy_other,
        healthz_count=len(samples.healthz_s), healthz_errors=samples.healthz_errors,
        healthz_p50_ms=_ms(samples.healthz_s, 50), healthz_p99_ms=_ms(samples.healthz_s, 99),
        healthz_max_ms=max(samples.healthz_s, default=float("nan")) * 1e3,
        small_plan_count=len(samples.small_s), small_plan_errors=samples.small_errors,
        small_plan_p50_ms=_ms(samples.small_s, 50), small_plan_p99_ms=_ms(samples.small_s, 99),
        peak_server_rss_mb=samples.peak_server_rss_bytes / 2**20, peak_tree_rss_mb=samples.peak_tree_rss_bytes / 2**20,
        server_env=env_overrides,
    )


def format_report(report: StressReport) -> str:
    env = " ".join(f"{k}={v}" for k, v in report.server_env.items()) or "default settings"
    return "\n".join([
        f"stress: {report.seconds:g} s, {report.heavy_clients} clients sending heavy plans "
        f"({report.heavy_sequences} sequences, cp_size 1024, bucket_size 1) back to back; server: {env}; "
        f"{os.cpu_count()} CPUs",
        f"  heavy plans   {report.heavy_ok} answered, {report.heavy_busy_429} refused 429 (retried after Retry-After), "
        f"{report.heavy_other} other",
        f"  /healthz      p50 {report.healthz_p50_ms:6.2f} ms   p99 {report.healthz_p99_ms:6.2f} ms   "
        f"max {report.healthz_max_ms:6.2f} ms   ({report.healthz_count} probes, {report.healthz_errors} errors)",
        f"  small plans   p50 {report.small_plan_p50_ms:6.2f} ms   p99 {report.small_plan_p99_ms:6.2f} ms   "
        f"({report.small_plan_count} plans, {report.small_plan_errors} errors; 256 sequences, DP 4, CP 8)",
        f"  peak RSS      server process {report.peak_server_rss_mb:6.1f} MB   "
        f"whole tree (with the pools) {report.peak_tree_rss_mb:6.1f} MB",
    ])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stress", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--heavy-clients", type=int, default=4, help="more than the pool admits (1 + 2 queued)")
    parser.add_argument("--heavy-sequences", type=int, default=256,
                        help="sequences per heavy plan (each fills a micro-batch of 1024 CP ranks)")
    parser.add_argument("--env", action="append", default=[], metavar="SKRULL_X=V", help="server setting override")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report = run(args)
    print(json.dumps(asdict(report), indent=2) if args.json else format_report(report))
    return 0 if report.healthz_errors == report.small_plan_errors == report.heavy_other == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
