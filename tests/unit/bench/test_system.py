"""What identifies the code behind a benchmark cell."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kvlab.bench.system import code_revision


def _git(root: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        check=True,
        capture_output=True,
    )


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    (tmp_path / "src").mkdir()
    (tmp_path / "docs").mkdir()
    (tmp_path / "src" / "module.py").write_text("VALUE = 1\n")
    (tmp_path / "docs" / "notes.md").write_text("first\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "first")
    return tmp_path


def test_a_commit_outside_src_keeps_the_revision_so_a_long_run_stays_resumable(checkout: Path) -> None:
    before = code_revision(checkout)
    (checkout / "docs" / "notes.md").write_text("second\n")
    _git(checkout, "commit", "-q", "-am", "docs only")
    assert code_revision(checkout) == before


def test_uncommitted_and_committed_source_changes_each_change_the_revision(checkout: Path) -> None:
    clean = code_revision(checkout)
    (checkout / "src" / "module.py").write_text("VALUE = 2\n")
    dirty = code_revision(checkout)
    assert dirty != clean and dirty.startswith(clean + "+")
    _git(checkout, "commit", "-q", "-am", "source")
    committed = code_revision(checkout)
    assert committed not in (clean, dirty) and "+" not in committed


def test_outside_a_git_checkout_the_revision_is_the_package_version(tmp_path: Path) -> None:
    assert code_revision(tmp_path).startswith("kvlab ")
