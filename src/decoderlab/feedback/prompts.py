"""An alias for one release: the prompts file of an RL run is read by :mod:`decoderlab.reinforcement.prompts`
(import from there)."""

from ..reinforcement.prompts import PromptRow, load_prompts  # noqa: F401 -- the alias re-exports them
