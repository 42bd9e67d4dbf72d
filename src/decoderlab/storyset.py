"""An alias for one release: the chat demonstration's TinyStories instruction set is :mod:`decoderlab.tinystories`
(import from there)."""

from .tinystories import *  # noqa: F401,F403 -- the alias re-exports the module's names
