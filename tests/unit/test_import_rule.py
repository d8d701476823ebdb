"""DESIGN's floors: nothing in src/kvlab imports a floor above its own, and nothing imports in a circle.

Every import counts (module level, lazy inside a function, under `TYPE_CHECKING`, `importlib` of a
literal name). Modules on one floor may import each other, but not in a circle. The codec floor is
stricter still: it knows tensors and bytes only.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict

import pytest

from tests.unit.source_scan import (
    PACKAGE,
    ROOT,
    Import,
    all_imports,
    dynamic_import_calls,
    imports_in_source,
    is_package,
    known_modules,
    module_name,
    source_files,
    string_constants,
)

# From the ground up (DESIGN.md, "Layout"). A module belongs to the floor of the longest entry that is
# its name or a package above it; the bare package `kvlab` (its __init__, which every import runs first)
# matches only itself.
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # The leaf modules import nothing from kvlab but `errors` (bandwidth, registry) or nothing at all;
    # `attention` is the attention math that both `models` (the attention hook) and `cache` use.
    ("ground", (
        "kvlab", "kvlab.models", "kvlab.compress", "kvlab.quant", "kvlab.codec", "kvlab.attention",
        "kvlab.attention_kernels",
        "kvlab.registry", "kvlab.timing", "kvlab.errors", "kvlab.paths", "kvlab.threads", "kvlab.bandwidth",
        "kvlab.data",
    )),
    ("cache", ("kvlab.cache",)),
    ("store", ("kvlab.store",)),
    ("generation", ("kvlab.generation",)),
    ("lossless", ("kvlab.lossless",)),
    ("engine", ("kvlab.engine",)),
    # `components` imports the packages that register components, `kvlab.bench` and `kvlab.store` among
    # them (by name, through importlib): it stands on the highest floor it loads.
    ("application", ("kvlab.bench", "kvlab.serve", "kvlab.integrations", "kvlab.components")),
    ("cli", ("kvlab.cli",)),
)
# Stricter floors: what each may import from kvlab (itself included).
ALLOWED = {
    "codec": ("kvlab.codec", "kvlab.quant", "kvlab.errors", "kvlab.registry"),
    "quant": ("kvlab.quant",),
}
# Modules that import by computed names, and the module-level table each draws its names from.
DYNAMIC_IMPORT_TABLES = {
    "kvlab.components": "COMPONENT_PACKAGES",  # load_components() imports each package in it
    "kvlab.cli": "COMMANDS",  # load_command() imports the module of the command that runs
}
# Modules whose computed import names are not kvlab modules.
DYNAMIC_IMPORTS_OUTSIDE_KVLAB = {
    "kvlab.bench.tasks.ruler": "imports RULER's constants from the nvidia-long-context-eval data package",
}


def floor_of(module: str) -> int | None:
    """Index into FLOORS of the floor `module` stands on; None when no floor names it."""
    best: tuple[int, int] | None = None  # (length of the matching entry, floor)
    for index, (_, names) in enumerate(FLOORS):
        for name in names:
            matches = module == name or (name != "kvlab" and module.startswith(name + "."))
            if matches and (best is None or len(name) > best[0]):
                best = (len(name), index)
    return None if best is None else best[1]


def table_imports() -> list[Import]:
    """The kvlab modules named in DYNAMIC_IMPORT_TABLES, as imports of the module that holds each table."""
    found = []
    for path in source_files():
        table = DYNAMIC_IMPORT_TABLES.get(module_name(path))
        if table is not None:
            found += [Import(path, line, text) for line, text in string_constants(path.read_text(), table)
                      if text in known_modules()]
    return found


def every_import() -> list[Import]:
    return [*all_imports(), *table_imports()]


def find_upward_imports(imports: list[Import]) -> list[str]:
    offending = []
    for found in imports:
        importer, imported = floor_of(module_name(found.path)), floor_of(found.target)
        if importer is not None and imported is not None and imported > importer:
            offending.append(f"{found.where}: {module_name(found.path)} ({FLOORS[importer][0]}) imports "
                             f"{found.target} ({FLOORS[imported][0]})")
    return offending


def find_cycles(imports: list[Import]) -> list[str]:
    """Each import circle among kvlab modules, once, as the chain of imports (file:line) that closes it."""
    edges: dict[str, dict[str, Import]] = defaultdict(dict)
    for found in imports:
        importer = module_name(found.path)
        if found.target != importer:
            edges[importer].setdefault(found.target, found)
    components = strongly_connected(edges)
    cycles = []
    for component in components:
        start = min(component)
        chain = shortest_path_back(edges, start, component)
        cycles.append(" -> ".join(f"{edge.where} ({module_name(edge.path)} imports {edge.target})" for edge in chain))
    return sorted(cycles)


def strongly_connected(edges: dict[str, dict[str, Import]]) -> list[set[str]]:
    """Tarjan's strongly connected components with more than one module (a circle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in edges.get(node, {}):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def shortest_path_back(edges: dict[str, dict[str, Import]], start: str, component: set[str]) -> list[Import]:
    """The imports of a shortest circle through `start` inside `component` (breadth first)."""
    previous: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        next_frontier = []
        for node in frontier:
            for successor, edge in sorted(edges.get(node, {}).items()):
                if successor not in component:
                    continue
                if successor == start:
                    chain = [edge]
                    while node != start:
                        chain.append(previous[node])
                        node = module_name(previous[node].path)
                    return chain[::-1]
                if successor not in previous:
                    previous[successor] = edge
                    next_frontier.append(successor)
        frontier = next_frontier
    raise AssertionError(f"no circle through {start} in {sorted(component)}")


def test_every_module_stands_on_a_floor() -> None:
    unplaced = sorted(module for module in known_modules() if floor_of(module) is None)
    assert not unplaced, f"modules on no floor of FLOORS (place them): {unplaced}"


def test_no_module_imports_a_floor_above_its_own() -> None:
    offending = find_upward_imports(every_import())
    assert not offending, f"{len(offending)} upward imports:\n" + "\n".join(offending)


def test_no_modules_import_each_other_in_a_circle() -> None:
    cycles = find_cycles(every_import())
    assert not cycles, f"{len(cycles)} import circles:\n" + "\n".join(cycles)


def test_every_computed_import_is_accounted_for() -> None:
    unaccounted = []
    for path in source_files():
        name = module_name(path)
        if name in DYNAMIC_IMPORT_TABLES or name in DYNAMIC_IMPORTS_OUTSIDE_KVLAB:
            continue
        unaccounted += [f"{path.relative_to(ROOT.parent)}:{line}" for line in dynamic_import_calls(path.read_text())]
    assert not unaccounted, ("imports by computed name; name their table in DYNAMIC_IMPORT_TABLES or say why "
                             "they are not kvlab modules in DYNAMIC_IMPORTS_OUTSIDE_KVLAB:\n" + "\n".join(unaccounted))


def test_the_dynamic_import_tables_exist() -> None:
    for module, table in DYNAMIC_IMPORT_TABLES.items():
        path = PACKAGE.parent / (module.replace(".", "/") + "/__init__.py")
        if not path.exists():
            path = path.parent.with_suffix(".py")
        names = [text for _, text in string_constants(path.read_text(), table) if text in known_modules()]
        assert names, f"{module}.{table} names no kvlab module: the table moved, update DYNAMIC_IMPORT_TABLES"


@pytest.mark.parametrize("floor", sorted(ALLOWED))
def test_floor_sources_import_only_what_lies_below(floor: str) -> None:
    offending = []
    for found in all_imports():
        if module_name(found.path).startswith(f"kvlab.{floor}") and not any(
            found.target == allowed or found.target.startswith(allowed + ".") for allowed in ALLOWED[floor]
        ):
            offending.append(f"{found.where} imports {found.target}")
    assert not offending, "\n".join(offending)


def test_importing_the_codecs_loads_no_model_cache_or_compressor_module() -> None:
    script = (
        "import json, sys, kvlab.codec; "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('kvlab.') or m == 'transformers')))"
    )
    loaded = json.loads(subprocess.run([sys.executable, "-c", script], check=True, capture_output=True,
                                       text=True).stdout)
    above = [m for m in loaded if not m.startswith(ALLOWED["codec"])]
    assert not above, f"import kvlab.codec loaded {above}"


# The scanner itself: each kind of import it must see, so the rules above can fail.

MODULES = frozenset({"kvlab", "kvlab.cache", "kvlab.cache.attention", "kvlab.codec", "kvlab.codec.base",
                     "kvlab.compress", "kvlab.models", "kvlab.models.hook"})


def targets(source: str, importer: str = "kvlab.codec.base", package: bool = False) -> list[str]:
    return [found.target for found in imports_in_source(source, importer, package, modules=MODULES)]


def test_the_scan_sees_absolute_and_relative_imports() -> None:
    source = "import numpy\nfrom kvlab.compress import compressors\nfrom ..cache import KVCache\nfrom . import base\n"
    assert targets(source) == ["kvlab.compress", "kvlab.cache", "kvlab.codec.base"]


def test_the_scan_resolves_relative_imports_in_a_package_init() -> None:
    assert targets("from . import base\nfrom .. import cache\n", "kvlab.codec", package=True) == [
        "kvlab.codec.base", "kvlab.cache"]


def test_the_scan_resolves_a_name_to_its_submodule_only_where_one_exists() -> None:
    assert targets("from kvlab.cache import attention, KVCache\n") == ["kvlab.cache", "kvlab.cache.attention"]


def test_the_scan_sees_lazy_imports_inside_functions() -> None:
    source = "def f():\n    from kvlab.cache import KVCache\n    return KVCache\n"
    assert targets(source) == ["kvlab.cache"]


def test_the_scan_sees_type_checking_imports() -> None:
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kvlab.models.hook\n"
    assert targets(source) == ["kvlab.models.hook"]


def test_the_scan_sees_importlib_of_a_literal_name() -> None:
    source = "import importlib\ndef f():\n    return importlib.import_module('kvlab.cache')\n"
    assert targets(source) == ["kvlab.cache"]
    assert dynamic_import_calls("import importlib\nimportlib.import_module(name)\n") == [2]


def test_an_upward_lazy_import_is_reported_with_its_line() -> None:
    path = PACKAGE / "models" / "hook.py"
    imports = imports_in_source("import torch\n\ndef f():\n    from kvlab.cache import attention\n",
                                "kvlab.models.hook", path=path, modules=MODULES)
    assert find_upward_imports(imports) == [
        "src/kvlab/models/hook.py:4: kvlab.models.hook (ground) imports kvlab.cache.attention (cache)"]


def test_a_circle_is_reported_with_every_import_in_it() -> None:
    first, second = PACKAGE / "cache" / "first.py", PACKAGE / "cache" / "second.py"
    imports = [Import(first, 3, "kvlab.cache.second"), Import(second, 7, "kvlab.cache.first"),
               Import(second, 8, "kvlab.errors")]
    assert find_cycles(imports) == [
        "src/kvlab/cache/first.py:3 (kvlab.cache.first imports kvlab.cache.second) -> "
        "src/kvlab/cache/second.py:7 (kvlab.cache.second imports kvlab.cache.first)"]


def test_the_floors_run_in_designs_order() -> None:
    assert [name for name, _ in FLOORS] == [
        "ground", "cache", "store", "generation", "lossless", "engine", "application", "cli"]
    assert floor_of("kvlab.engine.scheduler") == 5 and floor_of("kvlab.components") == 6
    assert floor_of("kvlab") == 0 and floor_of("kvlab.cli.ls") == 7


def test_the_scan_sees_the_known_lazy_import_in_the_sources() -> None:
    # cli/__init__ imports its command modules by name from COMMANDS: the table must reach the graph.
    assert any(module_name(found.path) == "kvlab.cli" and found.target == "kvlab.cli.generate"
               for found in table_imports())
    assert any(is_package(found.path) for found in all_imports())
