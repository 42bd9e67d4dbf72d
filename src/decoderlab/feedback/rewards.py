"""An alias for one release: the rewards live in :mod:`decoderlab.reinforcement.rewards` (import them from there).
Like that module, it imports no torch."""

from ..reinforcement.rewards import *  # noqa: F401,F403 -- the alias re-exports the module's names
