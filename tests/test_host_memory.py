"""A CPU rank keeps the memory its micro-batches free (``trainer_client.distributed.host_memory``), so that
micro-batches of ever different sizes stop faulting fresh pages in, as the profile's repeated ones never did."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trainer_client.distributed.host_memory import retain_freed_memory

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="glibc's mallopt and mallinfo2, Linux's page-fault count"
)

# Blocks of different sizes, each freed before the next, as a rank's micro-batches free theirs; run in a fresh
# process (the setting is per process), "retain" or "plain" as its argument.
_SIZES_MIB = "(3, 9, 5, 17, 2, 12, 7)"

# glibc's own account, per block: whether it was mapped on its own (mallinfo2's hblks grew), and whether freeing it
# shrank the heap (its arena).
_ACCOUNT = f"""
import ctypes, json, sys, torch
from trainer_client.distributed.host_memory import retain_freed_memory
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]
mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MallInfo2
if sys.argv[1] == "retain":
    assert retain_freed_memory()
accounts = []
for mib in {_SIZES_MIB}:
    before = mallinfo2()
    block = torch.ones(mib << 18)  # mib MiB of float32
    held = mallinfo2()
    del block
    freed = mallinfo2()
    accounts.append({{"mapped_alone": held.hblks > before.hblks, "heap_shrank": freed.arena < held.arena}})
print(json.dumps(accounts))
"""

# The page faults of each pass over the blocks, every page written.
_PASSES = f"""
import json, resource, sys, torch
from trainer_client.distributed.host_memory import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory()
def faults_of_one_pass():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for mib in {_SIZES_MIB}:
        block = torch.ones(mib << 18)
        del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps([faults_of_one_pass() for _ in range(4)]))
"""


def _run(script: str, mode: str) -> list:
    result = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, check=True)
    return json.loads(result.stdout)


def test_the_setting_is_made_once_per_process() -> None:
    assert retain_freed_memory() is retain_freed_memory()


def test_freed_blocks_stay_in_the_heap_where_plain_glibc_maps_and_unmaps_them() -> None:
    try:
        plain, retained = _run(_ACCOUNT, "plain"), _run(_ACCOUNT, "retain")
    except subprocess.CalledProcessError as error:
        if "mallinfo2" in error.stderr:
            pytest.skip("glibc before 2.33 has no mallinfo2")
        raise
    # Plain glibc maps the first large block on its own (its threshold starts at 128 KiB) and unmaps it when freed.
    assert plain[0]["mapped_alone"]
    # Kept: every block up to 32 MiB comes from the heap, and no free shrinks it.
    assert not any(block["mapped_alone"] or block["heap_shrank"] for block in retained), retained


def test_freed_blocks_are_reused_without_faulting_pages_in_again() -> None:
    plain, retained = _run(_PASSES, "plain"), _run(_PASSES, "retain")
    # 17 MiB of blocks: 4,352 pages. Plain glibc maps large blocks afresh until its threshold has grown past them,
    # and faults their pages in again on the second pass.
    assert plain[1] > 1000
    # Kept, they fault in on the first pass. A small object the first passes leave between two freed blocks can make
    # a later block not fit once (the heap then grows by it); from then on nothing faults in.
    assert retained[0] > 1000 and retained[2] < 100 and retained[3] < 100, retained
