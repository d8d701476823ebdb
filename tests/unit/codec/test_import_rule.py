"""The codec floor knows tensors and bytes only: no imports from models, caches or compressors."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvlab

PACKAGE = Path(kvlab.__file__).parent
# What each floor may import from kvlab (itself included); everything else is above it.
ALLOWED = {
    "codec": ("kvlab.codec", "kvlab.quant", "kvlab.errors", "kvlab.registry"),
    "quant": ("kvlab.quant",),
}


def kvlab_imports(source: str, package: str) -> list[tuple[int, str]]:
    """`(line, module)` of every kvlab import in the source of a module of `package`, relative ones resolved."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.append((node.lineno, module))
    return [(line, module) for line, module in found if module == "kvlab" or module.startswith("kvlab.")]


@pytest.mark.parametrize("floor", sorted(ALLOWED))
def test_floor_sources_import_only_what_lies_below(floor: str) -> None:
    offending = []
    for path in sorted((PACKAGE / floor).rglob("*.py")):
        package = ".".join(path.relative_to(PACKAGE.parent).parts[:-1])
        for line, module in kvlab_imports(path.read_text(), package):
            if not any(module == allowed or module.startswith(allowed + ".") for allowed in ALLOWED[floor]):
                offending.append(f"{path.relative_to(PACKAGE)}:{line} imports {module}")
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


def test_the_scan_sees_absolute_and_relative_imports() -> None:
    source = "import numpy\nfrom kvlab.compress import compressors\nfrom ..cache import KVCache\nfrom . import base\n"
    found = [module for _, module in kvlab_imports(source, "kvlab.codec")]
    assert found == ["kvlab.compress", "kvlab.cache", "kvlab.codec"]
