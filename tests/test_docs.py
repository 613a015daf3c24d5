"""The documentation holds together: the site builds with warnings as errors (as ``make docs`` builds it), a
broken reference fails that build, the README's links reach files, and every citation of the design in the code
names a section of ``docs/design.md``."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _build(source: Path, output: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(source),
                           str(output)], capture_output=True, text=True, cwd=ROOT)


@pytest.mark.slow
def test_the_site_builds_without_a_warning(tmp_path: Path) -> None:
    build = _build(DOCS, tmp_path / "html")
    assert build.returncode == 0, build.stderr
    pages = {path.relative_to(tmp_path / "html").as_posix() for path in (tmp_path / "html").rglob("*.html")}
    assert {"index.html", "design.html", "reference/http-api.html", "reference/cli.html", "reference/settings.html",
            "reference/python-api.html", "benchmarks.html"} <= pages
    # the generated pages are generated: the API from openapi.json, the settings from Settings, the code by autodoc
    assert "/plan" in (tmp_path / "html/reference/http-api.html").read_text()
    assert "SKRULL_SEARCH_BUDGET" in (tmp_path / "html/reference/settings.html").read_text()
    assert "make_plan" in (tmp_path / "html/reference/python-api.html").read_text()


@pytest.mark.slow
def test_a_broken_reference_fails_the_build(tmp_path: Path) -> None:
    # the site's own configuration (conf.py, its extension, its static folder) over two pages, one of which links to
    # a page that does not exist: the whole site builds in the test above
    docs = tmp_path / "docs"
    docs.mkdir()
    for entry in ("conf.py", "_ext", "_static"):
        (docs / entry).symlink_to(DOCS / entry)
    (docs / "index.md").write_text("# Skrull\n\n```{toctree}\nlimits\n```\n")
    (docs / "limits.md").write_text("# Limits\n\nSee [a page that does not exist](no-such-page.md).\n")
    build = _build(docs, tmp_path / "html")
    assert build.returncode != 0
    assert "no-such-page" in build.stderr


def test_the_readme_links_reach_files() -> None:
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [target for target in targets if not target.startswith(("http://", "https://"))]
    assert "docs/design.md" in local
    assert [target for target in local if not (ROOT / target).exists()] == []


_CITATION = re.compile(r'docs/design\.md(?:, "([^"]+)")?')


@pytest.mark.parametrize("folder", ["scheduler_service", "trainer_client", "proto", "tests", "benchmarks", "deploy"])
def test_design_citations_name_sections_of_the_design(folder: str) -> None:
    headings = set(re.findall(r"^#+ (.+)$", (DOCS / "design.md").read_text(), flags=re.MULTILINE))
    broken = []
    for path in (ROOT / folder).rglob("*.py"):
        if path == Path(__file__).resolve():
            continue
        text = path.read_text()
        if "DESIGN.md" in text:
            broken.append(f"{path.relative_to(ROOT)} cites DESIGN.md, which is docs/design.md now")
        broken += [f"{path.relative_to(ROOT)} cites a section {section!r} the design does not have"
                   for section in _CITATION.findall(text) if section and section not in headings]
    assert broken == []


def test_the_trainer_package_docstring_names_every_module_and_each_sub_package_its_own() -> None:
    import trainer_client

    root = Path(trainer_client.__file__).parent
    assert trainer_client.__doc__ is not None
    top = {path.stem for path in root.glob("*.py")} - {"__init__"}
    sub_packages = {path.parent.name for path in root.glob("*/__init__.py")}
    assert sub_packages == {"advise", "components", "dacp", "data", "distributed", "hf", "models", "planning",
                            "profiler"}
    unnamed = sorted(name for name in top | sub_packages if f"``{name}``" not in trainer_client.__doc__)
    for package in sorted(sub_packages):
        docstring = importlib.import_module(f"trainer_client.{package}").__doc__ or ""
        unnamed += [f"{package}.{path.stem}" for path in sorted((root / package).glob("*.py"))
                    if not path.stem.startswith("__") and f"``{path.stem}``" not in docstring]
    assert not unnamed, f"not named in their package's docstring: {unnamed}"
