"""The config file (``--config run.yaml``, or ``.toml`` / ``.json``), and the flags given over it.

A config file is a mapping of ``TrainConfig`` field names to values, each key once (``read_config_file``). A flag given
on the command line overrides the file's key, and, for ``--steps``/``--epochs``, the file's choice of the other
(``load_config``). The file may name settings as TRL, transformers or axolotl do (``foreign_keys.py``).

A value the model refuses is named by its key in the file (``run.yaml: lora_rank: must be positive, got 0``), where
the file gave it; a file that cannot be read or parsed, or that gives a key twice, is named with the line where the
parser says. PyYAML is imported only for a YAML file.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainer_client.config import FLAGS, ConfigError, Origin, TrainConfig
from trainer_client.foreign_keys import translate

__all__ = ["CONFIG_SUFFIXES", "load_config", "read_config_file"]

CONFIG_SUFFIXES = (".yaml", ".yml", ".toml", ".json")


def read_config_file(path: Path) -> dict[str, object]:
    """The settings ``path`` holds: a mapping of ``TrainConfig`` field names to values, in YAML (``.yaml``,
    ``.yml``), TOML or JSON by its suffix; an empty file holds none. A file that cannot be read or parsed, or that
    gives a key twice (YAML and JSON parsers would keep the last silently), is a ``ValueError`` naming it (and the
    line, where the parser says)."""
    if path.suffix.lower() not in CONFIG_SUFFIXES:
        raise ValueError(f"--config {path}: a config file is YAML, TOML or JSON, named {', '.join(CONFIG_SUFFIXES)}")
    try:
        text = path.read_text()
    except OSError as error:
        raise ValueError(f"--config {path}: {error.strerror or error}") from None
    values = _parse(path, text)
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(f"{path}: holds a {type(values).__name__}, not a mapping of settings to values")
    return {str(key): value for key, value in values.items()}


class _DuplicateKey(ValueError):
    """A JSON object gave a key twice."""


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A JSON object that gives each key once."""
    seen: dict[str, object] = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(f"duplicate key {key!r}")
        seen[key] = value
    return seen


_TOML_LINE = re.compile(r"\(at line (\d+), column \d+\)$")


def _parse(path: Path, text: str) -> object:
    suffix = path.suffix.lower()
    if suffix == ".json":
        try:
            return json.loads(text, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{error.lineno}:{error.colno}: {error.msg}") from None
        except _DuplicateKey as error:
            raise ValueError(f"{path}: {error}") from None
    if suffix == ".toml":
        try:
            return tomllib.loads(text)  # refuses a key given twice: "Cannot overwrite a value"
        except tomllib.TOMLDecodeError as error:
            # tomllib names the line of a key given twice ("Cannot overwrite a value"), not the key: its text does
            found = _TOML_LINE.search(str(error))
            lines = text.splitlines()
            line = lines[int(found[1]) - 1].strip() if found and int(found[1]) <= len(lines) else ""
            raise ValueError(f"{path}: {error}" + (f": {line}" if line else "")) from None
    try:
        import yaml  # only a YAML config needs PyYAML
    except ImportError:
        raise ValueError(f"--config {path}: reading YAML needs PyYAML (pip install pyyaml); or give the settings as "
                         ".toml or .json") from None
    try:
        return yaml.load(text, Loader=_unique_key_loader())  # a SafeLoader
    except yaml.MarkedYAMLError as error:
        where = f":{error.problem_mark.line + 1}:{error.problem_mark.column + 1}" if error.problem_mark else ""
        raise ValueError(f"{path}{where}: {error.problem or error.context}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: {error}") from None


def _unique_key_loader() -> type:
    """PyYAML's ``SafeLoader``, refusing a mapping that gives a key twice (``SafeLoader`` keeps the last). A key a
    merge (``<<: *base``) brings in may be given again: that is what a merge is for."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            seen = set()
            for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():  # else SafeLoader refuses it
                if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                    key = self.construct_object(key_node, deep=deep)
                    if key in seen:
                        raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}",
                                                                key_node.start_mark)
                    seen.add(key)
            mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
            return mapping

    return UniqueKeyLoader


def load_config(flags: Mapping[str, object], *, config_file: Path | None = None) -> TrainConfig:
    """The run ``config_file`` describes with ``flags`` (field name → value, those given on the command line)
    over it. A flag of an exclusive set (``--steps``, ``--epochs``) replaces the file's choice of the other. The
    file may name settings as TRL, transformers or axolotl do (``foreign_keys.py``): an alias is read as its Skrull
    key, and a setting Skrull has not is refused, each with why and what replaces it, one line each."""
    written = read_config_file(config_file) if config_file is not None else {}
    from_file, spelled, refusals = translate(written, context={**written, **flags})
    chosen = {flag.exclusive for name in flags if (flag := FLAGS.get(name)) is not None} - {None}
    kept = {key: value for key, value in from_file.items()
            if key not in flags and (key not in FLAGS or FLAGS[key].exclusive not in chosen)}
    problems = [f"{config_file}: {refusal}" for refusal in refusals]
    try:
        config = TrainConfig(**{**kept, **flags})
    except ConfigError as error:
        described = error.given_in(Origin(path=config_file, keys=frozenset(kept), spelled=spelled))
        if not problems:
            raise described from None
        problems += described.lines
    if problems:  # every problem of the file at once, a line each
        raise ValueError("\n".join(problems))
    return config

