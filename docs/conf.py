"""Sphinx configuration of Skrull's documentation: Markdown pages (MyST), the furo theme, and reference pages
generated from the code (the HTTP API from the exported OpenAPI document, the service's settings from
``Settings.model_fields``, the Python API by autodoc; the command lines' page is Markdown that
``python -m trainer_client.cli_reference`` writes from their argparse parsers). ``make docs`` builds it with
warnings as errors."""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path[:0] = [str(DOCS / "_ext"), str(DOCS.parent), str(DOCS.parent / "proto")]

project = "Skrull"
author = "The Skrull developers"
copyright = "2026, the Skrull developers"
release = "0.1.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.viewcode",
    "sphinxcontrib.openapi",
    "settings_table",
]
source_suffix = {".md": "markdown"}
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
exclude_patterns = ["_build"]
html_theme = "furo"
html_title = "Skrull"
html_static_path = ["_static"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False}
nitpicky = False

