"""The user's cache directory: $SPECCOMPILE_CACHE, else the platform's (e.g. ~/.cache/speccompile).
It holds what can always be made again: the demo bundles, and each machine's optimized session
graphs (runtime/saved_graphs.py)."""

import os
from pathlib import Path


def cache_dir() -> Path:
    override = os.environ.get("SPECCOMPILE_CACHE")
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_cache_dir("speccompile"))
