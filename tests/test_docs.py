"""The documented example config is the one the code documents, and it loads."""

from __future__ import annotations

from pathlib import Path

from hotweights.controller.config import EXAMPLE_CONFIG, load_config

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_example_config_in_docs_matches_the_code_and_loads() -> None:
    path = DOCS / "cluster.example.toml"
    assert path.read_text() == EXAMPLE_CONFIG, "regenerate docs/cluster.example.toml from hotweights.controller.config"
    config = load_config(path)
    assert [spec.id for spec in config.engines()] == ["g0-e0", "g0-e1", "g0-e2"]
