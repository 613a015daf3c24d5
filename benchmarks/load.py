"""Load benchmark of the planning service: real uvicorn on loopback, concurrent httpx clients.

    python -m benchmarks.load                      # 4000 requests, 32 clients, 256 sequences, DP=4, CP=8
    python -m benchmarks.load --requests 500       # a quick run
    python -m benchmarks.load --env SKRULL_WORKERS=2 --env SKRULL_INLINE_MAX_CELLS=0

Starts ``python -m scheduler_service serve`` on a free loopback port with the
default settings (plus any ``--env``), waits for ``/readyz``, sends warm-up
requests, then ``--requests`` POST /plan from ``--concurrency`` keep-alive
clients over a pool of distinct batches (lengths sampled from the paper's
Table 1 LMSysChat1M distribution). It reports throughput, client-side latency
percentiles and errors, and beside them the in-process time of the same work
(parse + plan + serialize, and the planner alone), so the HTTP overhead shows.

The clients share the machine with the server: on a 2-core host they take
about one core, so the figures are a lower bound on what the server can do.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np
from skrull_proto import PlanRequest, SchedulerName

from scheduler_service.contract.wire import request_to_problem
from scheduler_service.core.plan import PlanLimits
from scheduler_service.core.planner import make_plan
from scheduler_service.core.samplers import sample_lengths
from scheduler_service.processes import stop_process
from scheduler_service.runtime.settings import default_workers
from scheduler_service.runtime.work import plan_request

__all__ = ["free_port", "main", "process_tree", "start_server", "wait_ready"]

WARMUP_REQUESTS = 200
IN_PROCESS_SAMPLE = 200  # batches timed in-process


@dataclass(frozen=True, kw_only=True)
class LoadReport:
    requests: int
    concurrency: int
    client: str
    rate_per_s: float | None
    errors: int
    wall_s: float
    throughput_per_s: float
    latency_p50_ms: float
    latency_p90_ms: float
    latency_p99_ms: float
    latency_max_ms: float
    in_process_p50_ms: float
    in_process_p99_ms: float
    planner_p50_ms: float
    planner_p99_ms: float
    server_cpu_ms_per_request: float
    app_mean_ms: float
    num_workers: int
    load_average: float  # the host's 1-minute load average at the end of the run: other work on shared cores
    server_env: dict[str, str]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _percentile_ms(samples_s: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples_s), q) * 1e3)


def make_batches(args: argparse.Namespace) -> list[PlanRequest]:
    """A distinct batch for every request (and every warm-up request): nothing can be answered from a cache."""
    rng = np.random.default_rng(args.seed)
    # Truncate as a trainer would: nothing longer than the micro-batch capacity (bucket_size × cp_size) is sent.
    probe = request_to_problem(PlanRequest(sequence_lengths=[1], dp_size=args.dp, cp_size=args.cp, model=args.model))
    max_length = min(args.max_length, probe.micro_batch_capacity)
    batches = []
    for _ in range(args.requests + WARMUP_REQUESTS):
        lengths = sample_lengths(args.dataset, args.batch, rng, max_length=max_length)
        batches.append(PlanRequest(sequence_lengths=[int(x) for x in lengths], dp_size=args.dp, cp_size=args.cp,
                                   model=args.model, scheduler=SchedulerName(args.scheduler)))
    return batches


def in_process_times(batches: list[PlanRequest], repeats: int) -> tuple[list[float], list[float]]:
    """(parse + plan + serialize, planner alone) per request, in seconds, on this process."""
    limits = PlanLimits()
    bodies = [batch.model_dump_json().encode() for batch in batches]
    end_to_end, planner = [], []
    for _ in range(repeats):
        for body in bodies:
            started = time.perf_counter()
            request = PlanRequest.model_validate_json(body)
            plan_request(request)
            end_to_end.append(time.perf_counter() - started)
            problem = request_to_problem(request, limits=limits)
            started = time.perf_counter()
            make_plan(problem, request.scheduler)
            planner.append(time.perf_counter() - started)
    return end_to_end, planner


def _stat_fields(stat: Path) -> list[str] | None:
    """``/proc/<pid>/stat`` after the command name; None when the process ended meanwhile."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def process_tree(pid: int) -> list[int]:
    """A process and its live descendants (uvicorn workers, the heavy and CP-SAT pools)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        if (fields := _stat_fields(stat)) is not None:
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, stack = [], [pid]
    while stack:
        current = stack.pop()
        tree.append(current)
        stack.extend(children.get(current, []))
    return tree


def _process_tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds so far of a process and its live descendants."""
    ticks = os.sysconf("SC_CLK_TCK")
    total_s = 0.0
    for process_id in process_tree(pid):
        if (fields := _stat_fields(Path(f"/proc/{process_id}/stat"))) is not None:
            total_s += (int(fields[11]) + int(fields[12])) / ticks
    return total_s


def _app_time_s(base_url: str) -> tuple[float, float]:
    """(sum of seconds, count) of POST /plan as the app itself timed them (its Prometheus histogram)."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    total_s = count = 0.0
    for line in text.splitlines():
        if line.startswith("skrull_plan_request_duration_seconds_sum{"):
            total_s += float(line.rsplit(" ", 1)[1])
        elif line.startswith("skrull_plan_request_duration_seconds_count{"):
            count += float(line.rsplit(" ", 1)[1])
    return total_s, count


def start_server(port: int, env_overrides: dict[str, str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, **env_overrides}
    command = [sys.executable, "-m", "scheduler_service", "serve", "--host", "127.0.0.1", "--port", str(port)]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_ready(base_url: str, server: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"server exited with code {server.returncode} before it was ready")
        try:
            if httpx.get(base_url + "/readyz", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"server not ready after {timeout_s} s")


class _RawConnection:
    """A minimal keep-alive HTTP/1.1 client on asyncio streams, for measuring the server rather than the
    client: httpx spends about as much CPU per request as the server does, and here they share 2 cores."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, body: bytes) -> int:
        """POST /plan once; a keep-alive connection the server has closed meanwhile is reopened once."""
        try:
            return await self._post(body)
        except (OSError, asyncio.IncompleteReadError):
            await self.close()
            return await self._post(body)

    async def _post(self, body: bytes) -> int:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(b"POST /plan HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (self.host.encode(), len(body), body))
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = int(re.search(rb"(?i)\r\ncontent-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
        await self.reader.readexactly(length)
        return status

    async def close(self) -> None:
        writer, self.reader, self.writer = self.writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def _drive(
    base_url: str, bodies: list[bytes], num_requests: int, concurrency: int, rate_per_s: float | None = None,
    seed: int = 0, raw: bool = False,
) -> tuple[list[float], int, float]:
    """Closed loop (each client sends its next request when the last is answered) or, with ``rate_per_s``,
    open loop: Poisson arrivals, at most ``concurrency`` in flight, latency counted from the *scheduled*
    arrival so that queueing behind a slow server is not hidden (no coordinated omission)."""
    latencies_s: list[float] = []
    errors = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    headers = {"content-type": "application/json"}
    host, port = base_url.removeprefix("http://").split(":")
    idle: list[_RawConnection] = [_RawConnection(host, int(port)) for _ in range(concurrency)]
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=60.0) as client:

        async def post(body: bytes) -> int:
            if not raw:
                return (await client.post("/plan", content=body, headers=headers)).status_code
            connection = idle.pop()
            try:
                return await connection.post(body)
            finally:
                idle.append(connection)

        async def send(index: int, scheduled: float) -> None:
            nonlocal errors
            try:
                ok = await post(bodies[index % len(bodies)]) == 200
            except (httpx.HTTPError, OSError, asyncio.IncompleteReadError, ValueError, AttributeError):
                ok = False
            latencies_s.append(time.perf_counter() - scheduled)
            errors += not ok

        started = time.perf_counter()
        if rate_per_s is None:
            next_index = 0

            async def client_loop() -> None:
                nonlocal next_index
                while next_index < num_requests:
                    index = next_index
                    next_index += 1
                    await send(index, time.perf_counter())

            await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        else:
            gaps = np.random.default_rng(seed).exponential(1.0 / rate_per_s, size=num_requests)
            arrivals = started + np.cumsum(gaps)
            slots = asyncio.Semaphore(concurrency)

            async def open_send(index: int, scheduled: float) -> None:
                async with slots:
                    await send(index, scheduled)

            tasks = []
            for index, arrival in enumerate(arrivals.tolist()):
                await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
                tasks.append(asyncio.create_task(open_send(index, arrival)))
            await asyncio.gather(*tasks)
        wall_s = time.perf_counter() - started
        for connection in idle:
            await connection.close()
    return latencies_s, errors, wall_s


def run(args: argparse.Namespace) -> LoadReport:
    batches = make_batches(args)
    bodies = [batch.model_dump_json().encode() for batch in batches]
    end_to_end_s, planner_s = in_process_times(batches[:IN_PROCESS_SAMPLE], repeats=args.in_process_repeats)
    env_overrides = dict(item.split("=", 1) for item in args.env)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    server = start_server(port, env_overrides)
    try:
        wait_ready(base_url, server)
        asyncio.run(_drive(base_url, bodies[-WARMUP_REQUESTS:], WARMUP_REQUESTS, args.concurrency, raw=args.raw_client))
        cpu_before_s, (app_before_s, app_before_n) = _process_tree_cpu_s(server.pid), _app_time_s(base_url)
        latencies_s, errors, wall_s = asyncio.run(
            _drive(base_url, bodies[: args.requests], args.requests, args.concurrency, args.rate, args.seed,
                   raw=args.raw_client)
        )
        server_cpu_s = _process_tree_cpu_s(server.pid) - cpu_before_s
        load_average = os.getloadavg()[0]
        app_after_s, app_after_n = _app_time_s(base_url)
    finally:
        stop_process(server)
    return LoadReport(
        requests=len(latencies_s), concurrency=args.concurrency, client="raw" if args.raw_client else "httpx",
        rate_per_s=args.rate, errors=errors, wall_s=wall_s,
        throughput_per_s=len(latencies_s) / wall_s,
        latency_p50_ms=_percentile_ms(latencies_s, 50), latency_p90_ms=_percentile_ms(latencies_s, 90),
        latency_p99_ms=_percentile_ms(latencies_s, 99), latency_max_ms=max(latencies_s) * 1e3,
        in_process_p50_ms=_percentile_ms(end_to_end_s, 50), in_process_p99_ms=_percentile_ms(end_to_end_s, 99),
        planner_p50_ms=_percentile_ms(planner_s, 50), planner_p99_ms=_percentile_ms(planner_s, 99),
        server_cpu_ms_per_request=server_cpu_s / len(latencies_s) * 1e3,
        app_mean_ms=(app_after_s - app_before_s) / max(app_after_n - app_before_n, 1) * 1e3,
        num_workers=int(env_overrides.get("SKRULL_WORKERS", default_workers())), load_average=load_average,
        server_env=env_overrides,
    )


def format_report(report: LoadReport, args: argparse.Namespace) -> str:
    env = " ".join(f"{k}={v}" for k, v in report.server_env.items()) or "default settings"
    mode = (f"open loop at {report.rate_per_s:g} requests/s (at most {report.concurrency} in flight)"
            if report.rate_per_s else f"closed loop, {report.concurrency} concurrent {report.client} clients")
    return "\n".join([
        f"POST /plan load: {report.requests} requests, {mode}, "
        f"{args.batch} sequences ({args.dataset}), DP={args.dp} CP={args.cp}, {args.scheduler}; server: {env} "
        f"({report.num_workers} workers); {os.cpu_count()} CPUs, load average {report.load_average:.1f} after the run",
        f"  throughput  {report.throughput_per_s:8.1f} plans/s   ({report.wall_s:.2f} s wall)   errors {report.errors}",
        f"  latency     p50 {report.latency_p50_ms:6.2f} ms   p90 {report.latency_p90_ms:6.2f} ms   "
        f"p99 {report.latency_p99_ms:6.2f} ms   max {report.latency_max_ms:6.2f} ms",
        f"  in-process  p50 {report.in_process_p50_ms:6.2f} ms   p99 {report.in_process_p99_ms:6.2f} ms   "
        "(parse + plan + check + simulate + serialize)",
        f"  planner     p50 {report.planner_p50_ms:6.2f} ms   p99 {report.planner_p99_ms:6.2f} ms   (make_plan alone)",
        f"  server      {report.server_cpu_ms_per_request:6.2f} ms CPU per request (server processes);  "
        f"{report.app_mean_ms:6.2f} ms mean inside the app (middleware to response, every worker)",
        # the targets: >= 300 plans/s in a closed loop; p99 <= 50 ms at 150 requests/s in an open loop
        (f"  target      p99 <= 50 ms at 150 requests/s: {'met' if report.latency_p99_ms <= 50 else 'MISSED'};  "
         if report.rate_per_s else
         f"  target      >= 300 plans/s: {'met' if report.throughput_per_s >= 300 else 'MISSED'};  ")
        + f"zero errors: {'met' if report.errors == 0 else 'MISSED'}",
    ])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.load", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--batch", type=int, default=256, help="sequences per request")
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--cp", type=int, default=8)
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--scheduler", default="skrull", choices=[s.value for s in SchedulerName if s != "cpsat"])
    parser.add_argument("--dataset", default="lmsys")
    parser.add_argument("--max-length", type=int, default=128 * 1024, help="truncate sampled lengths (tokens)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--in-process-repeats", type=int, default=2)
    parser.add_argument("--rate", type=float, default=None,
                        help="open loop: Poisson arrivals at this many requests/s (default: closed loop)")
    parser.add_argument("--raw-client", action="store_true",
                        help="a minimal asyncio HTTP/1.1 client instead of httpx (less client CPU on a small host)")
    parser.add_argument("--env", action="append", default=[], metavar="SKRULL_X=V", help="server setting override")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report = run(args)
    print(json.dumps(asdict(report), indent=2) if args.json else format_report(report, args))
    return 0 if report.errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
