"""A CPU rank keeps the memory its micro-batches free (``trainer_client.distributed.host_memory``), so that
micro-batches of ever different sizes stop faulting fresh pages in, as the profile's repeated ones never did."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trainer_client.distributed.host_memory import retain_freed_memory

# Micro-batches of different sizes, each freed before the next; the page faults of each pass over them.
_PASSES = """
import json, resource, sys, torch
from trainer_client.distributed.host_memory import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory()
def faults_of_one_pass():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for mib in (3, 9, 5, 17, 2, 12, 7):
        block = torch.ones(mib << 18)  # mib MiB of float32, every page written
        del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps([faults_of_one_pass() for _ in range(3)]))
"""


def _faults_per_pass(mode: str) -> list[int]:
    result = subprocess.run([sys.executable, "-c", _PASSES, mode], capture_output=True, text=True, check=True)
    return json.loads(result.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and Linux's page-fault count")
def test_freed_blocks_are_reused_without_faulting_pages_in_again() -> None:
    assert retain_freed_memory() is retain_freed_memory()  # set once per process
    plain, retained = _faults_per_pass("plain"), _faults_per_pass("retain")
    # 17 MiB of blocks: 4,352 pages. Plain glibc maps large blocks afresh until its threshold has grown past them,
    # and faults their pages in again on the second pass; kept, they fault in once.
    assert plain[1] > 1000
    assert retained[0] > 1000 and retained[1] < 100 and retained[2] < 100
