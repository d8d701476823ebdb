"""Generated code runs in a separate, limited process: results, timeouts, no network, no leaks."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlab.bench.execution import run_python


def test_a_passing_program_passes() -> None:
    assert run_python("assert sum(range(4)) == 6\n").status == "passed"


def test_a_failing_assertion_fails_with_its_error() -> None:
    result = run_python("assert 1 == 2, 'wrong sum'\n")
    assert result.status == "failed" and "wrong sum" in result.detail


def test_an_endless_loop_times_out() -> None:
    assert run_python("while True:\n    pass\n", timeout_s=1.0).status == "timed out"


def test_the_network_is_disabled() -> None:
    program = "import socket\nsocket.create_connection(('127.0.0.1', 9))\n"
    result = run_python(program)
    assert result.status == "failed" and "network access is disabled" in result.detail


def test_the_program_runs_in_a_scratch_directory_not_ours(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert run_python("open('marker.txt', 'w').write('x')\nimport os\nassert os.path.exists('marker.txt')\n").passed
    assert list(tmp_path.iterdir()) == [], "the child must not write where the benchmark runs"


def test_the_child_process_does_not_share_our_interpreter_state() -> None:
    import builtins

    builtins.kvlab_marker = 1  # type: ignore[attr-defined]
    try:
        assert run_python("import builtins\nassert not hasattr(builtins, 'kvlab_marker')\n").passed
    finally:
        del builtins.kvlab_marker  # type: ignore[attr-defined]
