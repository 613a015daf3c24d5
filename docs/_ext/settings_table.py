"""``settings-table``: the service's settings as a table, read from ``Settings.model_fields`` when the docs are
built, so the page cannot drift from the code: each field's ``SKRULL_*`` variable (and ``serve`` flag), type,
default and description."""

from __future__ import annotations

from typing import Any

from docutils import nodes
from docutils.parsers.rst import Directive
from pydantic_core import PydanticUndefined

from scheduler_service.runtime.settings import ENV_PREFIX, Settings

COLUMNS = ("variable and flag", "type", "default", "description")


def _default(field: Any) -> str:
    if field.default_factory is not None:
        return "computed (see the description)"
    if field.default in (PydanticUndefined, None):
        return "unset"
    return repr(field.default)


def _type(field: Any) -> str:
    annotation = field.annotation
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def _row(cells: list[str]) -> nodes.row:
    row = nodes.row()
    for text in cells:
        entry = nodes.entry()
        entry += nodes.paragraph(text=text)
        row += entry
    return row


class SettingsTable(Directive):
    def run(self) -> list[nodes.Node]:
        group = nodes.tgroup(cols=len(COLUMNS))
        for width in (28, 14, 16, 42):
            group += nodes.colspec(colwidth=width)
        head = nodes.thead()
        head += _row(list(COLUMNS))
        body = nodes.tbody()
        for name, field in Settings.model_fields.items():
            flag = "--" + name.replace("_", "-")
            body += _row([f"{ENV_PREFIX}{name.upper()} ({flag})", _type(field), _default(field),
                           field.description or ""])
        group += head
        group += body
        table = nodes.table()
        table += group
        return [table]


def setup(app: Any) -> dict[str, Any]:
    app.add_directive("settings-table", SettingsTable)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
