"""House rules a tool can check: timing only through kvlab.timing, and the size limits on files and functions."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.unit.source_scan import ROOT, module_name, source_files

# The `time` functions that read a clock.
CLOCKS = frozenset({"perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time", "time_ns", "process_time",
                    "process_time_ns"})
TIMING_MODULE = "kvlab.timing"
# Clocks read outside kvlab.timing that measure no duration, by (module, function, clock), with the reason.
# Deadlines, retry windows and a rate limiter decide *when* something happens; wall-clock stamps are
# dates. Neither is a measurement kvlab reports, so neither needs kvlab.timing's device synchronization.
NOT_TIMING: dict[tuple[str, str, str], str] = {
    ("kvlab.bandwidth", "TokenBucket.__init__", "perf_counter"): "a token bucket's refill clock: rate control",
    ("kvlab.serve.app", "create_app", "time"): "the `created` date of /v1/models (OpenAI wire format)",
    ("kvlab.serve.replies", "Reply.__init__", "time"): "the `created` date of a completion (OpenAI wire format)",
    ("kvlab.serve.engine", "ServeEngine.shutdown", "monotonic"): "the shutdown deadline",
    ("kvlab.store.backends.file", "FileStore._sweep", "time"): "wall-clock age of temporary files, against their mtime",
    ("kvlab.store.prefix.cache", "PrefixCache.fetch", "monotonic"): "the retry window of a store that went down",
    ("kvlab.store.prefix.cache", "PrefixCache._fail", "monotonic"): "the retry window of a store that went down",
    ("kvlab.store.prefix.cache", "PrefixCache.save", "monotonic"): "the retry window of a store that went down",
}
MAX_FILE_LINES = 400
# A function's size is the lines of its body after the docstring: from the first statement to the
# function's last line, blank and comment lines included; signature, decorators and docstring are not
# counted (they document, they do not grow the logic). A nested function counts in its parent too.
MAX_FUNCTION_LINES = 60


def clock_reads(source: str) -> Iterator[tuple[int, str, str]]:
    """`(line, function qualname or "<module>", clock)` of every `time.<clock>` and `from time import <clock>`."""

    def visit(node: ast.AST, scope: list[str]) -> Iterator[tuple[int, str, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                yield from visit(child, [*scope, child.name])
                continue
            where = ".".join(scope) or "<module>"
            if (isinstance(child, ast.Attribute) and isinstance(child.value, ast.Name) and child.value.id == "time"
                    and child.attr in CLOCKS):
                yield child.lineno, where, child.attr
            elif isinstance(child, ast.ImportFrom) and child.module == "time":
                yield from ((child.lineno, where, alias.name) for alias in child.names if alias.name in CLOCKS)
            yield from visit(child, scope)

    yield from visit(ast.parse(source), [])


def function_sizes(source: str) -> Iterator[tuple[int, str, int]]:
    """`(line of the def, qualname, body lines after the docstring)` of every function and method."""

    def visit(node: ast.AST, scope: list[str]) -> Iterator[tuple[int, str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = child.body
                if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                        and isinstance(body[0].value.value, str):
                    body = body[1:]
                assert child.end_lineno is not None
                yield child.lineno, ".".join([*scope, child.name]), child.end_lineno - body[0].lineno + 1
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                yield from visit(child, [*scope, child.name])
            else:
                yield from visit(child, scope)

    yield from visit(ast.parse(source), [])


def relative(path: Path) -> str:
    return path.relative_to(ROOT.parent).as_posix()


def test_durations_are_measured_only_through_kvlab_timing() -> None:
    offending = []
    for path in source_files():
        module = module_name(path)
        if module == TIMING_MODULE:
            continue
        for line, where, clock in clock_reads(path.read_text()):
            if (module, where, clock) not in NOT_TIMING:
                offending.append(f"{relative(path)}:{line}: {where} reads time.{clock}")
    assert not offending, (
        "time durations with kvlab.timing.Stopwatch (it synchronizes the device); a clock that measures no "
        "duration goes in NOT_TIMING with its reason:\n" + "\n".join(offending)
    )


def test_every_timing_exemption_names_a_clock_read_that_exists() -> None:
    found = set()
    for path in source_files():
        found |= {(module_name(path), where, clock) for _, where, clock in clock_reads(path.read_text())}
    stale = sorted(set(NOT_TIMING) - found)
    assert not stale, f"NOT_TIMING names clock reads that are gone (remove them): {stale}"


def test_no_source_file_is_over_the_line_limit() -> None:
    offending = [f"{relative(path)}: {count} lines" for path in source_files()
                 if (count := len(path.read_text().splitlines())) > MAX_FILE_LINES]
    assert not offending, f"files over {MAX_FILE_LINES} lines:\n" + "\n".join(offending)


def test_no_function_is_over_the_line_limit() -> None:
    offending = [f"{relative(path)}:{line}: {name} has {size} body lines"
                 for path in source_files() for line, name, size in function_sizes(path.read_text())
                 if size > MAX_FUNCTION_LINES]
    assert not offending, f"functions over {MAX_FUNCTION_LINES} body lines (docstring not counted):\n" + "\n".join(
        offending)


# The scanners themselves, so the rules above can fail.


def test_the_clock_scan_sees_calls_references_and_imports_with_their_scope() -> None:
    source = (
        "import time\nfrom time import monotonic, sleep\n"
        "class Clock:\n    def read(self):\n        return time.perf_counter()\n"
        "stamp = dict(default=time.time)\n"
    )
    assert list(clock_reads(source)) == [(2, "<module>", "monotonic"), (5, "Clock.read", "perf_counter"),
                                         (6, "<module>", "time")]


def test_the_function_size_skips_the_docstring_and_counts_blank_and_comment_lines() -> None:
    source = 'def f():\n    """Doc.\n\n    More.\n    """\n    a = 1\n\n    # why\n    return a\n'
    assert list(function_sizes(source)) == [(1, "f", 4)]


def test_the_function_size_counts_nested_functions_and_methods() -> None:
    source = "class A:\n    def m(self):\n        def inner():\n            return 1\n        return inner\n"
    assert list(function_sizes(source)) == [(2, "A.m", 3), (3, "A.m.inner", 1)]


def test_a_function_of_only_a_docstring_has_one_body_line() -> None:
    assert list(function_sizes('def f():\n    """Doc."""\n')) == [(1, "f", 1)]
