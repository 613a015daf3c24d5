"""``make docker-smoke``: build both images and run them for real, checking what a user would see.

1. Uses the Docker engine that answers, or starts ``dockerd`` (root) and stops it at the end.
2. Builds both images (``deploy/build-images.sh``, timed).
3. Looks inside each image, as the user it runs as: not root; the scheduler holds the service and not torch or
   transformers; the trainer holds the CPU build of the pinned torch and torchrun; neither keeps the build's pip
   CA secret or settings; the planner's kernel cache is there and the image's user can write it.
4. Runs the scheduler image with its port published on the loopback, waits until Docker reports its health
   check healthy, then plans a batch through the port and checks the answer (``check_plan``: every sequence
   scheduled exactly once, in the DP ranks' own micro-batches or the spanning ones; one entry per DP rank; no
   slower than deepspeed), and loads the plan viewer from it.
5. Runs the compose demo (scheduler + CPU trainer, ``docker-compose.yml``) to completion: every step's loss is
   finite and every plan came from the service.

Everything it starts (containers, the compose project, dockerd) is removed or stopped, also on failure. It
prints the figures the deployment guide (docs/guides/deployment.md) reports: build time, image sizes,
start-to-ready time. Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script by any Python 3: the one helper it shares is the service's, stdlib only
from scheduler_service.processes import stop_process  # noqa: E402

DOCKER = os.environ.get("DOCKER") or ("/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker")
COMPOSE = os.environ.get("COMPOSE", "docker-compose").split()
SCHEDULER_IMAGE, TRAINER_IMAGE = "skrull-scheduler:0.1.0", "skrull-trainer:0.1.0"
CONTAINER = "skrull-smoke-scheduler"
PROJECT = "skrull-smoke"
TRAINER_STEPS = 20  # docker-compose.yml's --steps
LENGTHS = [812, 30311, 97, 4096, 1500, 256, 65000, 733]
DP_SIZE = 2
BATCH = {"sequence_lengths": LENGTHS, "dp_size": DP_SIZE, "cp_size": 4, "scheduler": "skrull"}


def run(*command: str, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, check=check, text=True, capture_output=True, cwd=ROOT,
                          env=None if env is None else {**os.environ, **env})


def engine_answers() -> bool:
    return run(DOCKER, "info", check=False).returncode == 0


@contextlib.contextmanager
def docker_engine() -> Iterator[None]:
    """The running engine, or one started here (and stopped when done)."""
    if engine_answers():
        yield
        return
    log = tempfile.NamedTemporaryFile(prefix="skrull-dockerd-", suffix=".log", delete=False)  # noqa: SIM115
    daemon = subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT)
    print(f"started dockerd (pid {daemon.pid}, log {log.name})")
    try:
        deadline = time.monotonic() + 60
        while not engine_answers():
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"dockerd did not come up; see {log.name}")
            time.sleep(0.5)
        yield
    finally:
        stop_process(daemon, grace_s=60)
        print(f"stopped dockerd (pid {daemon.pid})")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def http(method: str, url: str, body: object | None = None) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def build_images() -> float:
    start = time.monotonic()
    subprocess.run([str(ROOT / "deploy" / "build-images.sh")], check=True, cwd=ROOT,
                   env={**os.environ, "DOCKER": DOCKER})
    return time.monotonic() - start


def image_size_mb(image: str) -> float:
    return int(run(DOCKER, "image", "inspect", "-f", "{{.Size}}", image).stdout) / 1e6


# Run inside an image by its own user and Python: what a container of it would find.
PROBE = """
import importlib.util, json, os, shutil
present = {name: importlib.util.find_spec(name) is not None
           for name in ("scheduler_service", "skrull_proto", "fastapi", "uvicorn", "trainer_client", "torch",
                        "transformers")}
torch = importlib.import_module("torch") if present["torch"] else None
cache = os.environ.get("SKRULL_JIT_CACHE_DIR", "")
print(json.dumps({
    "uid": os.getuid(), "present": present, "torchrun": shutil.which("torchrun") is not None,
    "torch": torch.__version__ if torch else None, "cuda": torch.version.cuda if torch else None,
    "pip_settings": sorted(k for k in os.environ if k.startswith("PIP_")),
    "ca_secret": [os.path.join(folder, name) for folder, _, files in os.walk("/run/secrets") for name in files
                  if os.path.getsize(os.path.join(folder, name))],  # BuildKit leaves empty mount points
    "jit_cache_files": sum(len(files) for _, _, files in os.walk(cache)) if cache else 0,
    "jit_cache_writable": bool(cache) and os.access(cache, os.W_OK),
}))
"""


def image_facts(image: str) -> dict[str, object]:
    """``PROBE``'s findings in ``image``, run as the image's own user."""
    facts: dict[str, object] = json.loads(run(DOCKER, "run", "--rm", "--entrypoint", "python", image, "-c",
                                              PROBE).stdout)
    return facts


def check_image_contents() -> None:
    """Each image holds what its job needs and nothing of the build's secrets, and runs as a user, not root."""
    [pin] = [line.split("==")[1] for line in (ROOT / "constraints.txt").read_text().splitlines()
             if line.startswith("torch==")]
    expected = {
        SCHEDULER_IMAGE: {"scheduler_service": True, "skrull_proto": True, "fastapi": True, "uvicorn": True,
                          "torch": False, "transformers": False},
        TRAINER_IMAGE: {"scheduler_service": True, "skrull_proto": True, "trainer_client": True, "torch": True,
                        "transformers": True},
    }
    for image, modules in expected.items():
        facts = image_facts(image)
        present = facts["present"]
        assert isinstance(present, dict)
        wrong = {name: present[name] for name, wanted in modules.items() if present[name] != wanted}
        assert not wrong, f"{image}: modules present (True) or missing (False) against what it needs: {wrong}"
        assert facts["uid"] != 0, f"{image} runs as root"
        assert not facts["pip_settings"] and not facts["ca_secret"], f"{image} keeps build settings: {facts}"
        assert facts["jit_cache_files"] and facts["jit_cache_writable"], f"{image}: no warm kernel cache {facts}"
        if image == TRAINER_IMAGE:
            assert str(facts["torch"]).split("+")[0] == pin and facts["cuda"] is None and facts["torchrun"], facts
        print(f"{image}: uid {facts['uid']}, torch {facts['torch']}, kernel cache {facts['jit_cache_files']} files")


def scheduled_indices(plan: dict[str, Any]) -> list[int]:
    """Every sequence index a /plan answer schedules, once per place it appears: in each micro-batch, the DP
    ranks' own (``dp_ranks[*].micro_batches``) and the spanning ones over several DP replicas (``spanning``,
    omitted when empty), its ``local`` lists, ``distributed``, and its ``sharded`` groups' ``sequences``
    (omitted when empty; grouped by ``cp_ranks`` in a DP rank's micro-batch, by ``ranks`` in a spanning one)."""
    micro_batches = [*(mb for dp in plan["dp_ranks"] for mb in dp["micro_batches"]), *plan.get("spanning", [])]
    return [index for mb in micro_batches
            for index in [*(i for local in mb["local"] for i in local), *mb["distributed"],
                          *(i for group in mb.get("sharded", []) for i in group["sequences"])]]


def check_plan(plan: dict[str, Any], batch: dict[str, Any]) -> list[int]:
    """What a user checks of a /plan answer to ``batch``: every sequence scheduled exactly once (spanning
    micro-batches included), one entry per DP rank, and no slower than the deepspeed baseline. Returns the
    scheduled indices, sorted; raises AssertionError saying what is wrong."""
    expected = range(len(batch["sequence_lengths"]))
    counts = Counter(scheduled_indices(plan))
    missing = [index for index in expected if index not in counts]
    duplicated = {index: times for index, times in sorted(counts.items()) if times > 1}
    unknown = sorted(index for index in counts if index not in expected)
    wrong = [*([f"missing indices {missing}"] if missing else []),
             *([f"duplicated indices {duplicated} (index: times scheduled)"] if duplicated else []),
             *([f"indices not in the batch {unknown}"] if unknown else [])]
    assert not wrong, (f"the plan does not schedule each of the batch's {len(expected)} sequences exactly once: "
                       + "; ".join(wrong))
    assert len(plan["dp_ranks"]) == batch["dp_size"], (
        f"the plan has {len(plan['dp_ranks'])} DP ranks, the batch asked for {batch['dp_size']}")
    assert plan["speedup_vs_deepspeed"] >= 1.0, (
        f"the plan is slower than deepspeed: speedup_vs_deepspeed {plan['speedup_vs_deepspeed']}")
    return sorted(counts.elements())


def check_scheduler_container() -> dict[str, float]:
    """Run the scheduler image, wait for healthy, plan through the published port; seconds to ready / healthy."""
    port = free_port()
    run(DOCKER, "rm", "-f", CONTAINER, check=False)
    started = time.monotonic()
    run(DOCKER, "run", "-d", "--name", CONTAINER, "-p", f"127.0.0.1:{port}:8000", SCHEDULER_IMAGE)
    try:
        ready_s: float | None = None
        health = "starting"
        while ready_s is None or health != "healthy":
            elapsed_s = time.monotonic() - started
            if ready_s is None and http_ok(f"http://127.0.0.1:{port}/readyz"):
                ready_s = elapsed_s
            health = run(DOCKER, "inspect", "-f", "{{.State.Health.Status}}", CONTAINER).stdout.strip()
            if health == "unhealthy" or elapsed_s > 120:
                raise SystemExit(f"scheduler container is {health} after {elapsed_s:.0f} s:\n"
                                 + run(DOCKER, "logs", CONTAINER, check=False).stderr[-4000:])
            time.sleep(0.2)
        healthy_s = time.monotonic() - started
        status, body = http("POST", f"http://127.0.0.1:{port}/plan", BATCH)
        assert status == 200, f"POST /plan answered {status}: {body}"
        plan = json.loads(body)
        scheduled = check_plan(plan, BATCH)
        status, page = http("GET", f"http://127.0.0.1:{port}/")
        assert status == 200 and "/static/viewer.js" in page, "the plan viewer is not in the image"
        assert http("GET", f"http://127.0.0.1:{port}/static/viewer.js")[0] == 200
        print(f"scheduler container: /readyz after {ready_s:.1f} s, Docker healthy after {healthy_s:.1f} s; "
              f"planned {len(scheduled)} sequences in {plan['solve_time_ms']:.1f} ms, "
              f"estimated speedup {plan['speedup_vs_deepspeed']:.2f}x over deepspeed")
        return {"ready_s": ready_s, "healthy_s": healthy_s}
    finally:
        run(DOCKER, "rm", "-f", CONTAINER, check=False)


def http_ok(url: str) -> bool:
    try:
        return http("GET", url)[0] == 200
    except OSError:  # not listening yet
        return False


def check_compose_demo() -> float:
    """The compose demo to completion; its trainer's losses and plan sources. Returns its wall time."""
    env = {"SKRULL_HOST_PORT": str(free_port())}  # not 8000: a `make serve` may hold it
    compose = [*COMPOSE, "-p", PROJECT, "-f", str(ROOT / "docker-compose.yml")]
    started = time.monotonic()
    try:
        up = run(*compose, "up", "--no-build", "--abort-on-container-exit", "--exit-code-from", "trainer",
                 check=False, env=env)
        wall_s = time.monotonic() - started
        logs = run(*compose, "logs", "--no-color", "trainer", check=False, env=env).stdout
        if up.returncode != 0:
            raise SystemExit(f"compose demo failed (exit {up.returncode}):\n{up.stdout[-3000:]}\n{up.stderr[-3000:]}")
        steps = re.findall(r"step\s+(\d+) loss (\S+) plan (\w+)", logs)
        assert len(steps) == TRAINER_STEPS, f"expected {TRAINER_STEPS} steps in the trainer's log:\n{logs[-3000:]}"
        losses = [float(loss) for _, loss, _ in steps]
        assert all(math.isfinite(loss) for loss in losses), losses
        sources = {source for _, _, source in steps}
        assert sources == {"service"}, f"plans came from {sources}, not only the service"
        print(f"compose demo: {len(steps)} steps in {wall_s:.0f} s, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
              "every plan from the scheduler service")
        return wall_s
    finally:
        run(*compose, "down", "--volumes", "--remove-orphans", check=False, env=env)


def main() -> int:
    for tool in (DOCKER, COMPOSE[0]):
        if shutil.which(tool) is None:
            print(f"docker-smoke needs {tool} (Debian: apt-get install docker.io docker-compose debootstrap)",
                  file=sys.stderr)
            return 2
    with docker_engine():
        build_s = build_images()
        sizes = {image: image_size_mb(image) for image in (SCHEDULER_IMAGE, TRAINER_IMAGE)}
        check_image_contents()
        container = check_scheduler_container()
        compose_s = check_compose_demo()
    images = ", ".join(f"{image} {mb:.0f} MB" for image, mb in sizes.items())
    print(f"docker-smoke passed: build {build_s:.0f} s; {images}; scheduler ready {container['ready_s']:.1f} s "
          f"(healthy {container['healthy_s']:.1f} s); compose demo {compose_s:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
