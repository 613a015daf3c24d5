"""The command lines read well: ``skrull-train --help`` in named groups of at most 15 flags, each flag's help one
or two lines on an 80-column terminal, ``--data`` naming every shape of record it reads, one account of the default
job id; no command's help holds markup; and ``docs/reference/cli.md`` is what the commands' parsers say, for every
command ``pyproject.toml`` installs."""

from __future__ import annotations

import argparse
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler_service.core.samplers import DATASETS
from trainer_client.cli_reference import COMMANDS, REFERENCE, REGENERATE, Command, reference_page
from trainer_client.config import TrainConfig
from trainer_client.config_choices import SYNTHETIC_DATASETS
from trainer_client.flags import GROUPS
from trainer_client.train import build_parser

ROOT = Path(__file__).resolve().parents[1]
MAX_FLAGS_PER_GROUP = 15
# The keys the record encoder tells records apart by (trainer_client.data.RecordEncoder.encode), and text's default.
RECORD_KEYS = ("input_ids", "messages", "conversations", "prompt", "completion", "text")
SOURCES = ("JSONL", "parquet", "CSV", "JSON", "dataset folder", "Hub data set", "synthetic:")


def _train_help(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps to the terminal's width, and a test has none
    return build_parser().format_help()


def _sections(help_text: str) -> dict[str, list[str]]:
    """Each group's title → its flags' lines, as printed after the usage and the description: the group's own
    description, where it has one, is the paragraph before its flags, which no blank line separates."""
    sections: dict[str, list[str]] = {}
    for block in re.split(r"\n(?=\S[^\n]*:\n)", help_text.split("\n\n", 2)[2]):
        title, _, body = block.partition(":\n")
        sections[title] = body.strip("\n").split("\n\n")[-1].splitlines()
    return sections


def _flags(lines: list[str]) -> dict[str, int]:
    """Each flag of a group's lines → the lines its help takes: on the flag's own line where it fits there (after
    two spaces or more), and on the lines indented under it."""
    flags: dict[str, int] = {}
    for line in lines:
        entry = re.match(r"^  (-\S.*?)(?: {2,}\S.*)?$", line)
        if entry:
            flag = entry[1]
            flags[flag] = 0 if line.rstrip() == f"  {flag}" else 1
        else:
            assert line.startswith(" " * 4), line
            flags[flag] += 1
    return flags


def test_every_train_flag_is_in_a_named_group_of_at_most_15(monkeypatch: pytest.MonkeyPatch) -> None:
    sections = _sections(_train_help(monkeypatch))
    assert list(sections) == ["options", *GROUPS]
    counts = {title: len(_flags(lines)) for title, lines in sections.items()}
    assert counts["options"] == 2  # argparse's --help, and --config: no field's flag
    assert max(counts.values()) <= MAX_FLAGS_PER_GROUP, counts
    fields = [name for group in GROUPS.values() for name in group.fields]
    assert sorted(fields) == sorted(TrainConfig.model_fields)  # each field in one group, none twice


def test_every_train_flag_help_takes_one_or_two_lines_at_80_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    sections = _sections(_train_help(monkeypatch))
    lines = {flag: count for section in sections.values() for flag, count in _flags(section).items()}
    assert len(lines) == 2 + len(TrainConfig.model_fields)
    assert {flag: count for flag, count in lines.items() if not 1 <= count <= 2} == {}


def test_the_data_flag_names_every_shape_it_reads_and_its_group_every_source(monkeypatch: pytest.MonkeyPatch) -> None:
    text = " ".join(_train_help(monkeypatch).split())
    data_help = TrainConfig.model_fields["data"].description or ""
    assert [key for key in RECORD_KEYS if key not in data_help] == []
    assert [source for source in SOURCES if source not in GROUPS["data"].description] == []
    assert f"data: {GROUPS['data'].description} --data DATA {data_help}" in text  # the sources just above --data


def test_the_help_lists_every_synthetic_sampler_without_loading_them() -> None:
    assert tuple(DATASETS) == SYNTHETIC_DATASETS  # --help names them from choices, which loads no numpy
    assert f"synthetic:NAME ({', '.join(DATASETS)})" in GROUPS["data"].description


def test_the_logging_dir_and_the_job_id_tell_the_same_default_job_id() -> None:
    job_id = TrainConfig.model_fields["job_id"].description or ""
    logging_dir = TrainConfig.model_fields["logging_dir"].description or ""
    # the default job id is said once, by --job-id; --logging-dir names it as --job-id says it
    assert "default: --checkpoint-dir's name, else the model's and the data's, and the start time" in job_id
    assert "default: runs/JOB_ID, the job id as --job-id says" in logging_dir


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                yield from _parsers(subparser)


@pytest.mark.parametrize("command", COMMANDS, ids=[command.script for command in COMMANDS])
def test_no_help_text_holds_markup(command: Command) -> None:
    marked = []
    for parser in _parsers(command.parser()):
        texts = [parser.description, parser.epilog, *(group.description for group in parser._action_groups),
                 *(action.help for action in parser._actions)]
        marked += [f"{parser.prog}: {text}" for text in texts if text and "`" in text]
    assert marked == []


def test_every_command_pyproject_installs_is_in_the_reference() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert {command.script: f"{command.module}:main" for command in COMMANDS} == scripts


@pytest.mark.slow
def test_the_reference_page_is_what_the_parsers_say() -> None:
    assert REFERENCE.read_text(encoding="utf-8") == reference_page(), f"{REFERENCE} is stale: run {REGENERATE}"
    # written from the parsers: each command's usage, and each group of the trainer's flags
    page = REFERENCE.read_text()
    assert "usage: python -m trainer_client.train --dp DP --cp CP" in page
    assert all(f"**{title}**" in page for title in GROUPS)
