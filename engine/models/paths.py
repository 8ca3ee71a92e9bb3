"""Where kvtier keeps its files: ``$KVTIER_HOME``, else the user cache directory."""

from __future__ import annotations

import os
from pathlib import Path


def kvtier_home() -> Path:
    if home := os.environ.get("KVTIER_HOME"):
        return Path(home).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "kvtier"


def default_store_dir() -> Path:
    return kvtier_home() / "store"
