"""The layers stay apart: the planning core imports no framework, the contract no runtime, the runtime no web
framework, the trainer nothing of the service but the core and the contract, and the service (every module of
it) never the trainer: what reads data sets, tokenizers and checkpoints is the trainer's.

Each check imports every module of its layer in a fresh interpreter and lists the forbidden packages (or
subpackages) that came with them, so an import added anywhere in the layer (or anything it imports) fails here.
"""

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import scheduler_service
import scheduler_service.contract
import scheduler_service.core
import scheduler_service.runtime
import trainer_client


def _modules(package: ModuleType) -> list[str]:
    """The package and every module in it."""
    found = pkgutil.walk_packages(package.__path__, package.__name__ + ".")
    return [package.__name__, *(info.name for info in found)]


def _forbidden_imports(modules: list[str], forbidden: set[str]) -> list[str]:
    """Which of ``forbidden`` (packages, or subpackages such as ``scheduler_service.web``) importing ``modules``
    loads."""
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "import json\n"
        f"print(json.dumps(sorted(f for f in {forbidden!r} if any(m == f or m.startswith(f + '.') "
        "for m in sys.modules))))"
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


def test_the_contract_imports_neither_the_runtime_nor_a_web_framework() -> None:
    forbidden = {"scheduler_service.runtime", "scheduler_service.web", "fastapi", "starlette", "uvicorn", "torch",
                 "trainer_client"}
    modules = _modules(scheduler_service.contract)
    assert {"scheduler_service.contract.wire", "scheduler_service.contract.profiles",
            "scheduler_service.contract.advice"} <= set(modules)
    assert _forbidden_imports(modules, forbidden) == []


def test_the_runtime_imports_no_web_framework() -> None:
    forbidden = {"fastapi", "starlette", "uvicorn", "prometheus_client", "torch"}
    modules = _modules(scheduler_service.runtime)
    assert "scheduler_service.runtime.service" in modules and "scheduler_service.runtime.pools" in modules
    assert _forbidden_imports(modules, forbidden) == []


def test_the_trainer_and_the_gpu_check_need_nothing_of_the_service() -> None:
    """A GPU machine has the trainer's dependencies, not the service's: ``make gpu-check`` runs on its Python. And
    the trainer stands on the planning core and the contract, never on the service's runtime or web layers."""
    modules = [*(name for name in _modules(trainer_client) if not name.endswith(".__main__")),  # __main__ runs
               "benchmarks.accuracy", "benchmarks.gpu_check"]
    forbidden = {"fastapi", "starlette", "uvicorn", "ortools", "redis", "prometheus_client", "pydantic_settings",
                 "orjson", "matplotlib", "scheduler_service.runtime", "scheduler_service.web"}
    assert _forbidden_imports(modules, forbidden) == []


def test_the_service_never_imports_the_trainer() -> None:
    """Every module of ``scheduler_service`` (web, runtime, CLI and export included): the service image has no
    torch, and the advisor's data-set and checkpoint readers live in ``trainer_client.advise.inputs``."""
    modules = [name for name in _modules(scheduler_service) if not name.endswith(".__main__")]  # __main__ runs
    assert {"scheduler_service.cli", "scheduler_service.runtime.advising", "scheduler_service.web.routes.advise",
            "scheduler_service.contract.advice", "scheduler_service.core.advise"} <= set(modules)
    forbidden = {"trainer_client", "torch", "transformers", "datasets"}
    assert _forbidden_imports(modules, forbidden) == []
    # Nor lazily: an import inside a function loads nothing above, so every import statement is read as well.
    sources = sorted(Path(scheduler_service.__file__).parent.rglob("*.py"))
    assert [f"{path}: {name}" for path in sources for name in _imported_packages(path) if name in forbidden] == []


def _imported_packages(path: Path) -> set[str]:
    """The top-level packages ``path`` imports absolutely, at any depth (functions included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.partition(".")[0])
    return names


def test_importing_one_module_of_the_core_loads_that_module_alone() -> None:
    code = ("import json, sys\nimport scheduler_service.core.errors\n"
            "print(json.dumps(sorted(m for m in sys.modules if m == 'numba' or m.startswith('scheduler_service.core.')"
            ")))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                       text=True).stdout)
    assert loaded == ["scheduler_service.core.errors"]


def test_every_name_the_core_exports_is_the_one_its_module_defines() -> None:
    import importlib

    for name in scheduler_service.core.__all__:
        value = getattr(scheduler_service.core, name)
        assert any(getattr(importlib.import_module(module), name, None) is value
                   for module in _modules(scheduler_service.core) if module != "scheduler_service.core"), name


def test_the_trainers_configuration_is_its_bottom_layer() -> None:
    """The trainer's configuration (``config``, its flags and its file, so ``--help`` and a config file's checks)
    loads no torch, transformers, numpy or numba, no HTTP client, not the wire models, and of the trainer only the
    names it is declared with; nor does checking a LoRA run's settings."""
    code = ("import json, sys\nimport trainer_client.config, trainer_client.config_file, trainer_client.flags\n"
            "trainer_client.config.TrainConfig(dp=1, cp=1, lora_rank=8, lora_targets='q_proj,v_proj')\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('trainer_client.') "
            "or m.partition('.')[0] in {'torch', 'transformers', 'numpy', 'numba', 'httpx', 'skrull_proto'})))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                       text=True).stdout)
    assert loaded == ["trainer_client.config", "trainer_client.config_choices", "trainer_client.config_file",
                      "trainer_client.flags", "trainer_client.foreign_keys"]
