"""Every measured figure in README.md and docs/**/*.md equals the committed JSON it was printed from.

**Markers.** A measured block is tied to its JSON by a comment on its own line right before it::

    <!-- figures: docs/lossless/never-loses-batch1.json, docs/lossless/gemma3_16k.json -->

(paths from the repository root, comma-separated). The block is every line after the marker up to the next
blank line, so a caption line and its table are one block. Each named file must exist and hold valid JSON,
and the block must print at least one number.

**What is a number.** A run of digits, optionally with thousands separators ("131,072") and decimals, optionally
signed where a space or bracket precedes the sign ("-13%"), optionally followed by a unit, attached or after one
space: x, %, ms, s, min, KB, MB, GB, KiB, MiB, GiB, MB/s, GB/s, tok/s, tokens/s. It must stand alone: a number
that touches a letter, a digit, `_`, `.`, `,`, `/`, `=`, `^`, `:`, `+`, or a `-` joined to a word belongs to an
identifier and is not checked ("int8", "k=4", "8K", "fp32", "SmolLM2", "snapkv-0.9", "1+8", "6/6", "2^20",
"1e-5", "64-token"); a `.`, `,`, `:` or `;` followed by a space or the end only ends a sentence. A `-` or en
dash between two numbers is a range ("1.09-1.16x": both are checked). Text inside backticks (commands,
fields, literals) is not checked.

**Matching.** A printed number matches a JSON number when the JSON value rounded to the printed decimals equals
it ("3.94" matches 3.9347, "1.18x" matches 1.1812, "14.9" matches 14.93). A unit allows one conversion: % from
a fraction (x100), ms from seconds (x1000), KB/MB/GB from bytes, KiB/MiB/GiB from bytes. A table cell without a
unit takes the unit its column header names ("KV MiB", "TTFT s"). The JSON's numbers are its int and float
leaves (not booleans) and the numbers written in its string leaves, read by the rule above ("load avg 2.17").

**Where.** In a table's data row (a `|` line below the header separator) every number of the row must match
within ONE record: a dict below the file's top level (the top level only when it is the file's one dict), so a
row never mixes figures of two runs or two settings. Every other line of a block (a caption, a paragraph, a
code block) needs each number somewhere in the named files.

**Untied tables.** A table whose header row names a time or a rate (tok/s, tokens/s, ms, s as a unit word, GB/s,
MB/s, TTFT, ITL, latency, speedup, "vs plain", "x plain", "/ plain", wall clock) must be tied by a marker, so a
new measured table cannot slip in without its JSON.

Not checked: the reports `kvlab bench report` writes (first line "# kvlab benchmark report"), which code renders
from a results folder.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATED_REPORT_TITLE = "# kvlab benchmark report"
MARKER = re.compile(r"^<!-- figures: (?P<files>.+?) -->$")
UNITS = r"tokens/s|tok/s|GB/s|MB/s|GiB|MiB|KiB|GB|MB|KB|min|ms|s|x|%"
# A sign counts only after a space, a bracket or the start ("1.09-1.16x" is a range, not -1.16).
NUMBER = re.compile(
    rf"(?P<sign>(?<![^\s(\[])[-+])?(?P<digits>\d{{1,3}}(?:,\d{{3}})+|\d+)(?P<decimals>\.\d+)?"
    rf"(?:(?P<space> )?(?P<unit>{UNITS})(?![\w/]))?"
)
# Characters that make a number part of an identifier when they touch it.
JOINED = re.compile(r"[\w.,/=^:+]")
HEADER_UNIT = re.compile(rf"(?<![\w/])({UNITS})(?![\w/])")
MEASURED_HEADER = re.compile(
    r"tok/s|tokens/s|(?<![\w/])ms(?![\w])|GB/s|MB/s|\bTTFT\b|\bITL\b|latency|speedup|vs plain|x plain|/ plain"
    r"|wall clock|(?<![\w'’])s(?![\w'’])",
    re.IGNORECASE,
)
SCALES = {"%": (1.0, 100.0), "ms": (1.0, 1e3), "KB": (1.0, 1e-3), "MB": (1.0, 1e-6), "GB": (1.0, 1e-9),
          "KiB": (1.0, 2.0**-10), "MiB": (1.0, 2.0**-20), "GiB": (1.0, 2.0**-30)}
SEPARATOR = re.compile(r"^\|?\s*:?-{3,}")


@dataclass(frozen=True)
class Figure:
    """A number as printed: its text, value, decimals and unit ("" when none)."""

    text: str
    value: float
    decimals: int
    unit: str

    def matches(self, number: float, unit: str = "") -> bool:
        """Whether `number`, converted by the figure's unit (or `unit`), rounds to the printed figure."""
        tolerance = 0.5 * 10.0**-self.decimals + 1e-9 * max(1.0, abs(self.value))
        scales = SCALES.get(self.unit or unit, (1.0,))
        return any(abs(number * scale - self.value) <= tolerance for scale in scales)


def _stands_alone(text: str, match: re.Match[str]) -> bool:
    start, end = match.start(), match.end()
    before = text[start - 1] if start else " "
    if JOINED.match(before) or (before in "-–" and start >= 2 and re.match(r"[A-Za-z_]", text[start - 2])):
        return False
    after, following = text[end : end + 1], text[end + 1 : end + 2]
    if after in ("-", "–"):
        return following.isdigit()  # a range: "1.09-1.16x"
    if after in (".", ",", ":", ";"):
        return following == "" or following.isspace()  # the end of a sentence or clause
    return not JOINED.match(after)


def figures_in(text: str) -> list[Figure]:
    """The standalone numbers of `text`, outside backticks (the rule in the module docstring)."""
    text = re.sub(r"`[^`]*`", " ", text)
    figures = []
    for match in NUMBER.finditer(text):
        if not _stands_alone(text, match):
            continue
        digits = match.group("digits").replace(",", "") + (match.group("decimals") or "")
        value = float(digits) * (-1.0 if match.group("sign") == "-" else 1.0)
        decimals = len(match.group("decimals") or ".") - 1
        unit = match.group("unit") or ""
        figures.append(Figure(match.group(0).strip(), value, decimals, unit))
    return figures


def json_numbers(data: Any) -> list[float]:
    """Every int and float leaf of `data`, and every number written in its string leaves."""
    if isinstance(data, bool) or data is None:
        return []
    if isinstance(data, (int, float)):
        return [float(data)]
    if isinstance(data, str):
        return [figure.value for figure in figures_in(data)]
    values = data.values() if isinstance(data, dict) else data
    return [number for value in values for number in json_numbers(value)]


def json_records(data: Any) -> list[list[float]]:
    """The numbers of every record: each dict below the top level (the top level when it is the only dict)."""
    found: list[list[float]] = []

    def visit(node: Any, top: bool) -> None:
        if isinstance(node, dict):
            if not top:
                found.append(json_numbers(node))
            for value in node.values():
                visit(value, False)
        elif isinstance(node, list):
            for value in node:
                visit(value, False)

    visit(data, True)
    return found or [json_numbers(data)]


@dataclass(frozen=True)
class Sources:
    """The JSON files one marker names: their records and all their numbers."""

    names: str
    records: list[list[float]]
    numbers: list[float]


def load_sources(files: str, root: Path) -> tuple[Sources | None, str]:
    """The files of a marker, or None and what is wrong with them."""
    records: list[list[float]] = []
    numbers: list[float] = []
    for name in (part.strip() for part in files.split(",")):
        path = root / name
        if not path.is_file():
            return None, f"names {name}, which does not exist"
        try:
            data = json.loads(path.read_text())
        except ValueError as error:
            return None, f"names {name}, which is not valid JSON ({error})"
        records += json_records(data)
        numbers += json_numbers(data)
    return Sources(files, records, numbers), ""


def split_cells(row: str) -> list[str]:
    """The cells of a markdown table row (`\\|` is a literal bar inside a cell)."""
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


def header_units(header: str) -> list[str]:
    """The unit each column's header names, "" where none."""
    units = []
    for cell in split_cells(header):
        found = HEADER_UNIT.findall(re.sub(r"`[^`]*`", " ", cell))
        units.append(found[-1] if found else "")
    return units


def _row_problems(where: str, row: str, units: list[str], sources: Sources) -> list[str]:
    """The row's figures that no single record holds, against the record that holds the most of them."""
    figures = [(figure, units[i] if i < len(units) else "")
               for i, cell in enumerate(split_cells(row)) for figure in figures_in(cell)]
    if not figures:
        return []

    def missing(record: list[float]) -> list[Figure]:
        return [figure for figure, unit in figures if not any(figure.matches(number, unit) for number in record)]

    best = min((missing(record) for record in sources.records), key=len)
    return [f"{where}: {figure.text!r} does not match the record of {sources.names} that holds the row's other "
            f"figures" for figure in best]


def _line_problems(where: str, line: str, sources: Sources) -> list[str]:
    return [f"{where}: {figure.text!r} is not in {sources.names}"
            for figure in figures_in(line) if not any(figure.matches(number) for number in sources.numbers)]


def block_problems(name: str, lines: list[str], start: int, sources: Sources) -> list[str]:
    """Problems of the block `lines` (line `start` is the first, 1-based) against its sources."""
    problems: list[str] = []
    units: list[str] = []
    in_table = False
    for offset, line in enumerate(lines):
        where = f"{name}:{start + offset}"
        if line.startswith("|") and offset + 1 < len(lines) and SEPARATOR.match(lines[offset + 1]):
            units, in_table = header_units(line), False
        elif line.startswith("|") and SEPARATOR.match(line):
            in_table = True
        elif line.startswith("|") and in_table:
            problems += _row_problems(where, line, units, sources)
        else:
            problems += _line_problems(where, line, sources)
    if not any(figures_in(line) for line in lines):
        problems.append(f"{name}:{start}: the block after the marker prints no figure")
    return problems


def doc_problems(name: str, text: str, root: Path) -> list[str]:
    """Every problem of one markdown document: markers, their files, and each tied block's figures."""
    lines = text.splitlines()
    problems: list[str] = []
    for index, line in enumerate(lines):
        marker = MARKER.match(line.strip())
        if not marker:
            continue
        sources, problem = load_sources(marker.group("files"), root)
        if sources is None:
            problems.append(f"{name}:{index + 1}: the marker {problem}")
            continue
        end = index + 1
        while end < len(lines) and lines[end].strip():
            end += 1
        problems += block_problems(name, lines[index + 1 : end], index + 2, sources)
    return problems


def untied_measured_tables(name: str, text: str) -> list[str]:
    """Tables whose header names a time or a rate with no marker in the lines that lead to them."""
    lines = text.splitlines()
    found = []
    in_fence = False
    for index, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        is_header = line.startswith("|") and index + 1 < len(lines) and SEPARATOR.match(lines[index + 1])
        if in_fence or not is_header or not MEASURED_HEADER.search(re.sub(r"`[^`]*`", " ", line)):
            continue
        above = index
        while above > 0 and lines[above - 1].strip() and not MARKER.match(lines[above - 1].strip()):
            above -= 1
        if above == 0 or not MARKER.match(lines[above - 1].strip()):
            found.append(f"{name}:{index + 1}: a measured table ({line.strip()[:60]}...) with no figures marker")
    return found


def documents() -> list[Path]:
    """README.md and every docs/**/*.md but the generated benchmark reports."""
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [path for path in paths if not path.read_text().startswith(GENERATED_REPORT_TITLE)]


@pytest.mark.parametrize("path", documents(), ids=lambda path: path.relative_to(ROOT).as_posix())
def test_every_tied_figure_matches_its_json(path: Path) -> None:
    problems = doc_problems(path.relative_to(ROOT).as_posix(), path.read_text(), ROOT)
    assert not problems, "figures that differ from their JSON (correct the doc from the JSON):\n" + "\n".join(problems)


@pytest.mark.parametrize("path", documents(), ids=lambda path: path.relative_to(ROOT).as_posix())
def test_every_measured_table_is_tied_to_its_json(path: Path) -> None:
    untied = untied_measured_tables(path.relative_to(ROOT).as_posix(), path.read_text())
    assert not untied, "add a `<!-- figures: FILE.json -->` line before each:\n" + "\n".join(untied)


def test_the_readme_and_docs_tie_figures() -> None:
    markers = [line for path in documents() for line in path.read_text().splitlines() if MARKER.match(line.strip())]
    assert len(markers) >= 10, f"only {len(markers)} figures markers in README.md and docs/: were they removed?"


# The checker itself, on synthetic documents.

RECORDS = {"header": "smollm2, batch 4, load avg 2.17",
           "rows": [{"setting": "plain", "tokens_per_s": 11.8254, "ratio": 1.0, "wait_s": 0.25, "bytes": 371000000},
                    {"setting": "lossless", "tokens_per_s": 13.9278, "ratio": 1.1778, "share": 0.3042}]}


def check(tmp_path: Path, doc: str, data: Any = None) -> list[str]:
    (tmp_path / "run.json").write_text(json.dumps(RECORDS if data is None else data))
    return doc_problems("doc.md", doc, tmp_path)


TABLE = "<!-- figures: run.json -->\n| setting | tok/s | vs plain |\n|---|---|---|\n| plain | 11.8 | 1.00x |\n{row}\n"


def test_rounded_figures_match(tmp_path: Path) -> None:
    assert check(tmp_path, TABLE.format(row="| lossless | 13.93 | 1.18x |")) == []


def test_a_stale_figure_fails_naming_doc_line_figure_and_file(tmp_path: Path) -> None:
    problems = check(tmp_path, TABLE.format(row="| lossless | 13.9 | 1.24x |"))
    assert len(problems) == 1 and problems[0].startswith("doc.md:5:") and "'1.24x'" in problems[0], problems
    assert "run.json" in problems[0], problems


def test_a_row_mixing_two_records_fails(tmp_path: Path) -> None:
    problems = check(tmp_path, TABLE.format(row="| lossless | 11.8 | 1.18x |"))
    assert len(problems) == 1 and ("'11.8'" in problems[0] or "'1.18x'" in problems[0]), problems


def test_the_top_level_is_not_a_record(tmp_path: Path) -> None:
    problems = check(tmp_path, TABLE.format(row="| lossless | 2.17 | 1.18x |"))
    assert problems, "a row's figure found only in the top level's header string must not match"


def test_a_missing_file_fails(tmp_path: Path) -> None:
    problems = doc_problems("doc.md", "<!-- figures: nowhere.json -->\n| a | 1 |\n", tmp_path)
    assert problems == ["doc.md:1: the marker names nowhere.json, which does not exist"], problems


def test_a_file_that_is_not_json_fails(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    problems = doc_problems("doc.md", "<!-- figures: bad.json -->\nrate 1.0\n", tmp_path)
    assert len(problems) == 1 and "not valid JSON" in problems[0], problems


def test_a_paragraph_matches_anywhere_in_the_file(tmp_path: Path) -> None:
    doc = "<!-- figures: run.json -->\nBatch 4 at load avg 2.17: 13.9 tokens/s against 11.8, 1.18x.\n"
    assert check(tmp_path, doc) == []
    assert check(tmp_path, doc.replace("13.9", "14.2")) != []


def test_units_convert_percent_milliseconds_and_bytes(tmp_path: Path) -> None:
    doc = "<!-- figures: run.json -->\nIt waited 250 ms, 30% of its drafts (371 MB) and 353.8 MiB.\n"
    assert check(tmp_path, doc) == []
    assert check(tmp_path, doc.replace("30%", "31%")) != []


def test_a_header_unit_applies_to_its_column(tmp_path: Path) -> None:
    doc = "<!-- figures: run.json -->\n| setting | wait ms | bytes MB |\n|---|---|---|\n| plain | 250 | 371 |\n"
    assert check(tmp_path, doc) == []


def test_thousands_separators_and_identifiers(tmp_path: Path) -> None:
    assert [figure.value for figure in figures_in("131,072 tokens, 1.09-1.16x, (-13%)")] == [131072, 1.09, 1.16, -13]
    identifiers = "int8 k=4 8K fp32 SmolLM2 snapkv-0.9 1+8 6/6 2^20 1e-5 `12.5` v0.3 x86_64"
    assert figures_in(identifiers) == [], figures_in(identifiers)


def test_a_block_without_figures_fails(tmp_path: Path) -> None:
    assert check(tmp_path, "<!-- figures: run.json -->\nno figures here\n") != []


def test_an_untied_measured_table_fails() -> None:
    table = "| setting | decode tok/s |\n|---|---|\n| plain | 11.8 |\n"
    assert untied_measured_tables("doc.md", table) != []
    assert untied_measured_tables("doc.md", "<!-- figures: run.json -->\ncaption\n" + table) == []
    assert untied_measured_tables("doc.md", "| term | meaning |\n|---|---|\n| TTL | a time |\n") == []
