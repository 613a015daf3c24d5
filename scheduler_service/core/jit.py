"""The planning core's compiled kernels: numba's ``njit``, configured in one place.

The search's inner loops (``costing``, ``dacp_search``, ``gds_search``, ``plan_refine``) are plain scalar loops
over typed arrays, decorated with ``kernel``:

* **Cached.** Compiled code is kept on disk, in ``SKRULL_JIT_CACHE_DIR`` when it is set, else in numba's own
  ``NUMBA_CACHE_DIR``, else in ``$XDG_CACHE_HOME/skrull/numba`` (``~/.cache/skrull/numba``), else, where that
  cannot be written (a read-only home in a container), under the temporary folder. Numba itself would fall back on
  ``__pycache__`` beside the source, which an installed package cannot write, and refuse at import where nothing is
  writable; the folder is chosen before any kernel is decorated. Numba keys a kernel's cache on its own source
  file only, and a kernel carries the code of the kernels it calls from other files: so the cache lives in a
  subfolder named after a digest of every source file of the core, and a change anywhere in the core compiles
  afresh. Numba's key also holds the CPU name and its features: an image baked with ``NUMBA_CPU_NAME=generic``
  serves any x86-64 machine that runs with it set too.
* **Deterministic.** No ``fastmath`` and no ``parallel``: a plan is the same bit for bit on every run, and the
  same as the plain Python's.
* **Plain Python on request.** ``NUMBA_DISABLE_JIT=1`` (set before this module is imported) makes every kernel
  the Python function it is written as: the reference the tests compare the compiled kernels with.
* **GIL-free.** ``nogil``: a long plan never stalls an event loop or a worker's health ping in the same process.

Kernels compile at their first call (a few seconds for the whole core with a cold cache, a fraction of one with a
warm cache); ``planner.warm_up`` makes that call at start-up, where the service and the trainer can wait for it.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

__all__ = ["BOOL_1D", "CACHE_DIR_VARIABLE", "FLOAT_1D", "FLOAT_2D", "FLOAT_3D", "INT_1D", "INT_2D", "JIT_DISABLED",
           "cache_dir", "kernel"]

CACHE_DIR_VARIABLE = "SKRULL_JIT_CACHE_DIR"
Function = TypeVar("Function", bound=Callable[..., Any])


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK | os.X_OK)


def _choose_cache_dir() -> Path:
    for variable in (CACHE_DIR_VARIABLE, "NUMBA_CACHE_DIR"):
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser()
    user_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "skrull" / "numba"
    if _writable(user_cache):
        return user_cache
    return Path(tempfile.gettempdir()) / f"skrull-numba-{os.getuid()}"


def _sources_digest() -> str:
    """A digest of every source file of the planning core."""
    digest = hashlib.sha256()
    for source in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:16]


_CACHE_DIR = _choose_cache_dir() / f"core-{_sources_digest()}"
if not _writable(_CACHE_DIR):
    raise RuntimeError(f"the JIT cache folder {_CACHE_DIR} cannot be written: set {CACHE_DIR_VARIABLE} to a "
                       "writable folder")

import numba  # noqa: E402  (the cache folder must be chosen before any kernel is decorated)
from numba import types  # noqa: E402
from numba.core.registry import CPUDispatcher  # noqa: E402

_numba_config: Any = numba.config  # set at import from the environment: mypy cannot see its attributes
_numba_config.CACHE_DIR = str(_CACHE_DIR)
JIT_DISABLED = bool(_numba_config.DISABLE_JIT)
# The array types of kernel signatures: contiguous, as the boundary makes every array
INT_1D = types.int64[::1]
INT_2D = types.int64[:, ::1]
FLOAT_1D = types.float64[::1]
FLOAT_2D = types.float64[:, ::1]
FLOAT_3D = types.float64[:, :, ::1]
BOOL_1D = types.boolean[::1]


def cache_dir() -> Path:
    """Where compiled kernels are cached (a subfolder of the configured folder, named for this core's sources)."""
    return _CACHE_DIR


class _Kernel(CPUDispatcher):
    """A numba dispatcher with one declared signature, compiled (or loaded from the cache) at its first use: called
    from Python, or typed as the callee of a kernel being compiled. Numba would otherwise compile a kernel once
    per combination of constant arguments a caller passes it (``Literal[int](1)``, ``Literal[int](-1)``, …); with
    one signature, constants convert to it. Compiling at first use rather than at import keeps a process that
    plans with one scheduler from loading the others' code."""

    declared: Any  # the signature
    _can_compile: bool  # the dispatcher's: whether a call may compile a new specialisation

    def _compile_declared(self) -> None:
        if self._can_compile:
            self.compile(self.declared)
            self.disable_compile()

    def get_call_template(self, args: Any, kws: Any) -> Any:
        self._compile_declared()
        return super().get_call_template(args, kws)

    def _compile_for_args(self, *args: Any, **kws: Any) -> Any:
        self._compile_declared()
        argument_types = tuple(self.typeof_pyval(argument) for argument in args)
        compiled = self.overloads.get(argument_types)
        if compiled is None:
            raise TypeError(f"kernel {self.py_func.__qualname__} takes {self.declared}; called with "
                            f"({', '.join(map(str, argument_types))})")
        return compiled.entry_point  # type: ignore[attr-defined]


def kernel(signature: Any, *, inline: bool = False) -> Callable[[Function], Function]:
    """Compile the decorated function for ``signature`` at its first use (cached, deterministic, GIL-free); the
    function itself under ``NUMBA_DISABLE_JIT=1``."""
    def compile_kernel(function: Function) -> Function:
        if JIT_DISABLED:
            return function
        compiled = _Kernel(py_func=function, locals={}, targetoptions={
            "nopython": True, "nogil": True, "inline": "always" if inline else "never"})
        compiled.declared = signature
        compiled.enable_caching()
        return cast(Function, compiled)

    return compile_kernel
