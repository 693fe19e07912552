"""The documented example config is the one the code documents, and it loads."""

from __future__ import annotations

import tomllib
from dataclasses import MISSING, fields
from pathlib import Path

from hotweights.controller.config import SECTIONS, GroupSection, load_config

DOCS = Path(__file__).resolve().parent.parent / "docs"
EXAMPLE = DOCS / "cluster.example.toml"


def test_the_example_config_loads() -> None:
    config = load_config(EXAMPLE)
    assert [spec.id for spec in config.engines()] == ["g0-e0", "g0-e1", "g0-e2"]


def test_the_example_config_documents_every_key_with_the_codes_default() -> None:
    """Each default is defined once, as a field of its section's dataclass; the example names every field and
    says the same."""
    example = tomllib.loads(EXAMPLE.read_text())
    for name, tables in example.items():
        section = (SECTIONS | {"groups": GroupSection})[name]
        defaults = {f.name: f.default if f.default is not MISSING else f.default_factory() for f in fields(section)}
        for table in tables if isinstance(tables, list) else [tables]:
            assert not (missing := defaults.keys() - table.keys()), f"[{name}]: document {sorted(missing)}"
            for key, value in table.items():
                default = defaults[key]
                assert value == (list(default) if isinstance(default, tuple) else default), (
                    f"[{name}] {key}: the example says {value!r}, the code {default!r}"
                )


def module_map() -> dict[str, list[str]]:
    """The rows of docs/architecture.md's module map: module path -> its other cells."""
    text = (DOCS / "architecture.md").read_text().split("## Module map", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in text.splitlines():
        if line.startswith("| `"):
            cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_the_module_map_lists_every_module_with_its_job_and_what_it_may_import() -> None:
    root = DOCS.parent
    modules = {
        path.relative_to(root).as_posix()
        for package in ("hotweights", "cache", "standby", "controller", "gateway", "chaos")
        for path in (root / package).rglob("*.py")
        if path.name != "__init__.py" or path.parent.name == "backends"
    }
    rows = module_map()
    missing = sorted(modules - rows.keys())
    assert not missing, f"add these modules to docs/architecture.md's module map: {missing}"
    stale = {name for name in rows.keys() - modules if name.endswith(".py")}
    assert not stale, f"these modules of docs/architecture.md's module map no longer exist: {sorted(stale)}"
    for name, cells in rows.items():
        assert len(cells) == 2 and all(cells), f"{name}: give the module its one job and what it may import"


def test_the_docs_point_at_no_file_outside_the_repository() -> None:
    root = DOCS.parent
    for path in [root / "README.md", *DOCS.rglob("*.md")]:
        assert "../shared" not in path.read_text(), f"{path.relative_to(root)} points outside the repository"
