"""The layers stay apart: the planning core imports no framework, the runtime no web framework.

Each check imports every module of its layer in a fresh interpreter and lists the forbidden packages that came
with them, so an import added anywhere in the layer (or anything it imports) fails here.
"""

import json
import pkgutil
import subprocess
import sys
from types import ModuleType

import scheduler_service.core
import scheduler_service.runtime


def _modules(package: ModuleType) -> list[str]:
    """The package and every module in it."""
    found = pkgutil.walk_packages(package.__path__, package.__name__ + ".")
    return [package.__name__, *(info.name for info in found)]


def _forbidden_imports(modules: list[str], forbidden: set[str]) -> list[str]:
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "import json\n"
        f"print(json.dumps(sorted({forbidden!r} & {{name.split('.')[0] for name in sys.modules}})))"
    )
    output = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    found: list[str] = json.loads(output)
    return found


def test_the_planning_core_imports_no_framework_or_storage() -> None:
    # cpsat is the one module that imports ortools; the planner imports it only when the cpsat scheduler is asked for
    modules = [name for name in _modules(scheduler_service.core) if name != "scheduler_service.core.cpsat"]
    forbidden = {"fastapi", "starlette", "pydantic", "torch", "ortools", "uvicorn", "httpx", "redis", "sqlite3",
                 "prometheus_client"}
    assert _forbidden_imports(modules, forbidden) == []


def test_the_runtime_imports_no_web_framework() -> None:
    forbidden = {"fastapi", "starlette", "uvicorn", "prometheus_client", "torch"}
    modules = _modules(scheduler_service.runtime)
    assert "scheduler_service.runtime.service" in modules and "scheduler_service.runtime.pools" in modules
    assert _forbidden_imports(modules, forbidden) == []


def test_the_trainer_and_the_gpu_check_need_nothing_of_the_service() -> None:
    """A GPU machine has the trainer's dependencies, not the service's: ``make gpu-check`` runs on its Python."""
    modules = ["trainer_client.train", "trainer_client.profile", "benchmarks.accuracy", "benchmarks.gpu_check"]
    forbidden = {"fastapi", "starlette", "uvicorn", "ortools", "redis", "prometheus_client", "pydantic_settings",
                 "orjson", "matplotlib"}
    assert _forbidden_imports(modules, forbidden) == []
