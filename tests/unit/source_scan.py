"""Reads kvlab's sources as syntax trees for the house-rule tests: its modules and every import between them.

Every import counts, wherever it sits: at module level, inside a function (lazy), under
`if TYPE_CHECKING:`, and `importlib.import_module` of a literal name (a dynamic import). Imports whose
module name is computed are not guessed: `dynamic_import_calls` lists them so a test can demand that
each one is accounted for.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import kvlab

PACKAGE = Path(kvlab.__file__).parent
ROOT = PACKAGE.parent


@dataclass(frozen=True)
class Import:
    """One kvlab import: `target` is the kvlab module it loads (a submodule where `from pkg import name` names one)."""

    path: Path
    line: int
    target: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT.parent).as_posix()}:{self.line}"


def module_name(path: Path) -> str:
    """`kvlab.cache.kv_cache` for src/kvlab/cache/kv_cache.py, `kvlab.cache` for its __init__.py."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


@cache
def source_files() -> tuple[Path, ...]:
    return tuple(sorted(PACKAGE.rglob("*.py")))


@cache
def known_modules() -> frozenset[str]:
    return frozenset(module_name(path) for path in source_files())


def _absolute(module: str | None, level: int, importer: str, importer_is_package: bool) -> str:
    """The absolute name of `from <level dots><module> import ...` written in module `importer`."""
    if not level:
        return module or ""
    package = importer if importer_is_package else importer.rpartition(".")[0]
    for _ in range(level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{module}" if module else package


def _is_kvlab(name: str) -> bool:
    return name == "kvlab" or name.startswith("kvlab.")


def _dynamic_target(node: ast.Call) -> ast.expr | None:
    """The name argument of `importlib.import_module(name)` or `__import__(name)`, else None."""
    function = node.func
    named = (isinstance(function, ast.Attribute) and function.attr == "import_module") or (
        isinstance(function, ast.Name) and function.id in ("import_module", "__import__")
    )
    return node.args[0] if named and node.args else None


def imports_in_source(source: str, importer: str, importer_is_package: bool = False,
                      path: Path | None = None, modules: frozenset[str] | None = None) -> list[Import]:
    """Every kvlab import in `source` (the text of module `importer`), in line order.

    `from pkg import name` resolves to `pkg.name` where that is a module in `modules` (default: kvlab's
    modules), else to `pkg`.
    """
    modules = known_modules() if modules is None else modules
    path = path or ROOT / (importer.replace(".", "/") + ".py")
    found: list[Import] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [Import(path, node.lineno, alias.name) for alias in node.names if _is_kvlab(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module, node.level, importer, importer_is_package)
            if not _is_kvlab(base):
                continue
            targets = {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
            found += [Import(path, node.lineno, target) for target in sorted(targets)]
        elif isinstance(node, ast.Call):
            argument = _dynamic_target(node)
            if isinstance(argument, ast.Constant) and isinstance(argument.value, str) and _is_kvlab(argument.value):
                found.append(Import(path, node.lineno, argument.value))
    return sorted(found, key=lambda found_import: found_import.line)


@cache
def all_imports() -> tuple[Import, ...]:
    """Every kvlab import in every module under src/kvlab."""
    found: list[Import] = []
    for path in source_files():
        found += imports_in_source(path.read_text(), module_name(path), is_package(path), path)
    return tuple(found)


def dynamic_import_calls(source: str) -> list[int]:
    """Lines of `import_module(...)`/`__import__(...)` calls whose module name is not a literal string."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            argument = _dynamic_target(node)
            if argument is not None and not (isinstance(argument, ast.Constant) and isinstance(argument.value, str)):
                lines.append(node.lineno)
    return sorted(lines)


def string_constants(source: str, name: str) -> list[tuple[int, str]]:
    """`(line, text)` of every string literal inside the module-level assignment to `name`."""
    found = []
    for node in ast.parse(source).body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(target, ast.Name) and target.id == name for target in targets) and node.value is not None:
            found += [(constant.lineno, constant.value) for constant in ast.walk(node.value)
                      if isinstance(constant, ast.Constant) and isinstance(constant.value, str)]
    return found
