"""Importing this module registers every built-in component in its registry."""

from __future__ import annotations

import importlib

# Packages whose import registers components in their registries.
COMPONENT_PACKAGES: tuple[str, ...] = ("kvlab.compress", "kvlab.codec", "kvlab.lossless", "kvlab.bench", "kvlab.store")


def load_components() -> None:
    for package in COMPONENT_PACKAGES:
        importlib.import_module(package)
