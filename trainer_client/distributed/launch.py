"""Ranks on this machine without torchrun: ``spawn_ranks`` (gloo on CPU, NCCL on CUDA) and ``spawn_gloo`` start
``world_size`` processes joined in a process group, as torchrun would, for tests and tools; ``free_port`` is where
they meet.
"""

from __future__ import annotations

import functools
import gc
import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch._dynamo  # before any process group exists (mesh.py, "Teardown")
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer_client.config_choices import DEFAULT_COLLECTIVE_TIMEOUT_S

__all__ = ["free_port", "spawn_gloo", "spawn_ranks"]


def free_port() -> int:
    """A free TCP port on loopback (the OS picks; tiny race window, fine for tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _spawned(
    local_rank: int, world_size: int, port: int, device_type: str, fn: Callable[..., None], args: tuple[Any, ...]
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
                      RANK=str(local_rank), LOCAL_RANK=str(local_rank))
    timeout = timedelta(seconds=DEFAULT_COLLECTIVE_TIMEOUT_S)
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=local_rank, world_size=world_size, timeout=timeout, device_id=device)
    else:
        torch.set_num_threads(1)  # several ranks share few cores; oversubscription only slows every rank down
        dist.init_process_group("gloo", rank=local_rank, world_size=world_size, timeout=timeout)
    try:
        fn(*args)
    finally:
        dist.destroy_process_group()


def spawn_ranks(fn: Callable[..., None], world_size: int, *args: Any, device_type: str = "cpu") -> None:
    """Run ``fn(*args)`` on ``world_size`` processes of this machine joined in a process group, as torchrun would:
    gloo on CPU (one thread each), NCCL on CUDA (one GPU each). Re-raises a rank's exception.

    CPU ranks are forked, as torch's own multi-process tests do: a forked rank starts with what this process has
    imported (torch, transformers, the compiled kernels), where a fresh interpreter pays 4-5 s of imports per rank,
    most of a small run. This process's objects are frozen out of the garbage collector from the fork until the
    ranks end (``gc.freeze``): a child never finalises what it inherited, such as a pool whose threads did not come
    with the fork (a child's collection of torch.compile's inherited state crashed it). CUDA ranks are spawned, and
    so are CPU ranks of a process that has initialised CUDA: CUDA cannot be used in a child forked after that.
    """
    spawn = functools.partial(mp.start_processes, _spawned, args=(world_size, free_port(), device_type, fn, args),
                              nprocs=world_size, join=True)
    if device_type == "cuda" or torch.cuda.is_initialized():
        spawn(start_method="spawn")
        return
    gc.collect()
    gc.freeze()
    try:
        spawn(start_method="fork")
    finally:
        gc.unfreeze()


def spawn_gloo(fn: Callable[..., None], world_size: int, *args: Any) -> None:
    """Run ``fn(*args)`` on ``world_size`` CPU processes joined in a gloo group; re-raises a rank's exception."""
    spawn_ranks(fn, world_size, *args, device_type="cpu")
