"""The glossary's retired names stay retired: none of them appears in the library's source."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def retired_names() -> list[str]:
    """Every `name` in the last column of the glossary's tables that have a "retired names" column."""
    names = []
    retired_column = False
    for line in (ROOT / "docs" / "glossary.md").read_text().splitlines():
        if not line.startswith("|"):
            retired_column = False
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if cells[-1] == "retired names":
            retired_column = True
        elif retired_column:
            names += re.findall(r"`([^`]+)`", cells[-1])
    return names


def test_the_glossary_lists_retired_names() -> None:
    assert {"ratio_vs_fp16", "nominal_ratio", "MethodSpec"} <= set(retired_names())


def test_no_retired_name_is_left_in_the_source() -> None:
    found = {}
    for path in sorted((ROOT / "src" / "kvlab").rglob("*.py")):
        text = path.read_text()
        for name in retired_names():
            # A name is a whole identifier (`self.ratio` must not match `self.ratios`); a phrase may wrap case.
            pattern = re.escape(name) if " " in name else rf"(?<![\w.]){re.escape(name)}\b"
            if re.search(pattern, text, flags=re.IGNORECASE if " " in name else 0):
                found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not found, f"retired names still in src/ (see docs/glossary.md): {found}"
