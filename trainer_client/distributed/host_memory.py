"""Freed host memory kept by the process, as CUDA's caching allocator keeps freed device memory.

On a GPU, torch's caching allocator keeps the blocks a micro-batch frees and hands them to the next one: a step
pays for new memory only while the micro-batches grow. On a CPU, tensors come from the C library's ``malloc``.
glibc returns a large freed block to the operating system (``munmap``, or trimming the heap's top), and the next
micro-batch of another size gets fresh pages, each faulted in and zeroed on first touch. Training runs micro-batches
of ever different sizes, so it paid that again and again: 11,000-41,000 page faults per step of ``make demo`` (tiny
Qwen2, dp 1 × cp 2, 2-4k tokens a rank). The profiler repeats one micro-batch at a time, which glibc's adaptive
threshold soon served from its heap: the profile measured a machine without those faults, and predicted runs low.

``retain_freed_memory`` sets glibc's thresholds once (``mallopt``): blocks up to 32 MiB (glibc's largest
threshold) come from the heap, and the heap is not trimmed, so after its first two steps a run reuses what it
freed (2-3,825 page faults a step in the same run). The process keeps its peak's memory, which it needed anyway at
that peak: what a caching allocator does. Larger blocks are still mapped and unmapped each time. Elsewhere than
glibc (macOS, musl) nothing changes.
"""

from __future__ import annotations

import ctypes
import functools

__all__ = ["retain_freed_memory"]

_M_TRIM_THRESHOLD = -1  # glibc's malloc.h: the heap top's free bytes beyond which free() returns them to the OS
_M_MMAP_THRESHOLD = -3  # blocks at least this large are mapped on their own, and unmapped when freed
_LARGEST_MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: mallopt refuses more
_NEVER_TRIM = 2**31 - 1  # the threshold is a C int


@functools.cache
def retain_freed_memory() -> bool:
    """Keep freed blocks of up to 32 MiB in this process's heap (glibc); whether the C library took the setting.
    Once per process: later calls return the first answer."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):  # no mallopt: not glibc
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _LARGEST_MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM))
