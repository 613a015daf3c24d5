"""The command lines' reference page, ``docs/reference/cli.md``, written from the argparse parsers of the commands
themselves, so that it cannot drift from them.

    python -m trainer_client.cli_reference           # rewrite docs/reference/cli.md
    python -m trainer_client.cli_reference --check   # exit 1 if it differs from the parsers

Each command that ``pyproject.toml`` installs (``COMMANDS``; a test holds the two lists equal) gets a section: its
names, a paragraph on where the guides explain it, its usage, its description, and a table of flags per argument
group, each flag's help as ``--help`` prints it (its default included); a command's subcommands get one each. It is
Markdown, which GitHub shows as it is and the docs site builds (MyST). A test runs the ``--check`` comparison.

It lives in the trainer's package because the trainer may import the service's code and never the reverse, and the
page documents both.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["COMMANDS", "REFERENCE", "Command", "main", "reference_page"]

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "cli.md"
USAGE_COLUMNS = 100  # the usage lines' width: fixed, so that the page does not depend on the terminal that wrote it
REGENERATE = "python -m trainer_client.cli_reference"


@dataclass(frozen=True, kw_only=True, slots=True)
class Command:
    """A command ``pyproject.toml`` installs: ``script`` runs ``module``'s ``main``, whose flags ``module``'s
    ``build_parser`` declares; ``run_as`` is the same command run with ``python -m``."""

    script: str
    module: str
    run_as: str
    about: str  # Markdown: what it is for, and the guide that explains it

    def parser(self) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = importlib.import_module(self.module).build_parser()
        return parser


COMMANDS = (
    Command(script="skrull-plan", module="scheduler_service.cli", run_as="python -m scheduler_service",
            about="The planning service's command line: `plan` answers one request as `POST /plan` does, `serve` "
                  "runs the service ([planning](../guides/planning.md), [the service](../guides/service.md))."),
    Command(script="skrull-advise", module="trainer_client.advise.command", run_as="python -m trainer_client.advise",
            about="Ranks the parallel layouts of N GPUs for a data set ([the layout advisor](../guides/advise.md))."),
    Command(script="skrull-train", module="trainer_client.train", run_as="python -m trainer_client.train",
            about="Started alone, it starts the ranks itself (torchrun's launcher, in its process); under `torchrun` "
                  "every rank parses the same flags ([launching](../guides/training.md#training-with-skrull)). The "
                  "flags are generated from the fields of `trainer_client.config.TrainConfig`; a flag's key in a "
                  "`--config` file is its name with `_` for `-`, or the config key its help names ([config files]"
                  "(../guides/training.md#config-files))."),
    Command(script="skrull-tokenizer", module="trainer_client.chat_tokenizer",
            run_as="python -m trainer_client.chat_tokenizer",
            about="A small chat tokenizer made offline, for chats on the built-in models ([a tokenizer offline]"
                  "(../guides/training.md#a-tokenizer-offline))."),
    Command(script="skrull-export", module="trainer_client.components.model_export",
            run_as="python -m trainer_client.export",
            about="See [exporting the model](../guides/training.md#exporting-the-model)."),
    Command(script="skrull-profile", module="trainer_client.profiler.command",
            run_as="python -m trainer_client.profile",
            about="Measures this machine's performance model ([profiles and feedback]"
                  "(../concepts/profiles-and-feedback.md))."),
    Command(script="skrull-demo", module="trainer_client.demo", run_as="python -m trainer_client.demo",
            about="The end-to-end demo that `make demo` runs: the service plans, CPU ranks train, Skrull against "
                  "DeepSpeed."),
)


def _escaped(text: str) -> str:
    """``text`` as plain text in a Markdown table cell: no character of it read as markup, no ``|`` as a column."""
    for character in "\\`*<>|":
        text = text.replace(character, "\\" + character)
    return text


def _invocation(action: argparse.Action) -> str:
    """The flag as ``--help`` names it, each spelling in code: ``--dp DP``, ``--resume``, ``--no-resume``."""
    if action.metavar is not None:
        value = action.metavar if isinstance(action.metavar, str) else " ".join(action.metavar)
    elif action.choices is not None:
        value = "{" + ",".join(map(str, action.choices)) + "}"
    else:
        value = action.dest.upper() if action.option_strings else action.dest
    if not action.option_strings:  # a positional argument is named alone, whatever its number
        return f"`{value}`"
    if action.nargs == "+":
        value = f"{value} [{value} ...]"
    elif action.nargs in ("?", "*"):
        value = f"[{value}]" if action.nargs == "?" else f"[{value} ...]"
    if action.nargs == 0:
        return ", ".join(f"`{option}`" for option in action.option_strings)
    return ", ".join(f"`{option} {value}`" for option in action.option_strings)


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(prog=parser.prog, width=USAGE_COLUMNS)  # the formatter classes differ in help
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def _parser_section(parser: argparse.ArgumentParser, *, level: int, title: str, about: str) -> Iterator[str]:
    """The section of one parser, and one per subcommand after it."""
    yield f"{'#' * level} {title}"
    if about:
        yield about
    yield f"```text\n{_usage(parser)}\n```"
    if parser.description:
        yield _escaped(parser.description)
    formatter = parser.formatter_class(prog=parser.prog)  # its help strings: the defaults it adds, expanded
    subcommands: dict[str, argparse.ArgumentParser] = {}
    for group in parser._action_groups:
        rows = []
        for action in group._group_actions:
            if isinstance(action, argparse._SubParsersAction):
                subcommands |= action.choices
            elif action.help != argparse.SUPPRESS:
                rows.append(f"| {_invocation(action)} | {_escaped(formatter._expand_help(action))} |")
        if rows:
            described = f": {_escaped(group.description)}" if group.description else ""
            yield f"**{group.title}**{described}"
            yield "\n".join(["| flag | what it does |", "|---|---|", *rows])
    for name, subparser in subcommands.items():
        yield from _parser_section(subparser, level=level + 1, title=f"`{parser.prog} {name}`", about="")


def reference_page() -> str:
    """The text of ``docs/reference/cli.md``."""
    blocks = ["# Command lines",
              f"Generated from the argparse parsers of the commands themselves by `{REGENERATE}`, which rewrites "
              "this page (a test fails when it differs from them). Each command also answers `--help`."]
    for command in COMMANDS:
        blocks += _parser_section(command.parser(), level=2, title=f"`{command.script}` (`{command.run_as}`)",
                                  about=command.about)
    return "\n\n".join(blocks) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=REGENERATE, description="Write the command lines' reference page from the "
                                                                  "commands' parsers.")
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when the page is stale")
    args = parser.parse_args(argv)
    text = reference_page()
    if args.check:
        if not REFERENCE.is_file() or REFERENCE.read_text(encoding="utf-8") != text:
            print(f"stale: {REFERENCE}\nrun: {REGENERATE}", file=sys.stderr)
            return 1
        return 0
    REFERENCE.write_text(text, encoding="utf-8")
    print(f"wrote {REFERENCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
