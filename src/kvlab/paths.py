"""Where kvlab keeps files it may rebuild at any time (converted models, assembled GGUF files)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$KVLAB_CACHE_DIR`, else `$XDG_CACHE_HOME/kvlab`, else `~/.cache/kvlab`; not created here."""
    explicit = os.environ.get("KVLAB_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvlab"
