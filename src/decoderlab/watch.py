"""An alias for one release: ``HeadWatch`` lives in :mod:`decoderlab.headwatch` (import it from there)."""

from .headwatch import HeadWatch  # noqa: F401 -- the alias re-exports it
