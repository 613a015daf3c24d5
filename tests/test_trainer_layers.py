"""The trainer's sub-packages stand on each other in one order (docs/development.md, "Where code goes"): a
module imports, when it is loaded, only modules of its own layer or of a layer below. Lazy imports inside functions
(the configuration checks ``--compile`` against the parallelizer only when a config asks for it) and imports for the
type checker alone are not loads; what importing the configuration loads is checked in a fresh interpreter
(``tests/test_core_purity.py``: no torch, nothing of the trainer but its names).

Every module of ``trainer_client`` has a layer, so a new module is placed on purpose. A layer is a list of folders
and top-level modules, never of one module inside a folder: a folder stands on one layer as a whole.
"""

from __future__ import annotations

import ast
import pkgutil
from pathlib import Path

import trainer_client

# Bottom first: the folders (sub-packages) and top-level modules of each layer.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("configuration", ("config_choices", "foreign_keys", "config", "config_file", "flags")),
    ("processes and plans", ("distributed", "planning", "hub")),
    ("data and DACP", ("data", "dacp")),
    ("models", ("models",)),
    ("components, profiler, advisor", ("components", "profiler", "advise")),
    ("loops and commands", ("loop", "trainer", "train", "demo", "profile", "export", "hf", "chat_tokenizer",
                            "cli_reference")),
)


def _modules() -> list[str]:
    found = pkgutil.walk_packages(trainer_client.__path__, "trainer_client.")
    return [info.name for info in found]


def _layer(module: str) -> int:
    """The index of the layer of ``module`` (``trainer_client.X.Y``): that of its folder or top-level module ``X``."""
    top = module.removeprefix("trainer_client.").partition(".")[0]
    for index, (_, names) in enumerate(LAYERS):
        if top in names:
            return index
    raise AssertionError(f"{module} is in no layer of LAYERS: place {top}")


def _loaded_imports(path: Path, module: str) -> set[str]:
    """The ``trainer_client`` modules ``path`` imports when it is loaded: module-level statements (in ``try`` and
    plain ``if`` blocks too), not function bodies and not ``if TYPE_CHECKING:``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    imported: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, one level up per dot after the first
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                imported.add(base)
                imported.update(f"{base}.{alias.name}" for alias in node.names)  # a submodule imported by name
            elif isinstance(node, ast.If):
                if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                    visit(node.body)
                    visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(ast.parse(path.read_text(), filename=str(path)).body)
    modules = set(_modules()) | {"trainer_client"}
    return {name for name in imported if name in modules and name != "trainer_client"}


def test_every_trainer_module_has_a_layer() -> None:
    modules = _modules()
    assert {"trainer_client.config", "trainer_client.models.model", "trainer_client.planning.source",
            "trainer_client.profiler.auto", "trainer_client.advise.command"} <= set(modules)
    for module in modules:
        _layer(module)
    tops = {module.split(".")[1] for module in modules}
    listed = [name for _, names in LAYERS for name in names]
    assert sorted(listed) == sorted(tops)  # folders and top-level modules, each once, none missing


def test_a_trainer_module_loads_nothing_of_a_layer_above_its_own() -> None:
    root = Path(trainer_client.__file__).parent
    upward = []
    for module in _modules():
        relative = Path(*module.split(".")[1:])
        path = root / relative / "__init__.py" if (root / relative).is_dir() else root / relative.with_suffix(".py")
        for imported in sorted(_loaded_imports(path, module)):
            if _layer(imported) > _layer(module):
                upward.append(f"{module} ({LAYERS[_layer(module)][0]}) imports {imported} "
                              f"({LAYERS[_layer(imported)][0]})")
    assert upward == []


def test_the_layer_check_sees_an_upward_import(tmp_path: Path) -> None:
    source = tmp_path / "config_choices.py"
    source.write_text("from trainer_client.trainer import Trainer\nif TYPE_CHECKING:\n    import trainer_client.loop\n"
                      "def later():\n    import trainer_client.demo\n")
    assert _loaded_imports(source, "trainer_client.config_choices") == {"trainer_client.trainer"}


def test_a_package_init_lists_names_and_holds_no_logic() -> None:
    """A reader who opens a folder sees its modules: a package's ``__init__.py`` re-exports their names (or resolves
    them lazily, as ``trainer_client``'s does) and holds no more than that."""
    root = Path(trainer_client.__file__).parent
    long = {str(path.relative_to(root)): num_lines for path in root.rglob("__init__.py")
            if (num_lines := len(path.read_text().splitlines())) > 150}
    assert long == {}


def test_no_module_of_the_trainer_or_the_service_is_over_650_lines() -> None:
    """A module a reader can hold in mind: one concept each; a longer one is split by concept
    (``dacp.kernels`` beside ``dacp.attention``, ``core.fitting`` beside ``core.perf_model``)."""
    repository = Path(trainer_client.__file__).parent.parent
    long = {str(path.relative_to(repository)): num_lines
            for package in ("trainer_client", "scheduler_service") for path in (repository / package).rglob("*.py")
            if (num_lines := len(path.read_text().splitlines())) > 650}
    assert long == {}


def test_a_file_name_says_which_file_it_is() -> None:
    """No two modules of the trainer share a name, nor a module of the trainer and one of the planning core, so that
    a docstring or a traceback naming ``export.py`` names one file. The exceptions are the two commands'
    ``command.py``, told apart by their folders (``profiler/``, ``advise/``), and ``profile.py``, which keeps the
    documented ``python -m trainer_client.profile``."""
    repository = Path(trainer_client.__file__).parent.parent
    allowed = {"__init__.py", "__main__.py", "command.py", "profile.py"}
    trainer = [path.name for path in (repository / "trainer_client").rglob("*.py") if path.name not in allowed]
    core = {path.name for path in (repository / "scheduler_service" / "core").glob("*.py")} - allowed
    repeated = sorted({name for name in trainer if trainer.count(name) > 1} | (set(trainer) & core))
    assert repeated == []


def test_every_name_a_package_lists_resolves() -> None:
    """A package's ``__all__`` is where users import from (``from trainer_client import varlen_causal_attn_func``):
    every name it lists resolves, the lazily resolved ones too, after a module of theirs moved or was split."""
    import importlib

    packages = ["trainer_client", *(info.name for info in pkgutil.walk_packages(trainer_client.__path__,
                                                                                 "trainer_client.") if info.ispkg)]
    missing = [f"{package}.{name}" for package in packages
               for name in getattr(importlib.import_module(package), "__all__", ())
               if not hasattr(importlib.import_module(package), name)]
    assert missing == []
