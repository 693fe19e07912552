"""Every product module stays one job a reader takes in at once: at most ``MAX_LINES`` lines."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent
PRODUCT = ("hotweights", "cache", "standby", "controller", "gateway", "chaos")
MAX_LINES = 600


def too_long(root: Path, limit: int = MAX_LINES) -> list[str]:
    """``path: N lines`` for each product module under ``root`` longer than ``limit``."""
    modules = [path for package in PRODUCT for path in (root / package).rglob("*.py")]
    counts = {path: len(path.read_text().splitlines()) for path in modules}
    return [f"{path.relative_to(root)}: {count} lines" for path, count in sorted(counts.items()) if count > limit]


def test_no_product_module_is_over_the_limit() -> None:
    found = too_long(REPO)
    assert not found, f"split these modules (at most {MAX_LINES} lines each):\n" + "\n".join(found)


def test_the_check_names_the_module_and_its_count(tmp_path: Path) -> None:
    (tmp_path / "controller").mkdir()
    (tmp_path / "controller" / "big.py").write_text("x = 1\n" * 601)
    (tmp_path / "controller" / "small.py").write_text("x = 1\n" * 600)
    assert too_long(tmp_path) == ["controller/big.py: 601 lines"]
