"""A cache root of a test's own (``$DECODERLAB_CACHE``: measured waits, AOT packages, token caches) that still
holds the CPU kernels ``make install`` built: a subprocess given an empty root would build them again first
(20-25 s of a 2-core machine's compiler, a quarter of a compiled server's test)."""

from __future__ import annotations

from pathlib import Path

from decoderlab.kernels.build import cache_dir


def own_cache(root: Path) -> Path:
    """``root`` (created) with ``root/kernels`` linked to the kernels built for this user, when they are built;
    returns ``root``, for ``DECODERLAB_CACHE``. Tests of the build itself keep an empty root."""
    root.mkdir(parents=True, exist_ok=True)
    built = cache_dir()  # (asked before the test sets its own root)
    if built.is_dir() and not (root / "kernels").exists():
        (root / "kernels").symlink_to(built, target_is_directory=True)
    return root
